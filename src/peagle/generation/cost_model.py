"""The verify-cost model: [`VerifyCostModel`], the seconds of verifying n tokens per row after a context of L tokens
and of a drafter round, with the online factors that correct it from the passes generation runs.

The curve's timing lives in [`cost_timing`], its cache file in [`cost_cache`], and the choice of a curve for a call
in [`cost`].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from .stats import context_bucket

MIN_CONTEXT_POINT = 1024
"""The shortest longer context timed (each later one is the next power of two a call reaches)."""


@dataclass
class VerifyCostModel:
    """Seconds to verify n tokens per row at a context of L tokens, and seconds of one drafter round at L.

    The verify cost of n tokens after L tokens of context is modelled as

        cost(n, L) = factor(n) * (base(n) + growth(n, L))

    - `base(n)` (`verify_seconds`) is timed at every n at the reference context (`context`, 256 tokens);
    - `growth(n, L)` comes from a few n timed at longer contexts (`context_points`, one per power of two,
      timed lazily the first time a call reaches a longer context), interpolated in n and in L (linearly
      from the reference, extended beyond the longest point along its last segment), never negative;
    - `factor(n)` is learned online: every verify pass and plain step generation runs is compared with the
      modelled seconds (a running mean that turns into an exponential moving average of weight `smoothing`,
      in log space); an n never observed takes the factor of its observed neighbours (log-interpolated).
      Factors persist with the curve, so a curve timed on a busy machine is corrected by the passes of
      the next calls and stays corrected.
    The drafter's round likewise: `drafter_seconds` at the reference context, growth from the context points,
    one online factor.  A user's or a flat curve (`source` `"user"`, `"flat"`) is used as given: no online
    factors, no lazy timing.

    Args:
        verify_seconds: `[N]`, `verify_seconds[n - 1]` = seconds of a target pass over n new tokens per row at
            the reference context.
        drafter_seconds: seconds of one drafter round (parallel: its one pass; autoregressive: the first pass).
        drafter_step_seconds: seconds of one more autoregressive drafter pass (one slot).
        key: what the curve was measured for (target, device, dtype, threads, batch size); see
            [`cost_model_key`].
        source: `"calibrated"`, `"cache"`, `"flat"` or `"user"`.
        observations: verify passes folded in online, per n.
        smoothing: weight of a new observation in the running estimate, once it has enough of them.
        context: the reference context of `verify_seconds` (None: the costs do not depend on the context).
        context_points: longer contexts timed, each `{"context": L, "n": [...], "seconds": [...],
            "drafter_seconds": s}` (seconds per n listed, and of a drafter round, after L tokens).
        factors: `[N]` online factors (realised / modelled seconds) per n; 1.0 where not observed.
        drafter_factor, drafter_observations: the same for the drafter's round.
        row_seconds: seconds of a plain step with R of the batch's rows (`{"R": s}`), timed when rows end
            and the batch decides whether to keep them idle (a CPU's matrix kernels may take longer for 7
            rows than for 8).
        drafter_slot_seconds: seconds per slot of a drafter pass over a long block (the first round of a call
            catches up on the whole prompt), learned online; 0.0 until observed.
        timing: `"full"` (every n of the reference curve timed: `peagle calibrate --costs`, benchmarks' warm-up)
            or `"quick"` (a few n timed inside a call, the rest filled in and learnt online).
    """

    verify_seconds: list[float]
    drafter_seconds: float = 0.0
    drafter_step_seconds: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)
    source: str = "user"
    observations: list[int] = field(default_factory=list)
    smoothing: float = 0.1
    context: int | None = None
    context_points: list[dict[str, Any]] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)
    drafter_factor: float = 1.0
    drafter_observations: int = 0
    row_seconds: dict[str, float] = field(default_factory=dict)
    drafter_slot_seconds: float = 0.0
    timing: str = "full"

    def __post_init__(self):
        # every field is checked, not coerced: a cache file may hold `true` as seconds or a smoothing of 5, which
        # would turn the curve negative once online updates fold in
        if (
            not isinstance(self.verify_seconds, (list, tuple))
            or not self.verify_seconds
            or any(not _seconds(s) or s <= 0 for s in self.verify_seconds)
        ):
            raise ValueError(
                f"verify_seconds must be positive seconds per n = 1..N, got {self.verify_seconds!r}."
            )
        self.verify_seconds = [float(s) for s in self.verify_seconds]
        for name in ("drafter_seconds", "drafter_step_seconds", "drafter_slot_seconds"):
            value = getattr(self, name)
            if not _seconds(value) or value < 0:
                raise ValueError(f"{name} must be seconds >= 0, got {value!r}.")
        if not _seconds(self.smoothing) or not 0 < self.smoothing <= 1:
            raise ValueError(
                f"smoothing must be a weight in (0, 1] (of a new observation), got {self.smoothing!r}."
            )
        if self.timing not in ("full", "quick"):
            raise ValueError(f"timing must be 'full' or 'quick', got {self.timing!r}.")
        if not isinstance(self.key, dict) or not isinstance(self.source, str):
            raise ValueError(f"key must be a dict and source a string, got {self.key!r} and {self.source!r}.")
        if not _counts(self.observations):
            raise ValueError(f"observations must be counts >= 0 per n, got {self.observations!r}.")
        if self.context is not None and (
            isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1
        ):
            raise ValueError(f"context must be a number of tokens >= 1 or None, got {self.context!r}.")
        if not isinstance(self.context_points, (list, tuple)):
            raise ValueError(f"context_points must be a list, got {self.context_points!r}.")
        self.context_points = sorted(
            (_checked_point(p) for p in self.context_points), key=lambda p: p["context"]
        )
        if self.context_points and self.context is None:
            raise ValueError("context_points need the reference `context` of verify_seconds.")
        if not isinstance(self.factors, (list, tuple)) or any(
            not _seconds(f) or f <= 0 for f in self.factors
        ):
            raise ValueError(f"factors must be positive ratios per n, got {self.factors!r}.")
        if not _seconds(self.drafter_factor) or self.drafter_factor <= 0:
            raise ValueError(f"drafter_factor must be a positive ratio, got {self.drafter_factor!r}.")
        if not _counts([self.drafter_observations]):
            raise ValueError(f"drafter_observations must be a count >= 0, got {self.drafter_observations!r}.")
        if not isinstance(self.row_seconds, dict) or any(
            not (isinstance(k, str) and k.isdigit() and int(k) >= 1) or not _seconds(v) or v <= 0
            for k, v in self.row_seconds.items()
        ):
            raise ValueError(
                f"row_seconds must map row counts to positive seconds, got {self.row_seconds!r}."
            )
        n = len(self.verify_seconds)
        if len(self.observations) != n or len(self.factors) != n:  # an older file, or a curve built by hand
            self.observations = [0] * n
            self.factors = [1.0] * n
        self.observations = [int(c) for c in self.observations]
        self.factors = [float(f) for f in self.factors]

    @classmethod
    def flat(
        cls, max_tokens: int = 16, seconds: float = 1.0, drafter_seconds: float = 0.0
    ) -> VerifyCostModel:
        """A curve where verifying n tokens costs the same as one (a GPU at batch 1): the rule then drafts
        every draft whose chain has any chance, i.e. K almost every round."""
        return cls([seconds] * max_tokens, drafter_seconds=drafter_seconds, source="flat")

    # ------------------------------------------------------------------ the modelled costs
    def base(self, n: int) -> float:
        """Seconds to verify n tokens at the reference context (beyond the timed range: extended linearly)."""
        if n <= len(self.verify_seconds):
            return self.verify_seconds[n - 1]
        last = self.verify_seconds[-1]
        step = max(last - self.verify_seconds[-2], 0.0) if len(self.verify_seconds) > 1 else 0.0
        return last + step * (n - len(self.verify_seconds))

    def growth(self, n: int, context: int | None) -> float:
        """Extra seconds of verifying n tokens after `context` tokens instead of the reference context (0
        without context points, or at or below the reference)."""
        if context is None or self.context is None or not self.context_points or context <= self.context:
            return 0.0
        knots = [(self.context, 0.0)] + [
            (p["context"], _point_seconds(p, n) - self.base(n)) for p in self.context_points
        ]
        return max(_along(knots, context), 0.0)

    def modelled(self, n: int, context: int | None = None) -> float:
        """Seconds to verify n tokens after `context` tokens, before the online factor."""
        return self.base(n) + self.growth(n, context)

    def factor(self, n: int, seen: list[int] | None = None) -> float:
        """The online factor of n (observed, else log-interpolated between the nearest observed n; `seen`: the
        observed n, when the caller has them)."""
        if n <= len(self.factors) and self.observations[n - 1] > 0:
            return self.factors[n - 1]
        if seen is None:
            seen = [i + 1 for i, c in enumerate(self.observations) if c > 0]
        if not seen:
            return 1.0
        below = [m for m in seen if m < n]
        above = [m for m in seen if m > n]
        if not below or not above:
            return self.factors[(below[-1] if below else above[0]) - 1]
        lo, hi = below[-1], above[0]
        t = (n - lo) / (hi - lo)
        return math.exp((1 - t) * math.log(self.factors[lo - 1]) + t * math.log(self.factors[hi - 1]))

    def cost(self, n: int, context: int | None = None) -> float:
        """Seconds to verify n tokens per row after `context` tokens (None: at the reference context)."""
        return self.factor(n) * self.modelled(n, context)

    def curve(self, max_tokens: int, context: int | None = None) -> list[float]:
        """`[max_tokens]` seconds for n = 1..max_tokens after `context` tokens, never decreasing in n."""
        seen = [i + 1 for i, c in enumerate(self.observations) if c > 0]
        return monotone([self.factor(n, seen) * self.modelled(n, context) for n in range(1, max_tokens + 1)])

    def drafter_cost(self, context: int | None = None) -> float:
        """Seconds of one drafter round after `context` tokens in the drafter's cache."""
        seconds = self.drafter_seconds
        if (
            context is not None
            and self.context is not None
            and self.context_points
            and context > self.context
        ):
            knots = [(self.context, 0.0)] + [
                (p["context"], p["drafter_seconds"] - self.drafter_seconds) for p in self.context_points
            ]
            seconds += max(_along(knots, context), 0.0)
        return seconds * self.drafter_factor

    @property
    def refined_online(self) -> bool:
        """Measured curves follow the machine; a user's or a flat curve stays as given."""
        return self.source in ("calibrated", "cache")

    # ------------------------------------------------------------------ online refinement
    def _weight(self, count: int) -> float:
        """A running mean over the first observations, then the exponential moving average."""
        return max(self.smoothing, 1.0 / (count + 2))

    def observe_verify(self, n: int, seconds: float, context: int | None = None) -> None:
        """Fold in a measured verify pass over n tokens per row after `context` tokens: the factor of n moves
        towards `seconds / modelled(n, context)`."""
        if not self.refined_online or not (seconds > 0 and math.isfinite(seconds)) or n < 1:
            return
        while n > len(self.verify_seconds):
            self.verify_seconds.append(self.base(len(self.verify_seconds) + 1))
            self.observations.append(0)
            self.factors.append(1.0)
        ratio = min(max(seconds / self.modelled(n, context), 0.05), 20.0)  # a suspended process is no sample
        old = self.factor(n)  # an unobserved n starts from its neighbours' factor
        w = self._weight(self.observations[n - 1])
        self.factors[n - 1] = math.exp((1 - w) * math.log(old) + w * math.log(ratio))
        self.observations[n - 1] += 1

    def observe_drafter(self, seconds: float, steps: int = 0, context: int | None = None) -> None:
        """Fold in a measured drafter round (`steps` autoregressive passes after the first) after `context`
        slots in the drafter's cache."""
        if not self.refined_online or not (seconds > 0 and math.isfinite(seconds)):
            return
        if steps and self.drafter_seconds > 0:
            per_step = max(seconds - self.drafter_cost(context), 0.0) / steps
            self.drafter_step_seconds += self.smoothing * (per_step - self.drafter_step_seconds)
            seconds -= per_step * steps
        modelled = self.drafter_cost(context) / self.drafter_factor
        if modelled <= 0:
            self.drafter_seconds = seconds
            return
        ratio = min(max(seconds / modelled, 0.05), 20.0)
        w = self._weight(self.drafter_observations)
        self.drafter_factor = math.exp((1 - w) * math.log(self.drafter_factor) + w * math.log(ratio))
        self.drafter_observations += 1

    def observe_catch_up(self, seconds: float, slots: int) -> None:
        """Fold in a drafter round over a long block of `slots` new slots (a call's first round)."""
        if not self.refined_online or slots < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        per_slot = seconds / slots
        if self.drafter_slot_seconds <= 0:
            self.drafter_slot_seconds = per_slot
        else:
            self.drafter_slot_seconds += 0.5 * (per_slot - self.drafter_slot_seconds)

    def observe_rows(self, rows: int, seconds: float, context: int | None = None) -> None:
        """Fold in a measured plain step of `rows` rows after `context` tokens: `row_seconds[rows]`, a plain step's
        seconds at the reference context (scaled as the curve scales a plain step), moves towards it.  What
        decides how many ended rows a batch keeps, learnt from the passes generation runs anyway."""
        if not self.refined_online or not (seconds > 0 and math.isfinite(seconds)) or rows < 1:
            return
        value = seconds * self.modelled(1, self.context) / self.modelled(1, context)
        old = self.row_seconds.get(str(rows))
        self.row_seconds[str(rows)] = value if old is None else old + self.smoothing * (value - old)

    def remember_pays(self, context: int, ratio: float) -> None:
        """What a call ended with: drafting's realised rate against a plain step's at `context` (in memory only:
        it is about the head at hand, which the curve's key does not identify)."""
        memory = self.__dict__.setdefault("_pays_memory", {})
        bucket = context_bucket(context)
        old = memory.get(bucket)
        memory[bucket] = ratio if old is None else 0.5 * (old + ratio)

    def remembered_pays(self, context: int) -> float | None:
        """The ratio remembered at the longest bucket at or below `context` (drafting that did not pay after a
        shorter context does not pay after a longer one either: verifying costs more there)."""
        memory = self.__dict__.get("_pays_memory", {})
        below = [b for b in memory if b <= context_bucket(context)]
        return memory[max(below)] if below else None

    def reset_online(self) -> None:
        """Forget the online factors (after the curve is timed again)."""
        self.observations = [0] * len(self.verify_seconds)
        self.factors = [1.0] * len(self.verify_seconds)
        self.drafter_factor, self.drafter_observations = 1.0, 0

    # ------------------------------------------------------------------ context points
    def timed_contexts(self) -> list[int]:
        """The reference context and every timed context point."""
        return ([self.context] if self.context else []) + [p["context"] for p in self.context_points]

    def next_context_point(self, context: int, max_context: int | None = None) -> int | None:
        """The context to time before deciding at `context`, or None: when `context` lies more than half
        again beyond the longest timed context, the power of two at or above it (at least
        [`MIN_CONTEXT_POINT`], at most `max_context`), so rounds interpolate between timed points."""
        if not self.refined_online or not self.context:
            return None
        longest = max(self.timed_contexts())
        if context <= longest * 3 // 2:
            return None
        point = max(MIN_CONTEXT_POINT, 1 << (int(context) - 1).bit_length())
        if max_context is not None:
            point = min(point, int(max_context))
        return point if point > longest else None

    def add_context_point(self, point: dict[str, Any]) -> None:
        """Add (or replace) the timings of one context."""
        point = _checked_point(point)
        if self.context is None:
            raise ValueError("context points need the reference `context` of verify_seconds.")
        kept = [p for p in self.context_points if p["context"] != point["context"]]
        self.context_points = sorted(kept + [point], key=lambda p: p["context"])

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "verify_seconds": list(self.verify_seconds),
            "drafter_seconds": self.drafter_seconds,
            "drafter_step_seconds": self.drafter_step_seconds,
            "key": dict(self.key),
            "source": self.source,
            "observations": list(self.observations),
            "smoothing": self.smoothing,
            "context": self.context,
            "context_points": [dict(p) for p in self.context_points],
            "factors": list(self.factors),
            "drafter_factor": self.drafter_factor,
            "drafter_observations": self.drafter_observations,
            "row_seconds": dict(self.row_seconds),
            "drafter_slot_seconds": self.drafter_slot_seconds,
            "timing": self.timing,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerifyCostModel:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown cost-model fields {sorted(unknown)}; expected some of {sorted(known)}."
            )
        return cls(**data)


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _counts(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in values
    )


