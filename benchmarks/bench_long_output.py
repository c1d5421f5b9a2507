"""Tokens per target pass over the course of one long output, by position bucket (issue #67).

For each held-out prompt (`--skip`, `--limit` of `--examples`, never MT-Bench or HumanEval), greedy decoding writes
`--max-new-tokens` tokens (end of sequence suppressed, so every output is that long) with K drafts every round,
once per drafter window of `--windows` (`none`: the whole context; `256`: the shipped head's default), and every
output is checked against plain greedy. Each output is cut into buckets of `--bucket` new tokens, and each bucket's
tokens per target pass is reported, pooled over the prompts. Acceptance does not depend on the machine's speed, so
this runs beside other work; no time is reported. Writes `<out>/long_output.json` and `<out>/long_output.png`.

Example:
    python benchmarks/bench_long_output.py --limit 2 --max-new-tokens 1536 --windows none,256
"""

from __future__ import annotations

import argparse
import sys

import torch

from peagle import PEagleDrafter  # importing peagle installs the generate() hook (assistant_model=head)
from peagle.data.shards import load_examples
from peagle.evaluation.long_inputs import prompt_part
from peagle.evaluation.long_output import long_output_run
from peagle.evaluation.results import save_figure, write_json_and_plot
from peagle.evaluation.timing import machine_description
from peagle.targets import default_drafter_path, load_default_target


def pooled(runs: list[dict]) -> list[dict]:
    """Buckets summed over prompts: tokens, passes and tokens per target pass per position bucket."""
    by_start: dict[int, list[int]] = {}
    for run in runs:
        for b in run["buckets"]:
            slot = by_start.setdefault(b["start"], [b["end"], 0, 0])
            slot[1] += b["tokens"]
            slot[2] += b["passes"]
    return [
        {"start": s, "end": e, "tokens": t, "passes": p, "tokens_per_target_pass": t / p}
        for s, (e, t, p) in sorted(by_start.items())
    ]


def plot(summary: dict, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, buckets in summary["pooled"].items():
        ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["tokens_per_target_pass"] for b in buckets],
                marker="o", label=f"drafter window {label}")  # fmt: skip
    ax.set_xlabel("position in the output (new tokens)")
    ax.set_ylabel("tokens per target pass")
    ax.set_title(f"P-EAGLE head, K = {summary['k']} chains, one long output")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    ap.add_argument(
        "--skip", type=int, default=48, help="the first prompt's example (0-39 calibrate the head)"
    )
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=1536)
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("-k", type=int, default=7, help="drafts every round")
    ap.add_argument("--windows", default="none,256", help="drafter windows; none = the whole context")
    ap.add_argument("--head", default=None, help="head folder (default: the shipped P-EAGLE head)")
    ap.add_argument("--out", default="bench_results/long_output")
    args = ap.parse_args(argv)
    target, _ = load_default_target(dtype=torch.float32)
    head = PEagleDrafter.from_pretrained(args.head or default_drafter_path(), dtype=torch.float32).eval()
    examples = load_examples(args.examples)[args.skip : args.skip + args.limit]
    windows = {w: (0 if w == "none" else int(w)) for w in args.windows.split(",")}
    runs: dict[str, list[dict]] = {w: [] for w in windows}
    for i, example in enumerate(examples):
        prompt = torch.tensor([prompt_part(example)])
        reference = None
        for label, window in windows.items():
            settings = {"max_new_tokens": args.max_new_tokens, "num_assistant_tokens": args.k, "drafter_window": window,
                        "bucket": args.bucket}  # fmt: skip
            run = long_output_run(target, head, prompt, settings, reference)
            reference = run.pop("reference")
            run["prompt"] = args.skip + i
            runs[label].append(run)
            print(f"prompt {args.skip + i}, window {label}: {run['tokens_per_target_pass']:.3f} tokens/pass, "
                  f"identical {run['identical']}", flush=True)  # fmt: skip
    result = {
        "settings": {**vars(args), "k": args.k},
        "machine": machine_description(),
        "runs": runs,
        "summary": {"k": args.k, "pooled": {label: pooled(r) for label, r in runs.items()}},
    }
    for label, buckets in result["summary"]["pooled"].items():
        print(
            f"window {label}: "
            + ", ".join(f"{b['start']}-{b['end']}: {b['tokens_per_target_pass']:.2f}" for b in buckets)
        )
    write_json_and_plot(result, args.out, "long_output", plot)
    return 0 if all(r["identical"] for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
