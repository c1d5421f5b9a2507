"""What the foreign layouts share: a Llama-style drafter config, read in and written out.

The vLLM, EAGLE-3 and speculators layouts all describe the drafter with Llama config fields (flat in
`config.json`, or nested in speculators' `transformer_layer_config`) plus EAGLE-3 fields (`draft_vocab_size`,
`target_hidden_size`, aux layer ids, a mask token id).  `to_peagle_state` maps those fields and a renamed
tensor set to `PEagleConfig` keyword arguments; `llama_config_dict` / `peagle_metadata` write them back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .._version import __version__
from ..configuration_peagle import PEagleConfig
from .checks import IGNORED_TENSORS
from .io import Checkpoint, TensorSource

MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
"""Where foreign configs keep the mask token id (vLLM reads all three)."""
METADATA_KEY = "peagle"
"""An extra `config.json` block carrying peagle-only fields (K, K_train, the target) through foreign layouts."""
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
"""Config flags that add a norm peagle's drafter does not have; refused when true."""
_METADATA_FIELDS = (
    "num_parallel_positions",
    "num_speculative_tokens",
    "target_model_name",
    "target_num_hidden_layers",
    "confidence_threshold",
    "draft_calibration",
    "drafter_window",
)


# ---------------------------------------------------------------------------------------------- reading
def integer(cfg: Mapping[str, Any], key: str, where: str, default: Any = None) -> Any:
    """`cfg[key]` when it is an integer (`default` when absent or null); anything else (`"64"`, `64.0`, `true`)
    is an error naming the key and the file: values read from a file are never coerced."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {key} is {value!r} ({type(value).__name__}); expected an integer.")
    return value


def flag(cfg: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """`cfg[key]` when it is true or false (`default` when absent or null), else an error naming key and file."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} is {value!r} ({type(value).__name__}); expected true or false.")
    return value


def _text(cfg: Mapping[str, Any], key: str, where: str, default: str) -> str:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} is {value!r} ({type(value).__name__}); expected a string.")
    return value


def strip_model_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def rope_parameters(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """transformers >= 5 `rope_parameters` from either that key or legacy `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{where}: {key} is {value!r}; expected an object or null.")
    theta = cfg.get("rope_theta")
    if theta is not None and (
        isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0
    ):
        raise ValueError(f"{where}: rope_theta is {theta!r}; expected a positive number.")
    if isinstance(params, Mapping) and params:
        rope = dict(params)
    else:
        rope = dict(scaling or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope["type"])
        del rope["type"]
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(cfg.get("rope_theta") or 10000.0))
    return rope


def llama_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`PEagleConfig` keyword arguments from a Llama config dict (defaults as transformers' LlamaConfig)."""
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{where} lacks {missing}; expected a Llama-style drafter config.")
    hidden, heads = integer(cfg, "hidden_size", where), integer(cfg, "num_attention_heads", where)
    if heads < 1:
        raise ValueError(f"{where}: num_attention_heads is {heads}; expected an integer >= 1.")
    eps = cfg.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0):
        raise ValueError(f"{where}: rms_norm_eps is {eps!r}; expected a positive number.")
    fields: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": integer(cfg, "intermediate_size", where, 4 * hidden),
        "num_attention_heads": heads,
        "num_key_value_heads": integer(cfg, "num_key_value_heads", where, heads),
        "head_dim": integer(cfg, "head_dim", where, hidden // heads),
        "hidden_act": _text(cfg, "hidden_act", where, "silu"),
        "max_position_embeddings": integer(cfg, "max_position_embeddings", where, 2048),
        "rms_norm_eps": float(eps or 1e-6),
        "rope_parameters": rope_parameters(cfg, where),
        "attention_bias": flag(cfg, "attention_bias", where, False),
        "mlp_bias": flag(cfg, "mlp_bias", where, False),
        "vocab_size": integer(cfg, "vocab_size", where),
        "tie_word_embeddings": False,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
        if cfg.get(key) is not None:
            fields[key] = cfg[key]
    return fields


def mask_token(cfg: Mapping[str, Any], where: str) -> int | None:
    """The mask token id under any of `MASK_TOKEN_KEYS` (they must agree), or None."""
    values = {k: integer(cfg, k, where) for k in MASK_TOKEN_KEYS if cfg.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where} names different mask tokens {values}; expected one id.")
    return next(iter(values.values()), None)


def num_layers(
    state: Mapping[str, TensorSource], declared: Any, where: str, tensor_name: Callable[[str], str]
) -> int:
    """The number of decoder layers in the weights (`layers.0` = the fused layer), checked against the config."""
    found = {int(m.group(1)) for n in state if (m := re.match(r"layers\.(\d+)\.", n))}
    first = tensor_name("layers.0.")
    if 0 not in found:
        raise ValueError(f"{where}: no fused first layer ({first}*) in the weights.")
    count = max(found) + 1
    gaps = sorted(set(range(count)) - found)
    if gaps:
        raise ValueError(
            f"{where}: decoder layers {gaps} are missing from the weights (found {sorted(found)})."
        )
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int)):
        raise ValueError(f"{where}: num_hidden_layers is {declared!r}; expected an integer.")
    if declared is not None and declared != count:
        raise ValueError(
            f"{where} declares num_hidden_layers={declared}, but the weights hold {count} decoder layers "
            f"({first}* and layers.1..{count - 1}.*); num_hidden_layers counts the fused layer."
        )
    return count


