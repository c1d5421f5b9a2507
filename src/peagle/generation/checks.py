"""The checks a `generate(..., assistant_model=<PEagleDrafter>)` request passes before any forward pass: the
installed transformers' generation internals, the generation config, the arguments generate() does not put in
the config, the head itself, and what generate() prepared for peagle's loop.  Each refusal names the option and
what is supported.  [`hook`] runs the first ones, [`decoding.peagle_decoding`] the last."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
import transformers
from packaging import version
from transformers.generation.configuration_utils import GenerationConfig
from transformers.generation.utils import GenerationMixin

from ..modeling_peagle import PEagleDrafter
from ..sizing.target_config import text_config
from .windows import layer_windows

MIN_TRANSFORMERS_VERSION = "5.24"
"""Oldest transformers whose list-valued `output_hidden_states` keeps the embeddings at index 0."""
SUPPORTED_TRANSFORMERS = f">={MIN_TRANSFORMERS_VERSION},<5.26"
"""The range `pyproject.toml` declares: the releases whose generation internals the hook was checked against."""

_GENERATE_PARAMETERS = {"custom_generate", "assistant_model", "streamer", "stopping_criteria"}


# ---------------------------------------------------------------------------------------------- checks
@functools.cache
def _integration_problem() -> str | None:
    """Why this transformers cannot run P-EAGLE drafting, or `None` when its internals are the expected ones."""
    installed = version.parse(transformers.__version__)
    if installed.release < version.parse(MIN_TRANSFORMERS_VERSION).release:
        return (
            f"transformers {transformers.__version__} is older than {MIN_TRANSFORMERS_VERSION}: before 5.23 its "
            "list-valued `output_hidden_states` has no embeddings entry at index 0 (the aux layer ids would be off "
            "by one), and before 5.24 generate() passes the cache as `past_key_values`, which peagle's loop does "
            "not manage"
        )
    generate = getattr(GenerationMixin.generate, "__wrapped__", GenerationMixin.generate)
    missing = _GENERATE_PARAMETERS - set(inspect.signature(generate).parameters)
    if missing:
        return f"GenerationMixin.generate lacks the parameters {sorted(missing)}"
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

    Supported: a decoder-only target the head was built for (hidden size, vocabulary, layer count), any batch
    size (left-padded), `num_beams=1`, greedy search or sampling (`num_return_sequences > 1` with sampling).
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
    if num_return > 1 and not generation_config.do_sample:
        raise ValueError(
            f"num_return_sequences={num_return} needs do_sample=True (greedy decoding would return {num_return} "
            "identical sequences per prompt)."
        )
    if getattr(generation_config, "penalty_alpha", None) or getattr(generation_config, "dola_layers", None):
        raise ValueError(
            "P-EAGLE drafting supports greedy search and sampling; penalty_alpha / dola_layers select another "
            "decoding method."
        )
    conflicting = {
        "prompt_lookup_num_tokens": getattr(generation_config, "prompt_lookup_num_tokens", None),
        "assistant_early_exit": getattr(generation_config, "assistant_early_exit", None),
        "speculation_type": getattr(generation_config, "speculation_type", None),
        "use_mtp": getattr(generation_config, "use_mtp", None) or None,
        "assistant_ensemble_weight": getattr(generation_config, "assistant_ensemble_weight", None),
    }
    conflicting = {k: v for k, v in conflicting.items() if v is not None}
    if conflicting:
        raise ValueError(
            f"a P-EAGLE assistant_model drafts on its own; unset {conflicting} in the generation config (expected "
            "None). Prompt lookup joins the head's draft trees when prompt_lookup_num_tokens is passed to "
            "generate() itself."
        )
    guidance = getattr(generation_config, "guidance_scale", None)
    if guidance is not None and guidance != 1:
        raise ValueError(
            f"guidance_scale={guidance} (classifier-free guidance) is not supported with a P-EAGLE assistant_model: "
            "its processor runs an unconditional forward of its own per step, which a verify pass of several "
            "tokens cannot reproduce, so the output would differ from plain generate(). Drop assistant_model."
        )
    if generation_config.use_cache is False:
        raise ValueError(
            "use_cache=False is not supported with a P-EAGLE assistant_model: verification rolls the target's "
            "cache back after rejected drafts. Drop use_cache=False (the output is the same)."
        )
    if generation_config.output_attentions:
        raise ValueError(
            "output_attentions=True is not supported with a P-EAGLE assistant_model (verify passes hold several "
            "tokens per step). Drop output_attentions, or generate without the head."
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"generate() got a batch of {batch_size} prompts; expected at least one.")
    _check_request_values(target, generation_config)
    head.check_target(tc)
    head.check_finite_weights("assistant_model (the P-EAGLE head)", once=True)  # read once per head object


def _check_request_values(target: Any, generation_config: GenerationConfig) -> None:
    """The generation config's values a speculative call would honour differently from plain `generate()`, each
    refused naming the value and what is expected: token ids outside the vocabulary, lengths that are not whole."""
    _check_token_ids(target, generation_config)
    _check_lengths(generation_config)


def _check_lengths(generation_config: GenerationConfig) -> None:
    """Refuse a `max_new_tokens` / `max_length` that is not a whole number (2.5): plain `generate()` stops once the
    length reaches it (rounding up), peagle's loop would cut at the integer below."""
    for name in ("max_new_tokens", "max_length"):
        value = getattr(generation_config, name, None)
        if value is None:
            continue
        whole = not isinstance(value, bool) and isinstance(value, int | float) and float(value).is_integer()
        if not whole:
            raise ValueError(f"{name} is {value!r}; expected a whole number of tokens (an integer).")


