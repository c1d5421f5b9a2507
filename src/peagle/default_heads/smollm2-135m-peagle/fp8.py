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
(F8_E4M3) next to `<layer>.weight_scale` (F32), and the config records what was quantized in
`config.peagle_fp8`; `PEagleDrafter.from_pretrained` rebuilds the `FP8Linear` modules from that record.

Kernels (picked per device, each verified once against an fp32 emulation before use):

    kernel        granularity  what runs
    rowwise       row          one scaled_mm with RowWise scales (bf16 out)
    tensorwise    row          one scaled_mm with unit scales (fp32 out), row scales applied after
    blockwise     block        one scaled_mm with BlockWise1x128 x BlockWise128x128 (Hopper, CUDA >= 12.9,
                               block (128, 128), K and N multiples of 128)
    chunked       block        one unit-scale scaled_mm per bk-wide slice of K, scales applied per slice
    emulate       any          fp32 matmul of the quantize-dequantized operands (same numerics, no FP8 math)
    dequantize    any          F.linear with the weight dequantized to the activation dtype (weight-only)

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

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_CAPABILITY = (8, 9)
GRANULARITIES = ("row", "block")
FALLBACKS = ("dequantize", "emulate")
KERNELS = ("auto", "rowwise", "tensorwise", "blockwise", "chunked", "emulate", "dequantize")
FALLBACK_ENV = "PEAGLE_FP8_FALLBACK"
CONFIG_KEY = "peagle_fp8"
DEFAULT_BLOCK_SIZE = (128, 128)

_ROW_KERNELS = ("rowwise", "tensorwise")
_BLOCK_KERNELS = ("blockwise", "chunked")
_HAS_SCALED_MM_V2 = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
# when a kernel fails at run time on a shape its probe did not cover, the layer switches to the next one
_KERNEL_RETREAT = {"rowwise": "tensorwise", "blockwise": "chunked"}


