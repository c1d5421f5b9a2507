"""Arguments shared by several sub-commands (argparse only)."""

from __future__ import annotations

import argparse

from ..runtime import DTYPE_CHOICES

DTYPES = ["float32", "bfloat16"]
"""The dtypes the demo and the benchmark run the target and the heads in."""


def speculative_tokens(value: str) -> int:
    """argparse type of a K (`-k`, `--num-parallel-positions`): an integer in [1, MAX_SPECULATIVE_TOKENS]."""
    from ..configuration_peagle import MAX_SPECULATIVE_TOKENS

    try:
        k = int(value)
    except ValueError:
        k = None
    if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(
            f"expected an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}"
        )
    return k


def positive_int(value: str) -> int:
    """argparse type of a count that must be at least 1 (layers, vocabulary rows)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


def non_negative_int(value: str) -> int:
    """argparse type of a count that may be 0 (examples to skip)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def add_num_speculative_tokens_argument(p: argparse.ArgumentParser, help: str) -> None:
    """`-k/--num-speculative-tokens`: inference K (K_train is `--num-parallel-positions`)."""
    p.add_argument("-k", "--num-speculative-tokens", type=speculative_tokens, default=None, help=help)


def add_confidence_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        help="assistant_confidence_threshold: end a round after its first draft the head gives a lower "
        "probability; 0 drafts K tokens every round (default: the head's own setting, cost-aware drafting "
        "for the shipped heads)",
    )


def add_head_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head-dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="drafter dtype (default auto: bfloat16 where this machine computes it natively, e.g. AVX-512 BF16/AMX "
        "CPUs and recent GPUs, else float32: an AVX2-only CPU runs large bf16 matmuls through slow fallback "
        "kernels); drafts only propose, so the output is still the target's own",
    )


def add_target_argument(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument(
        "--target",
        default=None,
        help=help
        or "target model: a local folder, a Hub id, or 'default' (the embedded SmolLM2-135M-Instruct)",
    )
