"""The settings of head training, each defined once: [`PEagleTrainingArguments`] (transformers'
`TrainingArguments` plus the P-EAGLE method), [`DataArguments`] (target and data), [`HeadArguments`] (the head
to build or continue) and [`LoraArguments`] (adapting an existing head).

`peagle train` parses the four with `HfArgumentParser`, the pattern of transformers' own examples: each flag is its
field's name (`--cod_ratio`), with the field's default and help.  Python code builds the same objects and hands them
to `recipe.train_head`, so each default exists once, here.  `RECIPE_DEFAULTS` are the recipe's choices where they
differ from `TrainingArguments`' own (`recipe.training_arguments` and the command both apply them).  Head sizes left None follow the size rule (`peagle.sizing`, `PEagleConfig.for_target`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..configuration_peagle import MAX_SPECULATIVE_TOKENS, number_problem
from ..data.distill import GenerationSettings
from ..data.documents import is_document_source
from .losses import LOSS_TYPES

RECIPE_DEFAULTS: dict[str, Any] = {
    "num_train_epochs": 1.0,
    "learning_rate": 3e-4,
    "warmup_steps": 0.01,  # below 1: a fraction of the optimiser steps
    "gradient_accumulation_steps": 8,
    "logging_steps": 10,
    "logging_first_step": True,  # every run that makes a step logs a loss (and the first is the baseline)
    "report_to": "none",
}
"""The standard recipe's training settings where they differ from `TrainingArguments`' defaults."""


def _at_least(owner: Any, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"{name} is {value!r}; expected an integer >= {minimum}.")


def _not_a_file(owner: Any, name: str) -> None:
    """Refuse a folder setting (`output_dir`, `feature_cache`) that names an existing file."""
    value = getattr(owner, name)
    if value is not None and os.path.isfile(os.path.expanduser(str(value))):
        raise ValueError(f"{name} is {value!r}, which is a file; expected a folder (new or existing).")


def _in_range(owner: Any, name: str, low: float, high: float | None, low_open: bool = False) -> None:
    """Refuse `owner.<name>` unless it is a finite number in [low, high] ((low, high] with `low_open`)."""
    problem = number_problem(name, getattr(owner, name), low, high, low_open=low_open)
    if problem:
        raise ValueError(problem + ".")


def parse_lr_scales(entries: list[str] | tuple[str, ...]) -> list[tuple[re.Pattern, float]]:
    """`"REGEX=SCALE"` entries as `(compiled regex, scale)` pairs, in order; the last `=` separates the two, so
    the regex may hold one (`(?=...)`).  Refuses a missing `=`, a bad regex and a scale that is not a
    non-negative number."""
    scales = []
    for entry in entries:
        pattern, sep, value = str(entry).rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"lr_scales entry {entry!r} is not 'REGEX=SCALE' (e.g. 'lm_head=0.1').")
        try:
            scale = float(value)
        except ValueError:
            scale = float("nan")
        if not scale >= 0.0:
            raise ValueError(f"lr_scales entry {entry!r}: the scale {value!r} is not a number >= 0.")
        try:
            scales.append((re.compile(pattern), scale))
        except re.error as err:
            raise ValueError(f"lr_scales entry {entry!r}: {pattern!r} is not a regex: {err}") from err
    return scales


@dataclass
class PEagleTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the P-EAGLE training method.

    Args:
        num_parallel_positions: K_train, depths 0..K-1 per anchor (default: the head config's).
        cod_ratio: COD keep ratio r per depth (``r**d`` of the anchors at depth d).
        cod_min_ratio: floor r_min of the keep ratio.
        sequence_partitions: S, forward/backward passes per example (same gradient for every S); with
            `partition_memory_budget`, the smallest S tried.
        partition_memory_budget: a size (`"4GB"`, `"3.5GiB"`, bytes) the activations of one step must fit: each
            micro-batch is split into the fewest segments whose estimated peak fits
            ([`peagle.training.memory.StepMemoryModel`]; weights and optimiser state not counted).  `"auto"` (the
            default) chooses the size from the device's memory ([`resolve_memory_budget`]: a quarter of the RAM up
            to 4 GiB on a CPU, half the free memory of a GPU) and is off under `gradient_checkpointing`; `"none"`:
            S is `sequence_partitions`.
        balance_partitions: choose segment boundaries that even out the passes' sizes.
        max_length: examples are truncated to this many tokens; long document examples go up to it (8,192 by
            default, or the target's range where that is shorter).
        loss_type: `"kl"` (against the target's distribution over the draft vocab) or `"ce"` (its argmax).
        ttt_decay: EAGLE-3 mode: weight of unroll step i is ``ttt_decay ** i``.
        flex_block_size: tile size of the flex-attention block mask (heads built with `flex_attention`).
        flush_denormal: flush denormal floats to zero while training on a CPU: softmaxes over the draft
            vocabulary produce many, and CPU arithmetic on them is many times slower (no effect on GPUs).
        trainable_parameters: a regular expression over the head's parameter names; when set, only the
            parameters it matches (`re.search`) are trained and the rest stay frozen, e.g. `"lm_head"` to fit the
            rows of a grown draft vocabulary with the decoder layers kept as they are.
        lr_scales: per-parameter learning rates, as `"REGEX=SCALE"` strings: a parameter whose name the first
            matching regex finds (`re.search`) trains at `SCALE * learning_rate` (under the same schedule), the
            others at `learning_rate`; e.g. `["lm_head=0.1"]` moves the LM head ten times slower than the layers.
    """

    num_parallel_positions: int | None = field(
        default=None,
        metadata={"help": "K_train, parallel positions (depths) per anchor (default: the head's)."},
    )
    cod_ratio: float = field(default=0.7, metadata={"help": "COD keep ratio r per depth."})
    cod_min_ratio: float = field(default=0.2, metadata={"help": "COD keep-ratio floor r_min."})
    sequence_partitions: int = field(default=1, metadata={"help": "Forward/backward passes per example."})
    partition_memory_budget: str | None = field(
        default="auto",
        metadata={
            "help": "Choose S per micro-batch so a step's activations fit this size, e.g. 4GB or 3.5GiB; 'auto': "
            "a quarter of the RAM up to 4 GiB on a CPU, half the free memory of a GPU; 'none': S is "
            "sequence_partitions."
        },
    )
    balance_partitions: bool = field(default=True, metadata={"help": "Balance segment sizes."})
    max_length: int = field(
        default=8192,
        metadata={
            "help": "Truncate examples to this many tokens (and the longest document examples' length)."
        },
    )
    loss_type: str = field(default="kl", metadata={"help": "'kl' or 'ce'."})
    ttt_decay: float = field(default=0.8, metadata={"help": "EAGLE-3 unroll step weight decay."})
    flex_block_size: int = field(default=128, metadata={"help": "flex-attention block size."})
    flush_denormal: bool = field(
        default=True, metadata={"help": "Flush denormal floats to zero (CPU speed)."}
    )
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep every example column."})
    trainable_parameters: str | None = field(
        default=None, metadata={"help": "Regex over head parameter names: train only those (default: all)."}
    )
    lr_scales: list[str] = field(
        default_factory=list,
        metadata={"help": "'REGEX=SCALE' entries: matching head parameters train at SCALE * learning_rate."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.trainable_parameters is not None:
            try:
                re.compile(self.trainable_parameters)
            except re.error as err:
                raise ValueError(
                    f"trainable_parameters {self.trainable_parameters!r} is not a regex: {err}"
                ) from err
        parse_lr_scales(self.lr_scales)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type is {self.loss_type!r}; expected one of {LOSS_TYPES}.")
        if self.sequence_partitions < 1:
            raise ValueError(f"sequence_partitions is {self.sequence_partitions}; expected >= 1.")
        if self.partition_memory_budget is not None:
            from .memory import resolve_memory_budget

            resolve_memory_budget(self.partition_memory_budget)  # a size, "auto" or "none"
        k = self.num_parallel_positions
        if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_parallel_positions is {k}; expected an integer in [1, {MAX_SPECULATIVE_TOKENS}]."
            )
        _at_least(self, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "flex_block_size")
        if self.max_length < 3:
            raise ValueError(f"max_length is {self.max_length}; expected >= 3 tokens.")
        _not_a_file(self, "output_dir")
        _in_range(self, "ttt_decay", 0.0, 1.0, low_open=True)
        _in_range(self, "cod_ratio", 0.0, 1.0, low_open=True)
        _in_range(self, "cod_min_ratio", 0.0, 1.0)
        _in_range(self, "learning_rate", 0.0, None)
        _in_range(self, "weight_decay", 0.0, None)
        _in_range(self, "max_grad_norm", 0.0, None)
        _in_range(self, "num_train_epochs", 0.0, None)
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError(
                f"num_train_epochs is {self.num_train_epochs} and max_steps is {self.max_steps}: nothing would be "
                "trained (an untrained head would be saved). Give num_train_epochs > 0 or max_steps > 0."
            )


def explicit_documents(documents: str | os.PathLike | None) -> bool:
    """Whether a `documents` setting names documents (a folder, or `"stdlib"`) rather than None, `"auto"` or
    `"none"`."""
    return documents is not None and str(documents).strip().lower() not in ("auto", "none", "")


@dataclass
class DataArguments:
    """Where the training examples come from: the target, and prompts it answers itself or ready examples."""

    target: str = field(default="default", metadata={"help": "target folder, GGUF file, Hub id or 'default'"})
    dtype: str = field(
        default="float32", metadata={"choices": ["float32", "bfloat16", "float16"], "help": "target dtype"}
    )
    prompts: list[str] = field(default_factory=list, metadata={"help": ".txt/.json/.jsonl prompt files"})
    limit: int | None = field(default=None, metadata={"help": "read at most this many prompts per file"})
    num_magpie_prompts: int = field(default=0, metadata={"help": "prompts the target writes itself (Magpie)"})
    num_code_prompts: int = field(
        default=0, metadata={"help": "coding prompts from Python's standard library"}
    )
    examples: str | None = field(
        default=None,
        metadata={"help": "ready examples: a .jsonl with input_ids, loss_mask, or a shard folder"},
    )
    max_new_tokens: int = field(
        default=GenerationSettings.max_new_tokens,
        metadata={"help": "response length cap for self-distillation"},
    )
    generation_batch_size: int = field(
        default=GenerationSettings.batch_size, metadata={"help": "prompts per generate() call"}
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "a Jinja chat template file for a target whose tokenizer has none"}
    )
    plain_prompts: bool = field(
        default=False,
        metadata={"help": "no chat template: each prompt is encoded as plain text (not with Magpie prompts)"},
    )
    do_sample: bool = field(
        default=GenerationSettings.do_sample, metadata={"help": "sample responses instead of greedy decoding"}
    )
    temperature: float = field(
        default=GenerationSettings.temperature, metadata={"help": "sampling temperature (with do_sample)"}
    )
    feature_cache: str | None = field(default=None, metadata={"help": "cache target features in this folder"})
    documents: str | None = field(
        default="auto",
        metadata={
            "help": "a folder of text files ('stdlib': Python's own sources) added as long teacher-forced examples, "
            "2K tokens doubling up to max_length and the target's range; 'auto': stdlib where the target's range "
            "reaches 2K tokens; 'none': short examples only"
        },
    )
    document_examples_per_length: int = field(
        default=16, metadata={"help": "examples per length made from --documents"}
    )
    document_questions: int = field(
        default=16,
        metadata={
            "help": "questions about the documents the target answers itself (long self-distilled examples)"
        },
    )
    calibration_examples: str = field(
        default="auto",
        metadata={
            "help": "hold out the last N examples and fit the head's draft calibration on them after training; "
            "'auto': min(32, 10%% of the examples), none below 40; 0: none"
        },
    )

    def __post_init__(self):
        _not_a_file(self, "feature_cache")
        _at_least(self, 1, "limit", "max_new_tokens", "generation_batch_size", "document_examples_per_length")
        _at_least(self, 0, "num_magpie_prompts", "num_code_prompts", "document_questions")
        if explicit_documents(self.documents) and not is_document_source(self.documents):
            raise ValueError(
                f"documents is {str(self.documents)!r}, not a folder; expected a folder of text files, 'stdlib', 'auto' "
                "or 'none'."
            )
        if self.calibration_examples != "auto":
            try:
                count = int(self.calibration_examples)
            except ValueError:
                count = -1
            if count < 0:
                raise ValueError(
                    f"calibration_examples is {self.calibration_examples!r}; expected 'auto' or a count >= 0."
                )
            self.calibration_examples = count


