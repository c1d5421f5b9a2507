"""Measure the draft-confidence cut that makes a head fastest on this machine, and optionally store it in the head.

`assistant_confidence_threshold=t` ends a drafting round after its first draft the head gives a probability below
`t`.  The output is unchanged (checked here on every run); only the work per round changes: on a CPU, verifying
K+1 tokens costs well over one plain step, so drafts the head is unsure of cost more than they bring.  This
script runs plain greedy and the head at each threshold side by side on the same prompts (never MT-Bench or
HumanEval: general chat turns written here plus Python-stdlib coding prompts), prints tokens/s, speedup and
acceptance length per threshold, writes them as JSON, and with `--write` stores the fastest threshold as the
head's `confidence_threshold` (its default whenever `generate()` is not given one).

Usage (the values shipped with the default heads; torch's default threads on the 2-core CPU):
    python scripts/tune_confidence_threshold.py --kind peagle --write --out docs/results/confidence_peagle.json
    python scripts/tune_confidence_threshold.py --kind eagle3 --write --out docs/results/confidence_eagle3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peagle import PEagleDrafter
from peagle.bench import chat_prompt_ids, machine_description, method_kwargs, timed_generate
from peagle.targets import default_drafter_path, load_default_target
from peagle.training.prompts import check_not_evaluation, stdlib_code_prompts

CHAT_PROMPTS = (
    "How do I make a good first impression at a new job?",
    "Describe how bread rises, for a curious ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "Summarise the pros and cons of working from home.",
)


def tuning_prompts(num_code: int, seed: int) -> list[str]:
    prompts = list(CHAT_PROMPTS) + stdlib_code_prompts(num_code, seed=seed)
    check_not_evaluation(prompts, source="tuning prompts")
    return prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["peagle", "eagle3"], default="peagle")
    ap.add_argument("--head", default=None, help="head folder (default: the shipped head of --kind)")
    ap.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K, draft tokens per round (default: the head's)",
    )
    ap.add_argument("--thresholds", default="0,0.2,0.3,0.4,0.5,0.6,0.7,0.8")
    ap.add_argument(
        "--num-code", type=int, default=4, help="Python-stdlib coding prompts besides the chat ones"
    )
    ap.add_argument(
        "--seed", type=int, default=12345, help="which stdlib prompts (the heads' data used seed 0)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--head-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="JSON file for the measurements")
    ap.add_argument(
        "--write", action="store_true", help="store the fastest threshold in the head's config.json"
    )
    args = ap.parse_args(argv)

    folder = Path(args.head or default_drafter_path(args.kind))
    # float32 target: the dtype in which speculative output is bit-identical
    target, tokenizer = load_default_target()
    head = (
        PEagleDrafter.from_pretrained(folder, dtype=getattr(torch, args.head_dtype))
        .attach_target(target)
        .eval()
    )
    k = args.num_speculative_tokens or head.config.num_speculative_tokens
    thresholds = [float(t) for t in args.thresholds.split(",")]
    prompts = tuning_prompts(args.num_code, args.seed)
    totals = {t: {"new_tokens": 0, "seconds": 0.0, "target_calls": 0} for t in [None, *thresholds]}
    lossless = True
    with tqdm(total=len(prompts) * len(totals), desc=f"tune {folder.name}") as bar:
        for text in prompts:
            ids = chat_prompt_ids(tokenizer, text)
            timed_generate(target, ids, 8)  # warm-up
            reference = None
            for t in totals:  # plain greedy first, then every threshold on the same prompt
                # the threshold goes in as the head's default: passing exactly 0.4 to generate() would read as
                # transformers' unset default
                head.config.confidence_threshold = t or 0.0
                kwargs = {} if t is None else method_kwargs(args.kind, k, {args.kind: head})
                run = timed_generate(target, ids, args.max_new_tokens, **kwargs)
                reference = run.output if reference is None else reference
                lossless &= run.output == reference
                for key in ("new_tokens", "seconds", "target_calls"):
                    totals[t][key] += getattr(run, key)
                bar.update(1)
    plain = totals.pop(None)
    plain_tps = plain["new_tokens"] / plain["seconds"]
    rows = []
    print(f"{folder.name}, K={k}, {len(prompts)} prompts, plain greedy {plain_tps:.1f} tok/s")
    print("| threshold | tok/s | speedup | acceptance length |\n|---|---|---|---|")
    for t, tot in totals.items():
        tps = tot["new_tokens"] / tot["seconds"]
        rows.append({"threshold": t, "tokens_per_s": tps, "speedup": tps / plain_tps,
                     "tau": tot["new_tokens"] / tot["target_calls"]})  # fmt: skip
        print(f"| {t:g} | {tps:.1f} | {tps / plain_tps:.2f}x | {rows[-1]['tau']:.2f} |")
    best = max(rows, key=lambda r: r["speedup"])
    print(f"fastest: threshold {best['threshold']:g} ({best['speedup']:.2f}x); outputs identical: {lossless}")
    if not lossless:
        print("error: some output differed from plain greedy; nothing written")
        return 1
    result = {"head": folder.name, "k": k, "prompts": prompts, "plain_tokens_per_s": plain_tps, "rows": rows,
              "best": best["threshold"], "machine": machine_description(),
              "command": "python scripts/tune_confidence_threshold.py " + " ".join(sys.argv[1:] if argv is None else argv)}  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.write:
        config_file = folder / "config.json"
        config = json.loads(config_file.read_text())
        config["confidence_threshold"] = best["threshold"]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        print(f"wrote confidence_threshold={best['threshold']:g} to {config_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
