"""The settings fields shared by several sub-commands, and the bridge from settings dataclasses to flags: every
sub-command's flags are the fields of its settings dataclasses, each spelled as its field (`--max_new_tokens`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
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
    """argparse type of a K (`--num_speculative_tokens`): an integer in [1, MAX_SPECULATIVE_TOKENS]."""
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


def num_speculative_tokens_field(help: str) -> Any:
    """The settings field `num_speculative_tokens` (`--num_speculative_tokens`, formerly `-k` and
    `--num-speculative-tokens`): inference K (K_train is `--num_parallel_positions`)."""
    return dataclasses.field(
        default=None, metadata={"help": help, "parse": speculative_tokens, "old_flags": ["-k"]}
    )


def confidence_field() -> Any:
    """The settings field `confidence_threshold` of generation (None: the head's own setting)."""
    return dataclasses.field(
        default=None,
        metadata={
            "help": "assistant_confidence_threshold: end a round after its first draft the head gives a lower "
            "probability; 0 drafts K tokens every round (default: the head's own setting, cost-aware drafting "
            "for the shipped heads)"
        },
    )


def head_dtype_field() -> Any:
    """The settings field `head_dtype`: the drafter's dtype, `auto` by default."""
    return dataclasses.field(
        default="auto",
        metadata={
            "choices": DTYPE_CHOICES,
            "help": "drafter dtype (default auto: bfloat16 where this machine computes it natively, e.g. AVX-512 "
            "BF16/AMX CPUs and recent GPUs, else float32: an AVX2-only CPU runs large bf16 matmuls through slow "
            "fallback kernels); drafts only propose, so the output is still the target's own",
        },
    )


def target_field(help: str | None = None, default: str | None = None) -> Any:
    """The settings field `target`: a local folder, a Hub id or 'default'."""
    return dataclasses.field(
        default=default,
        metadata={
            "help": help
            or "target model: a local folder, a Hub id, or 'default' (the embedded SmolLM2-135M-Instruct)"
        },
    )


def positional(help: str, parse: Any = None) -> Any:
    """A required positional argument of a settings dataclass (`peagle export HEAD ...`); `parse` is an argparse type
    function that checks it (a bad value is a usage error)."""
    metadata = {"help": help, "positional": True}
    if parse is not None:
        metadata["parse"] = parse
    return dataclasses.field(metadata=metadata)


def hub_repo_id(value: str) -> str:
    """argparse type of a destination Hub repo id: one the Hub accepts (`peagle.integrations.hub.check_repo_id`)."""
    from ..integrations.hub import check_repo_id

    try:
        return check_repo_id(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def upload_folder(value: str) -> str:
    """argparse type of `--prepare_only DIR`: not empty, and neither it nor a folder above it a file
    (`peagle.integrations.hub.check_upload_folder`)."""
    from ..integrations.hub import check_upload_folder

    try:
        check_upload_folder(value)
    except (ValueError, OSError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag, hidden from `--help`: it says which flag replaces it (on stderr), then does what
    that flag does."""

    def __init__(self, option_strings: list[str], dest: str, replacement: argparse.Action, **kwargs: Any):
        super().__init__(
            option_strings,
            dest,
            nargs=replacement.nargs,
            const=replacement.const,
            type=replacement.type,
            choices=replacement.choices,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            metavar=replacement.metavar,
        )
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.replacement.option_strings[0]
        print(
            f"{parser.prog}: {option_string} is deprecated and will be removed in the next release; use {new}",
            file=sys.stderr,
        )
        self.replacement(parser, namespace, values, new)


@functools.cache
def _settings_parser_type() -> type:
    """`HfArgumentParser` with one spelling per flag: the field's name (`--max_new_tokens`); every other spelling it
    would add (`--max-new-tokens`, `--no-speed`) and each field's `old_flags` become hidden [`DeprecatedFlag`]s.

    It reads four field metadata keys beside `HfArgumentParser`'s own (`help`, `choices`, `metavar`):
    `positional` (the field is a positional argument, not a flag), `switch` (a boolean flag that takes no value, as
    argparse's `store_true`: `--private HEAD` is not read as `--private=HEAD`), `parse` (an argparse type function
    that parses and checks the value, e.g. [`positive_int`], so a bad value is a usage error) and `old_flags`
    (former spellings, kept as hidden deprecated aliases)."""
    from transformers import HfArgumentParser

    class SettingsParser(HfArgumentParser):
        def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
            positional = kwargs.pop("positional", False)
            if kwargs.pop("switch", False):
                for key in ("type", "nargs", "const"):
                    kwargs.pop(key, None)
                kwargs["action"] = "store_true"
            old_flags = kwargs.pop("old_flags", ())
            parse = kwargs.pop("parse", None)
            if parse is not None:
                kwargs["type"] = parse
            if positional:
                kwargs.pop("required", None)
                return super().add_argument(names[0].removeprefix("--"), **kwargs)
            if (
                "dest" in kwargs
            ):  # the `--no_<field>` complement of a boolean field: the old flags are the field's
                old_flags = ()
            action = super().add_argument(names[0], **kwargs)
            for name in (*names[1:], *old_flags):
                super().add_argument(name, action=DeprecatedFlag, dest=action.dest, replacement=action)
            return action

    return SettingsParser


def dataclass_parent(*types: type) -> argparse.ArgumentParser:
    """A parent parser (`sub.add_parser(..., parents=[...])`) with one flag per field of each settings dataclass,
    spelled as the field (`--cod_ratio`), its default and help taken from the field: transformers'
    `HfArgumentParser`, the pattern of transformers' own examples, so each default exists once.  Other spellings
    (`--cod-ratio`, a field's `old_flags`) still work, hidden from `--help`, with a deprecation message."""
    return _settings_parser_type()(types, add_help=False)


def dataclass_from_args(kind: type, args: argparse.Namespace, **overrides: Any):
    """An instance of the settings dataclass `kind` from the parsed flags its fields became (`--debug` is peagle's
    own flag, not `TrainingArguments.debug`)."""
    fields = [f.name for f in dataclasses.fields(kind) if f.init and f.name != "debug"]
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    return kind(**{**values, **overrides})
