"""Training P-EAGLE (and EAGLE-3) drafter heads.

One module per concept (docs/DESIGN.md section 4 describes the method):

- the method's pure functions: `cod` ([`cod_sample`], conditional drop), `masks` ([`peagle_attention_mask`] /
  [`peagle_block_mask`], the attention rule), `partition` ([`partition_plan`], Algorithm 1, earlier
  segments read as keys and values: `prefix`), `memory` ([`choose_num_segments`]: S from a byte budget), `losses`, `plan` ([`plan_example`]: the elements of one example and the drafter inputs);
- the data it trains on lives in `peagle.data` (prompts, self-distillation, shards, vocabulary, features); its public
  names are re-exported here, so `from peagle.training import self_distill` keeps working;
- settings: `arguments` ([`PEagleTrainingArguments`], [`DataArguments`], [`HeadArguments`], [`LoraArguments`]);
- training: `trainer` ([`PEagleTrainer`]), `step` (its partitioned step per micro-batch); `optimizer` (trainable parameters, learning-rate groups); `callbacks`; `head_surgery` ([`grow_draft_vocab`] /
  [`resize_draft_vocab`]: a trained head with another draft vocabulary, [`grow_layers`]: one with more decoder
  layers); `recipe` ([`training_arguments`], [`build_head`], [`train_head`], which `peagle train` calls);

Example:

```python
from peagle.training import PEagleTrainer, build_head, self_distill, training_arguments

examples = self_distill(target, ["Write a haiku about rain.", ...], tokenizer=tokenizer)
head = build_head(target, examples)  # sized by peagle.sizing: layers, draft vocabulary from the data
args = training_arguments("ckpt", num_parallel_positions=8, sequence_partitions=4)
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
    "memory": ["StepMemoryModel", "choose_num_segments", "parse_bytes", "resolve_memory_budget"],
    "losses": ["distillation_loss", "target_draft_logits"],
    "..data.prompts": [
        "chat_prompt_ids",
        "user_turn_template",
        "check_not_evaluation",
        "drop_evaluation_prompts",
        "load_prompts",
        "stdlib_code_prompts",
        "stdlib_stub_prompts",
        "default_prompt_set",
    ],
    "..data.distill": [
        "GenerationSettings",
        "MagpieSettings",
        "generate_responses",
        "self_distill",
        "synthesize_prompts",
    ],
    "..data.vllm_engine": ["VLLMEngine"],
    "..data.features": ["PEagleDataCollator", "FeatureCache", "capture_features"],
    "..data.vocab": ["select_draft_vocab", "draft_vocab_coverage", "choose_draft_vocab_size"],
    "..data.shards": ["save_examples", "load_examples", "write_shard", "read_shards"],
    "plan": ["ExamplePlan", "plan_example", "parallel_drafter_inputs"],
    "arguments": ["PEagleTrainingArguments", "DataArguments", "HeadArguments", "LoraArguments"],
    "trainer": ["PEagleTrainer"],
    "head_surgery": ["grow_draft_vocab", "grow_layers", "resize_draft_vocab"],
    "recipe": ["train_head", "training_arguments", "build_head", "end_distributed"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # static names for type checkers and IDEs; the runtime imports are lazy
    from ..data.distill import (  # noqa: F401
        GenerationSettings,
        MagpieSettings,
        generate_responses,
        self_distill,
        synthesize_prompts,
    )
    from ..data.features import FeatureCache, PEagleDataCollator, capture_features  # noqa: F401
    from ..data.prompts import (  # noqa: F401
        chat_prompt_ids,
        check_not_evaluation,
        default_prompt_set,
        drop_evaluation_prompts,
        load_prompts,
        stdlib_code_prompts,
        stdlib_stub_prompts,
        user_turn_template,
    )
    from ..data.shards import load_examples, read_shards, save_examples, write_shard  # noqa: F401
    from ..data.vllm_engine import VLLMEngine  # noqa: F401
    from ..data.vocab import choose_draft_vocab_size, draft_vocab_coverage, select_draft_vocab  # noqa: F401
    from .arguments import DataArguments, HeadArguments, LoraArguments, PEagleTrainingArguments  # noqa: F401
    from .cod import cod_counts, cod_sample  # noqa: F401
    from .head_surgery import grow_draft_vocab, grow_layers, resize_draft_vocab  # noqa: F401
    from .losses import distillation_loss, target_draft_logits  # noqa: F401
    from .masks import PEagleMaskTemplate, peagle_attention_mask, peagle_block_mask, peagle_mask_rule  # noqa: F401
    from .memory import StepMemoryModel, choose_num_segments, parse_bytes, resolve_memory_budget  # noqa: F401
    from .partition import Segment, partition_boundaries, partition_plan  # noqa: F401
    from .plan import ExamplePlan, parallel_drafter_inputs, plan_example  # noqa: F401
    from .recipe import build_head, end_distributed, train_head, training_arguments  # noqa: F401
    from .trainer import PEagleTrainer  # noqa: F401


def __getattr__(name: str):
    """Import the submodule of a public name on first use (keeps `peagle train --help` and `import peagle` light)."""
    if name in _WHERE:
        module = _WHERE[name]
        value = getattr(importlib.import_module(module if module[0] == "." else f".{module}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [name for names in _EXPORTS.values() for name in names]
