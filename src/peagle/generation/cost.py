"""Cost-aware drafting: the machine's measured cost of verifying n tokens per row, for the rule in [`rule`].

[`VerifyCostModel`] holds the cost curve: calibrated once per (target, device, dtype, threads, batch size) by
timing forward passes (cached as JSON under the peagle cache folder), refined online from the verify passes
generation runs anyway, inspectable (`to_dict`) and overridable (`VerifyCostModel.flat(...)`, `from_dict`, or
`set_cost_model`).  On a GPU verifying 8 tokens costs about as much as 1 (a flat curve, so the rule drafts K
whenever the probabilities are not tiny); on a CPU each extra token costs a visible fraction of a step.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..modeling_peagle import cache_kwarg

# the rule's names stay importable from here: the `custom_generate/` recipe of heads already pushed reads them so
from .rule import (  # noqa: F401
    AcceptanceCorrection,
    best_batch_rate,
    best_rate,
    calibrated_probabilities,
    calibrated_probability,
    choose_batch_num_drafts,
    choose_num_drafts,
    expected_tokens,
)
from .stats import context_bucket

CACHE_SUBDIR = "cost"
CALIBRATION_CONTEXT = 256
"""Context length (tokens) the calibration times its verify passes at (the reference context)."""
MIN_CONTEXT_POINT = 1024
"""The shortest longer context timed (each later one is the next power of two a call reaches)."""
COST_MODEL_VERSION = 2
"""Part of the cache key: curves of an earlier model (no context points, factors kept in memory only) are timed
again."""


# ---------------------------------------------------------------------------------------------- cost model
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

    def factor(self, n: int) -> float:
        """The online factor of n (observed, else log-interpolated between the nearest observed n)."""
        if n <= len(self.factors) and self.observations[n - 1] > 0:
            return self.factors[n - 1]
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
        return monotone([self.cost(n, context) for n in range(1, max_tokens + 1)])

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


# ---------------------------------------------------------------------------------------------- calibration runs
def measured_points(max_tokens: int) -> list[int]:
    """The n a calibration times: every n up to 12 (chains), then 16, 24, 32, 48, 64, ... (trees), and
    `max_tokens` itself; the curve is interpolated in between.

    >>> measured_points(40)
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 24, 32, 40]
    """
    points = list(range(1, min(max_tokens, 12) + 1))
    n = 16
    while n < max_tokens:
        points.append(n)
        n = n + n // 2 if n >= 32 else n + 8
    if points[-1] != max_tokens:
        points.append(max_tokens)
    return points


def interpolate(points: list[int], seconds: list[float], max_tokens: int) -> list[float]:
    """`[max_tokens]` seconds for n = 1..max_tokens, linear between the measured `points`.

    >>> interpolate([1, 2, 4], [1.0, 2.0, 4.0], 4)
    [1.0, 2.0, 3.0, 4.0]
    """
    out = []
    for n in range(1, max_tokens + 1):
        i = bisect.bisect_left(points, n)
        if points[i] == n:
            out.append(seconds[i])
            continue
        n0, n1, s0, s1 = points[i - 1], points[i], seconds[i - 1], seconds[i]
        out.append(s0 + (s1 - s0) * (n - n0) / (n1 - n0))
    return out


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


def cost_model_key(target: Any, head: Any = None, batch_size: int = 1) -> dict[str, Any]:
    """What a cost curve depends on: the target (name and shape), its device and dtype, torch's thread count,
    the drafter's shape (its pass is part of the round's cost) and the batch size (rows verified together;
    recorded from 2 rows on, so batch-1 curves keep their key)."""
    cfg = target.config
    param = next(target.parameters())
    key = {
        "target": str(getattr(cfg, "_name_or_path", "") or type(target).__name__),
        "target_shape": [
            getattr(cfg, "hidden_size", None),
            getattr(cfg, "num_hidden_layers", None),
            getattr(cfg, "vocab_size", None),
        ],
        "device": str(param.device),
        "dtype": str(param.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
    }
    if head is not None:
        hc = head.config
        key["drafter"] = [
            hc.drafting_mode,
            hc.num_hidden_layers,
            hc.hidden_size,
            hc.draft_vocab_size,
            str(next(head.parameters()).dtype).replace("torch.", ""),
        ]
    if batch_size > 1:
        key["batch_size"] = int(batch_size)
    key["cost_model"] = COST_MODEL_VERSION
    return key


def cost_cache_path(key: dict[str, Any]) -> Path:
    """The JSON file caching the curve of `key`: under `$PEAGLE_COST_CACHE` when set, else the peagle cache
    folder's `cost/` (`$PEAGLE_CACHE/cost/`, default `~/.cache/peagle/cost/`)."""
    from ..targets import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("PEAGLE_COST_CACHE")
    return (Path(root) if root else cache_dir() / CACHE_SUBDIR) / f"{digest}.json"


