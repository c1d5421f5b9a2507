"""peagle: P-EAGLE parallel speculative decoding for HuggingFace transformers.

`import peagle` registers the `"peagle"` model type with `AutoConfig`/`AutoModel` and installs the one
generate() dispatch hook, so `target.generate(ids, assistant_model=head)` drafts K tokens per round in a
single drafter forward pass.
"""

from transformers import AutoConfig, AutoModel

from .configuration_peagle import PEagleConfig
from .formats import export
from .fp8 import FP8Linear, dequantize_head, quantize_head
from .generation import (
    PEagleCandidateGenerator,
    PEagleGenerationStats,
    install_generate_hook,
    uninstall_generate_hook,
)
from .modeling_peagle import PEagleDraft, PEagleDrafter, PEagleDrafterOutput
from .targets import load_default_drafter, load_default_target

__version__ = "0.1.0"

AutoConfig.register(PEagleConfig.model_type, PEagleConfig, exist_ok=True)
AutoModel.register(PEagleConfig, PEagleDrafter, exist_ok=True)
PEagleConfig.register_for_auto_class()
PEagleDrafter.register_for_auto_class("AutoModel")
install_generate_hook()

_TRAINING_EXPORTS = ("PEagleTrainer", "PEagleTrainingArguments", "train_head")


def __getattr__(name: str):
    """`peagle.PEagleTrainer`, `peagle.PEagleTrainingArguments`, `peagle.train_head`, imported on first use."""
    if name in _TRAINING_EXPORTS:
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'peagle' has no attribute {name!r}")


__all__ = [
    "PEagleConfig",
    "PEagleDrafter",
    "PEagleDrafterOutput",
    "PEagleDraft",
    "export",
    "FP8Linear",
    "quantize_head",
    "dequantize_head",
    "PEagleCandidateGenerator",
    "PEagleGenerationStats",
    "install_generate_hook",
    "uninstall_generate_hook",
    "load_default_target",
    "load_default_drafter",
    "PEagleTrainer",
    "PEagleTrainingArguments",
    "train_head",
    "__version__",
]