def _checked_point(point: Any) -> dict[str, Any]:
    """A context point as stored, checked: `{"context", "n", "seconds", "drafter_seconds"}`."""
    if not isinstance(point, dict) or set(point) != {"context", "n", "seconds", "drafter_seconds"}:
        raise ValueError(
            f"a context point is {{'context', 'n', 'seconds', 'drafter_seconds'}}, got {point!r}."
        )
    ns, secs, ctx = point["n"], point["seconds"], point["context"]
    if (
        isinstance(ctx, bool)
        or not isinstance(ctx, int)
        or ctx < 1
        or not _counts(ns)
        or not ns
        or list(ns) != sorted(set(ns))
        or ns[0] < 1
        or not isinstance(secs, (list, tuple))
        or len(secs) != len(ns)
        or any(not _seconds(s) or s <= 0 for s in secs)
        or not _seconds(point["drafter_seconds"])
        or point["drafter_seconds"] < 0
    ):
        raise ValueError(
            f"a context point needs a context >= 1, increasing n >= 1 and positive seconds for each, got {point!r}."
        )
    return {
        "context": int(ctx),
        "n": [int(n) for n in ns],
        "seconds": [float(s) for s in secs],
        "drafter_seconds": float(point["drafter_seconds"]),
    }


def _point_seconds(point: dict[str, Any], n: int) -> float:
    """A context point's seconds at n: linear between its timed n, flat beyond them."""
    return _along(list(zip(point["n"], point["seconds"])), n, extend=False)


