"""The `peagle` command: `peagle {demo,bench,train,export,push} ...`.

Each sub-command lives in the module that owns the work; this file only parses arguments and
dispatches.  Nothing imports this module.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(max_new_tokens=args.max_new_tokens, k=args.k) else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_cli

    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peagle", description="P-EAGLE parallel speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo", help="generate with and without the default head on the embedded SmolLM2 target"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=None, help="draft tokens per round (default: the head's)")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "bench", help="greedy vs P-EAGLE vs EAGLE-3 head vs prompt lookup on MT-Bench and HumanEval"
    )
    p.add_argument("--limit", type=int, default=None, help="prompts per set (default: all; 80 and 164)")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8,9,10", help="comma-separated K values")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per run; the median is kept")
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--methods", default="greedy,peagle,eagle3,pld")
    p.add_argument("--head", default=None, help="P-EAGLE head folder (default: the shipped head)")
    p.add_argument(
        "--ar-head", default=None, help="autoregressive head folder (default: the shipped EAGLE-3 head)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    p.set_defaults(func=_bench)

    # --- sub-commands added by other modules go below this line (one block each) ---

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