# ---------------------------------------------------------------------------------------------- quantization
def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`amax / 448`, and 1 where a row/tile is all zeros (so 0 / scale stays 0)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _check_block_size(block_size: Sequence[int]) -> tuple[int, int]:
    bs = tuple(int(b) for b in block_size)
    if len(bs) != 2 or bs[0] < 1 or bs[1] < 16 or bs[1] % 16:
        raise ValueError(
            f"block_size is {tuple(block_size)}; expected (rows, cols) with rows >= 1 and cols a positive "
            "multiple of 16 (FP8 kernels read K in 16-byte steps), e.g. (128, 128)."
        )
    return bs  # type: ignore[return-value]


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activation(x: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of activations, one scale per token (row) or per token and `block_k` group.

    Args:
        x: `(M, K)` activations, any float dtype.
        block_k: None for one scale per row, else the width of each row's scale group.

    Returns:
        `(x_fp8, scale)`: `(M, K)` row-major `float8_e4m3fn` and float32 scales `(M, 1)` or
        `(M, ceil(K / block_k))`, with `x ~= float(x_fp8) * scale`.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_activation expects a 2D (M, K) tensor, got shape {tuple(x.shape)}.")
    xf = x.float()
    if block_k is None:
        scale = _scale_from_amax(xf.abs().amax(dim=-1, keepdim=True))
        return _to_fp8(xf / scale), scale
    m, k = xf.shape
    kb = math.ceil(k / block_k)
    if kb * block_k != k:
        xf = F.pad(xf, (0, kb * block_k - k))
    groups = xf.view(m, kb, block_k)
    scale = _scale_from_amax(groups.abs().amax(dim=-1))
    q = _to_fp8(groups / scale.unsqueeze(-1)).view(m, kb * block_k)
    return (q if kb * block_k == k else _contiguous(q.narrow(1, 0, k))), scale


def quantize_weight(
    weight: torch.Tensor, granularity: str = "row", block_size: Sequence[int] = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a `(N, K)` linear weight to `float8_e4m3fn`.

    Args:
        weight: `(out_features, in_features)`.
        granularity: `"row"` (one scale per output channel) or `"block"` (one scale per `block_size` tile).
        block_size: `(bn, bk)` tile of `"block"` granularity; partial tiles at the edges are allowed.

    Returns:
        `(weight_fp8, weight_scale)`: `(N, K)` e4m3 and float32 scales `(N, 1)` (row) or
        `(ceil(N / bn), ceil(K / bk))` (block); `weight ~= dequantize_fp8(weight_fp8, weight_scale, ...)`.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity is {granularity!r}; expected one of {GRANULARITIES}.")
    if weight.dim() != 2:
        raise ValueError(f"expected a 2D (out, in) weight, got shape {tuple(weight.shape)}.")
    w = weight.detach().float()
    if granularity == "row":
        return quantize_activation(w, None)
    bn, bk = _check_block_size(block_size)
    n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    if (nb * bn, kb * bk) != (n, k):
        w = F.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    tiles = w.view(nb, bn, kb, bk)
    scale = _scale_from_amax(tiles.abs().amax(dim=(1, 3)))
    q = _to_fp8(tiles / scale.view(nb, 1, kb, 1)).view(nb * bn, kb * bk)
    if (nb * bn, kb * bk) != (n, k):
        q = _contiguous(q.narrow(0, 0, n).narrow(1, 0, k))
    return q, scale


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy with standard strides (also for size-1 dims, which `scaled_mm` checks)."""
    return t.clone(memory_format=torch.contiguous_format)


def _expand_tiles(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`(a, b)` tile scales -> `(a * rows, b * cols)`, each value repeated over its tile."""
    a, b = scale.shape
    return scale.view(a, 1, b, 1).expand(a, rows, b, cols).reshape(a * rows, b * cols)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of [`quantize_weight`] / [`quantize_activation`]: `float(q) * scale` over each scale's tile.

    Args:
        q: `(R, C)` float8 values.
        scale: `(R, 1)` per-row scales (`block_size=None`) or `(ceil(R / br), ceil(C / bc))` tile scales.
        block_size: `(br, bc)`; activations with group width `bk` use `(1, bk)`.
        dtype: dtype of the result.
    """
    r, c = q.shape
    if block_size is None:
        if tuple(scale.shape) != (r, 1):
            raise ValueError(f"per-row scales must have shape ({r}, 1), got {tuple(scale.shape)}.")
        return (q.float() * scale).to(dtype)
    br, bc = (int(b) for b in block_size)
    expected = (math.ceil(r / br), math.ceil(c / bc))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"block scales for a {(r, c)} tensor with block {(br, bc)} must have shape {expected}, "
            f"got {tuple(scale.shape)}."
        )
    full = _expand_tiles(scale, br, bc).narrow(0, 0, r).narrow(1, 0, c)
    return (q.float() * full).to(dtype)


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


# ---------------------------------------------------------------------------------------------- the module
_WARNED: set[tuple[str, str]] = set()


class FP8Linear(nn.Module):
    """A linear layer with `float8_e4m3fn` weights, float32 weight scales and dynamically quantized activations.

    Buffers (saved in the state dict): `weight` `(N, K)` float8_e4m3fn, `weight_scale` `(N, 1)` (row) or
    `(ceil(N/bn), ceil(K/bk))` (block) float32; parameter `bias` `(N,)` in the original dtype, if any.
    `forward` maps `(..., K) -> (..., N)` in the input's dtype.

    Args:
        granularity: `"row"` or `"block"`.
        block_size: `(bn, bk)` tiles for `"block"`.
        fallback: what to do on a device without FP8 matmuls: None (raise), `"dequantize"` or `"emulate"`.
        kernel: `"auto"` (pick per device) or a kernel name forced on any device (see the module docstring).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        granularity: str = "row",
        block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
        fallback: str | None = None,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity is {granularity!r}; expected one of {GRANULARITIES}.")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.granularity = granularity
        self.block_size = _check_block_size(block_size) if granularity == "block" else None
        self.fallback = _check_fallback(fallback)
        self.kernel = _check_kernel_name(kernel, self.block_size)
        self.name = ""  # set by quantize_linears, used in error messages
        if self.block_size is None:
            scale_shape = (self.out_features, 1)
        else:
            bn, bk = self.block_size
            scale_shape = (math.ceil(self.out_features / bn), math.ceil(self.in_features / bk))
        self.register_buffer(
            "weight", torch.zeros(self.out_features, self.in_features, dtype=FP8_DTYPE, device=device)
        )
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._prepared: dict[tuple, torch.Tensor] = {}
        self._auto: dict[torch.device, str] = {}

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        granularity: str = "row",
        block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
        fallback: str | None = None,
        kernel: str = "auto",
    ) -> FP8Linear:
        """Quantize `linear` (its weight to e4m3 with `granularity` scales; the bias is kept as is)."""
        w = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            granularity=granularity,
            block_size=block_size,
            fallback=fallback,
            kernel=kernel,
            device=w.device,
            dtype=w.dtype,
        )
        q, s = quantize_weight(w, granularity, module.block_size or block_size)
        module.weight.copy_(q)
        module.weight_scale.copy_(s)
        if linear.bias is not None:
            with torch.no_grad():
                module.bias.copy_(linear.bias)
        return module

    def dequantize(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """An `nn.Linear` holding the dequantized weight (in `dtype`, default the bias' dtype or float32)."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(self.dequantized_weight(dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`(N, K)` weight as the kernels see it: `float(weight) * weight_scale` over each scale's tile."""
        return dequantize_fp8(self.weight, self.weight_scale, self.block_size, dtype)

    # -- kernel choice
    def resolve_kernel(self, device: torch.device, warn: bool = True) -> str:
        """The kernel `forward` uses for inputs on `device` (raises on devices without FP8, absent a fallback;
        warns once per process and device when a fallback runs)."""
        if self.kernel != "auto":
            return self.kernel
        device = torch.device(device)
        ok, why = fp8_device_support(device)
        if ok:
            if device not in self._auto:
                self._auto[device] = auto_kernel(device, self.block_size, self.in_features, self.out_features)
            return self._auto[device]
        mode = self.fallback or _check_fallback(os.environ.get(FALLBACK_ENV) or None)
        if mode is None:
            raise RuntimeError(
                f"FP8Linear {self.name or ''}({self.in_features} -> {self.out_features}) got an input on {device}: "
                f"{why}. FP8 matmuls need an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper H100 = 9.0, "
                "Blackwell B200 = 10.0). To run anyway, choose a fallback explicitly: "
                "quantize_head(..., fallback='dequantize'), peagle.fp8.set_fp8_fallback(model, 'dequantize') "
                f"or {FALLBACK_ENV}=dequantize ('emulate' also fake-quantizes activations like the GPU kernels)."
            )
        key = (mode, str(device))
        if warn and key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(
                f"FP8 layers run on {device} ({why}) with fallback={mode!r}: "
                + (
                    "weights are dequantized to the activation dtype (no FP8 math, no speed-up)."
                    if mode == "dequantize"
                    else "FP8 numerics are emulated in float32 (no speed-up)."
                ),
                RuntimeWarning,
                stacklevel=3,
            )
        return mode

    def _operand(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if kernel == "dequantize" else torch.float32
        key = (
            kernel,
            x.device,
            dtype,
            self.weight._version,
            self.weight_scale._version,
            self.weight_scale.data_ptr(),
        )
        op = self._prepared.get(key)
        if op is None:
            self._prepared.clear()
            op = prepare_weight_operand(self.weight, self.weight_scale, kernel, self.block_size, dtype)
            self._prepared[key] = op
        return op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"FP8Linear {self.name} expects {self.in_features} input features, got {x.shape[-1]}."
            )
        kernel = self.resolve_kernel(x.device)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        try:
            y = fp8_matmul(
                x2,
                self.weight,
                self.weight_scale,
                self.block_size,
                kernel,
                x.dtype,
                self._operand(kernel, x2),
            )
        except RuntimeError as err:
            retreat = _KERNEL_RETREAT.get(kernel)
            if self.kernel != "auto" or retreat is None or not kernel_available(retreat, x.device):
                raise
            warnings.warn(
                f"FP8 kernel {kernel!r} failed for {self.name} on input shape {tuple(x2.shape)} ({err}); "
                f"this layer uses {retreat!r} from now on.",
                RuntimeWarning,
                stacklevel=2,
            )
            self._auto[x.device] = retreat
            return self.forward(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def _apply(self, fn: Callable, recurse: bool = True):
        # `model.to(torch.bfloat16)` / `.half()` must not cast the FP8 weight and float32 scales: detect a
        # dtype-changing `fn` on an empty probe and only move those two buffers to the new device.
        probes = [fn(torch.empty(0, dtype=d, device=self.weight.device)) for d in (FP8_DTYPE, torch.float32)]
        if probes[0].dtype != FP8_DTYPE or probes[1].dtype != torch.float32:
            keep = {id(self.weight), id(self.weight_scale)}
            device = probes[0].device

            def device_only(t: torch.Tensor) -> torch.Tensor:
                return t.to(device=device) if id(t) in keep else fn(t)

            apply = device_only
        else:
            apply = fn
        self._prepared.clear()
        self._auto.clear()
        return super()._apply(apply, recurse)

    def extra_repr(self) -> str:
        gran = "row" if self.block_size is None else f"block={self.block_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{gran}, kernel={self.kernel}, fallback={self.fallback}"
        )


def _check_fallback(fallback: str | None) -> str | None:
    if fallback is not None and fallback not in FALLBACKS:
        raise ValueError(f"fallback is {fallback!r}; expected None or one of {FALLBACKS}.")
    return fallback


def _check_kernel_name(kernel: str, block_size: Sequence[int] | None) -> str:
    if kernel != "auto":
        _check_kernel(kernel, block_size)
    return kernel


# ---------------------------------------------------------------------------------------------- models
def fp8_modules(model: nn.Module) -> dict[str, FP8Linear]:
    """Every [`FP8Linear`] in `model`, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def quantize_linears(
    model: nn.Module,
    granularity: str = "row",
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
    include: Callable[[str, nn.Linear], bool] | None = None,
    fallback: str | None = None,
    kernel: str = "auto",
) -> list[str]:
    """Replace `nn.Linear` layers of `model` by [`FP8Linear`] in place (any model, e.g. a target, in memory).

    Layers whose in/out features are not multiples of 16 (the FP8 kernels' alignment) stay as they are.

    Args:
        include: `(name, linear) -> bool` picking layers (default: all).

    Returns:
        The names of the quantized layers.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity is {granularity!r}; expected one of {GRANULARITIES}.")
    if granularity == "block":
        block_size = _check_block_size(block_size)
    done = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or (include is not None and not include(name, module)):
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        fp8 = FP8Linear.from_linear(module, granularity, block_size, fallback=fallback, kernel=kernel)
        fp8.name = name
        _set_submodule(model, name, fp8)
        done.append(name)
    return done


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
    try:
        from . import __version__
    except ImportError:  # loaded as Hub remote code, without the peagle package
        __version__ = None
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


def apply_fp8_config(model: nn.Module, record: dict[str, Any]) -> None:
    """Rebuild the FP8 layers listed in a `config.peagle_fp8` record (empty, ready for a state dict).

    Called by `PEagleDrafter.__init__`, so `from_pretrained` loads e4m3 weights and scales into them.
    """
    if not isinstance(record, dict):
        raise ValueError(f"config.{CONFIG_KEY} is {record!r}; expected the dict written by quantize_head.")
    fmt = record.get("format", "float8_e4m3fn")
    if fmt != "float8_e4m3fn":
        raise ValueError(f"config.{CONFIG_KEY}['format'] is {fmt!r}; this peagle reads 'float8_e4m3fn'.")
    granularity = record.get("granularity")
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"config.{CONFIG_KEY}['granularity'] is {granularity!r}; expected one of {GRANULARITIES}."
        )
    block = record.get("block_size") or DEFAULT_BLOCK_SIZE
    for name in record.get("modules", []):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"config.{CONFIG_KEY} lists module {name!r}, which the model does not have."
            ) from None
        if isinstance(module, FP8Linear):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"config.{CONFIG_KEY} lists {name!r}, a {type(module).__name__}; expected nn.Linear."
            )
        fp8 = FP8Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            granularity=granularity,
            block_size=block,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        fp8.name = name
        _set_submodule(model, name, fp8)


