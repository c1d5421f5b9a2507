"""peagle: P-EAGLE parallel speculative decoding for HuggingFace transformers.

`import peagle` registers the `"peagle"` model type with `AutoConfig`/`AutoModel` and installs the one
generate() dispatch hook, so `target.generate(ids, assistant_model=head)` drafts K tokens per round in a
single drafter forward pass.
"""

from transformers import AutoConfig, AutoModel

from .configuration_peagle import PEagleConfig
from .modeling_peagle import PEagleDraft, PEagleDrafter, PEagleDrafterOutput
from .targets import load_default_drafter, load_default_target

__version__ = "0.1.0"

AutoConfig.register(PEagleConfig.model_type, PEagleConfig, exist_ok=True)
AutoModel.register(PEagleConfig, PEagleDrafter, exist_ok=True)
PEagleConfig.register_for_auto_class()
PEagleDrafter.register_for_auto_class("AutoModel")

__all__ = [
    "PEagleConfig",
    "PEagleDrafter",
    "PEagleDrafterOutput",
    "PEagleDraft",
    "load_default_target",
    "load_default_drafter",
    "__version__",
]
