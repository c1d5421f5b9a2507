"""The `peagle` command: `peagle {demo,bench,train,calibrate,evaluate,export,push,pack,grow-data} ...`.

One module per sub-command (`grow-data` lives in `grow_data.py`); each defines `add_parser(subparsers)` (argparse only, cheap to import) and
`run(args) -> int`, which calls typed library functions.  Library modules never parse arguments or raise
`SystemExit`; nothing in the library imports this package.

An error ends the command with one line on stderr (`peagle <command>: error: <message>`) and exit status 1
(`main` raises `SystemExit` with that line); `--debug` or `PEAGLE_DEBUG=1` lets the exception through with its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ._common import DefaultsHelpFormatter, describe_defaults

COMMANDS = ("demo", "bench", "train", "calibrate", "evaluate", "export", "push", "pack", "grow-data")
"""Sub-commands, each the module `peagle.cli.<name>` (dashes as underscores)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle", description="P-EAGLE parallel speculative decoding.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
        p = module.add_parser(sub)
        p.allow_abbrev = (
            False  # `--num_parallel 2` is not `--num_parallel_positions 2`: flags are spelled out
        )
        p.add_argument(
            "--debug",
            action="store_true",
            help="on an error, show the full traceback instead of one line (also: PEAGLE_DEBUG=1)",
        )
        p.formatter_class = DefaultsHelpFormatter
        describe_defaults(p)
        p.set_defaults(func=module.run)
    return parser


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    """`--debug` was given or `PEAGLE_DEBUG` is set to something other than '', '0', 'false' or 'no'."""
    env = os.environ.get("PEAGLE_DEBUG", "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no")


def error_line(command: str, error: BaseException) -> str:
    """The one line an error prints: the message with its lines joined (the exception's type when the message
    says nothing, or is only a quoted key)."""
    message = " ".join(str(error).split())
    if not message or isinstance(error, KeyError | IndexError | AttributeError | TypeError):
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return f"peagle {command}: error: {message} (--debug or PEAGLE_DEBUG=1 for the traceback)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if debug_enabled(args):
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:
        raise SystemExit(error_line(args.command, error)) from error


if __name__ == "__main__":
    sys.exit(main())
