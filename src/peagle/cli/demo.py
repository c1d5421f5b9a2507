"""`peagle demo`: generate with and without a head: the shipped one on the embedded SmolLM2 target, or any
`--head` for its `--target`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ._common import (
    DTYPES,
    confidence_field,
    dataclass_parent,
    head_dtype_field,
    num_speculative_tokens_field,
    positive_int,
    target_field,
)


@dataclass
class DemoArguments:
    """The settings of `peagle demo` (each field is a flag of the same name)."""

    max_new_tokens: int = field(default=128, metadata={"parse": positive_int})
    num_speculative_tokens: int | None = num_speculative_tokens_field(
        "K, draft tokens per round (default: the head's)"
    )
    confidence_threshold: float | None = confidence_field()
    dtype: str = field(
        default="float32",
        metadata={"choices": DTYPES, "help": "target dtype (bfloat16: faster here, not bit-identical)"},
    )
    head_dtype: str = head_dtype_field()
    target: str | None = target_field()
    head: str | None = field(
        default=None,
        metadata={
            "help": "head folder or Hub id, any layout (default: the shipped head; needed with --target)"
        },
    )


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "demo",
        help="generate with and without a head (default: the shipped head on the embedded SmolLM2 target)",
        parents=[dataclass_parent(DemoArguments)],
    )


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
