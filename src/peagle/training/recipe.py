"""The standard recipe: a target and prompts -> self-distilled examples -> a trained, saved head.

[`training_arguments`] builds the recipe's `PEagleTrainingArguments`, [`build_head`] a new head for a target
(config, draft vocabulary, mask token), [`load_head_for_training`] an existing head (optionally with a LoRA
adapter), and [`train_head`] runs the whole recipe (`peagle train` calls it).  Scripts and the command line
build heads and arguments through these functions only.

Importing this module is cheap; torch, transformers and the trainer are imported inside the functions.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..modeling_peagle import PEagleDrafter
    from .trainer import PEagleTrainingArguments


def training_arguments(
    output_dir: str | os.PathLike,
    *,
    num_parallel_positions: int | None = 8,
    cod_ratio: float = 0.7,
    cod_min_ratio: float = 0.2,
    sequence_partitions: int = 1,
    max_length: int = 2048,
    loss_type: str = "kl",
    num_train_epochs: float = 1.0,
    max_steps: int = -1,
    learning_rate: float = 3e-4,
    warmup_steps: float = 0.01,
    lr_scheduler_type: str = "linear",
    per_device_train_batch_size: int = 1,
    gradient_accumulation_steps: int = 8,
    bf16: bool = False,
    save_steps: int = 500,
    logging_steps: int = 10,
    seed: int = 42,
    use_cpu: bool | None = None,
    progress: bool = True,
    **overrides: Any,
) -> PEagleTrainingArguments:
    """The recipe's `PEagleTrainingArguments` (the defaults of `peagle train`).

    Args:
        output_dir: checkpoints and logs.
        num_parallel_positions: K_train (None: the head config's).
        cod_ratio, cod_min_ratio: COD keep ratio per depth and its floor.
        sequence_partitions: S, forward/backward passes per example.
        max_length: examples are truncated to this many tokens.
        loss_type: `"kl"` or `"ce"`.
        warmup_steps: a float below 1 is a fraction of the optimiser steps.
        use_cpu: default: True unless CUDA is available.
        progress: show the trainer's progress bar.
        overrides: any other `PEagleTrainingArguments` / `TrainingArguments` field (e.g. `save_strategy="no"`,
            `save_total_limit=2`, `optim="sgd"`).
    """
    import torch

    from .trainer import PEagleTrainingArguments

    values: dict[str, Any] = {
        "output_dir": os.fspath(output_dir),
        "num_parallel_positions": num_parallel_positions,
        "cod_ratio": cod_ratio,
        "cod_min_ratio": cod_min_ratio,
        "sequence_partitions": sequence_partitions,
        "max_length": max_length,
        "loss_type": loss_type,
        "num_train_epochs": num_train_epochs,
        "max_steps": max_steps,
        "learning_rate": learning_rate,
        "warmup_steps": warmup_steps,
        "lr_scheduler_type": lr_scheduler_type,
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "bf16": bf16,
        "save_steps": save_steps,
        "logging_steps": logging_steps,
        "seed": seed,
        "use_cpu": (not torch.cuda.is_available()) if use_cpu is None else use_cpu,
        "report_to": "none",
        "disable_tqdm": not progress,
    }
    values.update(overrides)
    return PEagleTrainingArguments(**values)


def build_head(
    target,
    examples: Sequence[dict[str, Any]] | None = None,
    *,
    drafting_mode: str = "parallel",
    num_hidden_layers: int = 2,
    draft_vocab_size: int | None = None,
    num_parallel_positions: int | None = None,
    num_speculative_tokens: int | None = None,
    embed_from_target: bool = False,
    mask_token_id: int | None = None,
    target_model_name: str | None = None,
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> PEagleDrafter:
    """A new, randomly initialised head for `target`: `PEagleConfig.for_target` plus the draft vocabulary.

    Args:
        target: the target model (only `target.config` is read).
        examples: training examples; needed when `draft_vocab_size` is below the target's vocabulary (the most
            frequent response tokens are kept, plus the EOS ids, see [`select_draft_vocab`]).
        drafting_mode: `"parallel"` (P-EAGLE) or `"autoregressive"` (EAGLE-3 baseline).
        num_hidden_layers: drafter decoder layers.
        num_parallel_positions: K_train (default: the config's).
        num_speculative_tokens: the head's default inference K (default: the config's).
        embed_from_target: share the target's frozen embeddings (only the mask embedding is learned).
        mask_token_id: a reserved token of the tokenizer (default: the config's, the last id).
        target_model_name: recorded in the config (default: the target config's name).
        dtype: parameter dtype (default float32, the training dtype).
        config_overrides: any other `PEagleConfig` field (e.g. `attn_implementation="sdpa"`).
    """
    import torch

    from ..configuration_peagle import PEagleConfig
    from ..modeling_peagle import PEagleDrafter
    from .vocab import select_draft_vocab

    values: dict[str, Any] = {
        "num_hidden_layers": num_hidden_layers,
        "drafting_mode": drafting_mode,
        "embed_from_target": embed_from_target,
    }
    optional = {
        "draft_vocab_size": draft_vocab_size,
        "num_parallel_positions": num_parallel_positions,
        "num_speculative_tokens": num_speculative_tokens,
        "mask_token_id": mask_token_id,
        "target_model_name": target_model_name,
    }
    values.update({k: v for k, v in optional.items() if v is not None})
    values.update(config_overrides)
    head = PEagleDrafter(PEagleConfig.for_target(target.config, **values)).to(dtype or torch.float32)
    if draft_vocab_size is not None and draft_vocab_size < head.config.vocab_size:
        if examples is None:
            raise ValueError(
                "a draft vocabulary smaller than the target's is chosen from examples; pass them."
            )
        eos = target.config.eos_token_id
        extra = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        head.set_draft_vocab(select_draft_vocab(examples, draft_vocab_size, head.config.vocab_size, extra))
    return head


def load_head_for_training(path: str | os.PathLike, target, *, lora=None):
    """An existing head to continue training, in float32 and attached to `target`; with `lora` (a
    `peft.LoraConfig`, see `peagle.adapters.lora_config`) a LoRA adapter on the frozen head instead."""
    import torch

    if lora is not None:
        from ..adapters import lora_for_training

        return lora_for_training(path, target, lora)
    from ..modeling_peagle import PEagleDrafter

    return PEagleDrafter.from_pretrained(path, dtype=torch.float32, target_model=target)


def train_head(
    target,
    tokenizer=None,
    *,
    output_dir: str | os.PathLike,
    prompts: Sequence[Any] = (),
    examples: Sequence[dict[str, Any]] | None = None,
    num_magpie_prompts: int = 0,
    num_code_prompts: int = 0,
    max_new_tokens: int = 256,
    generation_batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    head=None,
    num_hidden_layers: int = 2,
    draft_vocab_size: int | None = None,
    drafting_mode: str = "parallel",
    embed_from_target: bool = False,
    mask_token_id: int | None = None,
    feature_cache: str | os.PathLike | None = None,
    training_args: PEagleTrainingArguments | Mapping[str, Any] | None = None,
    resume_from_checkpoint: str | bool | None = None,
    progress: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Self-distill data from `prompts`, train a head on it with [`PEagleTrainer`] and save it to `output_dir`.

    Args:
        target: the target causal LM (frozen).
        tokenizer: its tokenizer (needed for text prompts and Magpie prompts; not for pre-tokenized ones).  When
            given, the prompts of ready `examples` are checked against the evaluation sets too.
        output_dir: where the head (`config.json`, `model.safetensors`), `examples.jsonl`, checkpoints
            (`checkpoints/`) and `train_summary.json` go.
        prompts: user strings, chat message lists or pre-tokenized prompt ids.
        examples: ready examples (`input_ids`, `loss_mask`); skips generation.
        num_magpie_prompts: prompts the target writes itself (Magpie), added to `prompts`.
        num_code_prompts: coding prompts from Python's standard library, added to `prompts`.
        max_new_tokens, generation_batch_size, do_sample, temperature: self-distillation decoding.
        head: a head to continue training; default [`build_head`] with `num_hidden_layers`, `drafting_mode`,
            `embed_from_target`, `mask_token_id`, `draft_vocab_size` (default: the whole vocabulary) and the
            arguments' K_train.
        feature_cache: directory of a [`FeatureCache`] (built or reused) instead of online feature capture.
        training_args: `PEagleTrainingArguments` (e.g. from [`training_arguments`]), or a dict of its fields
            (`output_dir` defaults to `<output_dir>/checkpoints`, the rest to `PEagleTrainingArguments`' own
            defaults).

    Returns:
        `(head, summary)`: the trained head and a dict of what happened (also written to `train_summary.json`).

    Raises:
        ValueError: no prompts or examples, or a prompt is an MT-Bench/HumanEval prompt.
    """
    from .distill import self_distill, synthesize_prompts
    from .features import FeatureCache
    from .prompts import check_not_evaluation, stdlib_code_prompts
    from .shards import save_examples
    from .trainer import PEagleTrainer, PEagleTrainingArguments

    start = time.time()
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    if isinstance(training_args, PEagleTrainingArguments):
        args = training_args
    else:
        targs = dict(training_args or {})
        targs.setdefault("output_dir", os.path.join(output_dir, "checkpoints"))
        targs.setdefault("report_to", "none")
        targs.setdefault("disable_tqdm", not progress)
        args = PEagleTrainingArguments(**targs)
    if examples is None:
        prompts = list(prompts)
        if num_magpie_prompts:
            prompts += synthesize_prompts(
                target, num_magpie_prompts, tokenizer=tokenizer, seed=args.seed, progress=progress
            )
        if num_code_prompts:
            prompts += stdlib_code_prompts(num_code_prompts, seed=args.seed)
        if not prompts:
            raise ValueError("train_head needs prompts, examples, num_magpie_prompts or num_code_prompts.")
        examples = self_distill(
            target,
            prompts,
            tokenizer=tokenizer,
            max_new_tokens=max_new_tokens,
            batch_size=generation_batch_size,
            do_sample=do_sample,
            temperature=temperature,
            seed=args.seed,
            progress=progress,
        )
        save_examples(examples, os.path.join(output_dir, "examples.jsonl"))
    elif tokenizer is not None:
        check_not_evaluation(
            ([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m] for ex in examples),
            tokenizer,
            source="train_head examples",
        )
    examples = list(examples)
    if not examples:
        raise ValueError("no training examples (every response was empty).")

    if head is None:
        name = getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None
        head = build_head(
            target,
            examples,
            drafting_mode=drafting_mode,
            num_hidden_layers=num_hidden_layers,
            draft_vocab_size=draft_vocab_size,
            num_parallel_positions=args.num_parallel_positions or None,
            embed_from_target=embed_from_target,
            mask_token_id=mask_token_id,
            target_model_name=name or None,
        )

    dataset: Any = examples
    cache_info = None
    if feature_cache is not None:
        dataset = FeatureCache.build(
            target, examples, feature_cache, head.config.eagle_aux_hidden_state_layer_ids, progress=progress
        )
        cache_info = {"path": os.fspath(feature_cache), "bytes": dataset.size_bytes}

    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=dataset)
    result = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    head.save_pretrained(output_dir)

    history = [h for h in trainer.state.log_history if "loss" in h]
    last_acc = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("acc_d")}
    summary = {
        "output_dir": output_dir,
        "drafting_mode": head.config.drafting_mode,
        "num_hidden_layers": head.config.num_hidden_layers,
        "num_parallel_positions": head.config.num_parallel_positions,
        "draft_vocab_size": head.config.draft_vocab_size,
        "examples": len(examples),
        "tokens": sum(len(e["input_ids"]) for e in examples),
        "response_tokens": int(sum(sum(e["loss_mask"]) for e in examples)),
        "optimizer_steps": trainer.state.global_step,
        "first_loss": history[0]["loss"] if history else None,
        "train_loss": result.training_loss,
        "last_logged_accuracy": last_acc,
        "feature_cache": cache_info,
        "seconds": round(time.time() - start, 1),
    }
    with open(os.path.join(output_dir, "train_summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    return head, summary


def format_summary(summary: dict[str, Any]) -> str:
    """A small human-readable table of a [`train_head`] summary."""
    rows = [
        ("head", summary["output_dir"]),
        (
            "mode / layers / K_train",
            f"{summary['drafting_mode']} / {summary['num_hidden_layers']} / {summary['num_parallel_positions']}",
        ),
        ("draft vocab", summary["draft_vocab_size"]),
        (
            "examples / tokens / response tokens",
            f"{summary['examples']} / {summary['tokens']} / {summary['response_tokens']}",
        ),
        ("optimizer steps", summary["optimizer_steps"]),
        ("loss first log -> mean", f"{summary['first_loss']} -> {summary['train_loss']:.4f}"),
        (
            "top-1 by depth (last log)",
            " ".join(f"{v:.2f}" for v in summary["last_logged_accuracy"].values()) or "-",
        ),
    ]
    if summary.get("feature_cache"):
        cache = summary["feature_cache"]
        rows.append(("feature cache", f"{cache['path']} ({cache['bytes'] / 2**20:.1f} MiB)"))
    rows.append(("time", f"{summary['seconds']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


__all__ = ["training_arguments", "build_head", "load_head_for_training", "train_head", "format_summary"]
