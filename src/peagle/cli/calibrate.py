"""`peagle calibrate`: fit a head's per-depth draft-probability calibration on held-out self-distilled text, or
(`--costs`) time this machine's verify-cost curves anew."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from ._common import (
    DTYPES,
    dataclass_parent,
    head_dtype_field,
    non_negative_int,
    num_speculative_tokens_field,
    positional,
    positive_int,
    target_field,
)


@dataclass
class CalibrateArguments:
    """The settings of `peagle calibrate` (`head` is positional; each other field is a flag of the same name)."""

    head: str = positional(
        "head folder in peagle's layout (its config.json is updated in place); with --costs also 'default' "
        "(the shipped head)"
    )
    examples: str | None = field(
        default=None,
        metadata={
            "help": "held-out self-distilled examples (a shard folder, or JSONL rows with input_ids/loss_mask): "
            "the prompt part of each is generated from; never an evaluation set (required unless --costs)"
        },
    )
    costs: bool = field(
        default=False,
        metadata={
            "switch": True,
            "help": "instead: time the cost rule's full verify-cost curves of this target, head, dtype and thread "
            "count anew (the reference curve and --contexts, at each of --batch_sizes) and replace the cached ones "
            "with their online corrections (without it, a generate() call times a quick curve of a few passes at "
            "each new batch size, within about half a second); run it on an otherwise idle machine",
        },
    )
    batch_sizes: str = field(
        default="1", metadata={"help": "with --costs: comma-separated batch sizes to time (default 1)"}
    )
    contexts: str = field(
        default="1024,2048,4096,8192",
        metadata={
            "help": "with --costs: longer contexts to time (those beyond the target's range are skipped; others "
            "are timed lazily when a call reaches them)"
        },
    )
    target: str | None = target_field()
    limit: int = field(default=32, metadata={"parse": positive_int, "help": "examples to use (default 32)"})
    skip: int = field(
        default=0,
        metadata={"parse": non_negative_int, "help": "skip the first N examples (e.g. those trained on)"},
    )
    max_new_tokens: int = field(default=128, metadata={"parse": positive_int})
    num_speculative_tokens: int | None = num_speculative_tokens_field(
        "drafts per round (default: the head's K)"
    )
    dtype: str = field(default="float32", metadata={"choices": DTYPES, "help": "target dtype"})
    head_dtype: str = head_dtype_field()
    report: str | None = field(default=None, metadata={"help": "also write the ECE report to this JSON file"})


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "calibrate",
        help="fit the head's draft-probability calibration (used by cost-aware drafting) on held-out prompts",
        parents=[dataclass_parent(CalibrateArguments)],
    )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"peagle calibrate: {flag} must be comma-separated integers >= 1, got {text!r}.")
    return values


def run_costs(args: argparse.Namespace) -> int:
    import torch

    from ..generation.cost import cost_cache_path, recalibrate
    from ..modeling_peagle import PEagleDrafter
    from ..runtime import resolve_dtype
    from ..targets import load_default_drafter, load_target

    sizes = _int_list(args.batch_sizes, "--batch_sizes")
    contexts = _int_list(args.contexts, "--contexts")
    dtype = getattr(torch, args.dtype)
    target, _ = load_target(args.target or "default", dtype=dtype)
    head_dtype = resolve_dtype(args.head_dtype) or dtype
    if args.head == "default":
        head = load_default_drafter(target, dtype=head_dtype)
    else:
        head = PEagleDrafter.from_pretrained(args.head, dtype=head_dtype).attach_target(target)
    head.eval()
    k = args.num_speculative_tokens or head.config.num_speculative_tokens
    from ..generation.settings import AUTO_TREE_NODES

    models = recalibrate(target, head, max(k, AUTO_TREE_NODES) + 1, sizes, contexts)
    print(f"threads {torch.get_num_threads()}; seconds to verify n tokens per row after L tokens of context")
    for rows, model in zip(sizes, models):
        timed = [model.context] + [p["context"] for p in model.context_points]
        for context in timed:
            ns = [1, 2, k + 1, len(model.verify_seconds)]
            cells = ", ".join(f"n={n}: {model.cost(n, context) * 1e3:.1f} ms" for n in ns)
            print(f"B={rows} L={context}: {cells}; drafter round {model.drafter_cost(context) * 1e3:.1f} ms")
        print(f"  written to {cost_cache_path(model.key)}")
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from ..generation.calibration import calibrate_head_folder
    from ..runtime import resolve_dtype

    if args.costs:
        return run_costs(args)
    if not args.examples:
        raise SystemExit("peagle calibrate: --examples is required (or --costs to time the cost curves).")

    result = calibrate_head_folder(
        args.head,
        examples=args.examples,
        target=args.target or "default",
        limit=args.limit,
        skip=args.skip,
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        dtype=getattr(torch, args.dtype),
        head_dtype=resolve_dtype(args.head_dtype),
    )
    report = result["report"]
    print("depth | samples | ECE before | ECE after")
    for d, (n, b, a) in enumerate(zip(report["samples"], report["ece_before"], report["ece_after"])):
        print(f"{d:5d} | {n:7d} | {b:10.3f} | {a:9.3f}")
    print(f"calibration written to {Path(args.head) / 'config.json'}")
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=2))
    return 0