@torch.no_grad()
def measure_cost_model(
    target: Any,
    head: Any = None,
    max_tokens: int = 11,
    context: int = CALIBRATION_CONTEXT,
    repeats: int = 3,
    batch_size: int = 1,
) -> VerifyCostModel:
    """Time target passes over n = 1..max_tokens new tokens per row for `batch_size` rows after a `context`-token
    cache (median of `repeats`), and one drafter round (of as many rows) when `head` is given.  4.3 s up to 8
    tokens and 7.5 s up to 33 for the 135M target at batch 1 on the project's 2-core CPU (2026-12-03)."""
    from transformers.cache_utils import DynamicCache

    device = next(target.parameters()).device
    text = target.config.get_text_config()
    vocab = int(text.vocab_size)
    # a target with a short position range (learned positions, e.g. GPT-2) is timed at a shorter context
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if positions:
        context = max(1, min(context, int(positions) - max_tokens))
    gen = torch.Generator().manual_seed(0)
    rows = max(1, int(batch_size))
    prefix = torch.randint(0, vocab, (rows, context), generator=gen).to(device)
    cache = DynamicCache(config=target.config)  # the measurement's own cache, never the user's
    target(input_ids=prefix, use_cache=True, **cache_kwarg(cache))
    # sliding-window layers drop what falls out of the window unless told to keep it until the next crop; after
    # the prefill (as transformers' assisted decoding does), so the prefix itself is trimmed to the window
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    points = measured_points(max_tokens)
    seconds = []
    for n in points:
        ids = torch.randint(0, vocab, (rows, n), generator=gen).to(device)
        seconds.append(_time_pass(target, cache, ids, None, repeats, sync))
    seconds = monotone(interpolate(points, seconds, max_tokens))
    model = VerifyCostModel(
        seconds, key=cost_model_key(target, head, rows), source="calibrated", context=context
    )
    if head is not None:
        model.drafter_seconds, model.drafter_step_seconds = _time_drafter(
            head, target, max_tokens - 1, repeats, rows
        )
    return model


def context_point_tokens(max_tokens: int) -> list[int]:
    """The n a longer context times: 1 (a plain step), 2, 8 (a chain's round) and the longest, the rest
    interpolated (the growth with the context is smooth in n beyond the plain step).

    >>> context_point_tokens(33), context_point_tokens(4)
    ([1, 2, 8, 33], [1, 2, 4])
    """
    return sorted({n for n in (1, 2, 8, max_tokens) if n <= max_tokens})


def max_cost_context(target: Any, max_tokens: int) -> int | None:
    """The longest context a curve is timed at: the target's position range less the tokens verified (None
    when the config names no range)."""
    text = target.config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return max(1, int(positions) - max_tokens) if positions else None


