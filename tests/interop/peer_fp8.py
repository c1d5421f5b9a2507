"""compressed-tensors' side of the FP8 interop tests; runs in the peers' environment (tests/interop/peer_env.sh).

    python peer_fp8.py decompress FOLDER REFERENCE
        Reads FOLDER's `quantization_config` with compressed-tensors' own `QuantizationConfig`, builds a bare
        module tree of `nn.Linear` layers from the safetensors shapes (no peagle, no transformers model class),
        lets compressed-tensors attach its quantization parameters (`apply_quantization_config`), loads the
        file's tensors into them (strict), and decompresses (`ModelCompressor.decompress_model`).  Compares
        every decompressed weight with REFERENCE (a safetensors file: layer name -> float32 weight).

Prints one line `RESULT <json>`.  Imports nothing from peagle.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def file_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def linear_tree(tensors: dict):
    """An `nn.Module` with an `nn.Linear` (float32, dense) at every name that has a 2-D `<name>.weight`."""
    import torch
    from torch import nn

    root = nn.Module()
    for key, t in sorted(tensors.items()):
        if not key.endswith(".weight") or t.dim() != 2 or key.startswith("embed_tokens"):
            continue
        *parents, leaf = key.removesuffix(".weight").split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.add_module(leaf, nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=torch.float32))
    return root


def decompress(folder: str, reference: str) -> dict:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    config = json.loads((Path(folder) / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    stored = file_tensors(Path(folder))
    model = linear_tree(stored)
    apply_quantization_config(model, qconfig)
    quantized = sorted(
        name for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None
    )
    state = {
        k: v
        for k, v in stored.items()
        if k.removesuffix(".weight").removesuffix(".weight_scale")
        in {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    }
    result = model.load_state_dict(state, strict=False)
    ModelCompressor(quantization_config=qconfig).decompress_model(model)
    ref = load_file(reference)
    mismatched = sorted(
        name
        for name, weight in ref.items()
        if model.get_submodule(name).weight.dtype != weight.dtype
        or not torch.equal(model.get_submodule(name).weight, weight)
    )
    return {
        "format": qconfig.format,
        "strategy": qconfig.config_groups["group_0"].weights.strategy,
        "quantized": quantized,
        "missing": sorted(result.missing_keys),
        "unexpected": sorted(result.unexpected_keys),
        "mismatched": mismatched,
        "dense_dtypes": sorted(
            {str(m.weight.dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        ),
    }


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command != "decompress":
        raise SystemExit(f"unknown command {command!r}; expected 'decompress'")
    print("RESULT " + json.dumps(decompress(*args)), flush=True)
