"""FP8 (e4m3) linear layers for drafter heads on Hopper / Blackwell GPUs.

Weights are stored as `torch.float8_e4m3fn` with float32 scales, activations are quantized dynamically
(per token, at run time), and the matmul runs on torch's scaled-matmul kernel:
`torch.nn.functional.scaled_mm` (public since torch 2.10; it dispatches to `torch._scaled_mm_v2`) or
`torch._scaled_mm` on older torch.  Two weight granularities:

- `"row"`: one scale per output channel, `weight_scale` `(N, 1)`; activations one scale per token `(M, 1)`.
- `"block"`: one scale per `(bn, bk)` tile (default 128 x 128), `weight_scale` `(ceil(N/bn), ceil(K/bk))`;
  activations one scale per token and `bk`-wide group `(M, ceil(K/bk))`.

In both cases `dequantized = float(fp8) * scale` broadcast over the scale's tile, with
`scale = amax / 448` (448 = largest e4m3 value).  The checkpoint layout is plain safetensors: `<layer>.weight`
(F8_E4M3) next to `<layer>.weight_scale` (F32), the names and numerics of compressed-tensors' float8 format,
and `config.json` carries a compressed-tensors `quantization_config` (`checkpoint.py`), which vLLM and
transformers read; in memory the head records what was quantized in `config.peagle_fp8`, and
`PEagleDrafter.from_pretrained` rebuilds the `FP8Linear` modules from either.

Modules:

    quantize.py   quantization arithmetic (weights per row or tile, activations per token)
    kernels.py    device support, the kernels (rowwise, tensorwise, blockwise, chunked, emulate,
                  dequantize) and `fp8_matmul`; each kernel is verified once per device before use
    linear.py     `FP8Linear` and the model operations (swap, rebuild from the config, fallbacks, summary)
    checkpoint.py the compressed-tensors `quantization_config` <-> the `config.peagle_fp8` record
    head.py       `quantize_head` / `dequantize_head`, and writing a saved FP8 head's config

Importing this package registers FP8 heads with `PEagleDrafter` (`head.register_fp8_heads`): the model
itself imports nothing from here (docs/DESIGN.md section 5).  `peagle.formats` imports it on demand when a
checkpoint's config has a compressed-tensors `quantization_config` or (the earlier layout) `peagle_fp8`.

Devices without FP8 matmuls (the CPU, CUDA capability < 8.9, ROCm): `forward` raises a `RuntimeError` naming
the device, unless a fallback is chosen explicitly (`fallback="dequantize"` or `"emulate"`, per module via
`set_fp8_fallback`, or process-wide with `PEAGLE_FP8_FALLBACK`); the fallback warns once per process.
Quantizing, dequantizing, saving and loading work on every device (float8 is a storage dtype everywhere).

Why not transformers' `FineGrainedFP8Config`: in transformers 5.23 its `FP8Linear.forward` calls
`finegrained_fp8_linear`, which loads the Triton kernel `kernels-community/finegrained-fp8` (or DeepGEMM,
`kernels-community/deep-gemm`) from the Hugging Face Hub through the `kernels` package at the first forward;
there is no local `torch._scaled_mm` path.  It therefore works only with `kernels` installed and either Hub
access or those kernel repos already in the local Hub cache.  Without a GPU (or below capability 8.9) its
quantizer falls back to dequantizing to bf16 at load time.
"""

from ..modeling_peagle import PEagleDrafter
from .checkpoint import fp8_record, from_disk_config, head_quantization_config, quantization_config
from .head import dequantize_head, quantize_head, register_fp8_heads, save_fp8_config
from .kernels import (
    KERNELS,
    MIN_CAPABILITY,
    auto_kernel,
    fp8_device_support,
    fp8_kernel_info,
    fp8_matmul,
    is_fp8_supported,
    kernel_available,
    prepare_weight_operand,
)
from .linear import (
    CONFIG_KEY,
    FALLBACK_ENV,
    FALLBACKS,
    FP8Linear,
    apply_fp8_config,
    fp8_modules,
    fp8_summary,
    quantize_linears,
    set_fp8_fallback,
    set_fp8_kernel,
)
from .quantize import (
    DEFAULT_BLOCK_SIZE,
    FP8_DTYPE,
    FP8_MAX,
    GRANULARITIES,
    dequantize_fp8,
    quantize_activation,
    quantize_weight,
)

register_fp8_heads(PEagleDrafter)

__all__ = [
    "FP8Linear",
    "FP8_DTYPE",
    "FP8_MAX",
    "GRANULARITIES",
    "DEFAULT_BLOCK_SIZE",
    "FALLBACKS",
    "FALLBACK_ENV",
    "KERNELS",
    "MIN_CAPABILITY",
    "CONFIG_KEY",
    "quantize_weight",
    "quantize_activation",
    "dequantize_fp8",
    "fp8_matmul",
    "prepare_weight_operand",
    "fp8_device_support",
    "is_fp8_supported",
    "kernel_available",
    "auto_kernel",
    "fp8_kernel_info",
    "fp8_modules",
    "quantize_linears",
    "quantize_head",
    "dequantize_head",
    "apply_fp8_config",
    "set_fp8_fallback",
    "set_fp8_kernel",
    "fp8_summary",
    "register_fp8_heads",
    "save_fp8_config",
    "quantization_config",
    "head_quantization_config",
    "fp8_record",
    "from_disk_config",
]
