"""Reading a target's config: which head fields come from the target (widths, vocabulary, layer count, RoPE of the
global-attention layers, token ids) and which are the drafter's own, whatever the family calls them
([`target_fields`]); the target's family and parameter count.  torch and transformers are imported inside."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..configuration_peagle import default_aux_layer_ids
from .families import family_name

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$|^[\w.-]+$")
_HF_CACHE_FOLDER = re.compile(r"models--([\w.-]+)--([\w.-]+)")


def _is_local(name: str) -> bool:
    return name.startswith((".", "~", "/")) or "\\" in name or Path(name).expanduser().exists()


def recorded_target_name(name: str | None) -> str | None:
    """What a head records as its target's name: `name` itself when it is a Hub id (or any name that is not a path
    of this machine); for a local folder the Hub id the folder records (a Hub cache folder `models--org--name`, or
    its config's `_name_or_path`, or its card's `base_model`); None when no Hub id is known.  So an exported or
    pushed head never names a folder of the machine it was made on.

    >>> recorded_target_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    'HuggingFaceTB/SmolLM2-135M-Instruct'
    >>> recorded_target_name("/home/me/models/llama") is None
    True
    """
    if not name:
        return None
    name = str(name)
    if not _is_local(name):
        return name if _REPO_ID.match(name) else None
    folder = Path(name).expanduser()
    cached = _HF_CACHE_FOLDER.search(str(folder.resolve()))
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}"
    found = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        found.append(json.loads((folder / "config.json").read_text()).get("_name_or_path"))
    try:
        card = (folder / "README.md").read_text(encoding="utf-8").split("---")[1]
        found += re.findall(r"^base_model:\s*(?:-\s*)?['\"]?([\w./-]+?)['\"]?\s*$", card, flags=re.M)
    except (OSError, IndexError, UnicodeDecodeError):
        pass
    return next(
        (f for f in found if isinstance(f, str) and "/" in f and not _is_local(f) and _REPO_ID.match(f)), None
    )


def text_config(target: Any) -> Any:
    """The (text) config of a model or a config: multimodal configs nest the decoder's."""
    cfg = getattr(target, "config", target)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def target_model_type(target: Any) -> str | None:
    """transformers' `model_type` of the target's text config (`"gemma3_text"`), or None."""
    return getattr(text_config(target), "model_type", None) or None


STATEFUL_MODEL_TYPES = frozenset(
    {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "bamba", "zamba", "zamba2",
     "falcon_h1", "granitemoehybrid", "lfm2", "qwen3_next", "nemotron_h", "minimax", "plamo2"}
)  # fmt: skip
"""Families whose layers keep a recurrent state (SSM, linear attention, RNN blocks), whatever their configs say."""
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
"""`layer_types` / `block_types` entries of plain key/value attention; any other kind keeps a state."""


def is_stateful(tc: Any, model: Any = None) -> bool:
    """Whether a target keeps a recurrent state that a rejected draft cannot be cut from: the model says so
    (`_is_stateful`, transformers before 5.25), its family is one of `STATEFUL_MODEL_TYPES`, or its config lists
    layer or block kinds other than attention (`linear_attention`, `recurrent`, `mamba`, ...)."""
    if model is not None and getattr(model, "_is_stateful", False):
        return True
    if getattr(tc, "model_type", None) in STATEFUL_MODEL_TYPES:
        return True
    kinds = set(getattr(tc, "layer_types", None) or []) | set(getattr(tc, "block_types", None) or [])
    return bool({str(k) for k in kinds} - ATTENTION_LAYER_TYPES)


def check_target_family(target: Any, model: Any = None) -> None:
    """Raise `ValueError` naming the family and the reason when a target cannot be drafted for.

    A target must be a decoder-only model whose cache transformers can roll back after rejected drafts:
    encoder-decoder models and stateful ones (recurrent or linear-attention layers: Mamba, RecurrentGemma,
    Qwen3-Next, ...: `is_stateful`) cannot work.  `model` is the target model or
    a meta-device instance of its class (see [`target_parameters`]), for the stateful check.
    """
    tc = text_config(target)
    kind = target_model_type(target)
    if getattr(tc, "is_encoder_decoder", False):
        raise ValueError(
            f"target family {family_name(kind)} is encoder-decoder; P-EAGLE drafts for decoder-only targets "
            "(its features are the decoder's hidden states of the sequence being generated)."
        )
    if is_stateful(tc, model):
        raise ValueError(
            f"target family {family_name(kind)} ({type(model).__name__ if model is not None else type(tc).__name__}) "
            "is stateful (recurrent or linear-attention "
            "layers): peagle's loop cuts rejected drafts out of key/value caches, and a recurrent state cannot be "
            "cut back to the accepted ones."
        )
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not hasattr(tc, k)
    ]
    if missing:
        raise ValueError(
            f"target family {family_name(kind)}: its config {type(tc).__name__} lacks {missing}; expected a "
            "decoder-only transformer (hidden size, layers, attention heads, vocabulary)."
        )


