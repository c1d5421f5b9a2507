"""Tensors between a `PEagleDrafter` and the flat EAGLE-3 tensor set of the foreign layouts.

In: `assemble_head` turns a converted state (peagle tensor name -> source tensor, from a layout's
`to_peagle`) into a model, taking from the target what the checkpoint lacks.  Out: `export_tensors` gives
the tensor set vLLM and speculators read: the full `(vocab_size, hidden_size)` embedding table with the mask
row holding the learned mask vector, `mask_hidden` `(1, 1, 3 * target_hidden_size)`, `d2t` int64 offsets
`(draft_vocab_size,)`, `t2d` bool `(vocab_size,)` and every other tensor under the layout's name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..configuration_peagle import default_aux_layer_ids
from ..modeling_peagle import PEagleDrafter
from .checks import check_converted, complete_vocab_maps
from .io import Checkpoint, TensorSource

logger = logging.getLogger(__name__)


def _resolve_dtype(dtype: Any, fallback: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return fallback if fallback.is_floating_point else torch.float32
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    return dtype


def _take_from_target(state: dict[str, TensorSource], config: Any, target_model: Any, files: str) -> None:
    """Fill what an `embed_from_target` head or a head without `lm_head` takes from its target, in place."""
    if config.embed_from_target:
        emb = target_model.get_input_embeddings().weight.detach()
        if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"target input embeddings have shape {tuple(emb.shape)}; the head ({files}) expects "
                f"({config.vocab_size}, {config.hidden_size})."
            )
        state["mask_embedding"] = TensorSource(
            "embed_tokens.weight", Path("<target>"), emb[config.mask_token_id][None].clone()
        )
    if "lm_head.weight" not in state:
        out_emb = target_model.get_output_embeddings() if target_model is not None else None
        if out_emb is None:
            raise ValueError(
                f"{files}: missing tensor 'lm_head.weight'; give the target (target_model= in Python, --target on "
                "the command line) to take the draft-vocabulary rows of its lm_head."
            )
        weight = out_emb.weight.detach()
        if tuple(weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"target lm_head has shape {tuple(weight.shape)}; the head ({files}) expects "
                f"({config.vocab_size}, {config.hidden_size}) to take its rows."
            )
        ids = torch.arange(config.draft_vocab_size) + state["d2t"].tensor
        state["lm_head.weight"] = TensorSource(
            "lm_head.weight", Path("<target>"), weight[ids.to(weight.device)].clone()
        )


def assemble_head(
    checkpoint: Checkpoint,
    config_kwargs: dict[str, Any],
    state: dict[str, TensorSource],
    *,
    cls: type | None = None,
    target_model: Any = None,
    dtype: torch.dtype | str | None = None,
    tensor_name: Callable[[str], str] = str,
) -> PEagleDrafter:
    """Build a `cls` (default `PEagleDrafter`) from a converted foreign checkpoint.

    Missing `embed_tokens.weight` / `lm_head.weight` are taken from `target_model` when given (the lm_head
    rows of the draft vocabulary, `i + d2t[i]`); otherwise the error names the missing tensor.  Every
    tensor's shape is checked against the converted config; errors name the file and the tensor.
    """
    cls = cls or PEagleDrafter
    files = ", ".join(str(f) for f in checkpoint.files)
    if target_model is not None:
        tc = target_model.config
        tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
        if config_kwargs["eagle_aux_hidden_state_layer_ids"] is None:
            config_kwargs["eagle_aux_hidden_state_layer_ids"] = default_aux_layer_ids(
                int(tc.num_hidden_layers)
            )
        config_kwargs.setdefault("target_num_hidden_layers", int(tc.num_hidden_layers))
        from ..sizing import recorded_target_name  # a Hub id, never a folder of this machine

        config_kwargs.setdefault(
            "target_model_name", recorded_target_name(getattr(tc, "_name_or_path", None))
        )
    if "embed_tokens.weight" not in state:
        if target_model is None:
            raise ValueError(
                f"{files}: missing tensor 'embed_tokens.weight' (the head shares its target's embeddings); give "
                "the target (target_model= in Python, --target on the command line) to take them from it."
            )
        config_kwargs["embed_from_target"] = True
    try:
        config = cls.config_class(**config_kwargs)
    except ValueError as err:  # a value the layout's config.json (or its peagle block) holds
        raise ValueError(f"{checkpoint.path / 'config.json'} ({checkpoint.layout} layout): {err}") from err
    complete_vocab_maps(state, config_kwargs, files)
    _take_from_target(state, config, target_model, files)
    if config.drafting_mode == "parallel":
        mh = state["mask_hidden"]
        if mh.tensor.numel() != 3 * config.target_hidden_size:
            raise ValueError(
                f"{mh.file}: tensor {mh.name!r} has {mh.tensor.numel()} elements (shape {tuple(mh.tensor.shape)}); "
                f"expected 3 x target_hidden_size = {3 * config.target_hidden_size}."
            )
        state["mask_hidden"] = TensorSource(mh.name, mh.file, mh.tensor.reshape(1, 1, -1))
    else:
        state["mask_hidden"] = TensorSource(
            "mask_hidden", Path("<unused>"), torch.zeros(1, 1, 3 * config.target_hidden_size)
        )
    skip = {"embed_tokens.weight"} if config.embed_from_target else set()
    check_converted(state, cls, config, checkpoint, tensor_name, skip)

    dtype = _resolve_dtype(dtype, state["norm.weight"].tensor.dtype)  # not fc.weight: FP8 heads store e4m3
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = cls._from_config(config, dtype=dtype)
    result = model.load_state_dict({n: s.tensor for n, s in state.items()}, strict=False)
    left = [k for k in result.missing_keys if k not in skip]
    if left or result.unexpected_keys:
        raise ValueError(
            f"{files}: state dict mismatch after conversion: missing {left}, unexpected {result.unexpected_keys}."
        )
    model.config._name_or_path = str(checkpoint.path)
    model.eval()
    if target_model is not None:
        model.attach_target(target_model)
    logger.info(
        "loaded a %s-layout head from %s (%s)", checkpoint.layout, checkpoint.path, config.drafting_mode
    )
    return model


def _export_embeddings(head: PEagleDrafter, target_model: Any) -> torch.Tensor:
    """The full `(vocab_size, hidden_size)` embedding table with the mask row = the head's mask vector."""
    cfg = head.config
    if cfg.embed_from_target:
        if target_model is not None:
            head.attach_target(target_model)
        elif head.embed_tokens.weight.requires_grad:
            raise ValueError(
                "this head uses its target's embeddings (embed_from_target) and they are not attached; give the "
                "target (target_model= in Python, --target on the command line, or head.attach_target(target)) "
                "first: the exported layout stores the full embedding table with the mask row."
            )
    emb = head.embed_tokens.weight.detach().clone()
    if cfg.drafting_mode == "parallel":
        emb[cfg.mask_token_id] = head.mask_vector.detach().to(emb.dtype)
    return emb


def export_tensors(
    head: PEagleDrafter, tensor_name: Callable[[str], str], target_model: Any = None
) -> dict[str, torch.Tensor]:
    """The head's tensors in the flat EAGLE-3 set (see the module docstring), named by `tensor_name`."""
    parallel = head.config.drafting_mode == "parallel"
    tensors = {"embed_tokens.weight": _export_embeddings(head, target_model)}
    for name, value in head.state_dict().items():
        if name in ("embed_tokens.weight", "mask_embedding", "mask_hidden"):
            continue
        tensors[tensor_name(name)] = value.detach().clone().contiguous()
    if parallel:
        tensors["mask_hidden"] = head.mask_hidden.detach().clone().reshape(1, 1, -1)
    tensors["d2t"] = head.d2t.detach().to(torch.long).clone()
    tensors["t2d"] = head.t2d.detach().to(torch.bool).clone()
    return tensors