def _along(knots: list[tuple[float, float]], x: float, extend: bool = True) -> float:
    """The piecewise-linear function through `knots` (sorted by x) at `x`; beyond the last knot it continues
    along the last segment (`extend`) or stays flat; before the first it stays flat.

    >>> _along([(0, 0.0), (2, 1.0), (4, 3.0)], 3), _along([(0, 0.0), (2, 1.0), (4, 3.0)], 6)
    (2.0, 5.0)
    """
    if x <= knots[0][0] or len(knots) == 1:
        return knots[0][1]
    for (x0, y0), (x1, y1) in zip(knots, knots[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if not extend:
        return knots[-1][1]
    (x0, y0), (x1, y1) = knots[-2], knots[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def monotone(seconds: list[float]) -> list[float]:
    """The curve lowered to be non-decreasing in n (each entry the least at or after it).  Verifying more tokens
    never costs less; a point timed while the machine was busy would otherwise make drafting look cheap next to
    a slow plain step, and stay so in the cache.

    >>> monotone([3.0, 1.0, 2.0, 5.0])
    [1.0, 1.0, 2.0, 5.0]
    """
    out, low = list(seconds), float("inf")
    for i in range(len(out) - 1, -1, -1):
        low = min(low, out[i])
        out[i] = low
    return out


__all__ = ["MIN_CONTEXT_POINT", "VerifyCostModel", "monotone"]