def _rope(tc: Any) -> tuple[dict[str, Any], str]:
    """The head's RoPE parameters from the target's and a note saying where they came from."""
    rope = getattr(tc, "rope_parameters", None)
    if isinstance(rope, Mapping) and rope and all(isinstance(v, Mapping) for v in rope.values()):
        key = "full_attention" if "full_attention" in rope else sorted(rope)[0]
        params, note = dict(rope[key]), f"the target's {key!r} layers' (RoPE per layer type)"
    elif isinstance(rope, Mapping) and "rope_type" in rope:
        params, note = dict(rope), "the target's"
    elif getattr(tc, "rope_theta", None) is not None:
        params = {"rope_type": "default", "rope_theta": float(tc.rope_theta)}
        if isinstance(getattr(tc, "rope_scaling", None), Mapping):
            params.update(tc.rope_scaling)
        params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
        note = "the target's (legacy rope_theta / rope_scaling)"
    else:
        return {"rope_type": "default", "rope_theta": 10000.0}, "the drafter's own (the target has no RoPE)"
    params.setdefault("rope_theta", 10000.0)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        note += "; partial_rotary_factor dropped (the head rotates all of head_dim)"
    return params, note


def target_fields(target: Any) -> tuple[dict[str, Any], list[str]]:
    """`PEagleConfig` fields taken from the target, and notes on the drafter's own fields.

    From the target: `vocab_size`, widths (`hidden_size` = `target_hidden_size`, heads, kv heads, `head_dim`,
    `intermediate_size`), `max_position_embeddings`, `rms_norm_eps` (or `layer_norm_epsilon`), the RoPE of its
    global-attention layers, layer count and default aux layers, token ids, name and model type.  The drafter's
    own, whatever the target uses: SiLU (vLLM's EAGLE-3 Llama drafter implements no other), no biases, full
    attention (no sliding window), no soft-capping, no embedding scaling (the fused layer normalises the
    embedding), an untied LM head over the draft vocabulary.

    Returns:
        `(fields, notes)`: `notes` are `"field: value (reason)"` lines for the fields whose value is the drafter's
        own although the target has a different one.
    """
    tc = text_config(target)
    hidden = int(tc.hidden_size)
    heads = int(tc.num_attention_heads)
    layers = int(tc.num_hidden_layers)
    inter = getattr(tc, "intermediate_size", None) or getattr(tc, "n_inner", None) or 4 * hidden
    rope, rope_note = _rope(tc)
    eps = getattr(tc, "rms_norm_eps", None) or getattr(tc, "layer_norm_epsilon", None) or 1e-6
    fields: dict[str, Any] = {
        "vocab_size": int(tc.vocab_size),
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(tc, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(tc, "head_dim", None) or hidden // heads),
        "intermediate_size": int(inter),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", None) or 8192),
        "rms_norm_eps": float(eps),
        "rope_parameters": rope,
        "target_num_hidden_layers": layers,
        "eagle_aux_hidden_state_layer_ids": default_aux_layer_ids(layers),
        "target_model_name": recorded_target_name(getattr(tc, "_name_or_path", None)),
        "target_model_type": target_model_type(target),
        "bos_token_id": getattr(tc, "bos_token_id", None),
        "eos_token_id": getattr(tc, "eos_token_id", None),
        "pad_token_id": getattr(tc, "pad_token_id", None),
        # the drafter's own
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    notes = [f"rope_parameters: {rope} ({rope_note})"]
    act = (
        getattr(tc, "hidden_act", None)
        or getattr(tc, "hidden_activation", None)
        or getattr(tc, "activation_function", None)
    )
    if act not in (None, "silu"):
        notes.append(
            f"hidden_act: silu (the drafter's own; the target uses {act!r}; vLLM's EAGLE-3 drafter is SiLU)"
        )
    own = {
        "sliding_window": "full attention over the drafter's own cache",
        "final_logit_softcapping": "the training loss applies the target's cap to the target's logits",
        "attn_logit_softcapping": "plain attention",
        "attention_bias": "no attention biases",
    }
    for key, why in own.items():
        if getattr(tc, key, None):
            notes.append(f"{key}: none ({why}; the target sets {getattr(tc, key)!r})")
    if getattr(tc, "tie_word_embeddings", False):
        notes.append(
            "tie_word_embeddings: False (the draft LM head is its own, initialised from the target's rows)"
        )
    if (fields["target_model_type"] or "").startswith("gemma"):
        notes.append(
            "embedding scale: none (the target scales embeddings by sqrt(hidden_size); the head's fused layer "
            "normalises the shared table's rows, so the scale cancels)"
        )
    return fields, notes


__all__ = ["check_target_family", "recorded_target_name", "target_fields", "target_model_type", "text_config"]