def _token_ids(value: Any) -> list[int]:
    """The ids of a token-id setting (an int, a list of ints, a tensor, or None: none)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _check_token_ids(target: Any, generation_config: GenerationConfig) -> None:
    """Refuse an `eos_token_id` or `pad_token_id` outside the target's vocabulary, naming it and the vocabulary size.

    Plain `generate()` fails on such a pad id once a row ends early (the target embeds it) and never stops on such an
    eos id; peagle's loop would write the pad id into the output instead.  (A missing pad id falls back to the eos
    id, checked first.)  Reads the config's Python values: no device sync.
    """
    vocab = getattr(text_config(target), "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for name in ("eos_token_id", "pad_token_id"):
        ids = _token_ids(getattr(generation_config, name, None))
        outside = [i for i in ids if not 0 <= i < vocab]
        if not outside:
            continue
        why = (
            "rows that end early are filled with it, and plain generate() fails on it"
            if name == "pad_token_id"
            else "a token outside the vocabulary is never generated, so generation would not stop on it"
        )
        value = ids[0] if len(ids) == 1 else ids
        raise ValueError(
            f"{name} is {value!r}; expected token ids in [0, {vocab}) (the target's vocabulary size): {why}. "
            f"Pass {name} inside the vocabulary (e.g. the tokenizer's)."
        )


# ---------------------------------------------------------------------------------------------- generate() arguments
def check_user_request(kwargs: dict[str, Any]) -> frozenset[str]:
    """Refuse the generate() arguments outside the generation config that a speculative round cannot honour
    exactly (another custom_generate, embeddings instead of ids, empty prompts), naming them; return which of K
    and the confidence cut the user gave (so a value equal to transformers' default still counts as given)."""
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "custom_generate cannot be combined with a P-EAGLE assistant_model: the head runs peagle's own decoding "
            "loop (which generate() reaches through custom_generate)."
        )
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "inputs_embeds is not supported with a P-EAGLE assistant_model: the head drafts from token ids. Pass "
            "input_ids instead."
        )
    _check_prompt_rows(kwargs.get("inputs", kwargs.get("input_ids")), kwargs.get("attention_mask"))
    return frozenset(
        name for name in ("num_assistant_tokens", "assistant_confidence_threshold") if name in kwargs
    )


def _check_prompt_rows(input_ids: Any, attention_mask: Any) -> None:
    """Refuse prompts a head cannot draft after, before generate() prepares anything: an empty prompt, or a row
    whose attention mask is all zeros (no real token for the head to read the target's features at)."""
    _check_mask_shape(input_ids, attention_mask)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 0:
        raise ValueError(
            f"generate() got an empty prompt (input_ids of shape {tuple(input_ids.shape)}); give every row at "
            "least one token."
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.numel():
        empty = (attention_mask == 0).all(dim=1).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"attention_mask rows {empty} are all zeros: those prompts have no token to draft from. Drop the "
                "rows, or give each at least one unmasked token (left padding keeps the last ones)."
            )


def _check_mask_shape(input_ids: Any, attention_mask: Any) -> None:
    """Refuse an `attention_mask` whose shape is not the prompt's `(batch, length)`: plain `generate()` fails on most
    such masks, peagle's loop would read them wrongly or not at all."""
    if not (isinstance(input_ids, torch.Tensor) and isinstance(attention_mask, torch.Tensor)):
        return
    if input_ids.dim() == 2 and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected {tuple(input_ids.shape)}, the shape "
            "of input_ids (one 0/1 entry per prompt token)."
        )


STATELESS_PROCESSORS: set[type] = set()
"""Logits-processor classes declared safe to call on every candidate prefix ([`declare_stateless_processor`])."""


