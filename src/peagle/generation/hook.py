"""The one version-guarded hook that routes `generate(..., assistant_model=<PEagleDrafter>)` to peagle.

transformers picks a candidate generator in `GenerationMixin._get_candidate_generator`, a hard-coded dispatch
chain with no public argument for a custom generator.  `import peagle` wraps that method (and
`_validate_generation_mode`, so unsupported requests fail with a clear message): a P-EAGLE head gets a
[`PEagleCandidateGenerator`]; every other assistant reaches transformers untouched.  transformers' own
`_assisted_decoding` loop still verifies the drafts, so greedy output is token-for-token the target's own and
sampling keeps the target's distribution.  Why version-guarded: docs/DESIGN.md section 6.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import transformers
from packaging import version
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import GenerationConfig, GenerationMode
from transformers.generation.utils import GenerationMixin

from ..modeling_peagle import PEagleDrafter
from .candidates import PEagleCandidateGenerator, text_config

MIN_TRANSFORMERS_VERSION = "5.23"
"""Oldest transformers whose list-valued `output_hidden_states` keeps the embeddings at index 0."""
SUPPORTED_TRANSFORMERS = f">={MIN_TRANSFORMERS_VERSION},<5.25"
"""The range `pyproject.toml` declares: the releases whose generation internals the hook was checked against."""

_HOOKED_METHODS = ("_validate_generation_mode", "_get_candidate_generator")
_DISPATCH_PARAMETERS = {
    "generation_config",
    "input_ids",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
}
_VALIDATE_PARAMETERS = ["self", "generation_mode", "generation_config", "generation_mode_kwargs"]


# ---------------------------------------------------------------------------------------------- checks
@functools.cache
def _integration_problem() -> str | None:
    """Why this transformers cannot run P-EAGLE drafting, or `None` when its internals are the expected ones."""
    installed = version.parse(transformers.__version__)
    if installed.release < version.parse(MIN_TRANSFORMERS_VERSION).release:
        return (
            f"transformers {transformers.__version__} is older than {MIN_TRANSFORMERS_VERSION}: its list-valued "
            "`output_hidden_states` has no embeddings entry at index 0, so the aux layer ids would be off by one"
        )
    if not hasattr(CandidateGenerator, "requires_model_outputs"):
        return "CandidateGenerator has no `requires_model_outputs` (candidate generators cannot read verify outputs)"
    dispatch = getattr(
        GenerationMixin._get_candidate_generator, "__wrapped__", GenerationMixin._get_candidate_generator
    )
    missing = _DISPATCH_PARAMETERS - set(inspect.signature(dispatch).parameters)
    if missing:
        return f"GenerationMixin._get_candidate_generator lacks the parameters {sorted(missing)}"
    assisted = getattr(GenerationMixin, "_assisted_decoding", None)
    if assisted is None:
        return "GenerationMixin has no `_assisted_decoding`"
    try:
        source = inspect.getsource(assisted)
    except (OSError, TypeError):  # no source shipped: trust the signature checks above
        return None
    for needle in ("model_kwargs_overrides", "n_last_matches", "update_candidate_strategy"):
        if needle not in source:
            return f"GenerationMixin._assisted_decoding no longer uses `{needle}`"
    return None


def _raise_if_incompatible() -> None:
    problem = _integration_problem()
    if problem is not None:
        raise RuntimeError(
            f"peagle cannot draft inside generate() with transformers {transformers.__version__}: {problem}. "
            f"Install transformers{SUPPORTED_TRANSFORMERS} (the versions peagle's generation hook was written for)."
        )


def check_generation_request(
    target: Any,
    head: PEagleDrafter,
    generation_config: GenerationConfig,
    batch_size: int | None = None,
    generation_mode: Any = None,
) -> None:
    """Raise a `ValueError` naming what is supported when `target.generate(..., assistant_model=head)` cannot work.

    Supported: a decoder-only target the head was built for (hidden size, vocabulary, layer count), batch size 1,
    `num_beams=1`, `num_return_sequences=1`, greedy search or sampling.
    """
    tc = text_config(target)
    if getattr(tc, "is_encoder_decoder", False):
        raise ValueError(
            f"P-EAGLE drafting supports decoder-only targets; {type(target).__name__} is encoder-decoder."
        )
    num_beams = generation_config.num_beams or 1
    if num_beams > 1:
        raise ValueError(
            f"P-EAGLE drafting supports greedy search and sampling with num_beams=1; got num_beams={num_beams}."
        )
    num_return = generation_config.num_return_sequences or 1
    if num_return > 1:
        raise ValueError(
            f"P-EAGLE drafting returns one sequence per prompt (num_return_sequences=1); got num_return_sequences={num_return}."
        )
    if generation_mode is not None and generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"P-EAGLE drafting supports greedy search and sampling; these generation options select "
            f"{getattr(generation_mode, 'value', generation_mode)!r} instead."
        )
    conflicting = {
        "prompt_lookup_num_tokens": getattr(generation_config, "prompt_lookup_num_tokens", None),
        "assistant_early_exit": getattr(generation_config, "assistant_early_exit", None),
        "speculation_type": getattr(generation_config, "speculation_type", None),
        "use_mtp": getattr(generation_config, "use_mtp", None) or None,
    }
    conflicting = {k: v for k, v in conflicting.items() if v is not None}
    if conflicting:
        raise ValueError(f"a P-EAGLE assistant_model drafts on its own; unset {conflicting} (expected None).")
    if generation_config.stop_strings:
        raise ValueError(
            "stop_strings cannot be honoured exactly with a P-EAGLE assistant_model: transformers checks them once "
            "per verified block, so a stop string ending inside accepted drafts would not stop generation where "
            "plain decoding stops. Drop assistant_model, or stop on eos_token_id instead."
        )
    if batch_size is not None and batch_size != 1:
        raise ValueError(
            f"P-EAGLE drafting in generate() supports batch size 1; got a batch of {batch_size} prompts. "
            "Call generate() once per prompt."
        )
    head.check_target(tc)


# ---------------------------------------------------------------------------------------------- the hook
DEFAULT_STOPPING_CRITERIA = ("MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria")
"""Stopping criteria a speculative round honours exactly (length and EOS are checked token by token by
transformers' assisted decoding; a time limit has no exact answer anyway)."""


def _user_request(frame: Any) -> dict[str, Any] | None:
    """What the user passed to `generate()`, read from its frame (the caller of `_validate_generation_mode`):
    `{"kwargs": ..., "stopping_criteria": ...}`, or None when the caller is not transformers' `generate`."""
    if frame is None or frame.f_code.co_name != "generate":
        return None
    local = frame.f_locals
    kwargs = local.get("kwargs")
    if not isinstance(kwargs, dict):
        return None
    return {"kwargs": kwargs, "stopping_criteria": local.get("stopping_criteria")}


def check_user_request(generation_config: GenerationConfig, request: dict[str, Any] | None) -> None:
    """Refuse the generate() arguments outside the generation config that a speculative round cannot honour
    exactly (custom stopping criteria, a filled cache), naming them; remember which of K and the confidence cut
    the user gave (so a value equal to transformers' default still counts as given)."""
    if request is None:
        return
    custom = [
        type(c).__name__
        for c in (request["stopping_criteria"] or [])
        if type(c).__name__ not in DEFAULT_STOPPING_CRITERIA
    ]
    if custom:
        raise ValueError(
            f"custom stopping_criteria {custom} cannot be honoured exactly with a P-EAGLE assistant_model: they run "
            "once per verified block, not after every token as in plain decoding. Supported: max_new_tokens/"
            "max_length, eos_token_id and max_time."
        )
    cache = request["kwargs"].get("cache", request["kwargs"].get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError(
            "A cache (past_key_values) from an earlier call cannot be used with a P-EAGLE assistant_model: the head has no "
            "target features for the cached prefix. Pass the whole sequence as input_ids without the cache."
        )
    given = {
        name
        for name in ("num_assistant_tokens", "assistant_confidence_threshold")
        if name in request["kwargs"]
    }
    generation_config._peagle_given = given


def _wrap_validate_generation_mode(original: Callable) -> Callable:
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        head = (
            generation_mode_kwargs.get("assistant_model")
            if isinstance(generation_mode_kwargs, dict)
            else None
        )
        if isinstance(head, PEagleDrafter):
            _raise_if_incompatible()
            check_generation_request(self, head, generation_config, generation_mode=generation_mode)
            check_user_request(generation_config, _user_request(sys._getframe(1)))
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _wrap_get_candidate_generator(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        head = arguments.get("assistant_model")
        if not isinstance(head, PEagleDrafter):
            return original(self, *args, **kwargs)
        _raise_if_incompatible()
        generation_config = arguments["generation_config"]
        check_generation_request(self, head, generation_config, batch_size=arguments["input_ids"].shape[0])
        return PEagleCandidateGenerator(self, head, generation_config, arguments.get("logits_processor"))

    return _get_candidate_generator


def install_generate_hook() -> bool:
    """Route `generate(..., assistant_model=<PEagleDrafter>)` to [`PEagleCandidateGenerator`]; idempotent.

    Wraps `GenerationMixin._get_candidate_generator` (the dispatch) and `GenerationMixin._validate_generation_mode`
    (so unsupported requests such as beam search fail with our message before transformers ignores or rejects the
    assistant).  Both wrappers pass every other assistant through untouched.  Returns whether the hook is in place;
    on a transformers without these methods it warns and leaves transformers alone.
    """
    installed = True
    for name in _HOOKED_METHODS:
        current = getattr(GenerationMixin, name, None)
        if current is None:
            warnings.warn(
                f"transformers {transformers.__version__} has no GenerationMixin.{name}; peagle heads cannot draft "
                f"inside generate() (needs transformers{SUPPORTED_TRANSFORMERS}).",
                stacklevel=2,
            )
            installed = False
            continue
        if getattr(current, "_peagle_hook", False):
            continue
        if name == "_validate_generation_mode":
            if list(inspect.signature(current).parameters) != _VALIDATE_PARAMETERS:
                installed = (
                    False  # unexpected internals: leave it alone; the dispatch hook still raises clearly
                )
                continue
            wrapper = _wrap_validate_generation_mode(current)
        else:
            wrapper = _wrap_get_candidate_generator(current)
        wrapper._peagle_hook = True
        setattr(GenerationMixin, name, wrapper)
    return installed


def uninstall_generate_hook() -> None:
    """Restore transformers' own generation dispatch."""
    for name in _HOOKED_METHODS:
        current = getattr(GenerationMixin, name, None)
        if current is not None and getattr(current, "_peagle_hook", False):
            setattr(GenerationMixin, name, current.__wrapped__)


__all__ = [
    "check_generation_request",
    "install_generate_hook",
    "uninstall_generate_hook",
    "MIN_TRANSFORMERS_VERSION",
]
