"""`AutoModel.from_pretrained` on the vLLM and speculators exports returns a `PEagleDrafter`.

peagle writes those layouts with a `model_type` transformers does not know, the one vLLM parses them with:
`"eagle"` (vLLM's EAGLE config, `formats.vllm`) and `"speculators"` (`formats.speculators`).  Without peagle,
transformers therefore refuses them ("does not recognize this architecture") instead of building a `LlamaModel`
with half of its weights random, as it did for the flat `model_type: "llama"` config.  With peagle imported,
`register_auto_classes` maps both types to `ForeignHeadLoader`, which hands the folder to `load_head`.

A model type that another library has already registered with `AutoConfig` (vLLM registers `"eagle"` in its own
process) is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from transformers import CONFIG_MAPPING, AutoConfig, AutoModel, PretrainedConfig

from ..modeling_peagle import PEagleDrafter


class EagleExportConfig(PretrainedConfig):
    """How transformers' `AutoConfig` reads a vLLM-layout export (`model_type: "eagle"`): the raw fields only.
    The head's real config is built by `load_head`."""

    model_type = "eagle"


class SpeculatorsExportConfig(PretrainedConfig):
    """How transformers' `AutoConfig` reads a speculators-layout export (`model_type: "speculators"`)."""

    model_type = "speculators"


class _ForeignHeadLoader:
    """`AutoModel`'s entry for a foreign layout: `from_pretrained` returns `PEagleDrafter.from_pretrained(path)`."""

    config_class: ClassVar[type[PretrainedConfig]]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *model_args: Any, **kwargs: Any):
        kwargs.pop("config", None)  # the layout's own config is read by load_head
        for key in ("trust_remote_code", "_from_auto", "_commit_hash", "adapter_kwargs"):
            kwargs.pop(key, None)
        return PEagleDrafter.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)


class EagleExportLoader(_ForeignHeadLoader):
    config_class = EagleExportConfig


class SpeculatorsExportLoader(_ForeignHeadLoader):
    config_class = SpeculatorsExportConfig


FOREIGN_AUTO_CLASSES: tuple[tuple[type[PretrainedConfig], type[_ForeignHeadLoader]], ...] = (
    (EagleExportConfig, EagleExportLoader),
    (SpeculatorsExportConfig, SpeculatorsExportLoader),
)


def register_auto_classes() -> list[str]:
    """Map the foreign layouts' model types to `PEagleDrafter` in `AutoConfig`/`AutoModel`; returns the types
    registered (a type some other library registered first is skipped)."""
    done = []
    for config_class, loader in FOREIGN_AUTO_CLASSES:
        model_type = config_class.model_type
        if model_type in CONFIG_MAPPING and CONFIG_MAPPING[model_type] is not config_class:
            continue
        AutoConfig.register(model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, loader, exist_ok=True)
        done.append(model_type)
    return done


__all__ = [
    "EagleExportConfig",
    "SpeculatorsExportConfig",
    "EagleExportLoader",
    "SpeculatorsExportLoader",
    "register_auto_classes",
]