@torch.no_grad()
def measure_context_point(
    target: Any,
    head: Any,
    context: int,
    max_tokens: int,
    repeats: int = 2,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Time target passes over n tokens per row ([`context_point_tokens`]) and one drafter round after
    `context` tokens: a context point of [`VerifyCostModel`].

    No prefill of `context` tokens runs: a short real prefix is prefilled, and the cache's keys and values are
    repeated to `context` slots (a pass costs the same whatever the cached values are), so the point takes a
    few passes (about 1.5 s at 4,096 tokens for the 135M target at batch 1 on a 2-core CPU).  Raises
    `NotImplementedError` for caches whose layers are not plain or sliding-window key/value tensors (the
    curve then follows the context through its online factors only)."""
    device = next(target.parameters()).device
    text = target.config.get_text_config()
    vocab = int(text.vocab_size)
    rows = max(1, int(batch_size))
    gen = torch.Generator().manual_seed(2)
    cache = _stretched_cache(target, target.config, rows, context, vocab, gen, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    ns, seconds = context_point_tokens(max_tokens), []
    for n in ns:
        ids = torch.randint(0, vocab, (rows, n), generator=gen).to(device)
        mask = torch.ones(rows, context + n, dtype=torch.long, device=device) if rows > 1 else None
        seconds.append(_time_pass(target, cache, ids, mask, repeats, sync))
    del cache
    drafter = 0.0
    if head is not None:
        drafter = _time_drafter_at(head, target, max_tokens - 1, repeats, rows, context)
    return {"context": int(context), "n": ns, "seconds": seconds, "drafter_seconds": drafter}


def _stretched_cache(model: Any, config: Any, rows: int, context: int, vocab: int, gen, device) -> Any:
    """A DynamicCache that reads as `context` tokens long: a short prefix prefilled, then each layer's keys and
    values repeated along the sequence (sliding-window layers: up to their window)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    prefix = min(32, context)
    cache = DynamicCache(config=config)
    ids = torch.randint(0, vocab, (rows, prefix), generator=gen).to(device)
    model(input_ids=ids, use_cache=True, **cache_kwarg(cache))
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or layer.keys is None:
            raise NotImplementedError(f"cannot lengthen a {type(layer).__name__} cache layer")
        slots = context
        if isinstance(layer, DynamicSlidingWindowLayer):
            slots = min(context, layer.sliding_window - 1)
            layer.cumulative_length = context
        _lengthen(layer, slots)
    return cache


def _lengthen(layer: Any, slots: int) -> None:
    """A cache layer's keys and values repeated along the sequence to `slots` entries."""
    reps = -(-slots // layer.keys.shape[-2])
    layer.keys = layer.keys.repeat(1, 1, reps, 1)[:, :, :slots].contiguous()
    layer.values = layer.values.repeat(1, 1, reps, 1)[:, :, :slots].contiguous()


def _drafter_inputs(
    head: Any, target: Any, rows: int, length: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random `(tokens (rows, length), features (rows, length, 3 H_t))` for timing the drafter (its embeddings
    attached to the target's where it shares them)."""
    width = 3 * int(head.config.target_hidden_size)
    dtype = next(head.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    if head.config.embed_from_target and head.embed_tokens is None:
        head.attach_target(target)
    ctx = torch.randint(0, int(head.config.vocab_size), (rows, length), generator=gen).to(head.device)
    feats = torch.randn(rows, length, width, generator=gen).to(head.device, dtype)
    return ctx, feats


def _time_drafter_at(head: Any, target: Any, k: int, repeats: int, rows: int, context: int) -> float:
    """Seconds of one drafting round (3 real slots + K-1 parallel ones, or one autoregressive pass) after
    `context` slots in the drafter's cache."""
    from transformers.cache_utils import DynamicCache

    # an autoregressive head's round is timed to its first pass (more passes: drafter_step_seconds)
    one_pass = head.config.drafting_mode == "autoregressive"
    select = lambda logits, depth: (logits.argmax(-1), None, one_pass)  # noqa: E731
    cache = DynamicCache(config=head.config)
    ctx, feats = _drafter_inputs(head, target, rows, 35, seed=3)
    head.draft_round(ctx[:, :32], feats[:, :32], 1, cache, 0, select=select)
    if cache.get_seq_length() > 32:
        cache.crop(-(cache.get_seq_length() - 32))
    for layer in cache.layers:
        _lengthen(layer, context)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        head.draft_round(ctx[:, 32:], feats[:, 32:], max(k, 1), cache, context, select=select)
        times.append(time.perf_counter() - t0)
        cache.crop(-(cache.get_seq_length() - context))
    return statistics.median(times[1:])


def _time_drafter(head: Any, target: Any, k: int, repeats: int, rows: int = 1) -> tuple[float, float]:
    """Seconds of one drafting round (real slots of a typical round + K-1 parallel slots, or one autoregressive
    pass) after a short context, and of one more autoregressive pass."""
    from transformers.cache_utils import DynamicCache

    ctx, feats = _drafter_inputs(head, target, rows, 64, seed=1)
    select = lambda logits, depth: (logits.argmax(-1), None, False)  # noqa: E731
    times, steps = [], []
    for _ in range(repeats + 1):
        cache = DynamicCache(config=head.config)
        head.draft_round(ctx[:, :61], feats[:, :61], 1, cache, 0, select=select)
        t0 = time.perf_counter()
        head.draft_round(ctx[:, 61:], feats[:, 61:], max(k, 1), cache, 61, select=select)
        times.append(time.perf_counter() - t0)
        if head.config.drafting_mode == "autoregressive":
            t0 = time.perf_counter()
            head.draft_round(ctx[:, 61:62], feats[:, 61:62], 1, cache, 64, select=select)
            steps.append(time.perf_counter() - t0)
    first = statistics.median(times[1:])
    if head.config.drafting_mode == "autoregressive" and k > 1:
        step = statistics.median(steps[1:])
        first = max(first - step * (k - 1), step)
        return first, step
    return first, 0.0


_MODELS: dict[str, VerifyCostModel] = {}
_UNTIMEABLE: set[tuple[str, int]] = set()
"""(curve, context) pairs whose context point could not be timed in this process (not tried again)."""


def cost_model_for(
    target: Any, head: Any = None, max_tokens: int = 11, use_cache: bool = True, batch_size: int = 1
) -> VerifyCostModel:
    """The cost model of (target, head) at `batch_size` rows on this device/dtype/threads: from this process's
    memory, else the cache file, else measured now (and cached).  The returned object is shared, so online
    refinements carry over between `generate()` calls; [`persist_cost_model`] writes them back to the file."""
    override = getattr(head, "cost_model", None) if head is not None else None
    if override is not None:
        if not isinstance(override, VerifyCostModel):
            raise TypeError(
                f"head.cost_model must be a VerifyCostModel or None (set it with peagle.set_cost_model), got "
                f"{type(override).__name__} {override!r}."
            )
        return override
    key = cost_model_key(target, head, batch_size)
    name = json.dumps(key, sort_keys=True)
    model = _MODELS.get(name)
    if model is not None and len(model.verify_seconds) >= max_tokens:
        return model
    path = cost_cache_path(key)
    model = None
    if use_cache:
        try:
            if path.is_file():
                model = VerifyCostModel.from_dict(json.loads(path.read_text()))
                model.source = "cache"
        except (OSError, ValueError, TypeError):  # unreadable or malformed: measure again
            model = None
        if model is not None and (len(model.verify_seconds) < max_tokens or model.context is None):
            model = None
    if model is None:
        model = measure_cost_model(target, head, max_tokens=max_tokens, batch_size=batch_size)
    model.persist = use_cache  # type: ignore[attr-defined]  (where online figures and new points go)
    persist_cost_model(model)
    _MODELS[name] = model
    return model


def extend_to_context(
    model: VerifyCostModel, target: Any, head: Any, context: int, max_tokens: int, batch_size: int = 1
) -> float:
    """Before a round after `context` tokens: time the context point the curve lacks for it
    ([`VerifyCostModel.next_context_point`]), add it and persist the curve.  Returns the seconds spent (0.0
    when nothing needed timing).  A point that cannot be timed (a cache kind that cannot be lengthened, or not
    enough memory for a lengthened copy) is not tried again in this process; the online factors then carry
    the context's cost."""
    point = model.next_context_point(context, max_cost_context(target, max_tokens))
    name = json.dumps(model.key, sort_keys=True)
    if point is None or (name, point) in _UNTIMEABLE:
        return 0.0
    rows = max(1, int(batch_size))
    if not _fits_in_memory(target, rows, point):
        _UNTIMEABLE.add((name, point))
        return 0.0
    tic = time.perf_counter()
    try:
        timed = measure_context_point(
            target, head, point, max(max_tokens, len(model.verify_seconds)), 2, rows
        )
    except (NotImplementedError, RuntimeError, ValueError) as e:  # RuntimeError: e.g. out of memory
        _UNTIMEABLE.add((name, point))
        warnings.warn(
            f"peagle could not time its verify costs after {point} tokens of context ({e}); the cost rule "
            "follows longer contexts through the passes it observes.",
            RuntimeWarning,
            stacklevel=2,
        )
        return 0.0
    model.add_context_point(timed)
    persist_cost_model(model)
    return time.perf_counter() - tic


def ensure_row_seconds(model: VerifyCostModel, target: Any, rows: int) -> tuple[float | None, float]:
    """`(seconds of a plain step with `rows` rows at the reference context, seconds spent timing it now)`: from
    the curve's `row_seconds`, else timed (and persisted).  None when it cannot be timed."""
    known = model.row_seconds.get(str(rows))
    if known is not None:
        return known, 0.0
    if not model.context:
        return None, 0.0
    tic = time.perf_counter()
    try:
        seconds = measure_plain_step(target, rows, model.context)
    except (NotImplementedError, RuntimeError, ValueError):
        return None, time.perf_counter() - tic
    model.row_seconds[str(rows)] = seconds
    persist_cost_model(model)
    return seconds, time.perf_counter() - tic


@torch.no_grad()
def measure_plain_step(target: Any, rows: int, context: int, repeats: int = 3) -> float:
    """Seconds of one plain step (one new token per row, a 2D attention mask from 2 rows on) for `rows` rows
    after `context` cached tokens (median of `repeats` after a warm-up)."""
    device = next(target.parameters()).device
    vocab = int(target.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(4)
    cache = _stretched_cache(target, target.config, rows, context, vocab, gen, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    ids = torch.randint(0, vocab, (rows, 1), generator=gen).to(device)
    mask = torch.ones(rows, context + 1, dtype=torch.long, device=device) if rows > 1 else None
    return _time_pass(target, cache, ids, mask, repeats, sync)


def _time_pass(
    target: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor | None, repeats: int, sync
) -> float:
    """Median seconds of `repeats` target passes over `ids` on `cache` after one warm-up pass (the first pass of a
    shape allocates, 2-3x slower); each pass is cropped off the cache again."""
    times = []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        target(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=ids.shape[1],
            **cache_kwarg(cache),
        )
        sync()
        times.append(time.perf_counter() - t0)
        cache.crop(-ids.shape[1])
    return statistics.median(times[1:])


def _fits_in_memory(target: Any, rows: int, context: int) -> bool:
    """Whether a lengthened copy of the target's cache (`rows` x `context` tokens) takes at most a quarter of
    the memory available now (CPU: the free physical memory; CUDA: the device's free memory)."""
    text = target.config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    dim = getattr(text, "head_dim", None) or (
        text.hidden_size // text.num_attention_heads if getattr(text, "num_attention_heads", None) else None
    )
    if not (layers and heads and dim):
        return True
    param = next(target.parameters())
    need = 2 * layers * heads * dim * param.element_size() * rows * context
    try:
        if param.device.type == "cuda":
            free = torch.cuda.mem_get_info(param.device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return True
    return need <= free // 4


def persist_cost_model(model: VerifyCostModel) -> None:
    """Write a measured curve, with its context points and online factors, to its cache file (when caching is
    on for it); a failed write warns once and the curve stays in memory."""
    if not model.refined_online or not getattr(model, "persist", False) or not model.key:
        return
    path = cost_cache_path(model.key)
    try:
        save_cost_model(model, path)
    except OSError as e:  # a cache is an optimisation: keep the curve in memory and go on
        _warn_unwritable_once(path, e)


def prepare_cost_model(
    target: Any,
    head: Any,
    max_tokens: int,
    batch_size: int = 1,
    contexts: Sequence[int] = (),
    fresh: bool = False,
) -> tuple[VerifyCostModel, float]:
    """Everything a call at `batch_size` rows after up to `max(contexts)` tokens may time, timed now: the curve
    (`fresh`: anew, replacing the cached one and its online factors), a context point at each of `contexts`
    (within the target's range) and the plain step of every row count up to `batch_size` (what a batch times
    when rows end).  `peagle calibrate --costs` runs it, and benchmarks run it in their warm-up so that no
    measured call includes a one-time timing.  Returns the curve and the seconds spent."""
    tic = time.perf_counter()
    key = cost_model_key(target, head, batch_size)
    if fresh:
        model = measure_cost_model(target, head, max_tokens=max_tokens, batch_size=batch_size)
        model.persist = True  # type: ignore[attr-defined]
        _MODELS[json.dumps(key, sort_keys=True)] = model
    else:
        model = cost_model_for(target, head, max_tokens, batch_size=batch_size)
    limit = max_cost_context(target, max_tokens)
    timed = set(model.timed_contexts())
    for context in sorted(set(contexts)):
        if context > model.context and context not in timed and (limit is None or context <= limit):
            model.add_context_point(measure_context_point(target, head, context, max_tokens, 2, batch_size))
    if batch_size > 1:
        for rows in range(1, batch_size + 1):
            ensure_row_seconds(model, target, rows)
    persist_cost_model(model)
    return model, time.perf_counter() - tic


def recalibrate(
    target: Any,
    head: Any = None,
    max_tokens: int = 11,
    batch_sizes: Sequence[int] = (1,),
    contexts: Sequence[int] = (),
) -> list[VerifyCostModel]:
    """Time the curves of `batch_sizes` anew on purpose (`peagle calibrate --costs`): the reference curve, a
    context point at each of `contexts` and the row counts' plain steps; the fresh curves replace the cached
    ones (their online factors start over).  Run it on an otherwise idle machine."""
    return [
        prepare_cost_model(target, head, max_tokens, rows, contexts, fresh=True)[0] for rows in batch_sizes
    ]


def save_cost_model(model: VerifyCostModel, path: str | os.PathLike | None = None) -> Path:
    """Write the curve as JSON (default: its cache file)."""
    path = Path(path) if path is not None else cost_cache_path(model.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(model.to_dict(), indent=2))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


_UNWRITABLE: set[str] = set()
"""Cache paths already warned about in this process (one warning each)."""


def _warn_unwritable_once(path: Path, error: OSError) -> None:
    if str(path) in _UNWRITABLE:
        return
    _UNWRITABLE.add(str(path))
    warnings.warn(
        f"peagle could not write its verify-cost cache {path} ({error.strerror or error}); the measured curve "
        "is kept in memory for this process only. Set PEAGLE_COST_CACHE to a writable folder to keep it.",
        RuntimeWarning,
        stacklevel=3,
    )


def set_cost_model(head: Any, model: VerifyCostModel | None) -> None:
    """Use `model` for every `generate()` call with `head` (None: back to the measured, cached one)."""
    if model is not None and not isinstance(model, VerifyCostModel):
        raise TypeError(
            f"set_cost_model takes a VerifyCostModel (e.g. VerifyCostModel.flat(...) or "
            f"VerifyCostModel.from_dict(...)) or None, got {type(model).__name__} {model!r}."
        )
    head.cost_model = model


def forget_cost_models() -> None:
    """Drop the in-memory curves (the cache files stay)."""
    _MODELS.clear()


__all__ = [
    "VerifyCostModel",
    "context_point_tokens",
    "ensure_row_seconds",
    "extend_to_context",
    "measure_plain_step",
    "measure_context_point",
    "persist_cost_model",
    "prepare_cost_model",
    "recalibrate",
    "cost_model_for",
    "cost_model_key",
    "cost_cache_path",
    "forget_cost_models",
    "measure_cost_model",
    "measured_points",
    "monotone",
    "save_cost_model",
    "set_cost_model",
]
