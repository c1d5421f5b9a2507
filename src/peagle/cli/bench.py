"""`peagle bench`: greedy vs P-EAGLE vs EAGLE-3 head vs prompt lookup on MT-Bench and HumanEval."""

from __future__ import annotations

import argparse

from ._common import DTYPES, add_confidence_argument, add_head_dtype_argument


def add_parser(sub) -> argparse.ArgumentParser:
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
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="target dtype")
    add_head_dtype_argument(p)
    p.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    add_confidence_argument(p)
    return p


def run(args: argparse.Namespace) -> int:
    from ..bench import run_cli

    return run_cli(args)
