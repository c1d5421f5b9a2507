"""FP8 drafter heads: quantize and dequantize a head, and the remote code a saved FP8 head carries.

`quantize_head` swaps the head's linear layers for [`FP8Linear`] and records the scheme in
`config.peagle_fp8`.  Importing `peagle.fp8` registers two things with `PEagleDrafter` (see
`register_fp8_heads`): `PEagleDrafter.__init__` rebuilds the FP8 layers from that record (so
`from_pretrained` loads e4m3 weights and scales into them), and `save_pretrained` writes `fp8.py` next to
the weights.

`fp8.py` is `quantize.py`, `kernels.py` and `linear.py` joined into one file (their imports of each other
removed) plus four lines that register `apply_fp8_config` with the remote `PEagleDrafter`; `config.json`'s
`auto_map["AutoModel"]` points at `fp8.PEagleDrafter`, so `AutoModel.from_pretrained(folder,
trust_remote_code=True)` loads it first and the head gets its FP8 layers without peagle installed.  A head
without FP8 layers ships only `configuration_peagle.py` and `modeling_peagle.py` (docs/DESIGN.md section 5).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._version import __version__
from .linear import CONFIG_KEY, _set_submodule, apply_fp8_config, fp8_modules, quantize_linears
from .quantize import DEFAULT_BLOCK_SIZE, _check_block_size

REMOTE_CODE_FILE = "fp8.py"
REMOTE_CODE_SOURCES = ("quantize.py", "kernels.py", "linear.py")
"""The modules `fp8.py` joins, in dependency order; each imports only torch and the ones before it."""


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


# ---------------------------------------------------------------------------------------------- remote code
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE)  # what transformers follows

_REMOTE_ENTRY = """

# ---------------------------------------------------------------------------------------------- registration
from .modeling_peagle import PEagleDrafter  # noqa: E402

PEagleDrafter.register_config_extension(CONFIG_KEY, apply_fp8_config)
"""


def _module_body(path: Path) -> str:
    """A module's source without `from __future__` and relative imports (the joined file defines those names)."""
    source = path.read_text()
    drop: set[int] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or node.module == "__future__"):
            drop.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines = source.splitlines(keepends=True)
    return "".join(line for i, line in enumerate(lines, start=1) if i not in drop).strip() + "\n"


def remote_code_source() -> str:
    """The text of `fp8.py`: `REMOTE_CODE_SOURCES` joined, then the registration with `PEagleDrafter`.

    Raises `RuntimeError` if two of the joined modules define the same top-level name, or if the result
    imports anything relatively besides `modeling_peagle` (transformers would look for that file).
    """
    here = Path(__file__).parent
    parts, defined = [], {}
    for name in REMOTE_CODE_SOURCES:
        body = _module_body(here / name)
        for node in ast.parse(body).body:
            targets = [node] if isinstance(node, ast.FunctionDef | ast.ClassDef) else []
            targets += [t for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for target in targets:
                key = getattr(target, "name", None) or getattr(target, "id", None)
                if key in defined and key != "__doc__":
                    raise RuntimeError(
                        f"{name} and {defined[key]} both define {key!r}; fp8.py cannot join them."
                    )
                defined[key] = name
        parts.append(f"# {'-' * 94} {name}\n{body}")
    modules = ", ".join(REMOTE_CODE_SOURCES)
    header = (
        f'"""FP8 layers of this head, loaded as remote code (peagle {__version__}: peagle/fp8/ {modules}).\n\n'
        "config.json maps AutoModel to `fp8.PEagleDrafter`: importing this file first registers\n"
        "`apply_fp8_config` with PEagleDrafter, which then builds the FP8 layers `config.peagle_fp8` lists.\n"
        '"""\n\nfrom __future__ import annotations\n\n'
    )
    source = header + "\n\n".join(parts) + _REMOTE_ENTRY
    relative = set(_RELATIVE_IMPORT.findall(source))
    if relative != {"modeling_peagle"}:
        raise RuntimeError(
            f"fp8.py would import {sorted(relative)} relatively; expected only modeling_peagle."
        )
    return source


def save_remote_code(head: nn.Module, folder: str | Path) -> None:
    """Write `fp8.py` into a saved head's folder and point `auto_map["AutoModel"]` at it.

    Called by `PEagleDrafter.save_pretrained` for heads with `config.peagle_fp8`; without an `auto_map`
    (no remote code was saved) it does nothing.
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    auto_map = config.get("auto_map")
    if not auto_map or "AutoModel" not in auto_map:
        return
    (folder / REMOTE_CODE_FILE).write_text(remote_code_source())
    auto_map["AutoModel"] = f"{REMOTE_CODE_FILE.removesuffix('.py')}.{type(head).__name__}"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def register_fp8_heads(model_class: type) -> None:
    """Register FP8 layer rebuilding (`apply_fp8_config`) and `save_remote_code` for `config.peagle_fp8`."""
    model_class.register_config_extension(CONFIG_KEY, apply_fp8_config, save=save_remote_code)