def aux_ids(cfg: Mapping[str, Any], where: str = "config.json") -> list[int] | None:
    """`eagle_aux_hidden_state_layer_ids`, top level or under `eagle_config`: a list of integers (not coerced)."""
    key = "eagle_aux_hidden_state_layer_ids"
    ids = cfg.get(key)
    if not ids and isinstance(cfg.get("eagle_config"), Mapping):
        key = "eagle_config.eagle_aux_hidden_state_layer_ids"
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: {key} is {ids!r}; expected a list of integer layer ids.")
    return list(ids)


def to_peagle_state(
    checkpoint: Checkpoint,
    tensors: Mapping[str, TensorSource],
    *,
    llama_config: Mapping[str, Any],
    rename: Callable[[str], str],
    tensor_name: Callable[[str], str],
    parallel: bool,
    norm_before_residual: bool,
    metadata: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, TensorSource]]:
    """Map a foreign checkpoint to (PEagleConfig kwargs, peagle tensor name -> source tensor).

    Args:
        llama_config: the Llama fields (the config itself, or speculators' `transformer_layer_config`).
        rename: a tensor's name in the checkpoint -> its peagle name; `tensor_name` is the inverse.
        parallel: a P-EAGLE head (needs a mask token and `mask_hidden`), else an EAGLE-3 one.
        norm_before_residual: the layout's default when the config does not say.
        metadata: peagle-only fields recovered from the checkpoint (`_METADATA_FIELDS`).
    """
    cfg = checkpoint.config
    where = str(checkpoint.path / "config.json")
    for key in UNSUPPORTED_FLAGS:
        if cfg.get(key):
            raise ValueError(
                f"{where}: {key}=true adds a norm peagle's drafter does not have; expected false or absent."
            )
    state: dict[str, TensorSource] = {}
    for name, src in tensors.items():
        if IGNORED_TENSORS.search(name):
            continue
        new = rename(name)
        if new in state:
            raise ValueError(f"{src.file}: tensors {state[new].name!r} and {name!r} both map to {new!r}.")
        state[new] = src

    fields = llama_fields(llama_config, where)
    fields["num_hidden_layers"] = num_layers(state, llama_config.get("num_hidden_layers"), where, tensor_name)
    mask_id = mask_token(cfg, where)
    if parallel and mask_id is None:
        keys = " / ".join(MASK_TOKEN_KEYS)
        raise ValueError(f"{where}: parallel-drafting head without a mask token id; expected one of {keys}.")
    if parallel and "mask_hidden" not in state:
        files = ", ".join(str(f) for f in checkpoint.files)
        raise ValueError(
            f"{files}: mask_hidden not found in the weights, but {where} sets mask token {mask_id} (parallel "
            f"drafting); expected a tensor of 3 x {fields['hidden_size']} elements."
        )
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError(f"{', '.join(str(f) for f in checkpoint.files)}: missing tensor 'fc.weight'.")
    lm_head = state.get("lm_head.weight")
    draft_vocab = integer(cfg, "draft_vocab_size", where) or integer(cfg, "truncated_vocab_size", where)
    if draft_vocab is None:
        draft_vocab = lm_head.tensor.shape[0] if lm_head is not None else fields["vocab_size"]
    target_hidden = (
        integer(cfg, "target_hidden_size", where)
        or integer(llama_config, "target_hidden_size", where)
        or fc.tensor.shape[-1] // 3
    )
    config = {
        **fields,
        "draft_vocab_size": int(draft_vocab),
        "target_hidden_size": int(target_hidden),
        "eagle_aux_hidden_state_layer_ids": aux_ids(cfg, where),
        "norm_before_residual": flag(cfg, "norm_before_residual", where, norm_before_residual),
        "drafting_mode": "parallel" if parallel else "autoregressive",
        "mask_token_id": mask_id if mask_id is not None else int(fields["vocab_size"]) - 1,
    }
    config.update({k: metadata[k] for k in _METADATA_FIELDS if metadata.get(k) is not None})
    return config, state


# ---------------------------------------------------------------------------------------------- writing
def rope_legacy(config: PEagleConfig) -> tuple[float, dict[str, Any] | None]:
    """(`rope_theta`, `rope_scaling`) as transformers 4.x and vLLM read them."""
    rope = dict(config.rope_parameters or {})
    theta = float(rope.pop("rope_theta", 10000.0))
    if rope.get("rope_type", "default") == "default":
        return theta, None
    return theta, rope


def llama_config_dict(config: PEagleConfig) -> dict[str, Any]:
    """The drafter's Llama fields as a plain (transformers 4.x style) Llama `config.json` dict."""
    theta, scaling = rope_legacy(config)
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }


def peagle_metadata(config: PEagleConfig, num_speculative_tokens: int) -> dict[str, Any]:
    """The `METADATA_KEY` block: what a foreign layout has no field for, read back by `to_peagle_state`."""
    return {
        "peagle_version": __version__,
        "drafting_mode": config.drafting_mode,
        "num_parallel_positions": config.num_parallel_positions,
        "num_speculative_tokens": num_speculative_tokens,
        "target_model_name": config.target_model_name,
        "target_num_hidden_layers": config.target_num_hidden_layers,
        # generation settings of peagle's generate() (vLLM ignores them): a cut, or None for cost-aware drafting
        "confidence_threshold": config.confidence_threshold,
        "draft_calibration": config.draft_calibration,
        "drafter_window": config.drafter_window,
    }


def dtype_name(head: Any) -> str:
    """The head's weight dtype as config.json spells it (`"float32"`, `"bfloat16"`); for an FP8 head the dtype
    of its dense weights (the norm's), not the float8 storage of its quantized layers."""
    return str(head.norm.weight.dtype).removeprefix("torch.")
