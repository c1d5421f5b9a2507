"""Writing heads in the layouts vLLM and speculators read, and the `peagle export` command (see `peagle.formats`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..configuration_peagle import PEagleConfig
from .loading import EXPORT_LAYOUTS, METADATA_KEY, VLLM_ARCHITECTURE, _layout_name


# ---------------------------------------------------------------------------------------------- export
def _export_embeddings(head: Any, target_model: Any) -> torch.Tensor:
    """The full `(vocab_size, hidden_size)` embedding table with the mask row = the head's mask vector."""
    cfg = head.config
    if cfg.embed_from_target:
        if target_model is not None:
            head.attach_target(target_model)
        elif head.embed_tokens.weight.requires_grad:
            raise ValueError(
                "this head uses its target's embeddings (embed_from_target) and they are not attached; pass "
                "target_model= (or call head.attach_target(target)) first: the exported layout stores the full "
                "embedding table with the mask row."
            )
    emb = head.embed_tokens.weight.detach().clone()
    if cfg.drafting_mode == "parallel":
        emb[cfg.mask_token_id] = head.mask_vector.detach().to(emb.dtype)
    return emb


def _export_tensors(head: Any, layout: str, target_model: Any) -> dict[str, torch.Tensor]:
    parallel = head.config.drafting_mode == "parallel"
    tensors = {"embed_tokens.weight": _export_embeddings(head, target_model)}
    for name, value in head.state_dict().items():
        if name in ("embed_tokens.weight", "mask_embedding", "mask_hidden"):
            continue
        tensors[_layout_name(layout, name)] = value.detach().clone().contiguous()
    if parallel:
        tensors["mask_hidden"] = head.mask_hidden.detach().clone().reshape(1, 1, -1)
    tensors["d2t"] = head.d2t.detach().to(torch.long).clone()
    tensors["t2d"] = head.t2d.detach().to(torch.bool).clone()
    return tensors


def _rope_legacy(config: PEagleConfig) -> tuple[float, dict[str, Any] | None]:
    """(`rope_theta`, `rope_scaling`) as transformers 4.x and vLLM read them."""
    rope = dict(config.rope_parameters or {})
    theta = float(rope.pop("rope_theta", 10000.0))
    if rope.get("rope_type", "default") == "default":
        return theta, None
    return theta, rope


def _llama_config_dict(config: PEagleConfig) -> dict[str, Any]:
    theta, scaling = _rope_legacy(config)
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


def _metadata(config: PEagleConfig, k: int) -> dict[str, Any]:
    from .. import __version__

    return {
        "peagle_version": __version__,
        "drafting_mode": config.drafting_mode,
        "num_parallel_positions": config.num_parallel_positions,
        "num_speculative_tokens": k,
        "target_model_name": config.target_model_name,
        "target_num_hidden_layers": config.target_num_hidden_layers,
    }


def _dtype_name(head: Any) -> str:
    return str(head.fc.weight.dtype).removeprefix("torch.")


def vllm_config(head: Any, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """The `config.json` vLLM's EAGLE-3 Llama drafter reads (see the module docstring for the sources)."""
    c = head.config
    parallel = c.drafting_mode == "parallel"
    if parallel and c.target_hidden_size != c.hidden_size:
        raise ValueError(
            f"vLLM sizes mask_hidden as 3 x hidden_size = {3 * c.hidden_size}; this head's is 3 x "
            f"target_hidden_size = {3 * c.target_hidden_size}: it cannot be served with parallel drafting."
        )
    cfg = {"architectures": [VLLM_ARCHITECTURE], **_llama_config_dict(c)}
    cfg.update(
        draft_vocab_size=c.draft_vocab_size,
        target_hidden_size=c.target_hidden_size,
        norm_before_residual=c.norm_before_residual,
        torch_dtype=_dtype_name(head),
    )
    eagle = {"use_aux_hidden_state": True}
    if c.eagle_aux_hidden_state_layer_ids:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(c.eagle_aux_hidden_state_layer_ids)
        eagle["eagle_aux_hidden_state_layer_ids"] = list(c.eagle_aux_hidden_state_layer_ids)
    cfg["eagle_config"] = eagle
    if parallel:
        cfg["ptd_token_id"] = c.mask_token_id
        cfg["pard_token"] = c.mask_token_id
    cfg[METADATA_KEY] = _metadata(c, num_speculative_tokens or c.num_speculative_tokens)
    return cfg


def speculators_config(
    head: Any, num_speculative_tokens: int | None = None, verifier_architectures: list[str] | None = None
) -> dict[str, Any]:
    """The `config.json` of the speculators layout (`PEagleSpeculatorConfig` / `Eagle3SpeculatorConfig`)."""
    c = head.config
    parallel = c.drafting_mode == "parallel"
    kind = "peagle" if parallel else "eagle3"
    k = num_speculative_tokens or c.num_speculative_tokens
    cfg: dict[str, Any] = {
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
                "name_or_path": c.target_model_name,
                "architectures": list(verifier_architectures or []),
            },
        },
        "transformer_layer_config": _llama_config_dict(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.eagle_aux_hidden_state_layer_ids or []) or None,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": False,
        "embed_requires_grad": parallel,
        "torch_dtype": _dtype_name(head),
    }
    if parallel:
        cfg["mask_token_id"] = c.mask_token_id
        cfg["ptd_token_id"] = c.mask_token_id  # older speculators releases
    cfg[METADATA_KEY] = _metadata(c, k)
    return cfg


