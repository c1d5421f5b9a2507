"""What a verify pass costs after a long context: transformers' SDPA against peagle's packed grouped-query SDPA.

For each context L of `--contexts`, the embedded target (fp32) prefills L random tokens, then target passes over
n = `--ns` new tokens (with a 2D attention mask and every hidden state requested, as a verify pass runs) are timed
`--repeats` times each after a warm-up and cropped off again; the median is kept. The same cache is timed with
transformers' SDPA and inside `peagle.generation.attention.packed_attention`. Prints milliseconds and the ratio to
n = 1; writes `<out>/verify_cost.json` and `<out>/verify_cost.png`. Run it on an otherwise idle machine.

Example:
    python benchmarks/verify_cost.py --contexts 2048,4096,7936 --out docs/results/verify_packed
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
from transformers.cache_utils import DynamicCache

from peagle.evaluation.results import save_figure, write_json_and_plot
from peagle.evaluation.timing import machine_description
from peagle.generation.attention import packed_attention
from peagle.targets import load_default_target

KINDS = ("sdpa", "packed")


@torch.no_grad()
def time_passes(target, context: int, ns: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median milliseconds of a pass over n new tokens after `context` cached ones, per attention kind."""
    ids = torch.randint(100, 20000, (1, context + max(ns)), generator=torch.Generator().manual_seed(context))
    cache = DynamicCache(config=target.config)
    target(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    out: dict[str, dict[int, float]] = {}
    for kind in KINDS:
        scope = packed_attention(target) if kind == "packed" else contextlib.nullcontext()
        out[kind] = {}
        with scope:
            for n in ns:
                times = []
                for _ in range(repeats + 1):
                    mask = torch.ones(1, context + n, dtype=torch.long)
                    t0 = time.perf_counter()
                    target(input_ids=ids[:, context : context + n], attention_mask=mask, cache=cache,
                           use_cache=True, output_hidden_states=True)  # fmt: skip
                    times.append(time.perf_counter() - t0)
                    cache.crop(-n)
                out[kind][n] = statistics.median(times[1:]) * 1e3
    return out


def plot(summary: list[dict], path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in summary:
        for kind, style in zip(KINDS, ("--", "-")):
            ns = sorted(int(n) for n in row[kind])
            ax.plot(
                ns,
                [row[kind][n] / row[kind][1] for n in ns],
                style,
                marker="o",
                label=f"{kind}, L = {row['context']}",
            )
    ax.set_xlabel("new tokens in the pass (n)")
    ax.set_ylabel("cost in plain steps (n = 1)")
    ax.set_title("A verify pass after L cached tokens, SmolLM2-135M fp32")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2048,4096,7936")
    ap.add_argument("--ns", default="1,2,8,33", help="new tokens per timed pass (1 must be among them)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default="bench_results/verify_cost")
    args = ap.parse_args(argv)
    ns = [int(n) for n in args.ns.split(",")]
    if 1 not in ns:
        ap.error("--ns must include 1 (the plain step the ratios are of)")
    target, _ = load_default_target(dtype=torch.float32)
    summary = []
    for context in (int(c) for c in args.contexts.split(",")):
        row = {"context": context, **time_passes(target, context, ns, args.repeats)}
        summary.append(row)
        for kind in KINDS:
            ms = row[kind]
            print(
                f"L = {context:5d} {kind:6s} "
                + "  ".join(f"n={n}: {ms[n]:6.1f} ms ({ms[n] / ms[1]:.2f}x)" for n in ns)
            )
    write_json_and_plot({"settings": vars(args), "machine": machine_description(), "summary": summary},
                        args.out, "verify_cost", plot)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
