"""Long contexts in a batch: B held-out prompts after long contexts, both shipped heads against plain batched greedy
(issue #80).

For each context length of `--contexts`, B = `--batch-size` held-out prompts (`--examples` after `--skip`; never
MT-Bench or HumanEval), each after whole earlier held-out conversations of up to that many tokens
(`peagle.evaluation.long_inputs`, as `peagle bench --contexts` builds them), are left-padded into one batch.  Plain
batched greedy, the P-EAGLE head and the EAGLE-3-style head (each with its default rule and its shipped drafter
window) decode `--max-new-tokens` tokens per row, interleaved, `--repeats` times (median); every output is compared
with plain's.  Each call's prefill (its first target forward, which both sides pay alike) is timed too, and the
speed of the decoding after it is reported apart (`decoding_speedup`): at B = 8 after 2K tokens the prefill is about
four-fifths of a call.  An untimed warm-up per head times the cost curve at this batch size and context first
(`prepare_cost_model`, what `peagle calibrate --costs` does ahead of time).

Writes `<out>/long_batch.json` and `<out>/long_batch.png` (speed over plain by context); exit status 1 when an output
differed from plain.

Example (an otherwise idle machine, a fresh cost cache):
    PEAGLE_COST_CACHE=$(mktemp -d) python benchmarks/bench_long_batch.py --contexts 2048,4096 --batch-size 8 \\
        --out docs/results/long_batch
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

import peagle
from peagle.data.shards import load_examples
from peagle.evaluation.bench_batch import left_pad
from peagle.evaluation.long_inputs import checked_long_inputs
from peagle.evaluation.results import write_json_and_plot
from peagle.evaluation.timing import machine_description, timed_generate
from peagle.generation.cost import prepare_cost_model
from peagle.generation.settings import AUTO_TREE_NODES


def _timed(target, ids, mask, max_new_tokens, head=None):
    """The call's output, its seconds and the seconds of its first target forward (the prefill, which both sides
    pay alike)."""
    run = timed_generate(target, ids, max_new_tokens, head, attention_mask=mask)
    return run.sequences, run.seconds, run.prefill_seconds


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name in ("peagle", "eagle3"):
        ax.plot([r["context"] for r in rows], [r[name]["speedup"] for r in rows], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("context before each prompt (tokens)")
    ax.set_ylabel(f"speed over plain batched greedy (B = {rows[0]['batch_size']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,4096")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    parser.add_argument("--skip", type=int, default=48)
    parser.add_argument("--out", default="bench_results/long_batch")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    target, tok = peagle.load_default_target()
    heads = {
        "peagle": peagle.load_default_drafter(target),
        "eagle3": peagle.load_default_drafter(target, "eagle3"),
    }
    examples = load_examples(args.examples)
    prompts = list(range(args.skip, args.skip + args.batch_size))
    _, inputs = checked_long_inputs(examples, tok, contexts, prompts)
    rows, lossless = [], True
    for context in contexts:
        ids, mask = left_pad([torch.tensor(x) for x, _ in inputs[context]], tok.pad_token_id or 0)
        warm = time.perf_counter()
        for head in heads.values():
            target.generate(ids[:, -8:], attention_mask=mask[:, -8:], assistant_model=head, max_new_tokens=4)
            prepare_cost_model(
                target,
                head,
                AUTO_TREE_NODES + 1,
                batch_size=args.batch_size,
                contexts=[ids.shape[1] + args.max_new_tokens],
            )
        row = {"context": context, "batch_size": args.batch_size, "longest_input": ids.shape[1]}
        row["warm_up_seconds"] = time.perf_counter() - warm
        seconds = {name: [] for name in ("plain", *heads)}
        decoding = {name: [] for name in ("plain", *heads)}  # the call less its prefill
        for _ in range(args.repeats):
            ref, s, prefill = _timed(target, ids, mask, args.max_new_tokens)
            seconds["plain"].append(s)
            decoding["plain"].append(s - prefill)
            for name, head in heads.items():
                out, s, prefill = _timed(target, ids, mask, args.max_new_tokens, head)
                seconds[name].append(s)
                decoding[name].append(s - prefill)
                same = torch.equal(out, ref)
                lossless &= same
                st = head.last_generation_stats
                row[name] = {"same": same, "tokens_per_target_pass": st.tokens_per_target_pass,
                             "cost_timing_seconds": st.cost_timing_seconds}  # fmt: skip
        row["plain"] = {"seconds": statistics.median(seconds["plain"])}
        row["plain"]["decoding_seconds"] = statistics.median(decoding["plain"])
        for name in heads:
            row[name]["seconds"] = statistics.median(seconds[name])
            row[name]["speedup"] = row["plain"]["seconds"] / row[name]["seconds"]
            row[name]["decoding_seconds"] = statistics.median(decoding[name])
            row[name]["decoding_speedup"] = row["plain"]["decoding_seconds"] / row[name]["decoding_seconds"]
        rows.append(row)
        print(
            f"context {context} (B={args.batch_size}, longest input {ids.shape[1]}): plain {row['plain']['seconds']:.1f} s"
            + f" (decoding after the prefill {row['plain']['decoding_seconds']:.1f} s)"
            + "".join(
                f"; {n} {row[n]['seconds']:.1f} s = {row[n]['speedup']:.2f}x (decoding "
                f"{row[n]['decoding_speedup']:.2f}x), {row[n]['tokens_per_target_pass']:.2f} tokens/pass, "
                f"same {row[n]['same']}"
                for n in heads
            ),
            flush=True,
        )
    results = {
        "benchmark": "long_batch",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "settings": vars(args),
        "summary": rows,
    }
    write_json_and_plot(results, args.out, "long_batch", plot)
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
