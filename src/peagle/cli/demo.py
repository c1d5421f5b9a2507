"""`peagle demo`: generate with and without a head: the shipped one on the embedded SmolLM2 target, or any
`--head` for its `--target`."""

from __future__ import annotations

import argparse

from ._common import (
    DTYPES,
    add_confidence_argument,
    add_head_dtype_argument,
    add_num_speculative_tokens_argument,
    add_target_argument,
    positive_int,
)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="generate with and without a head (default: the shipped head on the embedded SmolLM2 target)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    add_num_speculative_tokens_argument(p, "K, draft tokens per round (default: the head's)")
    add_confidence_argument(p)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="target dtype (bfloat16: faster here, not bit-identical)",
    )
    add_head_dtype_argument(p)
    add_target_argument(p)
    p.add_argument(
        "--head",
        default=None,
        help="head folder or Hub id, any layout (default: the shipped head; needed with --target)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    ok = run_demo(
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        confidence_threshold=args.confidence_threshold,
        dtype=args.dtype,
        head_dtype=args.head_dtype,
        target=args.target,
        head=args.head,
    )
    return 0 if ok else 1
