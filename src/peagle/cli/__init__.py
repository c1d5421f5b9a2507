"""The `peagle` command: `peagle {demo,bench,train,calibrate,export,push} ...`.

One module per sub-command; each defines `add_parser(subparsers)` (argparse only, cheap to import) and
`run(args) -> int`, which calls typed library functions.  Library modules never parse arguments or raise
`SystemExit`; nothing in the library imports this package.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("demo", "bench", "train", "calibrate", "export", "push")
"""Sub-commands, each the module `peagle.cli.<name>`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peagle", description="P-EAGLE parallel speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        p = module.add_parser(sub)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
