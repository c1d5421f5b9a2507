"""Training P-EAGLE (and EAGLE-3) drafter heads.

Pure functions of the training method: [`cod_sample`] (conditional drop), [`peagle_attention_mask`] /
[`peagle_block_mask`] (the attention rule), [`partition_plan`] (sequence partitioning, Algorithm 1 with causal
completion).  Data: [`self_distill`], [`synthesize_prompts`], [`FeatureCache`].  Training:
[`PEagleTrainer`] with [`PEagleTrainingArguments`]; end to end: [`train_head`] (also `peagle train`).

Example:

```python
from peagle import PEagleConfig, PEagleDrafter
from peagle.training import PEagleTrainer, PEagleTrainingArguments, self_distill

examples = self_distill(target, ["Write a haiku about rain.", ...], tokenizer=tokenizer)
head = PEagleDrafter(PEagleConfig.for_target(target.config, num_hidden_layers=2))
args = PEagleTrainingArguments(output_dir="ckpt", num_parallel_positions=8, sequence_partitions=4)
PEagleTrainer(model=head, target_model=target, args=args, train_dataset=examples).train()
head.save_pretrained("my-head")
```
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "cod": ["cod_counts", "cod_sample"],
    "masks": ["peagle_mask_rule", "peagle_attention_mask", "peagle_block_mask", "PEagleMaskTemplate"],
    "partition": ["Segment", "partition_boundaries", "partition_plan"],
    "losses": ["distillation_loss", "target_draft_logits"],
    "data": [
        "PEagleDataCollator",
        "FeatureCache",
        "capture_features",
        "chat_prompt_ids",
        "user_turn_template",
        "generate_responses",
        "self_distill",
        "synthesize_prompts",
        "load_prompts",
        "stdlib_code_prompts",
        "save_examples",
        "load_examples",
        "select_draft_vocab",
    ],
    "trainer": [
        "ExamplePlan",
        "plan_example",
        "parallel_drafter_inputs",
        "PEagleTrainer",
        "PEagleTrainingArguments",
    ],
    "recipe": ["train_head"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # static names for type checkers and IDEs; the runtime imports are lazy
    from .cod import cod_counts, cod_sample  # noqa: F401
    from .data import (  # noqa: F401
        FeatureCache,
        PEagleDataCollator,
        capture_features,
        chat_prompt_ids,
        generate_responses,
        load_examples,
        load_prompts,
        save_examples,
        select_draft_vocab,
        self_distill,
        stdlib_code_prompts,
        synthesize_prompts,
        user_turn_template,
    )
    from .losses import distillation_loss, target_draft_logits  # noqa: F401
    from .masks import PEagleMaskTemplate, peagle_attention_mask, peagle_block_mask, peagle_mask_rule  # noqa: F401
    from .partition import Segment, partition_boundaries, partition_plan  # noqa: F401
    from .recipe import train_head  # noqa: F401
    from .trainer import (  # noqa: F401
        ExamplePlan,
        PEagleTrainer,
        PEagleTrainingArguments,
        parallel_drafter_inputs,
        plan_example,
    )


def __getattr__(name: str):
    """Import the submodule of a public name on first use (keeps `peagle train --help` and `import peagle` light)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [name for names in _EXPORTS.values() for name in names]
