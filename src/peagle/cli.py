"""The `peagle` command: `peagle {demo,bench,train,export,push} ...`.

Each sub-command lives in the module that owns the work; this file only parses arguments and
dispatches.  Nothing imports this module.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    print("peagle demo: not available yet (lands with the embedded-default issue).")
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peagle", description="P-EAGLE parallel speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="generate with and without the default head on the embedded SmolLM2 target")
    p.set_defaults(func=_demo)

    # --- sub-commands added by other modules go below this line (one block each) ---

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