def declare_stateless_processor(cls: type) -> type:
    """Declare a logits-processor class stateless: its output depends only on the `input_ids` and scores it is
    given, never on earlier calls.  Speculative verification calls processors once per candidate prefix (as
    transformers' own assisted generation does), more often and in another order than plain decoding, so a
    processor that counts its calls or tracks a grammar's position would change the output.  transformers' own
    processors are stateless; another class gets a warning unless declared this way (or by a class attribute
    `peagle_stateless = True`).  Usable as a class decorator; returns `cls`."""
    if not isinstance(cls, type):
        raise TypeError(f"declare_stateless_processor takes a class; got {cls!r} ({type(cls).__name__}).")
    STATELESS_PROCESSORS.add(cls)
    return cls


def unvouched_processors(processors: Any) -> list[str]:
    """The classes among `processors` peagle cannot vouch for: neither transformers' own nor declared stateless."""
    names = []
    for proc in processors or []:
        cls = type(proc)
        own = cls.__module__.startswith("transformers.")
        if own or cls in STATELESS_PROCESSORS or getattr(cls, "peagle_stateless", False):
            continue
        names.append(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(set(names))


def check_continuation(model: Any, cache: Any, cached: int, input_ids: torch.LongTensor) -> None:
    """Refuse a filled cache where continuing from it cannot give plain `generate()`'s answer, naming why."""
    batch, length = input_ids.shape
    if batch > 1:
        raise ValueError(
            f"a filled cache ({cached} tokens) with a batch of {batch} prompts: with a P-EAGLE assistant_model, "
            "generate() continues from a cache one sequence at a time (each row's cache then holds exactly its own "
            "tokens). Call generate() once per conversation, or pass the batch without the cache."
        )
    if length <= cached:
        raise ValueError(
            f"input_ids hold {length} tokens and the cache already holds {cached}: pass the whole sequence (the "
            "cached tokens and at least one new token after them), as plain generate() expects."
        )
    try:
        slides = layer_windows(model.config) is not None
    except ValueError:
        slides = True
    if slides or any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", [])):
        raise ValueError(
            f"{type(model).__name__} has sliding-window layers: continuing from a filled cache is not supported "
            "there with a P-EAGLE assistant_model yet (the window by position needs every slot the cache's "
            "sliding layers dropped). Pass the whole conversation without the cache."
        )


def check_assistant(assistant: Any) -> None:
    """Refuse heads wrapped or placed where the loop cannot run them, with the fix."""
    base = getattr(assistant, "get_base_model", None)
    if base is not None and not isinstance(assistant, PEagleDrafter) and isinstance(base(), PEagleDrafter):
        raise ValueError(
            f"assistant_model is a {type(assistant).__name__} around a P-EAGLE head (an unmerged LoRA adapter); "
            "call `assistant_model.merge_and_unload()` and pass the merged head."
        )
    if isinstance(assistant, PEagleDrafter):
        devices = {p.device.type for p in assistant.parameters()}
        if "meta" in devices:
            raise ValueError(
                "the P-EAGLE head has parameters on the meta device (loaded without weights); load it with "
                "weights (e.g. from_pretrained without device_map='meta') before generate()."
            )


def check_decoding_inputs(
    target: Any,
    head: PEagleDrafter,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    streamer: Any,
    model_kwargs: dict[str, Any],
    managed: set[str],
    logits_processor: Any = None,
) -> None:
    """The checks peagle's loop runs once generate() has prepared the request (before any forward pass)."""
    _raise_if_incompatible()
    unvouched = unvouched_processors(logits_processor)
    if unvouched:
        warnings.warn(
            f"logits processors {unvouched} are not known to be stateless. Speculative verification calls each "
            "processor once per candidate prefix (as transformers' assisted generation does), so a processor that "
            "keeps state between calls would change the output. If yours depends only on the input_ids and scores "
            "it is given, declare it with peagle.declare_stateless_processor(cls) (or a class attribute "
            "peagle_stateless = True).",
            stacklevel=4,
        )
    batch = int(input_ids.shape[0])
    check_generation_request(target, head, generation_config, batch_size=batch)
    _check_prompt_rows(input_ids, model_kwargs.get("attention_mask"))
    if streamer is not None and batch > 1:
        raise ValueError(
            f"streamer supports a single sequence; got a batch of {batch} prompts (as in transformers). Drop the "
            "streamer or call generate() once per prompt."
        )
    unknown = sorted(k for k, v in model_kwargs.items() if k not in managed and v is not None)
    if unknown:
        raise ValueError(
            f"generate() options {unknown} are not supported with a P-EAGLE assistant_model (peagle's loop passes "
            f"only {sorted(managed)} to the target). Drop them or generate without the head."
        )


__all__ = [
    "check_continuation",
    "MIN_TRANSFORMERS_VERSION",
    "SUPPORTED_TRANSFORMERS",
    "check_assistant",
    "check_decoding_inputs",
    "check_generation_request",
    "check_user_request",
    "declare_stateless_processor",
    "unvouched_processors",
]
