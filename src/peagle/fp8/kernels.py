"""FP8 matmul kernels: which devices run them, and `fp8_matmul`, the raw call of each kernel.

`torch.nn.functional.scaled_mm` (public since torch 2.10; it dispatches to `torch._scaled_mm_v2`) or
`torch._scaled_mm` on older torch.  Each kernel is verified once per device against the fp32 emulation
before `kernel="auto"` picks it (`kernel_available`, `auto_kernel`):

    kernel        granularity  what runs
    rowwise       row          one scaled_mm with RowWise scales (bf16 out)
    tensorwise    row          one scaled_mm with unit scales (fp32 out), row scales applied after
    blockwise     block        one scaled_mm with BlockWise1x128 x BlockWise128x128 (Hopper, CUDA >= 12.9,
                               block (128, 128), K and N multiples of 128)
    chunked       block        one unit-scale scaled_mm per bk-wide slice of K, scales applied per slice
    emulate       any          fp32 matmul of the quantize-dequantized operands (same numerics, no FP8 math)
    dequantize    any          F.linear with the weight dequantized to the activation dtype (weight-only)

Torch only (heads saved in the earlier peagle-only layout ship it inside their `fp8.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .quantize import (
    DEFAULT_BLOCK_SIZE,
    _contiguous,
    _expand_tiles,
    dequantize_fp8,
    quantize_activation,
    quantize_weight,
)

MIN_CAPABILITY = (8, 9)
KERNELS = ("auto", "rowwise", "tensorwise", "blockwise", "chunked", "emulate", "dequantize")

_ROW_KERNELS = ("rowwise", "tensorwise")
_BLOCK_KERNELS = ("blockwise", "chunked")
_HAS_SCALED_MM_V2 = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


# ---------------------------------------------------------------------------------------------- devices
@functools.cache
def _device_support(device_type: str, index: int | None) -> tuple[bool, str]:
    if device_type != "cuda":
        return False, f"device {device_type} has no FP8 tensor cores"
    if torch.version.hip is not None:
        return False, "ROCm GPUs use float8_e4m3fnuz, which this FP8 path does not implement"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    dev = torch.device("cuda", index) if index is not None else torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if (major, minor) < MIN_CAPABILITY:
        return (
            False,
            f"{name} has compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}",
        )
    return True, f"{name}, compute capability {major}.{minor}"


def fp8_device_support(device: str | torch.device) -> tuple[bool, str]:
    """Whether `device` runs FP8 matmuls (an NVIDIA GPU of compute capability >= 8.9), and why (a sentence)."""
    device = torch.device(device)
    return _device_support(device.type, device.index)


def is_fp8_supported(device: str | torch.device) -> bool:
    """True on NVIDIA GPUs with compute capability >= 8.9 (Ada, Hopper H100 = 9.0, Blackwell B200 = 10.0)."""
    return fp8_device_support(device)[0]


# ---------------------------------------------------------------------------------------------- kernels
_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    if device not in _ONES:
        _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _ONES[device]


def _recipe(name: str):
    return getattr(F.ScalingType, name) if _HAS_SCALED_MM_V2 else name


def _scaled_mm(a, b, scale_a, recipe_a: str, scale_b, recipe_b: str, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` for FP8 `a` `(M, K)` row-major and `b` `(K, N)` column-major, through the public
    `torch.nn.functional.scaled_mm` when torch has it, else `torch._scaled_mm` (scaling inferred from shapes)."""
    if _HAS_SCALED_MM_V2:
        return F.scaled_mm(
            a, b, scale_a, _recipe(recipe_a), scale_b, _recipe(recipe_b), output_dtype=out_dtype
        )
    if recipe_a.startswith("BlockWise"):
        raise NotImplementedError(
            f"block-wise FP8 scaling needs torch.nn.functional.scaled_mm, missing in torch {torch.__version__}."
        )
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _check_kernel(kernel: str, block_size: Sequence[int] | None) -> None:
    if kernel not in KERNELS or kernel == "auto":
        raise ValueError(f"kernel is {kernel!r}; expected one of {KERNELS[1:]}.")
    if kernel in _ROW_KERNELS and block_size is not None:
        raise ValueError(
            f"kernel {kernel!r} needs per-row weight scales; this weight has block scales {block_size}."
        )
    if kernel in _BLOCK_KERNELS and block_size is None:
        raise ValueError(f"kernel {kernel!r} needs block weight scales; this weight has per-row scales.")