@dataclass
class HeadArguments:
    """The head to train: a new one (sizes left None follow the size rule) or `base_head` continued."""

    drafting_mode: str = field(default="parallel", metadata={"choices": ["parallel", "autoregressive"]})
    num_hidden_layers: int | None = field(
        default=None,
        metadata={
            "help": "drafter layers (default: the size rule's); with base_head, grow it to this many first"
        },
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "LM-head rows (default: the smallest covering 99.5%% of the data's response tokens, within the "
            "size rule); with base_head, resize its vocabulary first"
        },
    )
    embed_from_target: bool = field(
        default=True,
        metadata={"help": "share the target's frozen embeddings (--no_embed_from_target: own table)"},
    )
    mask_token_id: int | None = None
    lm_head_init: str = field(
        default="target",
        metadata={
            "choices": ["target", "random"],
            "help": "LM head from the target's rows of the draft vocabulary",
        },
    )
    layers_init: str = field(
        default="random",
        metadata={
            "choices": ["random", "target"],
            "help": "decoder layers random or copied from the target's last",
        },
    )
    base_head: str | None = field(
        default=None,
        metadata={
            "help": "start from this head (with lora, default: the shipped head of the default target)"
        },
    )

    def __post_init__(self):
        _at_least(self, 1, "num_hidden_layers", "draft_vocab_size")
        for name in ("lm_head_init", "layers_init"):
            if getattr(self, name) not in ("target", "random"):
                raise ValueError(f"{name} is {getattr(self, name)!r}; expected 'target' or 'random'.")


@dataclass
class LoraArguments:
    """Adapting an existing head with a LoRA adapter (peft, `peagle.integrations.peft`); the head stays frozen."""

    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter on the base head"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default 2 * r)"})
    lora_dropout: float = 0.0
    lora_target_modules: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated module-name suffixes (default q/k/v/o_proj, gate/up/down_proj, fc)"
        },
    )

    def __post_init__(self):
        _at_least(self, 1, "lora_r")


__all__ = [
    "PEagleTrainingArguments",
    "DataArguments",
    "HeadArguments",
    "LoraArguments",
    "RECIPE_DEFAULTS",
    "parse_lr_scales",
]