def export(
    head: Any,
    out_dir: str | Path,
    layout: str = "vllm",
    *,
    target_model: Any = None,
    num_speculative_tokens: int | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write `head` in a serving layout.

    Args:
        head: a `PEagleDrafter`.
        out_dir: the folder to write (created; old `model*.safetensors` files in it are removed).
        layout: ``"vllm"`` (served by vLLM >= 0.16 with `{"method": "eagle3", "model": out_dir,
            "num_speculative_tokens": K, "parallel_drafting": true}`), ``"speculators"`` or ``"peagle"``.
        target_model: attached first; required for `embed_from_target` heads not yet attached (the vLLM
            and speculators layouts store the full embedding table, whose mask row holds the mask vector).
        num_speculative_tokens: K recorded in the config (default `config.num_speculative_tokens`).

    Returns:
        `out_dir` as a `Path`.  Loading it back with `PEagleDrafter.from_pretrained` gives identical logits.
    """
    if layout not in EXPORT_LAYOUTS:
        raise ValueError(f"layout is {layout!r}; expected one of {EXPORT_LAYOUTS}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "peagle":
        if target_model is not None:
            head.attach_target(target_model)
        head.save_pretrained(out, max_shard_size=max_shard_size)
        return out
    if layout == "vllm":
        config = vllm_config(head, num_speculative_tokens)
    else:
        archs = None
        if target_model is not None:
            archs = list(getattr(target_model.config, "architectures", None) or [type(target_model).__name__])
        config = speculators_config(head, num_speculative_tokens, archs)
    tensors = _export_tensors(head, layout, target_model)
    from huggingface_hub import save_torch_state_dict

    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    save_torch_state_dict(tensors, out, max_shard_size=max_shard_size, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------------------------------- CLI
def load_target_model(spec: str | None, dtype: torch.dtype | None = None) -> Any:
    """`None` -> None; ``"default"`` -> the embedded SmolLM2 target; otherwise a path or Hub id for AutoModelForCausalLM."""
    if not spec:
        return None
    if spec == "default":
        from ..targets import load_default_target

        return load_default_target()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype or "auto").eval()


def cli_export(args: argparse.Namespace) -> int:
    """`peagle export HEAD --out DIR [--layout vllm|speculators|peagle] [--target T]`."""
    from ..modeling_peagle import PEagleDrafter

    target = load_target_model(args.target)
    head = PEagleDrafter.from_pretrained(args.head, target_model=target, allow_pickle=args.allow_pickle)
    out = export(
        head,
        args.out,
        args.layout,
        target_model=target,
        num_speculative_tokens=args.num_speculative_tokens,
        max_shard_size=args.max_shard_size,
    )
    k = args.num_speculative_tokens or head.config.num_speculative_tokens
    print(f"wrote the {args.layout} layout of {args.head} to {out}")
    if args.layout == "vllm":
        spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": k}
        if head.config.drafting_mode == "parallel":
            spec["parallel_drafting"] = True
        print(f"serve with: vllm serve <target> --speculative-config '{json.dumps(spec)}'")
    return 0
