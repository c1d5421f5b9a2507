"""`peagle train`: target + prompts -> self-distilled data -> trained head (`peagle.training.recipe.train_head`)."""

from __future__ import annotations

import argparse
import os

from ._common import add_target_argument, positive_int, speculative_tokens


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a P-EAGLE (or EAGLE-3) head for a target on self-distilled data")
    src = p.add_argument_group("target and data")
    add_target_argument(src)
    src.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype"
    )
    src.add_argument(
        "--prompts", action="append", default=[], help=".txt/.json/.jsonl prompt file (repeatable)"
    )
    src.add_argument(
        "--limit", type=positive_int, default=None, help="read at most this many prompts per file"
    )
    src.add_argument(
        "--magpie", type=int, default=0, help="number of Magpie prompts the target writes itself"
    )
    src.add_argument("--code-prompts", type=int, default=0, help="number of coding prompts from the stdlib")
    src.add_argument(
        "--examples",
        default=None,
        help="ready examples: a .jsonl with input_ids, loss_mask, or a shard folder",
    )
    src.add_argument(
        "--max-new-tokens", type=positive_int, default=256, help="response length cap for self-distillation"
    )
    src.add_argument(
        "--gen-batch-size",
        type=positive_int,
        default=8,
        help="prompts per generate() call for self-distillation",
    )
    src.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file for a target whose tokenizer has none (docs/training.md)",
    )
    src.add_argument(
        "--plain-prompts",
        action="store_true",
        help="no chat template: each prompt is encoded as plain text and the target continues it (for a base "
        "model without a template; not with --magpie)",
    )
    src.add_argument("--sample", action="store_true", help="sample responses instead of greedy decoding")
    src.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample)")
    src.add_argument("--feature-cache", default=None, help="cache target features in this folder")
    head = p.add_argument_group("head")
    head.add_argument("--output", "-o", required=True, help="folder for the trained head")
    head.add_argument("--mode", default="parallel", choices=["parallel", "autoregressive"])
    head.add_argument(
        "--num-layers",
        type=positive_int,
        default=None,
        help="drafter layers (default: 2, or 1 when the size rule's budgets leave 2 too small a draft vocabulary); "
        "with --base-head, grow the base head to this many first (the new layers start adding nothing)",
    )
    head.add_argument(
        "--draft-vocab-size",
        type=positive_int,
        default=None,
        help="LM-head rows (default: the smallest covering 99.5%% of the data's response tokens, within the size "
        "rule); with --base-head, resize the base head's vocabulary first (a larger one keeps its ids and rows)",
    )
    head.add_argument(
        "--embed-from-target",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the target's frozen embeddings (default); --no-embed-from-target trains the head's own table",
    )
    head.add_argument("--mask-token-id", type=int, default=None)
    head.add_argument(
        "--lm-head-init",
        default="target",
        choices=["target", "random"],
        help="LM head from the target's rows of the draft vocabulary (default) or random",
    )
    head.add_argument(
        "--layers-init",
        default="random",
        choices=["random", "target"],
        help="decoder layers random (default) or copied from the target's last layers",
    )
    tr = p.add_argument_group("training")
    tr.add_argument(
        "--num-parallel-positions",
        type=speculative_tokens,
        default=8,
        help="K_train: parallel positions (depths) per anchor",
    )
    tr.add_argument("--cod-ratio", type=float, default=0.7)
    tr.add_argument(
        "--calibration-examples",
        default="auto",
        type=_calibration_count,
        help="hold out the last N examples and fit the head's draft calibration (cost-aware drafting) on them "
        "after training; 'auto' (default): min(32, 10%% of the examples), none below 40; 0: none",
    )
    tr.add_argument("--cod-min-ratio", type=float, default=0.2)
    tr.add_argument(
        "--trainable-parameters",
        default=None,
        metavar="REGEX",
        help="train only the head parameters whose names match (e.g. lm_head, after --draft-vocab-size grows a "
        "head's vocabulary); the rest stay frozen",
    )
    tr.add_argument(
        "--lr-scale",
        action="append",
        default=[],
        dest="lr_scales",
        metavar="REGEX=SCALE",
        help="train the head parameters whose names match at SCALE times --lr (repeatable; the first match "
        "wins), e.g. lm_head=0.1",
    )
    tr.add_argument("--partitions", type=positive_int, default=1, help="sequence partitions per example")
    tr.add_argument("--max-length", type=positive_int, default=2048)
    tr.add_argument("--loss", default="kl", choices=["kl", "ce"])
    tr.add_argument("--epochs", type=float, default=1.0)
    tr.add_argument("--max-steps", type=int, default=-1)
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--warmup-ratio", type=float, default=0.01, help="warmup as a fraction of the steps")
    tr.add_argument("--batch-size", type=positive_int, default=1)
    tr.add_argument("--grad-accum", type=positive_int, default=8)
    tr.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision")
    tr.add_argument("--save-steps", type=positive_int, default=500)
    tr.add_argument("--logging-steps", type=positive_int, default=10)
    tr.add_argument("--seed", type=int, default=42)
    tr.add_argument("--resume", default=None, help="checkpoint folder, or 'last'")
    tr.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    lora = p.add_argument_group("adapting an existing head (LoRA through peft, peagle.adapters)")
    lora.add_argument(
        "--base-head",
        default=None,
        help="start from this head (with --lora, default: the shipped head of the default target)",
    )
    lora.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter on the base head; the head stays frozen"
    )
    lora.add_argument("--lora-r", type=positive_int, default=16, help="LoRA rank")
    lora.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    lora.add_argument("--lora-dropout", type=float, default=0.0)
    lora.add_argument(
        "--lora-target-modules",
        default=None,
        help="comma-separated module-name suffixes (default q/k/v/o_proj, gate/up/down_proj, fc)",
    )
    return p