def prepare_weight_operand(
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    kernel: str,
    block_size: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight-side tensor a kernel consumes besides the FP8 weight (cache it per layer):
    `(1, N)` row scales (rowwise/tensorwise), `(L4, N/128)` column-major tile scales (blockwise),
    `(K/bk, N)` per-slice column scales (chunked), or the dequantized weight (emulate in fp32, dequantize in
    `dtype`)."""
    _check_kernel(kernel, block_size)
    n, k = qweight.shape
    if kernel in _ROW_KERNELS:
        return weight_scale.reshape(1, n)
    if kernel == "blockwise":
        nb, kb = weight_scale.shape
        l4 = 4 * math.ceil(kb / 4)  # K blocks padded to a multiple of 4, stored (L4, N/128) column-major
        return _contiguous(F.pad(weight_scale.float(), (0, l4 - kb))).t()
    if kernel == "chunked":
        return _contiguous(_expand_tiles(weight_scale, int(block_size[0]), 1).narrow(0, 0, n).t())
    return dequantize_fp8(qweight, weight_scale, block_size, torch.float32 if kernel == "emulate" else dtype)


def fp8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: Sequence[int] | None = None,
    kernel: str = "rowwise",
    out_dtype: torch.dtype | None = None,
    prepared: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ dequantize(qweight).T` with dynamic activation quantization, on the named kernel.

    No device check: this is the raw kernel call (torch's CPU build implements `rowwise`, `tensorwise` and
    `chunked` too, slowly, which is how the tests check the scale conventions without a GPU).

    Args:
        x: `(M, K)` activations.
        qweight: `(N, K)` `float8_e4m3fn` weight.
        weight_scale: `(N, 1)` row scales (`block_size=None`) or `(ceil(N/bn), ceil(K/bk))` tile scales.
        block_size: `(bn, bk)` for block scales.
        kernel: one of `rowwise`, `tensorwise`, `blockwise`, `chunked`, `emulate`, `dequantize`.
        out_dtype: dtype of the result (default `x.dtype`).
        prepared: [`prepare_weight_operand`]'s result, to skip recomputing it.

    Returns:
        `(M, N)` in `out_dtype`.
    """
    out_dtype = out_dtype or x.dtype
    if prepared is None:
        prepared = prepare_weight_operand(qweight, weight_scale, kernel, block_size, x.dtype)
    else:
        _check_kernel(kernel, block_size)
    if kernel == "dequantize":
        return F.linear(x, prepared.to(x.dtype)).to(out_dtype)
    bk = int(block_size[1]) if block_size is not None else None
    xq, sx = quantize_activation(x, bk)
    wt = qweight.t()  # (K, N), column-major
    if kernel == "emulate":
        xd = dequantize_fp8(xq, sx, (1, bk) if bk else None)
        y = xd @ prepared.t()
    elif kernel == "rowwise":
        y = _scaled_mm(xq, wt, sx, "RowWise", prepared, "RowWise", torch.bfloat16)
    elif kernel == "tensorwise":
        one = _one(x.device)
        y = _scaled_mm(xq, wt, one, "TensorWise", one, "TensorWise", torch.float32)
        y = y.mul_(sx).mul_(prepared)
    elif kernel == "blockwise":
        # activation scales (M, K/128) column-major, weight scales (L4, N/128) column-major (torch's meta checks)
        sa = _contiguous(sx.t()).t()  # strides (1, M), also when M == 1
        y = _scaled_mm(xq, wt, sa, "BlockWise1x128", prepared, "BlockWise128x128", torch.bfloat16)
    else:  # chunked: one unit-scale FP8 matmul per bk-wide slice of K; exact per-slice scaling in fp32
        one = _one(x.device)
        k = x.shape[1]
        y = None
        for j in range(sx.shape[1]):
            lo, hi = j * bk, min(k, (j + 1) * bk)
            xj, wj = xq.narrow(1, lo, hi - lo), wt.narrow(0, lo, hi - lo)
            part = _scaled_mm(xj, wj, one, "TensorWise", one, "TensorWise", torch.float32)
            part = part.mul_(sx.narrow(1, j, 1)).mul_(prepared.select(0, j))
            y = part if y is None else y.add_(part)
    return y.to(out_dtype)


_PROBES: dict[tuple[str, int | None, str], bool] = {}


def kernel_available(kernel: str, device: str | torch.device) -> bool:
    """Whether `kernel` runs on `device` and agrees with the fp32 emulation (checked once per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if kernel in ("emulate", "dequantize"):
        return True
    key = (device.type, device.index, kernel)
    if key not in _PROBES:
        block = DEFAULT_BLOCK_SIZE if kernel in _BLOCK_KERNELS else None
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 256, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(256, 256, generator=gen).to(device)
        qw, sw = quantize_weight(w, "block" if block else "row", block or DEFAULT_BLOCK_SIZE)
        try:
            got = fp8_matmul(x, qw, sw, block, kernel, torch.float32)
            ref = fp8_matmul(x, qw, sw, block, "emulate", torch.float32)
            ok = bool((got - ref).abs().max() <= 1e-2 * ref.abs().max())
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            ok = False
        _PROBES[key] = ok
    return _PROBES[key]


def auto_kernel(
    device: str | torch.device, block_size: Sequence[int] | None, in_features: int, out_features: int
) -> str:
    """The kernel `kernel="auto"` picks on an FP8-capable `device` for a layer of this shape."""
    if block_size is None:
        candidates = ["rowwise", "tensorwise"]
    else:
        candidates = ["chunked"]
        if tuple(block_size) == (128, 128) and in_features % 128 == 0 and out_features % 128 == 0:
            candidates.insert(0, "blockwise")
    for kernel in candidates:
        if kernel_available(kernel, device):
            return kernel
    raise RuntimeError(
        f"no FP8 kernel among {candidates} works on {torch.device(device)} with torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}); force a non-FP8 path with peagle.fp8.set_fp8_kernel(model, 'emulate')."
    )


def fp8_kernel_info(device: str | torch.device) -> dict[str, Any]:
    """Device support and the result of every kernel probe on `device` (for reports and benchmarks)."""
    ok, why = fp8_device_support(device)
    info: dict[str, Any] = {
        "device": str(device),
        "fp8_supported": ok,
        "reason": why,
        "torch": torch.__version__,
    }
    info["scaled_mm_api"] = "torch.nn.functional.scaled_mm" if _HAS_SCALED_MM_V2 else "torch._scaled_mm"
    if ok:
        info["kernels"] = {
            k: kernel_available(k, device) for k in ("rowwise", "tensorwise", "blockwise", "chunked")
        }
    return info
