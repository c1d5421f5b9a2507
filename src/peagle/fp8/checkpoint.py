"""FP8 heads on disk: a compressed-tensors `quantization_config` (format `float-quantized`), docs/fp8.md section 3.

In memory an FP8 head records its scheme in `config.peagle_fp8` (`quantize_head` writes it, `apply_fp8_config`
builds the layers from it).  On disk, `config.json` carries instead the `quantization_config` that vLLM,
transformers (with `compressed-tensors` installed) and llm-compressor read.  The tensors need no change:
compressed-tensors' float8 format stores `<layer>.weight` (F8_E4M3) and `<layer>.weight_scale` (F32) with
`dequantized = weight * weight_scale`, per output channel `(N, 1)` (strategy `channel`) or per
`block_structure` tile `(ceil(N/bn), ceil(K/bk))` (strategy `block`), exactly as `peagle.fp8.quantize` does.

    peagle (config.peagle_fp8)                compressed-tensors (config_groups.group_0)
    granularity "row"                         weights.strategy "channel"; input_activations token, dynamic
    granularity "block", block_size (bn, bk)  weights.strategy "block", block_structure [bn, bk];
                                              input_activations group, group_size bk, dynamic
    modules (the FP8 layers)                  targets ["Linear"] minus `ignore` (the linears left dense)

Checked against compressed-tensors 0.17 (`preset_name_to_scheme("FP8_DYNAMIC" / "FP8_BLOCK")`), transformers
5.23 `quantizers/quantizer_compressed_tensors.py` and vLLM 0.32 `compressed_tensors_w8a8_fp8.py`; the interop
suite loads the result with each of them (tests/interop/test_interop_fp8.py).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .linear import CONFIG_KEY, fp8_modules

QUANT_METHOD = "compressed-tensors"
CT_FORMAT = "float-quantized"
_STRATEGY = {"row": ("channel", "token"), "block": ("block", "group")}


def _same(name: str) -> str:
    return name


def quantization_config(record: Mapping[str, Any], ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors `quantization_config` of a `config.peagle_fp8` record.

    Args:
        record: the `peagle_fp8` record (`granularity`, `block_size`).
        ignore: the names of the linear layers left dense (e.g. `lm_head`), as the checkpoint spells them.
    """
    granularity = record.get("granularity")
    if granularity not in _STRATEGY:
        raise ValueError(f"config.{CONFIG_KEY}['granularity'] is {granularity!r}; expected 'row' or 'block'.")
    block = list(record["block_size"]) if granularity == "block" else None
    weight_strategy, act_strategy = _STRATEGY[granularity]
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": weight_strategy,
    }
    weights.update(block_structure=block, group_size=None)
    activations = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": True,
        "strategy": act_strategy,
    }
    activations.update(block_structure=None, group_size=block[1] if block else None)
    return {
        "quant_method": QUANT_METHOD,
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": CT_FORMAT,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def head_quantization_config(
    head: nn.Module, tensor_name: Callable[[str], str] = _same, dense: Sequence[str] = ()
) -> dict[str, Any]:
    """The `quantization_config` of an FP8 head, its `ignore` list spelled by a layout's `tensor_name`, plus
    `dense`: linear layers the reader's model has beyond the head's (e.g. speculators' `verifier_lm_head`)."""
    record = getattr(head.config, CONFIG_KEY, None)
    if not record:
        raise ValueError("this head has no FP8 layers (config.peagle_fp8 is not set).")
    granularities = {m.granularity for m in fp8_modules(head).values()}
    if granularities != {record["granularity"]}:
        raise ValueError(
            f"config.{CONFIG_KEY} says granularity {record['granularity']!r}, the layers are {sorted(granularities)}."
        )
    names = [
        tensor_name(f"{n}.weight").removesuffix(".weight")
        for n, m in head.named_modules()
        if type(m) is nn.Linear
    ]
    return quantization_config(record, names + list(dense))


def is_fp8_quantization_config(qc: Any) -> bool:
    """Whether `qc` (a config's `quantization_config`) is compressed-tensors; `fp8_record` tells if peagle reads it."""
    return isinstance(qc, Mapping) and qc.get("quant_method") == QUANT_METHOD


