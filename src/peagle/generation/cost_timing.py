"""Timing the verify-cost curve: target passes over n new tokens per row after a context (the reference curve,
[`measure_cost_model`]; a longer context's point, [`measure_context_point`]; a plain step of R rows,
[`measure_plain_step`]) and drafter rounds, each the median of a few passes after a warm-up."""

from __future__ import annotations

import bisect
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..drafting_peagle import cache_kwarg, custom_attention_mask
from .attention import packed_attention
from .cost_cache import cost_model_key
from .cost_model import VerifyCostModel, monotone
from .windows import SLIDING, LayerWindows, WindowLayer, positional_windows

CALIBRATION_CONTEXT = 256
"""Context length (tokens) the calibration times its verify passes at (the reference context)."""

CALL_TIMING_SECONDS = 0.5
"""At most about this many seconds of timing inside one `generate()` call that did not ask for it (a pass under
way is finished; a piece of timing that finds the budget spent waits for a later call)."""


@dataclass
class TimingBudget:
    """The timing one `generate()` call may do: `seconds` in all (None: no limit, timing asked for), of which
    `spent` so far, in `passes` timed target passes and `drafter_passes` timed drafter rounds."""

    seconds: float | None = CALL_TIMING_SECONDS
    spent: float = 0.0
    passes: int = 0
    drafter_passes: int = 0

    @property
    def left(self) -> bool:
        """Whether more timing fits."""
        return self.seconds is None or self.spent < self.seconds

    def fits(self, since: float, seconds: float) -> bool:
        """Whether `seconds` more of timing fit in what is left, after the timing that started at `since` (not in
        `spent` yet)."""
        return self.seconds is None or self.spent + time.perf_counter() - since + seconds < self.seconds


def quick_points(max_tokens: int) -> list[int]:
    """The n a quick curve times, most needed first: a plain step, a chain's round of 8, the longest pass and 2
    (the rest interpolated, and the whole curve corrected online by the passes generation runs).

    >>> quick_points(33), quick_points(5)
    ([1, 8, 33, 2], [1, 5, 2])
    """
    out: list[int] = []
    for n in (1, 8, max_tokens, 2):
        if n <= max_tokens and n not in out:
            out.append(n)
    return out


def fill_curve(points: list[int], seconds: list[float], max_tokens: int) -> list[float]:
    """`[max_tokens]` seconds for n = 1..max_tokens from timed `points` (any order, 1 among them): linear between
    them and, beyond the largest, along the last segment (flat with one point).

    >>> fill_curve([1, 4], [1.0, 2.5], 6)
    [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    """
    pairs = sorted(zip(points, seconds))
    xs, ys = [p for p, _ in pairs], [s for _, s in pairs]
    if xs[-1] < max_tokens:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        xs.append(max_tokens)
        ys.append(ys[-1] + max(slope, 0.0) * (max_tokens - xs[-2]))
    return interpolate(xs, ys, max_tokens)


def measured_points(max_tokens: int) -> list[int]:
    """The n a calibration times: every n up to 12 (chains), then 16, 24, 32, 48, 72, 108, ... (trees: steps of 8
    up to 32, then half again the last) and `max_tokens` itself; the curve is interpolated in between.

    >>> measured_points(40)
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 24, 32, 40]
    >>> measured_points(120)[12:]
    [16, 24, 32, 48, 72, 108, 120]
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
    cache (median of `repeats`; the n of [`measured_points`], interpolated in between), and one drafter round (of
    as many rows) when `head` is given: a calibrated [`VerifyCostModel`]."""
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
    positional_windows(target, cache)  # a real prefill: sliding layers keep the reference context whole
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


