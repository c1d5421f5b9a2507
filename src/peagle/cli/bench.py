"""`peagle bench`: greedy vs P-EAGLE vs EAGLE-3 head vs prompt lookup on MT-Bench and HumanEval."""

from __future__ import annotations

import argparse

from ._common import DTYPES, add_head_dtype_argument, add_target_argument


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="greedy vs P-EAGLE vs EAGLE-3 head vs prompt lookup on MT-Bench and HumanEval"
    )
    p.add_argument("--limit", type=int, default=None, help="prompts per set (default: all; 80 and 164)")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8,9,10", help="comma-separated K values (fixed K rows)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per run; the median is kept")
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--methods", default="greedy,peagle,eagle3,pld")
    add_target_argument(p)
    p.add_argument("--head", default=None, help="P-EAGLE head folder (default: the shipped head)")
    p.add_argument(
        "--ar-head", default=None, help="autoregressive head folder (default: the shipped EAGLE-3 head)"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="target dtype")
    add_head_dtype_argument(p)
    p.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        help="assistant_confidence_threshold of the fixed-K rows (default 0: K drafts every round)",
    )
    p.add_argument(
        "--no-default-rule",
        dest="default_rule",
        action="store_false",
        help="skip the rows that run each head with its default rule (cost-aware drafting)",
    )
    return p


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise SystemExit(f"peagle bench: --{name} must be comma-separated integers, got {text!r}") from err
    if not values or min(values) < 1:
        raise SystemExit(f"peagle bench: --{name} needs integers >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    # validate everything before anything heavy loads
    ks = _ints(args.ks, "ks")
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"peagle bench: --limit must be >= 1, got {args.limit}")
    if args.repeats < 1 or args.max_new_tokens < 1:
        raise SystemExit("peagle bench: --repeats and --max-new-tokens must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    import torch

    from ..bench import (
        check_methods,
        format_table,
        load_prompts,
        machine_description,
        run_benchmark,
        timed_generate,
        write_results,
    )
    from ..evalsets import EVAL_SETS
    from ..modeling_peagle import PEagleDrafter
    from ..targets import default_drafter_path, load_target

    try:
        check_methods(methods)
    except ValueError as err:
        raise SystemExit(f"peagle bench: {err}") from err
    unknown = [d for d in datasets if d not in EVAL_SETS]
    if unknown:
        raise SystemExit(f"peagle bench: unknown datasets {unknown}; expected some of {sorted(EVAL_SETS)}")
    target, tokenizer = load_target(args.target or "default", dtype=getattr(torch, args.dtype))
    if tokenizer is None:
        raise SystemExit(
            f"peagle bench: the target {args.target} has no tokenizer (needed for the chat prompts)"
        )
    heads = {}
    for method, path in (("peagle", args.head), ("eagle3", args.ar_head)):
        if method in methods:
            folder = path or default_drafter_path(method)
            head = PEagleDrafter.from_pretrained(folder, dtype=getattr(torch, args.head_dtype))
            heads[method] = head.attach_target(target).eval()
    prompts = load_prompts(tokenizer, datasets, args.limit)
    timed_generate(target, prompts[datasets[0]][0], 4)  # warm-up
    for head in heads.values():  # and the heads' cost models (measured once per machine, then cached)
        timed_generate(target, prompts[datasets[0]][0], 4, assistant=head)
    results = run_benchmark(
        target,
        prompts,
        heads,
        ks=ks,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        methods=methods,
        confidence_threshold=args.confidence_threshold,
        default_rule=args.default_rule,
    )
    results["machine"] = machine_description()
    results["command"] = "peagle bench " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k not in ("func", "command") and v is not None
    )
    js, png = write_results(results, args.out)
    print(format_table(results["summary"]))
    print(f"\nwrote {js} and {png}")
    lossless = all(s["lossless"] for s in results["summary"])
    if not lossless:
        print("WARNING: some speculative outputs differ from plain greedy (see 'lossless' column)")
    return 0 if lossless else 1