def fp8_record(
    qc: Mapping[str, Any], rename: Mapping[str, str] | None = None, where: str = "config.json"
) -> dict:
    """The `config.peagle_fp8` record of a compressed-tensors float8 `quantization_config`.

    Reads one config group targeting `Linear` with FP8 (e4m3) weights per channel or per block and dynamic
    activations per token or per group (what [`quantization_config`] writes, and llm-compressor's
    `FP8_DYNAMIC` / `FP8_BLOCK` presets); anything else raises a `ValueError` naming the field.

    Args:
        rename: checkpoint module name -> peagle module name, for the `ignore` entries of a foreign layout.

    Returns:
        A record with `targets` / `ignore` in place of `modules`; `apply_fp8_config` resolves it on the head.
    """

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"{where}: quantization_config {what}; peagle reads compressed-tensors float8 heads with one config "
            "group: targets ['Linear'], weights {type: float, num_bits: 8, strategy: channel | block}, "
            "input_activations dynamic per token | group (docs/fp8.md section 3)."
        )

    if qc.get("quant_method") != QUANT_METHOD:
        raise refuse(f"has quant_method {qc.get('quant_method')!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"has {len(groups)} config groups")
    (group,) = groups.values()
    fmt = group.get("format") or qc.get("format")
    if fmt != CT_FORMAT:
        raise refuse(f"has format {fmt!r}, not {CT_FORMAT!r}")
    if list(group.get("targets") or []) != ["Linear"]:
        raise refuse(f"targets {group.get('targets')!r}")
    w, a = group.get("weights") or {}, group.get("input_activations")
    if (w.get("type"), w.get("num_bits"), w.get("dynamic", False)) != ("float", 8, False):
        raise refuse(f"weights are {w.get('type')!r} {w.get('num_bits')}-bit (dynamic={w.get('dynamic')})")
    if w.get("strategy") == "channel":
        granularity, block, act = "row", None, ("token", None)
    elif w.get("strategy") == "block" and len(w.get("block_structure") or []) == 2:
        granularity, block = "block", [int(b) for b in w["block_structure"]]
        act = ("group", block[1])
    else:
        raise refuse(
            f"weights have strategy {w.get('strategy')!r} (block_structure {w.get('block_structure')})"
        )
    if not a or not a.get("dynamic") or (a.get("strategy"), a.get("group_size")) != act:
        raise refuse(
            f"input_activations are {a!r}; expected dynamic, strategy {act[0]!r}, group_size {act[1]}"
        )
    rename = rename or {}
    return {
        "format": "float8_e4m3fn",
        "granularity": granularity,
        "block_size": block,
        "activation_scheme": "dynamic",
        "targets": ["Linear"],
        "ignore": sorted(rename.get(n, n) for n in qc.get("ignore") or []),
    }


def partial_tiles(head: nn.Module) -> list[str]:
    """The block-granularity FP8 layers whose sizes are not multiples of their block (edge tiles are partial).

    peagle reads and runs them; compressed-tensors 0.17 fails to decompress them ("The size of tensor a (15)
    must match the size of tensor b (14)") and vLLM 0.32 refuses them ("Weight output_partition_size = 576 is
    not divisible by weight quantization block_n = 128"), see docs/fp8.md section 3.
    """
    return [
        f"{name} ({m.out_features} x {m.in_features}, block {m.block_size})"
        for name, m in fp8_modules(head).items()
        if m.block_size is not None and (m.out_features % m.block_size[0] or m.in_features % m.block_size[1])
    ]


def checked_quantization_config(
    head: nn.Module,
    tensor_name: Callable[[str], str] = _same,
    dense: Sequence[str] = (),
    strict: bool = False,
) -> dict[str, Any]:
    """`head_quantization_config`, after checking the block tiles.

    Block scales with partial edge tiles (`partial_tiles`) only peagle reads: with `strict` (the vLLM and
    speculators exports, checked before anything is written) they raise a `ValueError`, otherwise they warn.
    """
    partial = partial_tiles(head)
    if partial:
        message = (
            f"FP8 layers {', '.join(partial)} have partial block tiles: compressed-tensors and vLLM read block scales "
            "only for layers whose sizes are multiples of the block. Quantize with granularity='row', or with a "
            "block that divides every layer (docs/fp8.md section 3)."
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message + " peagle still loads this head.", UserWarning, stacklevel=3)
    return head_quantization_config(head, tensor_name, dense)


def write_quantization_config(folder: str | Path, qc: Mapping[str, Any]) -> None:
    """Rewrite a saved or exported head's `config.json`: `quantization_config` in, `peagle_fp8` out."""
    file = Path(folder) / "config.json"
    config = json.loads(file.read_text())
    config.pop(CONFIG_KEY, None)
    config["quantization_config"] = dict(qc)
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def from_disk_config(config: Any, rename: Mapping[str, str] | None = None, where: str = "config.json") -> Any:
    """Turn a loaded config's compressed-tensors `quantization_config` into `peagle_fp8`, in place.

    transformers must not see the `quantization_config` when peagle builds the head (it would hand the load to
    its compressed-tensors quantizer); peagle's own `FP8Linear` layers load the tensors as they are.
    """
    qc = getattr(config, "quantization_config", None)
    if is_fp8_quantization_config(qc):
        setattr(config, CONFIG_KEY, fp8_record(qc, rename, where))
        delattr(config, "quantization_config")
    return config