def _is_default(spec: str | None) -> bool:
    return spec is None or spec == "default"


def _calibration_count(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a count >= 0, got {value!r}")
    return count


def _read_chat_template(path: str) -> str:
    """The text of a `--chat-template` file (a Jinja template, as `tokenizer.chat_template` holds)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"--chat-template file {path!r} does not exist.") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--chat-template file {path!r} is not UTF-8 text (byte {err.start}).") from err
    if not text.strip():
        raise ValueError(f"--chat-template file {path!r} is empty; expected a Jinja chat template.")
    return text


def run(args: argparse.Namespace) -> int:
    if args.plain_prompts and args.chat_template:
        raise ValueError(
            "--plain-prompts encodes prompts without a template; --chat-template gives one: pass one."
        )
    if args.lora and args.base_head is None and not _is_default(args.target):
        raise ValueError("--lora with --target needs --base-head (the head to adapt).")
    if args.lora and args.draft_vocab_size is not None:
        raise ValueError("--lora adapts the base head's own draft vocabulary; --draft-vocab-size resizes it.")
    if args.lora and args.num_layers is not None:
        raise ValueError("--lora adapts the base head's own layers; --num-layers grows it.")
    if args.lora and args.trainable_parameters is not None:
        raise ValueError(
            "--lora trains only its adapters; --trainable-parameters chooses among the head's own weights."
        )
    import logging

    import torch

    # the head-size decisions (peagle.families) and the draft-vocabulary choice are logged at INFO: show them
    log = logging.getLogger("peagle")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

    from ..runtime import native_bf16
    from ..training.prompts import load_prompts
    from ..training.recipe import (
        end_distributed,
        format_summary,
        load_head_for_training,
        train_head,
        training_arguments,
    )
    from ..training.shards import load_examples

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if (args.bf16 or args.dtype == "bfloat16") and not native_bf16(device):
        log.warning(
            f"warning: this {device} has no native bfloat16 (e.g. an AVX2-only CPU); bf16 runs through slow "
            "fallback kernels here, often many times slower than float32: drop --bf16 / --dtype bfloat16."
        )
    from ..targets import load_target, load_target_tokenizer
    from ..training.prompts import check_chat_template

    spec = "default" if _is_default(args.target) else args.target
    # everything that can be checked without the target model is checked first: the data files, the template
    prompts = [p for path in args.prompts for p in load_prompts(path, limit=args.limit)]
    examples = load_examples(args.examples) if args.examples else None
    template = _read_chat_template(args.chat_template) if args.chat_template else None
    if examples is None and (prompts or args.magpie or args.code_prompts):
        tokenizer = load_target_tokenizer(spec)
        if tokenizer is not None and template is not None:
            tokenizer.chat_template = template
        check_chat_template(
            tokenizer, plain_prompts=args.plain_prompts, magpie=bool(args.magpie), what=f"target {spec}"
        )
    target, tokenizer = load_target(spec, dtype=getattr(torch, args.dtype), device=device)
    if tokenizer is not None and template is not None:
        tokenizer.chat_template = template
    training_args = training_arguments(
        os.path.join(args.output, "checkpoints"),
        num_parallel_positions=args.num_parallel_positions,
        cod_ratio=args.cod_ratio,
        cod_min_ratio=args.cod_min_ratio,
        sequence_partitions=args.partitions,
        max_length=args.max_length,
        loss_type=args.loss,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        warmup_steps=args.warmup_ratio,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        bf16=args.bf16,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        seed=args.seed,
        use_cpu=device == "cpu",
        trainable_parameters=args.trainable_parameters,
        lr_scales=args.lr_scales,
    )
    head = None
    if args.lora or args.base_head:
        lora = None
        if args.lora:
            from ..adapters import lora_config

            modules = args.lora_target_modules.split(",") if args.lora_target_modules else None
            lora = lora_config(
                r=args.lora_r,
                lora_alpha=args.lora_alpha,
                lora_dropout=args.lora_dropout,
                target_modules=modules,
            )
        if args.base_head is None:
            from ..targets import default_drafter_path

            args.base_head = default_drafter_path("peagle")
        head = load_head_for_training(args.base_head, target, lora=lora)
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
        plain_prompts=args.plain_prompts,
        num_hidden_layers=args.num_layers,
        draft_vocab_size=args.draft_vocab_size,
        drafting_mode=args.mode,
        embed_from_target=args.embed_from_target,
        mask_token_id=args.mask_token_id,
        lm_head_init=args.lm_head_init,
        layers_init=args.layers_init,
        feature_cache=args.feature_cache,
        calibration_examples=args.calibration_examples,
        training_args=training_args,
        resume_from_checkpoint=True if args.resume == "last" else args.resume,
        head=head,
    )
    print(format_summary(summary))
    if args.lora and training_args.should_save:
        from ..adapters import merge_lora

        merged_dir = os.path.join(args.output, "merged")
        merge_lora(head).save_pretrained(merged_dir)
        print(f"LoRA adapter: {args.output}\nmerged head:  {merged_dir}")
    end_distributed()
    return 0
