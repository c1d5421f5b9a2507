"""Arguments shared by several sub-commands (argparse only), and the bridge from settings dataclasses to flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..runtime import DTYPE_CHOICES

DTYPES = ["float32", "bfloat16"]
"""The dtypes the demo and the benchmark run the target and the heads in."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, unless its help already says it or there is none (None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or not show_default(action):
            return text
        return super()._get_help_string(action)


def show_default(action: argparse.Action) -> bool:
    """Whether `--help` states `action`'s default (not for None, False, [] or a suppressed one)."""
    default = action.default
    return default is not argparse.SUPPRESS and default is not None and default is not False and default != []


def describe_defaults(parser: argparse.ArgumentParser) -> None:
    """Give options that have no help text one that states their default (argparse shows no line otherwise)."""
    for action in parser._actions:
        if action.help is None and action.option_strings and show_default(action):
            action.help = "(default: %(default)s)"


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1 (argparse's error names the option)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return number


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


def dataclass_parent(*types: type) -> argparse.ArgumentParser:
    """A parent parser (`sub.add_parser(..., parents=[...])`) with one flag per field of each settings dataclass,
    named after the field (`--cod_ratio`, also spelled `--cod-ratio`), its default and help taken from the field:
    transformers' `HfArgumentParser`, the pattern of transformers' own examples, so each default exists once."""
    from transformers import HfArgumentParser

    return HfArgumentParser(types, add_help=False)


def dataclass_from_args(kind: type, args: argparse.Namespace, **overrides: Any):
    """An instance of the settings dataclass `kind` from the parsed flags its fields became (`--debug` is peagle's
    own flag, not `TrainingArguments.debug`)."""
    fields = [f.name for f in dataclasses.fields(kind) if f.init and f.name != "debug"]
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    return kind(**{**values, **overrides})
