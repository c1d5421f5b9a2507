"""FP8 drafter heads: quantize and dequantize a head, and how a saved FP8 head's config is written.

`quantize_head` swaps the head's linear layers for [`FP8Linear`] and records the scheme in
`config.peagle_fp8`.  Importing `peagle.fp8` registers two things with `PEagleDrafter` (see
`register_fp8_heads`): `PEagleDrafter.__init__` rebuilds the FP8 layers from that record (so
`from_pretrained` loads e4m3 weights and scales into them), and `save_pretrained` replaces the record in
`config.json` by the compressed-tensors `quantization_config` the ecosystem reads (`peagle.fp8.checkpoint`).
`peagle.formats` turns that `quantization_config` back into `peagle_fp8` when peagle loads the head.  Heads
saved in the earlier peagle-only layout (`peagle_fp8` in `config.json`, with an `fp8.py`) still load.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._version import __version__
from .checkpoint import checked_quantization_config, write_quantization_config
from .linear import CONFIG_KEY, _set_submodule, apply_fp8_config, fp8_modules, quantize_linears
from .quantize import DEFAULT_BLOCK_SIZE, _check_block_size


def quantize_head(
    head: nn.Module,
    granularity: str = "row",
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
    include_lm_head: bool = False,
    fallback: str | None = None,
    kernel: str = "auto",
) -> nn.Module:
    """Quantize a drafter head to FP8 in place and record it in `head.config.peagle_fp8`.

    `fc` and every attention/MLP projection become [`FP8Linear`]; `lm_head` too when `include_lm_head`
    (off by default: the draft argmax is the most sensitive matmul); embeddings, norms and `mask_hidden`
    are untouched.  `save_pretrained` then writes e4m3 weights with their scales, and
    `PEagleDrafter.from_pretrained` restores the FP8 layers.

    Args:
        granularity: `"row"` (per output channel) or `"block"` (per `block_size` tile).
        fallback: behaviour on devices without FP8 matmuls (None raises; `"dequantize"`, `"emulate"`).
        kernel: `"auto"` or a kernel name to force (see [`fp8_matmul`]).

    Returns:
        `head`, quantized.
    """
    config = getattr(head, "config", None)
    if config is None:
        raise TypeError(f"quantize_head expects a model with a config, got {type(head).__name__}.")
    if getattr(config, CONFIG_KEY, None) or fp8_modules(head):
        raise ValueError(
            "head is already FP8-quantized; call dequantize_head(head) first to change the scheme."
        )
    output = head.get_output_embeddings() if hasattr(head, "get_output_embeddings") else None

    def include(name: str, linear: nn.Linear) -> bool:
        return include_lm_head or linear is not output

    names = quantize_linears(head, granularity, block_size, include, fallback=fallback, kernel=kernel)
    setattr(config, CONFIG_KEY, _fp8_record(granularity, block_size, names))
    return head


def _fp8_record(granularity: str, block_size: Sequence[int], names: list[str]) -> dict[str, Any]:
    block = list(_check_block_size(block_size)) if granularity == "block" else None
    return {
        "format": "float8_e4m3fn",
        "granularity": granularity,
        "block_size": block,
        "weight_scale": "float32; dequantized = float(weight) * weight_scale per row (N, 1) or per block tile",
        "activation_scheme": "dynamic",
        "activation_granularity": "per_token" if block is None else f"per_token_group_{block[1]}",
        "modules": sorted(names),
        "peagle_version": __version__,
    }


def dequantize_head(head: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every [`FP8Linear`] by an `nn.Linear` with the dequantized weight and drop `config.peagle_fp8`.

    Args:
        dtype: weight dtype of the new layers (default: each layer's bias dtype, else the model's dtype).
    """
    default = dtype or getattr(head, "dtype", None) or torch.float32
    for name, module in fp8_modules(head).items():
        _set_submodule(
            head,
            name,
            module.dequantize(dtype or (module.bias.dtype if module.bias is not None else default)),
        )
    config = getattr(head, "config", None)
    if config is not None and hasattr(config, CONFIG_KEY):
        delattr(config, CONFIG_KEY)
    return head


# ---------------------------------------------------------------------------------------------- checkpoints
def save_fp8_config(head: nn.Module, folder: str | Path) -> None:
    """After `save_pretrained`: `config.json` carries the compressed-tensors `quantization_config` instead of
    `peagle_fp8` (`peagle.fp8.checkpoint`), so transformers, vLLM and compressed-tensors read the head."""
    write_quantization_config(folder, checked_quantization_config(head))


def register_fp8_heads(model_class: type) -> None:
    """Register FP8 layer rebuilding (`apply_fp8_config`) and `save_fp8_config` for `config.peagle_fp8`."""
    model_class.register_config_extension(CONFIG_KEY, apply_fp8_config, save=save_fp8_config)
