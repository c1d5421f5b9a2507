"""The `peagle` command: `peagle {demo,bench,train,export,push} ...`.

Each sub-command lives in the module that owns the work; this file only parses arguments and
dispatches.  Nothing imports this module.
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ["float32", "bfloat16"]
"""The dtypes the demo and the benchmark run the target and the heads in."""


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    ok = run_demo(
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        confidence_threshold=args.confidence_threshold,
        dtype=args.dtype,
        head_dtype=args.head_dtype,
    )
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_cli

    return run_cli(args)


def _confidence_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        help="assistant_confidence_threshold: end a round after its first draft the head gives a lower "
        "probability (default: the head's own `confidence_threshold`; 0 drafts K tokens every round)",
    )


def _head_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head-dtype",
        default="bfloat16",
        choices=DTYPES,
        help="drafter dtype (default: bfloat16, the shipped weights' dtype and the faster one on CPU); drafts "
        "only propose, so the output is still the target's own",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peagle", description="P-EAGLE parallel speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo", help="generate with and without the default head on the embedded SmolLM2 target"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=None, help="draft tokens per round (default: the head's)")
    _confidence_argument(p)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="target dtype (bfloat16: faster here, not bit-identical)",
    )
    _head_dtype_argument(p)
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
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="target dtype")
    _head_dtype_argument(p)
    p.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    _confidence_argument(p)
    p.set_defaults(func=_bench)

    # --- sub-commands added by other modules go below this line (one block each) ---

    # train: target + prompts -> self-distilled data -> trained head (peagle.training.recipe)
    def _train(args: argparse.Namespace) -> int:
        from .training.recipe import run_train

        return run_train(args)

    from .training.recipe import add_train_arguments  # argparse only; heavy imports happen in run_train

    p = sub.add_parser("train", help="train a P-EAGLE (or EAGLE-3) head for a target on self-distilled data")
    add_train_arguments(p)
    p.set_defaults(func=_train)

    # export: any published head layout -> vLLM / speculators / peagle (peagle.formats)
    def _export(args: argparse.Namespace) -> int:
        from .formats import cli_export

        return cli_export(args)

    p = sub.add_parser(
        "export", help="convert a head (any known layout) to the vllm, speculators or peagle layout"
    )
    p.add_argument("head", help="head folder or Hub repo id, in any layout peagle reads")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--layout", choices=["vllm", "speculators", "peagle"], default="vllm")
    p.add_argument(
        "--target",
        default=None,
        help="target path, Hub id or 'default'; needed when the head "
        "shares the target's embeddings or lacks embed_tokens / lm_head",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="K to record (default: the head's)"
    )
    p.add_argument(
        "--allow-pickle", action="store_true", help="permit .bin/.pt checkpoints (unpickling runs code)"
    )
    p.add_argument("--max-shard-size", default="5GB")
    p.set_defaults(func=_export)

    # push: upload a head with its model card, remote code and custom_generate/ (peagle.hub)
    def _push(args: argparse.Namespace) -> int:
        from .hub import cli_push

        return cli_push(args)

    p = sub.add_parser(
        "push", help="upload a head to the Hub with a model card, remote code and custom_generate/"
    )
    p.add_argument("head", help="head folder or Hub repo id, in any layout peagle reads")
    p.add_argument("repo_id", help="destination Hub repo, e.g. you/SmolLM2-135M-Instruct-peagle")
    p.add_argument(
        "--target", default=None, help="target path, Hub id or 'default' (checked against the head)"
    )
    p.add_argument(
        "--bench", default=None, help="benchmark JSON (peagle bench) for the acceptance/speedup table"
    )
    p.add_argument("--training", default=None, help="JSON file describing training data and budget")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None)
    p.add_argument(
        "--allow-pickle", action="store_true", help="permit .bin/.pt checkpoints (unpickling runs code)"
    )
    p.add_argument(
        "--prepare-only", default=None, metavar="DIR", help="write the upload folder to DIR, do not upload"
    )
    p.set_defaults(func=_push)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
