"""Cost-aware drafting: the machine's measured cost of verifying n tokens per row, for the rule in [`rule`].

[`VerifyCostModel`] ([`cost_model`]) holds the cost curve: calibrated once per (target, device, dtype, threads,
batch size) by timing forward passes ([`cost_timing`]; cached as JSON under the peagle cache folder,
[`cost_cache`]), refined online from the verify passes generation runs anyway, inspectable (`to_dict`) and
overridable (`VerifyCostModel.flat(...)`, `from_dict`, or `set_cost_model`).  This module picks the curve a call
uses ([`cost_model_for`]), times what a call reaches that the curve lacks ([`extend_to_context`],
[`ensure_row_seconds`]) and times everything ahead on purpose ([`prepare_cost_model`], [`recalibrate`]); every
cost name stays importable from here.  On a GPU verifying 8 tokens costs about as much as 1 (a flat curve, so the
rule drafts K whenever the probabilities are not tiny); on a CPU each extra token costs a visible fraction of a
step.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from typing import Any

from .cost_cache import (
    CACHE_SUBDIR,
    COST_MODEL_VERSION,
    cost_cache_path,
    cost_model_key,
    persist_cost_model,
    save_cost_model,
)
from .cost_model import MIN_CONTEXT_POINT, VerifyCostModel, monotone
from .cost_timing import (
    CALIBRATION_CONTEXT,
    CALL_TIMING_SECONDS,
    TimingBudget,
    context_fits_in_memory,
    context_point_tokens,
    interpolate,
    max_cost_context,
    measure_context_point,
    measure_cost_model,
    measure_plain_step,
    measure_quick_cost_model,
    measured_points,
)

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

_MODELS: dict[str, VerifyCostModel] = {}
_UNTIMEABLE: set[tuple[str, int]] = set()
"""(curve, context) pairs whose context point could not be timed in this process (not tried again)."""
_WARNED_TIMING = False
"""Whether this process has said that `generate()` times the machine's costs (said once)."""


def warn_timing_once(batch_size: int) -> None:
    """Say, once per process, that a call times this machine's costs and how to do it ahead of time."""
    global _WARNED_TIMING
    if _WARNED_TIMING:
        return
    _WARNED_TIMING = True
    warnings.warn(
        f"peagle's cost rule is timing this machine's verify costs for batch size {batch_size} (a few short "
        f"target and drafter passes, at most about {CALL_TIMING_SECONDS:g} s in a call, in the call's "
        "stats.cost_timing_seconds; each new batch size, dtype or thread count and longer context takes a few "
        "more, and the passes generation runs refine the curve). To time the full curves ahead of time, run "
        "`peagle calibrate HEAD --costs --batch_sizes 1,2,4,8` (or peagle.generation.cost.recalibrate(target, "
        "head, batch_sizes=[1, 2, 4, 8])) once per machine.",
        UserWarning,
        stacklevel=2,
    )


def cost_model_for(
    target: Any,
    head: Any = None,
    max_tokens: int = 11,
    use_cache: bool = True,
    batch_size: int = 1,
    budget: TimingBudget | None = None,
) -> VerifyCostModel:
    """The cost model of (target, head) at `batch_size` rows on this device/dtype/threads: from this process's
    memory, else the cache file, else timed now and cached.  With a `budget` (a `generate()` call that did not
    ask for timing) the curve is a quick one ([`measure_quick_cost_model`], said once per process), its seconds
    counted in the budget; without one, the full curve ([`measure_cost_model`]).  The returned object is shared,
    so online refinements carry over between `generate()` calls; [`persist_cost_model`] writes them back to the
    file."""
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
    if model is None and budget is not None:
        warn_timing_once(batch_size)
        model = measure_quick_cost_model(target, head, max_tokens, batch_size, budget)
    elif model is None:
        model = measure_cost_model(target, head, max_tokens=max_tokens, batch_size=batch_size)
    model.persist = use_cache  # type: ignore[attr-defined]  (where online figures and new points go)
    persist_cost_model(model)
    _MODELS[name] = model
    return model


