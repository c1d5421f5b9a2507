"""Tokens per target pass under sampling: how often the shipped head's drafts match the target's draws (#77).

For each temperature of `--temperatures` and each verify shape (a chain of K = `--k` drafts, a tree of
`--tree-size` nodes), every held-out prompt (`--examples` after `--skip`, `--limit` of them; never MT-Bench or
HumanEval) is sampled once with seed i (top-p 1, top-k off, `assistant_confidence_threshold=0.0`: every round
verifies the full chain or tree), and the merged `tokens_per_target_pass` is printed and written to
`<out>/sampling.json`.  Counts, not timings: it may run beside other work.  docs/DESIGN.md section 12.3 compares
the keyed draws with the accept/resample rule they replaced by running it on both commits.

Example:
    python benchmarks/bench_sampling.py --limit 12 --max-new-tokens 64 --out bench_results/sampling
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import peagle
from peagle.data.shards import load_examples
from peagle.evaluation.long_inputs import prompt_part
from peagle.generation.stats import PEagleGenerationStats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    parser.add_argument("--skip", type=int, default=48)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--tree-size", type=int, default=32)
    parser.add_argument("--out", default="bench_results/sampling")
    args = parser.parse_args(argv)
    target, _ = peagle.load_default_target()
    head = peagle.load_default_drafter(target)
    examples = load_examples(args.examples)[args.skip : args.skip + args.limit]
    shapes = {f"chain K={args.k}": 0, f"tree {args.tree_size}": args.tree_size}
    results = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for name, tree in shapes.items():
            stats = []
            for i, example in enumerate(examples):
                torch.manual_seed(i)
                target.generate(
                    torch.tensor([prompt_part(example)]), assistant_model=head, do_sample=True,
                    temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                    num_assistant_tokens=args.k, assistant_confidence_threshold=0.0, draft_tree_size=tree,
                )  # fmt: skip
                stats.append(head.last_generation_stats)
            key = f"T={temperature} {name}"
            results[key] = PEagleGenerationStats.merge(stats).tokens_per_target_pass
            print(f"{key}: {results[key]:.3f} tokens per target pass", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling.json").write_text(
        json.dumps({"settings": vars(args), "tokens_per_target_pass": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
