"""The ``"peagle"`` layout: this library's own (`config.json` with `model_type: "peagle"`).

transformers loads it (`PEagleDrafter.from_pretrained_native`) after `prepare` has imported the modules
behind the config's extension blocks and `checks.check_native` has checked every tensor's shape against the
config.  Writing it is `save_pretrained`, which also copies the remote code (docs/DESIGN.md section 5).
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..configuration_peagle import PEagleConfig
from ..modeling_peagle import EXTENSION_PREFIX, PEagleDrafter
from .checks import check_native
from .io import Checkpoint

NAME = "peagle"
EXTENSION_MODULES = {"peagle_fp8": "peagle.fp8"}
"""Config extension block -> the module that registers its builder with `PEagleDrafter` when imported."""


OWN_KEYS = ("drafting_mode", "num_parallel_positions", "embed_from_target", "target_model_type")
"""Top-level config.json fields only peagle's own layout writes (`PEagleConfig.to_dict` writes them all; the foreign
layouts carry peagle's fields in a `peagle` block)."""
OWN_TENSORS = ("mask_embedding",)
"""Tensors only peagle's own layout stores (the foreign layouts put the mask vector into the embedding table)."""


def detect(config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
    """`model_type` is ``"peagle"``.

    Raises `ValueError` for a peagle head whose `model_type` was dropped or changed (e.g. to ``"llama"``): read as
    a foreign layout it would silently lose K, K_train and its confidence settings.
    """
    model_type = config.get("model_type")
    if model_type == PEagleConfig.model_type:
        return True
    if config.get("speculators_model_type") is not None:
        return False
    keys = [k for k in OWN_KEYS if k in config] + [n for n in OWN_TENSORS if n in tensor_names]
    if keys:
        raise ValueError(
            f"model_type is {model_type!r}, but the head holds peagle's own fields {keys}: a peagle-layout head "
            f'whose model_type was dropped or changed. Set "model_type": "peagle" in config.json (read as another '
            "layout it would lose num_speculative_tokens and confidence_threshold)."
        )
    return False


def import_extensions(config: Mapping[str, Any]) -> None:
    """Import the module behind every extension block (`peagle_<name>`) set in a config dict."""
    for key, value in config.items():
        if key.startswith(EXTENSION_PREFIX) and value and key in EXTENSION_MODULES:
            importlib.import_module(EXTENSION_MODULES[key])


def prepare(
    checkpoint: Checkpoint, cls: type = PEagleDrafter, config: PEagleConfig | None = None
) -> PEagleConfig | None:
    """Make a peagle-layout checkpoint ready for transformers: extensions imported, tensors checked.

    An FP8 head's compressed-tensors `quantization_config` becomes `peagle_fp8` on the returned config (pass it
    to `from_pretrained_native`: peagle's FP8 layers load the tensors, not transformers' quantizer); otherwise
    `config` is returned as given.
    """
    import_extensions(checkpoint.config)
    qc = checkpoint.config.get("quantization_config")
    if isinstance(qc, Mapping) and qc.get("quant_method") == "compressed-tensors":
        from ..fp8 import from_disk_config

        if not isinstance(config, PEagleConfig):
            config = cls.config_class.from_pretrained(checkpoint.path)
        from_disk_config(config, where=str(checkpoint.path / "config.json"))
    check_native(checkpoint, cls, config=config)
    return config


def from_peagle(
    head: PEagleDrafter,
    out: Path,
    *,
    target_model: Any = None,
    num_speculative_tokens: int | None = None,
    max_shard_size: int | str = "5GB",
    verifier: str | None = None,
) -> None:
    """`head.save_pretrained(out)` (attached to `target_model` first, if given), recording `num_speculative_tokens`
    as K when given (the head's own config is left as it was); the config's `target_model_name` names the target
    (`verifier` is for the speculators layout)."""
    if target_model is not None:
        head.attach_target(target_model)
    config = head.config
    own = config.num_speculative_tokens
    if num_speculative_tokens is not None:
        config.num_speculative_tokens = num_speculative_tokens
    try:
        head.save_pretrained(out, max_shard_size=max_shard_size)
    finally:
        config.num_speculative_tokens = own