def extend_to_context(
    model: VerifyCostModel,
    target: Any,
    head: Any,
    context: int,
    max_tokens: int,
    batch_size: int = 1,
    budget: TimingBudget | None = None,
) -> float:
    """Before a round after `context` tokens: time the context point the curve lacks for it
    ([`VerifyCostModel.next_context_point`]), add it and persist the curve.  Returns the seconds spent (0.0
    when nothing needed timing).  A point that cannot be timed (a cache kind that cannot be lengthened, or not
    enough memory for a lengthened copy) is not tried again in this process; the online factors then carry
    the context's cost.  With a `budget`, a quick point ([`measure_context_point`]) and only while the budget
    lasts: a call that spent it leaves the point to a later call."""
    if model.next_context_point(context) is None:  # every round asks: answered without the target's config
        return 0.0
    point = model.next_context_point(context, max_cost_context(target, max_tokens))
    name = json.dumps(model.key, sort_keys=True)
    if point is None or (name, point) in _UNTIMEABLE or (budget is not None and not budget.left):
        return 0.0
    rows = max(1, int(batch_size))
    if not context_fits_in_memory(target, rows, point):
        _UNTIMEABLE.add((name, point))
        return 0.0
    tic = time.perf_counter()
    try:
        if budget is not None:
            warn_timing_once(rows)
        timed = measure_context_point(
            target, head, point, max(max_tokens, len(model.verify_seconds)), 2, rows, budget
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


def ensure_row_seconds(
    model: VerifyCostModel, target: Any, rows: int, budget: TimingBudget | None = None
) -> tuple[float | None, float]:
    """`(seconds of a plain step with `rows` rows at the reference context, seconds spent timing it now)`: from
    the curve's `row_seconds`, else timed (and persisted).  None when it cannot be timed, or (with a `budget`)
    when the call's budget is spent."""
    known = model.row_seconds.get(str(rows))
    if known is not None:
        return known, 0.0
    if not model.context or (budget is not None and not budget.left):
        return None, 0.0
    tic = time.perf_counter()
    try:
        seconds = measure_plain_step(target, rows, model.context, budget=budget)
    except (NotImplementedError, RuntimeError, ValueError):
        return None, time.perf_counter() - tic
    model.row_seconds[str(rows)] = seconds
    persist_cost_model(model)
    return seconds, time.perf_counter() - tic


def prepare_cost_model(
    target: Any,
    head: Any,
    max_tokens: int,
    batch_size: int = 1,
    contexts: Sequence[int] = (),
    fresh: bool = False,
) -> tuple[VerifyCostModel, float]:
    """Everything a call at `batch_size` rows after up to `max(contexts)` tokens may time, timed now: the full curve
    (`fresh`, or where the cached one is a call's quick curve: anew, replacing it and its online factors), a context point at each of `contexts`
    (within the target's range) and the plain step of every row count up to `batch_size` (what a batch times
    when rows end).  `peagle calibrate --costs` runs it, and benchmarks run it in their warm-up so that no
    measured call includes a one-time timing.  Returns the curve and the seconds spent."""
    tic = time.perf_counter()
    key = cost_model_key(target, head, batch_size)
    if not fresh:
        model = cost_model_for(target, head, max_tokens, batch_size=batch_size)
        fresh = model.refined_online and model.timing == "quick"  # a call's quick curve: time the full one
    if fresh:
        model = measure_cost_model(target, head, max_tokens=max_tokens, batch_size=batch_size)
        model.persist = True  # type: ignore[attr-defined]
        _MODELS[json.dumps(key, sort_keys=True)] = model
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
    "CACHE_SUBDIR",
    "CALIBRATION_CONTEXT",
    "CALL_TIMING_SECONDS",
    "COST_MODEL_VERSION",
    "MIN_CONTEXT_POINT",
    "TimingBudget",
    "VerifyCostModel",
    "context_point_tokens",
    "cost_cache_path",
    "cost_model_for",
    "cost_model_key",
    "ensure_row_seconds",
    "extend_to_context",
    "forget_cost_models",
    "interpolate",
    "max_cost_context",
    "measure_context_point",
    "measure_cost_model",
    "measure_plain_step",
    "measure_quick_cost_model",
    "measured_points",
    "monotone",
    "persist_cost_model",
    "prepare_cost_model",
    "recalibrate",
    "save_cost_model",
    "set_cost_model",
    "warn_timing_once",
]
