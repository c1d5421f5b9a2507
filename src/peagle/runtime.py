"""The dtype this machine computes fast: one rule for the CLI, the demo, the benchmark and the training scripts.

bfloat16 halves the drafter's memory traffic and is the faster dtype where the hardware computes it: CUDA GPUs
with bf16 support and CPUs whose oneDNN kernels run bf16 natively (AVX-512 BF16, AMX, AVX-512 through oneDNN's
bf16 path, Arm with bf16).  On a CPU with AVX2 only, PyTorch falls back to slow bf16 kernels for large matmuls
(large matmuls and training steps many times slower than in float32; docs/benchmarks.md section 5 has the
figures); decoding, which drafts a few rows at a time, was not measurably slower there.  `"auto"` picks bfloat16 only where it is native and float32 everywhere else;
float32 is always correct, bfloat16 only ever a speed choice.
"""

from __future__ import annotations

import functools

import torch

AUTO = "auto"
DTYPE_CHOICES = (AUTO, "float32", "bfloat16")
"""What `--head_dtype` and the demo's `head_dtype` accept."""


@functools.cache
def _cpu_native_bf16() -> bool:
    checks = (
        lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        lambda: torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),
    )
    # private probes: a torch release without one falls through to the next, then to float32
    for check in checks:
        try:
            return bool(check())
        except (AttributeError, RuntimeError):
            continue
    return False


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Whether `device` (default: CUDA if available, else the CPU) computes bfloat16 matmuls natively."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_native_bf16()
    return False


def preferred_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """bfloat16 where `device` computes it natively, float32 elsewhere."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """A dtype from its name; `"auto"` and None give [`preferred_dtype`] of `device`.

    Raises:
        ValueError: `dtype` names no torch floating-point dtype.
    """
    if dtype is None or dtype == AUTO:
        return preferred_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)} (or another torch float dtype)"
        )
    return resolved


def resolve_dtype_name(dtype: str | torch.dtype | None, device: torch.device | str | None = None) -> str:
    """[`resolve_dtype`] as its name (`"float32"`, `"bfloat16"`), for JSON records and vLLM's `dtype`."""
    return str(resolve_dtype(dtype, device)).removeprefix("torch.")