def set_fp8_fallback(model: nn.Module, fallback: str | None) -> nn.Module:
    """Set the fallback of every [`FP8Linear`] in `model` (None, `"dequantize"` or `"emulate"`)."""
    _check_fallback(fallback)
    for module in fp8_modules(model).values():
        module.fallback = fallback
    return model


def set_fp8_kernel(model: nn.Module, kernel: str = "auto") -> nn.Module:
    """Force a kernel on every [`FP8Linear`] in `model` (`"auto"` restores the per-device choice)."""
    for module in fp8_modules(model).values():
        module.kernel = _check_kernel_name(kernel, module.block_size)
        module._auto.clear()
    return model


def fp8_summary(model: nn.Module, device: str | torch.device | None = None) -> dict[str, Any]:
    """Which layers are FP8, their granularity, bytes saved, and (with `device`) the kernel each would use."""
    mods = fp8_modules(model)
    out: dict[str, Any] = {"layers": len(mods), "fp8_bytes": sum(m.weight.numel() for m in mods.values())}
    out["bf16_bytes"] = 2 * out["fp8_bytes"]
    out["granularity"] = sorted({m.granularity for m in mods.values()})
    if device is not None:
        kernels: dict[str, int] = {}
        for m in mods.values():
            try:
                k = m.resolve_kernel(torch.device(device), warn=False)
            except RuntimeError:
                k = "unsupported"
            kernels[k] = kernels.get(k, 0) + 1
        out["kernels"] = kernels
    return out


__all__ = [
    "FP8Linear",
    "FP8_DTYPE",
    "FP8_MAX",
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
]