@torch.no_grad()
def measure_quick_cost_model(
    target: Any,
    head: Any = None,
    max_tokens: int = 11,
    batch_size: int = 1,
    budget: TimingBudget | None = None,
) -> VerifyCostModel:
    """A curve from a few short passes (`timing = "quick"`), for a call that did not ask for timing: one target pass
    per n of [`quick_points`] per row after the reference context, in that order (always the plain step and the
    next; a later n only where the budget left holds what the points so far predict for it), the rest filled in
    ([`fill_curve`]), and one drafter round while the budget lasts (else the call's first drafting round measures
    it).  The reference context is one prefilled token with its keys and values repeated (as for a context point),
    so no long prefill runs.  The online factors then correct the curve
    from the passes generation runs; `peagle calibrate --costs` times the full one ([`measure_cost_model`])."""
    budget = budget if budget is not None else TimingBudget()
    tic = time.perf_counter()
    try:
        device = next(target.parameters()).device
        text = target.config.get_text_config()
        vocab = int(text.vocab_size)
        context = CALIBRATION_CONTEXT
        positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if positions:
            context = max(1, min(context, int(positions) - max_tokens))
        rows = max(1, int(batch_size))
        gen = torch.Generator().manual_seed(0)
        try:
            stretched = _stretched_cache(target, rows, context, vocab, gen, device)
        except NotImplementedError:  # a cache kind that cannot be lengthened: a real prefill
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=target.config)
            positional_windows(target, cache)
            target(input_ids=torch.randint(0, vocab, (rows, context), generator=gen).to(device), use_cache=True,
                   **cache_kwarg(cache))  # fmt: skip
            if hasattr(cache, "activate_past_recording"):
                cache.activate_past_recording()
            stretched = _Stretched(cache, rows, context, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        points, seconds = [], []
        for i, n in enumerate(quick_points(max_tokens)):
            if i >= 2 and not budget.fits(tic, _predicted(points, seconds, n)):
                continue  # a shorter point may still fit
            ids = torch.randint(0, vocab, (rows, n), generator=gen).to(device)
            # one pass each (a first pass of a shape timed within about 10% of a repeated one), refined online
            mask = stretched.mask(n, padded=False)
            seconds.append(_time_pass(target, stretched.cache, ids, mask, 1, sync, budget, warm_up=False))
            points.append(n)
        del stretched
        model = VerifyCostModel(
            monotone(fill_curve(points, seconds, max_tokens)),
            key=cost_model_key(target, head, rows),
            source="calibrated",
            context=context,
            timing="quick",
        )
        # one drafter round where about a plain step's seconds fit, else the first drafting round measures it
        if head is not None and budget.fits(tic, seconds[0]):
            model.drafter_seconds, model.drafter_step_seconds = _time_drafter(
                head, target, max_tokens - 1, 1, rows, budget
            )
        return model
    finally:
        budget.spent += time.perf_counter() - tic


def _predicted(points: list[int], seconds: list[float], n: int) -> float:
    """What a pass over n tokens per row should take, from the passes timed so far (1 among them): linear between
    them and along the last segment beyond."""
    return fill_curve(points, seconds, max(n, *points))[n - 1]


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
    budget: TimingBudget | None = None,
) -> dict[str, Any]:
    """Time target passes over n tokens per row ([`context_point_tokens`]) and one drafter round after
    `context` tokens: a context point of [`VerifyCostModel`].

    No prefill of `context` tokens runs: one token is prefilled, and the cache's keys and values are
    repeated to `context` slots (a pass costs the same whatever the cached values are), so the point takes a
    few passes.  With a `budget` (inside a call that did not ask for timing) each n is one pass and the n go plain
    step, longest, 8, 2 (always the first two; a later n only where the budget left holds what the passes so far
    predict for it).  Raises
    `NotImplementedError` for caches whose layers are not plain or sliding-window key/value tensors (the curve
    then follows the context through its online factors only)."""
    tic = time.perf_counter()
    try:
        device = next(target.parameters()).device
        text = target.config.get_text_config()
        vocab = int(text.vocab_size)
        rows = max(1, int(batch_size))
        gen = torch.Generator().manual_seed(2)
        stretched = _stretched_cache(target, rows, context, vocab, gen, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        order = context_point_tokens(max_tokens)
        if budget is not None:
            order = list(dict.fromkeys(n for n in (1, max_tokens, 8, 2) if n in order))
            repeats = 1
        timed: dict[int, float] = {}
        for i, n in enumerate(order):
            if (
                budget is not None
                and i >= 2
                and not budget.fits(tic, _predicted(list(timed), list(timed.values()), n))
            ):
                continue
            ids = torch.randint(0, vocab, (rows, n), generator=gen).to(device)
            mask = stretched.mask(n)
            timed[n] = _time_pass(
                target, stretched.cache, ids, mask, repeats, sync, budget, warm_up=budget is None
            )
        del stretched
        drafter = 0.0
        if head is not None:
            drafter = _time_drafter_at(head, target, max_tokens - 1, repeats, rows, context, budget)
        ns = sorted(timed)
        return {
            "context": int(context),
            "n": ns,
            "seconds": [timed[n] for n in ns],
            "drafter_seconds": drafter,
        }
    finally:
        if budget is not None:
            budget.spent += time.perf_counter() - tic


@torch.no_grad()
def measure_plain_step(
    target: Any, rows: int, context: int, repeats: int = 3, budget: TimingBudget | None = None
) -> float:
    """Seconds of one plain step (one new token per row, a 2D attention mask from 2 rows on) for `rows` rows
    after `context` cached tokens (median of `repeats` after a warm-up; with a `budget`, one pass)."""
    tic = time.perf_counter()
    try:
        device = next(target.parameters()).device
        vocab = int(target.config.get_text_config().vocab_size)
        gen = torch.Generator().manual_seed(4)
        stretched = _stretched_cache(target, rows, context, vocab, gen, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        ids = torch.randint(0, vocab, (rows, 1), generator=gen).to(device)
        mask = stretched.mask(1)
        if budget is not None:  # one pass
            return _time_pass(target, stretched.cache, ids, mask, 1, sync, budget, warm_up=False)
        return _time_pass(target, stretched.cache, ids, mask, repeats, sync)
    finally:
        if budget is not None:
            budget.spent += time.perf_counter() - tic


@dataclass
class _Stretched:
    """A timing cache that reads as `context` tokens long for `rows` rows ([`_stretched_cache`]), with what its
    passes' masks need: `windows` where sliding layers keep their own slots (as in a decoding call), and per mask
    key the slots its layers hold."""

    cache: Any
    rows: int
    context: int
    device: Any
    windows: LayerWindows | None = None
    implementation: str | None = None
    dtype: torch.dtype = torch.float32

    def mask(self, n: int, padded: bool = True) -> Any:
        """The attention mask of a pass over `n` new tokens per row.  Where sliding layers keep their own slots,
        what a decoding call's verify pass gives them: a 4D mask per layer kind over its slots (one, for a target
        whose layers all slide), every slot allowed (what a pass costs does not depend on which).  Otherwise a 2D
        mask of ones for more than one row where `padded` (a batch's passes take one), else None."""
        device = self.device
        if self.windows is None:
            return (
                torch.ones(self.rows, self.context + n, dtype=torch.long, device=device)
                if padded and self.rows > 1
                else None
            )
        masks = {
            kind: custom_attention_mask(
                torch.ones(
                    self.rows, 1, n, _kept_slots(self.context, w) + n, dtype=torch.bool, device=device
                ),
                self.implementation,
                self.dtype,
            )
            for kind, w in self.windows.windows.items()
        }
        return masks if self.windows.keyed else masks[SLIDING]


def _stretched_cache(model: Any, rows: int, context: int, vocab: int, gen, device) -> _Stretched:
    """A DynamicCache that reads as `context` tokens long for `rows` rows: one token prefilled for one row, then each
    layer's keys and values repeated along the sequence (sliding-window layers: up to their window) and the batch.
    Sliding layers keep their window's slots as in a decoding call ([`windows.WindowLayer`], masked by position),
    so a long context's passes cost what a call's do.  What a pass costs does not depend on the cached values."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    windows = positional_windows(model, cache, trim=True)  # as peagle_decoding's cache
    ids = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwarg(cache))
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, WindowLayer) or layer.keys is None:
            raise NotImplementedError(f"cannot lengthen a {type(layer).__name__} cache layer")
        window = None
        if isinstance(layer, DynamicSlidingWindowLayer):  # transformers' own: the window in slots
            window = layer.sliding_window
            layer.cumulative_length = context
        elif isinstance(layer, WindowLayer):
            window = layer.window
        _lengthen(layer, _kept_slots(context, window), rows)
    if windows is None:
        return _Stretched(cache, rows, context, device)
    dtype = model.get_input_embeddings().weight.dtype
    return _Stretched(cache, rows, context, device, windows, model.config._attn_implementation, dtype)


def _kept_slots(context: int, window: int | None) -> int:
    """The slots a layer keeps after `context` tokens: all of them, or a sliding window's last `window - 1`."""
    return context if window is None else min(context, window - 1)


def _lengthen(layer: Any, slots: int, rows: int = 1) -> None:
    """A one-row cache layer's keys and values repeated along the sequence to `slots` entries and to `rows` rows."""
    reps = -(-slots // layer.keys.shape[-2])
    layer.keys = layer.keys.repeat(rows, 1, reps, 1)[:, :, :slots].contiguous()
    layer.values = layer.values.repeat(rows, 1, reps, 1)[:, :, :slots].contiguous()


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


def _time_drafter_at(
    head: Any, target: Any, k: int, repeats: int, rows: int, context: int, budget: TimingBudget | None = None
) -> float:
    """Seconds of one drafting round (3 real slots + K-1 parallel ones, or one autoregressive pass) after
    `context` slots in the drafter's cache: the median of `repeats` after a warm-up (with a `budget`, one round)."""
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
    for _ in range(repeats + 1 if budget is None else 1):
        t0 = time.perf_counter()
        head.draft_round(ctx[:, 32:], feats[:, 32:], max(k, 1), cache, context, select=select)
        times.append(time.perf_counter() - t0)
        cache.crop(-(cache.get_seq_length() - context))
    if budget is not None:
        budget.drafter_passes += len(times)
    return statistics.median(times[1:] if budget is None else times)


def _time_drafter(
    head: Any, target: Any, k: int, repeats: int, rows: int = 1, budget: TimingBudget | None = None
) -> tuple[float, float]:
    """Seconds of one drafting round (real slots of a typical round + K-1 parallel slots, or one autoregressive
    pass) after a short context, and of one more autoregressive pass: the median of `repeats` after a warm-up
    round, each after a 61-slot prefill; with a `budget` (inside a call), one round after a 5-slot prefill."""
    from transformers.cache_utils import DynamicCache

    context = 61 if budget is None else 5
    ctx, feats = _drafter_inputs(head, target, rows, context + 3, seed=1)
    select = lambda logits, depth: (logits.argmax(-1), None, False)  # noqa: E731
    times, steps = [], []
    for _ in range(repeats + 1 if budget is None else 1):
        cache = DynamicCache(config=head.config)
        head.draft_round(ctx[:, :context], feats[:, :context], 1, cache, 0, select=select)
        t0 = time.perf_counter()
        head.draft_round(ctx[:, context:], feats[:, context:], max(k, 1), cache, context, select=select)
        times.append(time.perf_counter() - t0)
        if head.config.drafting_mode == "autoregressive":
            t0 = time.perf_counter()
            head.draft_round(ctx[:, context : context + 1], feats[:, context : context + 1], 1, cache,
                             context + 3, select=select)  # fmt: skip
            steps.append(time.perf_counter() - t0)
    if budget is not None:
        budget.drafter_passes += len(times) + len(steps)
    timed = slice(1, None) if budget is None else slice(None)
    first = statistics.median(times[timed])
    if head.config.drafting_mode == "autoregressive" and k > 1:
        step = statistics.median(steps[timed])
        first = max(first - step * (k - 1), step)
        return first, step
    return first, 0.0


def _time_pass(
    target: Any,
    cache: Any,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    repeats: int,
    sync,
    budget: TimingBudget | None = None,
    warm_up: bool = True,
) -> float:
    """Median seconds of `repeats` target passes over `ids` on `cache` after one warm-up pass (the first pass of a
    shape allocates, and is slower; without `warm_up`, the one pass as it is); each pass is cropped off the cache
    again (counted in `budget.passes`)."""
    times = []
    with packed_attention(target):  # the attention verify passes run with (peagle_decoding)
        for _ in range(repeats + 1 if warm_up else 1):
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
    if budget is not None:
        budget.passes += len(times)
    return statistics.median(times[1:] if warm_up else times)


def context_fits_in_memory(target: Any, rows: int, context: int) -> bool:
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


__all__ = [
    "CALIBRATION_CONTEXT",
    "CALL_TIMING_SECONDS",
    "TimingBudget",
    "fill_curve",
    "measure_quick_cost_model",
    "quick_points",
    "context_fits_in_memory",
    "context_point_tokens",
    "interpolate",
    "max_cost_context",
    "measure_context_point",
    "measure_cost_model",
    "measure_plain_step",
    "measured_points",
]
