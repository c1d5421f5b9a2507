"""The default (cost-aware) drafting rule against every fixed rule chosen in hindsight, side by side.

For each held-out prompt (never MT-Bench or HumanEval: the prompt part of held-out self-distilled examples plus a
few chat turns written here), runs plain greedy, the head's default rule, K drafts every round for each K in
`--ks`, and transformers' confidence cut at each threshold in `--thresholds` (with the head's K), all in one
process on the same prompts; checks every output against plain greedy; prints tokens/s and speedups, the best
fixed rule in hindsight and how far the default rule is from it; writes JSON.  Run it on an otherwise idle
machine.

`--modeled-cost FILE` replaces the clock by a cost model (a JSON written by `VerifyCostModel.to_dict`, e.g. the
one peagle cached for this machine under ~/.cache/peagle/cost/): every rule runs with that fixed curve (no online
refinement) and each run's time is what the curve says its passes cost (every verify pass of n tokens costs
cost(n), every drafter pass its cost).  The numbers are then deterministic and free of timing noise, so the rule's
own decisions can be studied on a busy machine; they are a model, not a benchmark.

Usage:
    python benchmarks/compare_drafting_rules.py --kind peagle --examples training_data/smollm2-135m-instruct/heldout \
        --out docs/results/rules_peagle.json
    python benchmarks/compare_drafting_rules.py --kind peagle --examples ... --modeled-cost ~/.cache/peagle/cost/X.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peagle import PEagleDrafter
from peagle.data.evalsets import chat_prompt_tensor
from peagle.data.prompts import check_not_evaluation
from peagle.data.shards import load_examples
from peagle.evaluation.timing import machine_description, timed_generate
from peagle.generation import PEagleGenerationStats
from peagle.generation.calibration import prompts_of_examples
from peagle.targets import default_drafter_path, load_default_target

CHAT_PROMPTS = (
    "How do I make a good first impression at a new job?",
    "Describe how bread rises, for a curious ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "Summarise the pros and cons of working from home.",
)


def rules(k: int, ks: list[int], thresholds: list[float]) -> dict[str, dict]:
    """Name -> generate() keyword arguments of every rule compared."""
    out = {"default rule": {}}
    for j in ks:
        out[f"K={j} every round"] = {"num_assistant_tokens": j, "assistant_confidence_threshold": 0.0}
    for t in thresholds:
        out[f"K={k}, cut {t:g}"] = {"num_assistant_tokens": k, "assistant_confidence_threshold": t}
    return out


def modeled_seconds(new_tokens: int, stats: PEagleGenerationStats | None, model) -> float:
    """Seconds the cost model charges for a run: plain steps cost(1), a round verifying k drafts cost(k + 1),
    each drafter run its first pass and each further autoregressive pass a step."""
    if stats is None:  # plain greedy
        return new_tokens * model.cost(1)
    k = len(stats.drafted_per_depth)
    verified = [
        stats.drafted_per_depth[i] - (stats.drafted_per_depth[i + 1] if i + 1 < k else 0) for i in range(k)
    ]
    seconds = stats.plain_steps * model.cost(1) + sum(n * model.cost(i + 2) for i, n in enumerate(verified))
    runs = stats.rounds + stats.declined_rounds
    return (
        seconds
        + runs * model.drafter_seconds
        + max(stats.drafter_forward_calls - runs, 0) * model.drafter_step_seconds
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["peagle", "eagle3"], default="peagle")
    ap.add_argument("--head", default=None, help="head folder (default: the shipped head of --kind)")
    ap.add_argument("--examples", default=None, help="held-out self-distilled examples (shards or JSONL)")
    ap.add_argument(
        "--skip", type=int, default=40, help="skip the first N examples (e.g. the calibration ones)"
    )
    ap.add_argument("--limit", type=int, default=8, help="held-out examples to use besides the chat turns")
    ap.add_argument("--ks", default="1,2,3,5,7")
    ap.add_argument("--thresholds", default="0.3,0.5,0.7,0.8")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--head-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="JSON file for the measurements")
    ap.add_argument(
        "--modeled-cost",
        default=None,
        help="cost-model JSON: time every run by this fixed curve instead of the clock (a model, see above)",
    )
    args = ap.parse_args(argv)

    folder = Path(args.head or default_drafter_path(args.kind))
    target, tokenizer = load_default_target()  # float32: the dtype in which output is bit-identical
    head = (
        PEagleDrafter.from_pretrained(folder, dtype=getattr(torch, args.head_dtype))
        .attach_target(target)
        .eval()
    )
    k = head.config.num_speculative_tokens
    model = None
    if args.modeled_cost:
        from peagle.generation.cost import VerifyCostModel, set_cost_model

        data = json.loads(Path(args.modeled_cost).expanduser().read_text())
        model = VerifyCostModel.from_dict({**data, "source": "user"})  # fixed: no online refinement
        set_cost_model(head, model)
    check_not_evaluation(list(CHAT_PROMPTS), source="comparison prompts")
    prompts = [chat_prompt_tensor(tokenizer, t) for t in CHAT_PROMPTS]
    if args.examples:
        prompts += prompts_of_examples(load_examples(args.examples)[args.skip : args.skip + args.limit])
    compared = rules(k, [int(j) for j in args.ks.split(",")], [float(t) for t in args.thresholds.split(",")])
    totals = {name: [0, 0.0] for name in ["plain greedy", *compared]}
    per_prompt = {name: [] for name in compared}
    stats: dict[str, list[PEagleGenerationStats]] = {name: [] for name in compared}
    lossless = True
    timed_generate(target, prompts[0], 8)  # warm-up (and the cost model's calibration, the first time)
    timed_generate(target, prompts[0], 8, assistant=head)
    with tqdm(total=len(prompts) * len(totals), desc=f"rules {folder.name}") as bar:
        for ids in prompts:
            plain = timed_generate(target, ids, args.max_new_tokens)
            if model is not None:
                plain.seconds = modeled_seconds(plain.new_tokens, None, model)
            totals["plain greedy"][0] += plain.new_tokens
            totals["plain greedy"][1] += plain.seconds
            bar.update(1)
            for name, kwargs in compared.items():
                run = timed_generate(target, ids, args.max_new_tokens, assistant=head, **kwargs)
                if model is not None:
                    run.seconds = modeled_seconds(run.new_tokens, run.stats, model)
                lossless &= run.output == plain.output
                totals[name][0] += run.new_tokens
                totals[name][1] += run.seconds
                per_prompt[name].append((run.new_tokens / run.seconds) / (plain.new_tokens / plain.seconds))
                stats[name].append(run.stats)
                bar.update(1)
    plain_tps = totals["plain greedy"][0] / totals["plain greedy"][1]
    rows = []
    for name in compared:
        tps = totals[name][0] / totals[name][1]
        merged = PEagleGenerationStats.merge(stats[name])
        rows.append({"rule": name, "tokens_per_s": tps, "speedup": tps / plain_tps,
                     "slowest_prompt": min(per_prompt[name]),
                     "tokens_per_target_pass": merged.tokens_per_target_pass})  # fmt: skip
    best_fixed = max((r for r in rows if r["rule"] != "default rule"), key=lambda r: r["speedup"])
    default = rows[0]
    print(f"{folder.name}, {len(prompts)} held-out prompts, plain greedy {plain_tps:.1f} tok/s")
    print("| rule | tok/s | speedup | slowest prompt | tokens/target pass |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rule']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['slowest_prompt']:.2f}x | "
              f"{r['tokens_per_target_pass']:.2f} |")  # fmt: skip
    gap = default["speedup"] / best_fixed["speedup"] - 1
    print(f"best fixed rule in hindsight: {best_fixed['rule']} ({best_fixed['speedup']:.2f}x); default rule "
          f"{default['speedup']:.2f}x ({100 * gap:+.1f}%); outputs identical: {lossless}")  # fmt: skip
    result = {"head": folder.name, "prompts": len(prompts), "plain_tokens_per_s": plain_tps, "rows": rows,
              "best_fixed": best_fixed["rule"], "default_vs_best_fixed": gap, "lossless": lossless,
              "machine": machine_description(), "modeled_cost": model.to_dict() if model else None,
              "command": "python benchmarks/compare_drafting_rules.py " + " ".join(sys.argv[1:] if argv is None else argv)}  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
