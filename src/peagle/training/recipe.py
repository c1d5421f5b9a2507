"""End to end: a target and a prompt source -> a trained, saved head (`train_head`, `peagle train`).

Importing this module is cheap (argparse only); the heavy imports happen inside the functions.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any


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
    training_args: dict[str, Any] | None = None,
    resume_from_checkpoint: str | bool | None = None,
    progress: bool = True,
):
    """Self-distill data from `prompts`, train a head on it with [`PEagleTrainer`] and save it to `output_dir`.

    Args:
        target: the target causal LM (frozen).
        tokenizer: its tokenizer (needed for text prompts and Magpie prompts; not for pre-tokenized ones).
        output_dir: where the head (`config.json`, `model.safetensors`), `examples.jsonl`, checkpoints
            (`checkpoints/`) and `train_summary.json` go.
        prompts: user strings, chat message lists or pre-tokenized prompt ids.
        examples: ready examples (`input_ids`, `loss_mask`); skips generation.
        num_magpie_prompts: prompts the target writes itself (Magpie), added to `prompts`.
        num_code_prompts: coding prompts from Python's standard library, added to `prompts`.
        max_new_tokens, generation_batch_size, do_sample, temperature: self-distillation decoding.
        head: a head to continue training; default a new one from `PEagleConfig.for_target(target.config, ...)`
            with `num_hidden_layers`, `drafting_mode`, `embed_from_target`, `mask_token_id`.
        draft_vocab_size: keep the most frequent response tokens (default: the whole vocabulary).
        feature_cache: directory of a [`FeatureCache`] (built or reused) instead of online feature capture.
        training_args: keyword arguments of [`PEagleTrainingArguments`] (`output_dir` defaults to
            `<output_dir>/checkpoints`).

    Returns:
        `(head, summary)`: the trained head and a dict of what happened (also written to `train_summary.json`).
    """
    from ..configuration_peagle import PEagleConfig
    from ..modeling_peagle import PEagleDrafter
    from .data import (
        FeatureCache,
        save_examples,
        select_draft_vocab,
        self_distill,
        stdlib_code_prompts,
        synthesize_prompts,
    )
    from .trainer import PEagleTrainer, PEagleTrainingArguments

    start = time.time()
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    targs = dict(training_args or {})
    seed = int(targs.get("seed", 42))
    if examples is None:
        prompts = list(prompts)
        if num_magpie_prompts:
            prompts += synthesize_prompts(
                target, num_magpie_prompts, tokenizer=tokenizer, seed=seed, progress=progress
            )
        if num_code_prompts:
            prompts += stdlib_code_prompts(num_code_prompts, seed=seed)
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
            seed=seed,
            progress=progress,
        )
        save_examples(examples, os.path.join(output_dir, "examples.jsonl"))
    examples = list(examples)
    if not examples:
        raise ValueError("no training examples (every response was empty).")

    if head is None:
        overrides: dict[str, Any] = {
            "num_hidden_layers": num_hidden_layers,
            "drafting_mode": drafting_mode,
            "embed_from_target": embed_from_target,
        }
        if mask_token_id is not None:
            overrides["mask_token_id"] = mask_token_id
        if draft_vocab_size is not None:
            overrides["draft_vocab_size"] = draft_vocab_size
        if "num_parallel_positions" in targs and targs["num_parallel_positions"]:
            overrides["num_parallel_positions"] = int(targs["num_parallel_positions"])
        if tokenizer is not None and getattr(tokenizer, "name_or_path", None):
            overrides["target_model_name"] = tokenizer.name_or_path
        head = PEagleDrafter(PEagleConfig.for_target(target.config, **overrides)).float()
        if draft_vocab_size is not None and draft_vocab_size < head.config.vocab_size:
            eos = target.config.eos_token_id
            extra = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
            head.set_draft_vocab(
                select_draft_vocab(examples, draft_vocab_size, head.config.vocab_size, extra)
            )

    dataset: Any = examples
    cache_info = None
    if feature_cache is not None:
        dataset = FeatureCache.build(
            target, examples, feature_cache, head.config.eagle_aux_hidden_state_layer_ids, progress=progress
        )
        cache_info = {"path": os.fspath(feature_cache), "bytes": dataset.size_bytes}

    targs.setdefault("output_dir", os.path.join(output_dir, "checkpoints"))
    targs.setdefault("report_to", "none")
    targs.setdefault("disable_tqdm", not progress)
    args = PEagleTrainingArguments(**targs)
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
    """A small human-readable table of a `train_head` summary."""
    rows = [
        ("head", summary["output_dir"]),
        (
            "mode / layers / K",
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
        rows.append(
            (
                "feature cache",
                f"{summary['feature_cache']['path']} ({summary['feature_cache']['bytes'] / 2**20:.1f} MiB)",
            )
        )
    rows.append(("time", f"{summary['seconds']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


# ------------------------------------------------------------------------------------------------ command line
def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `peagle train` / `scripts/train_head.py`."""
    src = parser.add_argument_group("target and data")
    src.add_argument(
        "--target", default=None, help="target model folder or name (default: the embedded SmolLM2)"
    )
    src.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype"
    )
    src.add_argument(
        "--prompts", action="append", default=[], help=".txt/.json/.jsonl prompt file (repeatable)"
    )
    src.add_argument("--limit", type=int, default=None, help="read at most this many prompts per file")
    src.add_argument(
        "--magpie", type=int, default=0, help="number of Magpie prompts the target writes itself"
    )
    src.add_argument("--code-prompts", type=int, default=0, help="number of coding prompts from the stdlib")
    src.add_argument("--examples", default=None, help="ready examples (.jsonl with input_ids, loss_mask)")
    src.add_argument(
        "--max-new-tokens", type=int, default=256, help="response length cap for self-distillation"
    )
    src.add_argument("--gen-batch-size", type=int, default=8)
    src.add_argument("--sample", action="store_true", help="sample responses instead of greedy decoding")
    src.add_argument("--temperature", type=float, default=1.0)
    src.add_argument("--feature-cache", default=None, help="cache target features in this folder")
    head = parser.add_argument_group("head")
    head.add_argument("--output", "-o", required=True, help="folder for the trained head")
    head.add_argument("--mode", default="parallel", choices=["parallel", "autoregressive"])
    head.add_argument("--num-layers", type=int, default=2)
    head.add_argument("--draft-vocab-size", type=int, default=None)
    head.add_argument("--embed-from-target", action="store_true", help="freeze the target's embeddings")
    head.add_argument("--mask-token-id", type=int, default=None)
    tr = parser.add_argument_group("training")
    tr.add_argument("--k", type=int, default=8, help="K_train, parallel positions")
    tr.add_argument("--cod-ratio", type=float, default=0.7)
    tr.add_argument("--cod-min-ratio", type=float, default=0.2)
    tr.add_argument("--partitions", type=int, default=1, help="sequence partitions per example")
    tr.add_argument("--max-length", type=int, default=2048)
    tr.add_argument("--loss", default="kl", choices=["kl", "ce"])
    tr.add_argument("--epochs", type=float, default=1.0)
    tr.add_argument("--max-steps", type=int, default=-1)
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--warmup-ratio", type=float, default=0.01, help="warmup as a fraction of the steps")
    tr.add_argument("--batch-size", type=int, default=1)
    tr.add_argument("--grad-accum", type=int, default=8)
    tr.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision")
    tr.add_argument("--save-steps", type=int, default=500)
    tr.add_argument("--logging-steps", type=int, default=10)
    tr.add_argument("--seed", type=int, default=42)
    tr.add_argument("--resume", default=None, help="checkpoint folder, or 'last'")
    tr.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    lora = parser.add_argument_group("adapting an existing head (LoRA through peft, peagle.adapters)")
    lora.add_argument(
        "--base-head",
        default=None,
        help="start from this head (with --lora, default: the shipped head of the default target)",
    )
    lora.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter on the base head; the head stays frozen"
    )
    lora.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    lora.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    lora.add_argument("--lora-dropout", type=float, default=0.0)
    lora.add_argument(
        "--lora-target-modules",
        default=None,
        help="comma-separated module-name suffixes (default q/k/v/o_proj, gate/up/down_proj, fc)",
    )
    return parser


