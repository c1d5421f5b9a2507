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
from dataclasses import dataclass, field
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

CACHE_SUBDIR = "cost"
CALIBRATION_CONTEXT = 256
"""Context length (tokens) the calibration times its verify passes at."""


# ---------------------------------------------------------------------------------------------- cost model
@dataclass
class VerifyCostModel:
    """Seconds to verify n tokens (n = 1..N) with the target, plus the drafter's cost per round.

    Args:
        verify_seconds: `[N]`, `verify_seconds[n - 1]` = seconds of a target pass over n new tokens (at the
            calibration context; online updates fold in the real context).
        drafter_seconds: seconds of one drafter round (parallel: its one pass; autoregressive: the first pass).
        drafter_step_seconds: seconds of one more autoregressive drafter pass (one slot).
        key: what the curve was measured for (target, device, dtype, threads); see [`cost_model_key`].
        source: `"calibrated"`, `"cache"`, `"flat"` or `"user"`.
        observations: verify passes folded in online, per n.
        smoothing: weight of a new observation in the running estimate.
    """

    verify_seconds: list[float]
    drafter_seconds: float = 0.0
    drafter_step_seconds: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)
    source: str = "user"
    observations: list[int] = field(default_factory=list)
    smoothing: float = 0.1

    def __post_init__(self):
        # every field is checked, not coerced: a cache file may hold `true` as seconds or a smoothing of 5, which
        # would turn the curve negative once online updates fold in
        def seconds(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if (
            not isinstance(self.verify_seconds, (list, tuple))
            or not self.verify_seconds
            or any(not seconds(s) or s <= 0 for s in self.verify_seconds)
        ):
            raise ValueError(
                f"verify_seconds must be positive seconds per n = 1..N, got {self.verify_seconds!r}."
            )
        self.verify_seconds = [float(s) for s in self.verify_seconds]
        for name in ("drafter_seconds", "drafter_step_seconds"):
            value = getattr(self, name)
            if not seconds(value) or value < 0:
                raise ValueError(f"{name} must be seconds >= 0, got {value!r}.")
        if not seconds(self.smoothing) or not 0 < self.smoothing <= 1:
            raise ValueError(
                f"smoothing must be a weight in (0, 1] (of a new observation), got {self.smoothing!r}."
            )
        if not isinstance(self.key, dict) or not isinstance(self.source, str):
            raise ValueError(f"key must be a dict and source a string, got {self.key!r} and {self.source!r}.")
        if not isinstance(self.observations, (list, tuple)) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.observations
        ):
            raise ValueError(f"observations must be counts >= 0 per n, got {self.observations!r}.")
        if len(self.observations) != len(self.verify_seconds):
            self.observations = [0] * len(self.verify_seconds)

    @classmethod
    def flat(
        cls, max_tokens: int = 16, seconds: float = 1.0, drafter_seconds: float = 0.0
    ) -> VerifyCostModel:
        """A curve where verifying n tokens costs the same as one (a GPU at batch 1): the rule then drafts
        every draft whose chain has any chance, i.e. K almost every round."""
        return cls([seconds] * max_tokens, drafter_seconds=drafter_seconds, source="flat")

    def cost(self, n: int) -> float:
        """Seconds to verify n tokens (beyond the measured range: extrapolated linearly)."""
        if n <= len(self.verify_seconds):
            return self.verify_seconds[n - 1]
        last = self.verify_seconds[-1]
        step = max(last - self.verify_seconds[-2], 0.0) if len(self.verify_seconds) > 1 else 0.0
        return last + step * (n - len(self.verify_seconds))

    def curve(self, max_tokens: int) -> list[float]:
        """`[max_tokens]` seconds for n = 1..max_tokens."""
        return [self.cost(n) for n in range(1, max_tokens + 1)]

    @property
    def refined_online(self) -> bool:
        """Measured curves follow the machine; a user's or a flat curve stays as given."""
        return self.source in ("calibrated", "cache")

    def observe_verify(self, n: int, seconds: float) -> None:
        """Fold in a measured verify pass over n tokens (an exponential moving average per n; entries not
        observed yet move by the same ratio, so the curve keeps its calibrated shape)."""
        if not self.refined_online or not (seconds > 0 and math.isfinite(seconds)) or n < 1:
            return
        while n > len(self.verify_seconds):
            self.verify_seconds.append(self.cost(len(self.verify_seconds) + 1))
            self.observations.append(0)
        old = self.verify_seconds[n - 1]
        new = old + self.smoothing * (seconds - old)
        ratio = new / old
        self.verify_seconds[n - 1] = new
        self.observations[n - 1] += 1
        for i, count in enumerate(self.observations):
            if count == 0:
                self.verify_seconds[i] *= ratio

    def observe_drafter(self, seconds: float, steps: int = 0) -> None:
        """Fold in a measured drafter round (`steps` autoregressive passes after the first)."""
        if not self.refined_online or not (seconds > 0 and math.isfinite(seconds)):
            return
        if steps and self.drafter_seconds > 0:
            per_step = max(seconds - self.drafter_seconds, 0.0) / steps
            self.drafter_step_seconds += self.smoothing * (per_step - self.drafter_step_seconds)
            seconds -= per_step * steps
        if self.drafter_seconds <= 0:
            self.drafter_seconds = seconds
        else:
            self.drafter_seconds += self.smoothing * (seconds - self.drafter_seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verify_seconds": list(self.verify_seconds),
            "drafter_seconds": self.drafter_seconds,
            "drafter_step_seconds": self.drafter_step_seconds,
            "key": dict(self.key),
            "source": self.source,
            "observations": list(self.observations),
            "smoothing": self.smoothing,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerifyCostModel:
        known = {
            "verify_seconds",
            "drafter_seconds",
            "drafter_step_seconds",
            "key",
            "source",
            "observations",
            "smoothing",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown cost-model fields {sorted(unknown)}; expected some of {sorted(known)}."
            )
        return cls(**data)


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
    cache (median of `repeats`), and one drafter round (of as many rows) when `head` is given.  About a second
    for a 135M target at batch 1 on a 2-core CPU."""
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
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            sync()
            t0 = time.perf_counter()
            target(input_ids=ids, use_cache=True, **cache_kwarg(cache))
            sync()
            times.append(time.perf_counter() - t0)
            cache.crop(-n)
        seconds.append(statistics.median(times[1:]))
    seconds = monotone(interpolate(points, seconds, max_tokens))
    model = VerifyCostModel(seconds, key=cost_model_key(target, head, rows), source="calibrated")
    if head is not None:
        model.drafter_seconds, model.drafter_step_seconds = _time_drafter(
            head, target, max_tokens - 1, repeats, rows
        )
    return model


def _time_drafter(head: Any, target: Any, k: int, repeats: int, rows: int = 1) -> tuple[float, float]:
    """Seconds of one drafting round (real slots of a typical round + K-1 parallel slots, or one autoregressive
    pass) after a short context, and of one more autoregressive pass."""
    from transformers.cache_utils import DynamicCache

    device = head.device
    width = 3 * int(head.config.target_hidden_size)
    dtype = next(head.parameters()).dtype
    gen = torch.Generator().manual_seed(1)
    if head.config.embed_from_target and head.embed_tokens is None:
        head.attach_target(target)
    ctx = torch.randint(0, head.config.vocab_size, (rows, 64), generator=gen).to(device)
    feats = torch.randn(rows, 64, width, generator=gen).to(device, dtype)
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


def cost_model_for(
    target: Any, head: Any = None, max_tokens: int = 11, use_cache: bool = True, batch_size: int = 1
) -> VerifyCostModel:
    """The cost model of (target, head) at `batch_size` rows on this device/dtype/threads: from this process's
    memory, else the cache file, else measured now (and cached).  The returned object is shared, so online
    refinements carry over between `generate()` calls."""
    override = getattr(head, "cost_model", None) if head is not None else None
    if override is not None:
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
        if model is not None and len(model.verify_seconds) < max_tokens:
            model = None
    if model is None:
        model = measure_cost_model(target, head, max_tokens=max_tokens, batch_size=batch_size)
        if use_cache:
            try:
                save_cost_model(model, path)
            except OSError as e:  # a cache is an optimisation: keep the curve in memory and go on
                _warn_unwritable_once(path, e)
    _MODELS[name] = model
    return model


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
    head.cost_model = model


def forget_cost_models() -> None:
    """Drop the in-memory curves (the cache files stay)."""
    _MODELS.clear()


__all__ = [
    "VerifyCostModel",
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
