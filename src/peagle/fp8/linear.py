"""`FP8Linear`, the FP8 layer, and the model operations that swap, rebuild and configure FP8 layers.

A checkpoint stores `<layer>.weight` (F8_E4M3) next to `<layer>.weight_scale` (F32); in memory the config
records what was quantized in `config.peagle_fp8` (`CONFIG_KEY`; on disk a compressed-tensors
`quantization_config`, see `checkpoint.py`), and `apply_fp8_config` rebuilds the empty FP8 layers from that
record before the weights load.  Torch only (heads saved in the earlier peagle-only layout ship it inside
their `fp8.py`).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .kernels import (
    _check_kernel,
    auto_kernel,
    fp8_device_support,
    fp8_matmul,
    kernel_available,
    prepare_weight_operand,
)
from .quantize import (
    DEFAULT_BLOCK_SIZE,
    FP8_DTYPE,
    GRANULARITIES,
    _check_block_size,
    dequantize_fp8,
    quantize_weight,
)

FALLBACKS = ("dequantize", "emulate")
FALLBACK_ENV = "PEAGLE_FP8_FALLBACK"
CONFIG_KEY = "peagle_fp8"
# when a kernel fails at run time on a shape its probe did not cover, the layer switches to the next one
_KERNEL_RETREAT = {"rowwise": "tensorwise", "blockwise": "chunked"}


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


def apply_fp8_config(model: nn.Module, record: dict[str, Any]) -> None:
    """Rebuild the FP8 layers listed in a `config.peagle_fp8` record (empty, ready for a state dict).

    A record read from a compressed-tensors checkpoint names `targets` and `ignore` instead of `modules`; they
    are resolved here, on the model, into `modules`.

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
    if "modules" not in record and record.get("targets") == ["Linear"]:
        # read from a compressed-tensors `quantization_config` (`peagle.fp8.checkpoint.fp8_record`): every
        # linear layer not in `ignore` (exact names, or `re:` patterns as llm-compressor writes them)
        ignore = list(record.get("ignore") or [])
        record["modules"] = sorted(
            name
            for name, module in model.named_modules()
            if type(module) is nn.Linear and not _ignored(name, ignore)
        )
        del record["targets"], record["ignore"]
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


def _ignored(name: str, ignore: Sequence[str]) -> bool:
    return any(
        re.fullmatch(p[3:], name) or re.fullmatch(p[3:], name + ".weight")
        if p.startswith("re:")
        else p == name
        for p in ignore
    )


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
