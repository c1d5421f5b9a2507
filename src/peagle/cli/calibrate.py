"""`peagle calibrate`: fit a head's per-depth draft-probability calibration on held-out self-distilled text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._common import (
    DTYPES,
    add_head_dtype_argument,
    add_num_speculative_tokens_argument,
    add_target_argument,
    non_negative_int,
    positive_int,
)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate",
        help="fit the head's draft-probability calibration (used by cost-aware drafting) on held-out prompts",
    )
    p.add_argument("head", help="head folder in peagle's layout (its config.json is updated in place)")
    p.add_argument(
        "--examples",
        required=True,
        help="held-out self-distilled examples (a shard folder, or JSONL rows with input_ids/loss_mask): the "
        "prompt part of each is generated from; never an evaluation set",
    )
    add_target_argument(p)
    p.add_argument("--limit", type=positive_int, default=32, help="examples to use (default 32)")
    p.add_argument(
        "--skip", type=non_negative_int, default=0, help="skip the first N examples (e.g. those trained on)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    add_num_speculative_tokens_argument(p, "drafts per round (default: the head's K)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="target dtype")
    add_head_dtype_argument(p)
    p.add_argument("--report", default=None, help="also write the ECE report to this JSON file")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from ..generation.calibration import calibrate_head_folder
    from ..runtime import resolve_dtype

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