def run_train(args: argparse.Namespace) -> int:
    """`peagle train`: load the target, build examples, train, save, print a summary."""
    import torch

    from .data import load_examples, load_prompts

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if args.target is None:
        from ..targets import load_default_target

        target, tokenizer = load_default_target(dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts: list[Any] = []
    for path in args.prompts:
        prompts += load_prompts(path, limit=args.limit)
    examples = load_examples(args.examples) if args.examples else None
    training_args = {
        "num_parallel_positions": args.k,
        "cod_ratio": args.cod_ratio,
        "cod_min_ratio": args.cod_min_ratio,
        "sequence_partitions": args.partitions,
        "max_length": args.max_length,
        "loss_type": args.loss,
        "num_train_epochs": args.epochs,
        "max_steps": args.max_steps,
        "learning_rate": args.lr,
        "warmup_steps": args.warmup_ratio,
        "lr_scheduler_type": "linear",
        "per_device_train_batch_size": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": args.bf16,
        "save_steps": args.save_steps,
        "logging_steps": args.logging_steps,
        "seed": args.seed,
        "use_cpu": device == "cpu",
    }
    resume: str | bool | None = args.resume
    if resume == "last":
        resume = True
    head = None
    if args.lora or args.base_head:
        head = _base_head_for_training(args, target)
    head, summary = train_head(
        target,
        tokenizer,
        output_dir=args.output,
        prompts=prompts,
        examples=examples,
        num_magpie_prompts=args.magpie,
        num_code_prompts=args.code_prompts,
        max_new_tokens=args.max_new_tokens,
        generation_batch_size=args.gen_batch_size,
        do_sample=args.sample,
        temperature=args.temperature,
        num_hidden_layers=args.num_layers,
        draft_vocab_size=args.draft_vocab_size,
        drafting_mode=args.mode,
        embed_from_target=args.embed_from_target,
        mask_token_id=args.mask_token_id,
        feature_cache=args.feature_cache,
        training_args=training_args,
        resume_from_checkpoint=resume,
        head=head,
    )
    print(format_summary(summary))
    if args.lora:
        from ..adapters import merge_lora

        merged_dir = os.path.join(args.output, "merged")
        merge_lora(head).save_pretrained(merged_dir)
        print(f"LoRA adapter: {args.output}\nmerged head:  {merged_dir}")
    return 0


def _base_head_for_training(args: argparse.Namespace, target):
    """`--base-head` loaded for training (float32), wrapped with LoRA when `--lora`."""
    import torch

    from ..modeling_peagle import PEagleDrafter

    path = args.base_head
    if path is None:
        if args.target is not None:
            raise ValueError("--lora with --target needs --base-head (the head to adapt).")
        from ..targets import default_drafter_path

        path = default_drafter_path("peagle")
    head = PEagleDrafter.from_pretrained(path, dtype=torch.float32, target_model=target)
    if not args.lora:
        return head
    from ..adapters import lora_config, lora_for_training

    modules = args.lora_target_modules.split(",") if args.lora_target_modules else None
    config = lora_config(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=modules
    )
    return lora_for_training(head, target, config)


def main(argv: list[str] | None = None) -> int:
    parser = add_train_arguments(
        argparse.ArgumentParser(
            prog="train_head", description="Train a P-EAGLE (or EAGLE-3) head for a target."
        )
    )
    return run_train(parser.parse_args(argv))


__all__ = ["train_head", "format_summary", "add_train_arguments", "run_train", "main"]
