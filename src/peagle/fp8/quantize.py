"""FP8 (e4m3) quantization arithmetic: weights per output row or per tile, activations per token.

`dequantized = float(fp8) * scale`, broadcast over the scale's row or tile, with `scale = amax / 448`
(448 = the largest e4m3 value; an all-zero row or tile gets scale 1).  Torch only (heads saved in the earlier
peagle-only layout ship it, with `kernels.py` and `linear.py`, inside their `fp8.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
GRANULARITIES = ("row", "block")
DEFAULT_BLOCK_SIZE = (128, 128)


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


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy with standard strides (also for size-1 dims, which `scaled_mm` checks)."""
    return t.clone(memory_format=torch.contiguous_format)


def _expand_tiles(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`(a, b)` tile scales -> `(a * rows, b * cols)`, each value repeated over its tile."""
    a, b = scale.shape
    return scale.view(a, 1, b, 1).expand(a, rows, b, cols).reshape(a * rows, b * cols)


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

    Returns:
        `(R, C)` in `dtype`.
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
