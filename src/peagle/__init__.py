"""peagle: P-EAGLE parallel speculative decoding for HuggingFace transformers.

The top level holds what most users need: the config and the model, the loaders (`load_head` for every
published layout, `load_target`, the embedded default target and heads), `export`, the generation statistics and
cost model, and, imported on first use, the training names and the FP8 helpers.  Specialised names stay in their
modules (`peagle.formats`, `peagle.generation`, `peagle.training`, `peagle.fp8`, `peagle.sizing`,
`peagle.integrations`, `peagle.evaluation`).

Importing peagle has these side effects, and no others:

- registers the `"peagle"` model type with `AutoConfig`/`AutoModel` (and for Hub remote code);
- installs the one version-guarded generate() dispatch hook (`install_generate_hook`; undo with
  `uninstall_generate_hook`), so `target.generate(ids, assistant_model=head)` drafts with the head;
- `peagle.formats` registers its layout loader on `PEagleDrafter.from_pretrained` and its folder swap on
  `save_pretrained` (old files never stay beside new ones), and `peagle.integrations.hub` its
  `push_to_hub`: the model itself imports neither (docs/DESIGN.md section 5);
- `peagle.sizing` registers its sizing rule as `PEagleConfig.for_target`'s (the configuration imports nothing
  from peagle).
"""

from transformers import AutoConfig, AutoModel

from . import sizing  # noqa: F401  (registers the sizing rule as PEagleConfig.for_target's)
from ._version import __version__
from .configuration_peagle import PEagleConfig
from .drafting_peagle import PEagleDraft
from .formats import export
from .formats import load_head as _load_head
from .generation import (
    DraftingSession,
    PEagleGenerateOutput,
    PEagleGenerationStats,
    declare_stateless_processor,
    install_generate_hook,
    uninstall_generate_hook,
)
from .generation.cost import VerifyCostModel, set_cost_model
from .integrations import hub  # noqa: F401  (registers PEagleDrafter.push_to_hub)
from .modeling_peagle import PEagleDrafter, PEagleDrafterOutput
from .targets import load_default_drafter, load_default_target, load_target

AutoConfig.register(PEagleConfig.model_type, PEagleConfig, exist_ok=True)
AutoModel.register(PEagleConfig, PEagleDrafter, exist_ok=True)
PEagleConfig.register_for_auto_class()
PEagleDrafter.register_for_auto_class("AutoModel")
install_generate_hook()


def load_head(path_or_id, *model_args, target=None, target_model=None, **kwargs) -> PEagleDrafter:
    """`peagle.formats.load_head`: a head in any published layout, attached to `target` when given.

    `target_model=` is the same argument under the name `PEagleDrafter.from_pretrained` gives it, so
    `peagle.load_head(folder, target_model=target)` and `PEagleDrafter.from_pretrained(folder, target_model=target)`
    load the same head.
    """
    if target is not None and target_model is not None and target is not target_model:
        raise ValueError("load_head got two different targets (target= and target_model=); pass one.")
    return _load_head(
        path_or_id, *model_args, target=target if target is not None else target_model, **kwargs
    )


_TRAINING_EXPORTS = ("PEagleTrainer", "PEagleTrainingArguments", "train_head")
_FP8_EXPORTS = ("FP8Linear", "quantize_head", "dequantize_head")


def __getattr__(name: str):
    """The training names (`peagle.PEagleTrainer`, ...) and the FP8 names (`peagle.FP8Linear`,
    `peagle.quantize_head`, `peagle.dequantize_head`), imported on first use."""
    if name in _TRAINING_EXPORTS:
        from . import training

        return getattr(training, name)
    if name in _FP8_EXPORTS:  # not imported eagerly: FP8 is optional and GPU-specific
        from . import fp8

        return getattr(fp8, name)
    raise AttributeError(f"module 'peagle' has no attribute {name!r}")


__all__ = [
    "PEagleGenerateOutput",
    "declare_stateless_processor",
    "PEagleConfig",
    "PEagleDrafter",
    "PEagleDrafterOutput",
    "PEagleDraft",
    "export",
    "load_head",
    "FP8Linear",
    "quantize_head",
    "dequantize_head",
    "DraftingSession",
    "PEagleGenerationStats",
    "VerifyCostModel",
    "set_cost_model",
    "install_generate_hook",
    "uninstall_generate_hook",
    "load_target",
    "load_default_target",
    "load_default_drafter",
    "PEagleTrainer",
    "PEagleTrainingArguments",
    "train_head",
    "__version__",
]
