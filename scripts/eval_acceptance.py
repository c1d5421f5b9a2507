"""Held-out acceptance of heads: new tokens per target pass with K drafts every round (no timing involved).

The scaling study's measurement: each head drafts exactly K tokens every round (`assistant_confidence_threshold=0`)
under the float32 SmolLM2 target, greedy, on the prompt part of held-out self-distilled examples (never trained
on, never MT-Bench or HumanEval); every output is checked against plain greedy.  Acceptance does not depend on
the machine, so the numbers hold on any hardware.

`--teacher-forced` measures the same quantity without decoding: `PEagleTrainer.evaluate_acceptance` drafts a
round at every anchor of the held-out responses in one pass (their tokens are the target's greedy continuation)
and counts the drafts greedy verification accepts; the target's features are computed once and cached
(`--feature-cache`), so a checkpoint costs seconds, which is what the scaling curve needs.

`--examples` takes several held-out sets, each `FOLDER` or `FOLDER:SKIP:LIMIT`; decoding pools them (counts summed
over every prompt, then divided) and also reports each set.  A long decoding split over the two cores, one process
per core, is pooled afterwards with `--pool`: the runs' `--out` files hold each head's summed generation stats, so
the pooled figure is exact.

Usage:
    python scripts/eval_acceptance.py src/peagle/default_heads/smollm2-135m-peagle runs/stage3-peagle \
        --examples training_data/smollm2-135m-instruct/heldout --skip 48 --limit 24 -k 7 --out eval.json
    python scripts/eval_acceptance.py HEAD --examples data/heldout:48:16 data/heldout-set2:40:80 --out a.json
    python scripts/eval_acceptance.py --pool a.json b.json --out pooled.json
    python scripts/eval_acceptance.py HEAD... --examples ... --skip 48 --limit 72 -k 7 --teacher-forced
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peagle import PEagleDrafter
from peagle.bench import timed_generate
from peagle.generation import PEagleGenerationStats
from peagle.generation.calibration import prompts_of_examples
from peagle.runtime import DTYPE_CHOICES, resolve_dtype_name
from peagle.targets import load_default_target
from peagle.training.shards import load_examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="*", help="head folders")
    ap.add_argument(
        "--examples",
        nargs="+",
        default=[],
        help="held-out examples (shards or JSONL), each FOLDER or FOLDER:SKIP:LIMIT (default --skip and --limit)",
    )
    ap.add_argument("--skip", type=int, default=48, help="skip the first N (the calibration/comparison ones)")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument(
        "--pool",
        nargs="+",
        default=None,
        metavar="RESULT_JSON",
        help="pool earlier decoding runs' --out files (disjoint example ranges, same settings) instead of decoding",
    )
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="tokens decoded per prompt (--teacher-forced: per response in the decoding walk)",
    )
    ap.add_argument(
        "--head-dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the heads' dtype (auto: bfloat16 where this machine computes it natively, else float32)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--teacher-forced",
        action="store_true",
        help="count the accepted drafts of a round at every anchor of the held-out responses (no decoding)",
    )
    ap.add_argument(
        "--truncate",
        action="store_true",
        help="--teacher-forced: keep each example's prompt and the first --max-new-tokens response tokens, all "
        "that the decoding walk reads (the average over every anchor then covers only them); about half the cost",
    )
    ap.add_argument(
        "--write-greedy",
        metavar="FOLDER",
        default=None,
        help="decode no head: write plain greedy's continuation of every --examples prompt (this target and dtype, "
        "batch 1, --max-new-tokens) to this shard folder, one shard per set; the decoding walk over them counts "
        "what decoding with a head gives, passes and all",
    )
    ap.add_argument(
        "--feature-cache",
        default="runs/cache-heldout",
        help="--teacher-forced: where the target's features of the examples are cached",
    )
    args = ap.parse_args()
    if args.pool:
        if args.heads or args.examples:
            ap.error("--pool reads earlier results: give no heads and no --examples")
        try:
            pooled = pool_results([json.loads(Path(f).read_text()) for f in args.pool])
        except ValueError as err:
            ap.error(str(err))
        pooled["settings"]["pooled_from"] = args.pool
        report(pooled["results"], pooled["settings"]["num_speculative_tokens"])
        if args.out:
            Path(args.out).write_text(json.dumps(pooled, indent=2))
        return
    if args.write_greedy:
        if args.heads or args.teacher_forced or not args.examples:
            ap.error("--write-greedy decodes plain greedy only: give --examples and no heads")
        write_greedy(load_default_target()[0], args)
        return
    if not args.heads or not args.examples:
        ap.error("give head folders and --examples (or --pool)")
    if args.teacher_forced and len(args.examples) > 1:
        ap.error("--teacher-forced takes one --examples set (scripts/scaling_curve.py pools several)")
    args.head_dtype = resolve_dtype_name(args.head_dtype)  # recorded resolved

    target, _ = load_default_target()
    if args.teacher_forced:
        args.examples, args.skip, args.limit = heldout_spec(args.examples[0], args.skip, args.limit)
        results = teacher_forced(target, args)
    else:
        results = decode(target, args)
        report(results, args.num_speculative_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))


def heldout_spec(spec: str, skip: int, limit: int) -> tuple[str, int, int]:
    """`FOLDER` or `FOLDER:SKIP:LIMIT` -> (folder, skip, limit)."""
    parts = spec.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return parts[0], int(parts[1]), int(parts[2])
    return spec, skip, limit


def prompt_sets(args) -> dict[str, tuple[dict, list[torch.Tensor]]]:
    """Each `--examples` spec -> (where its prompts came from: folder, skip, count; the `(1, T)` prompt ids)."""
    sets = {}
    for spec in args.examples:
        folder, skip, limit = heldout_spec(spec, args.skip, args.limit)
        prompts = prompts_of_examples(load_examples(folder)[skip : skip + limit])
        sets[spec] = ({"examples": folder, "skip": skip, "limit": len(prompts)}, prompts)
    return sets


def decode(target, args) -> dict:
    """Each head decodes every prompt of every `--examples` set drafting K every round; every output is checked
    against plain greedy (decoded once per prompt, whatever the number of heads).  Returns per head the pooled
    summary (`pooled_summary`), each set under `per_set`."""
    sets = prompt_sets(args)
    plain = {}  # (set, prompt index) -> plain greedy's new tokens, computed once and shared by every head
    results = {}
    for folder in args.heads:
        head = PEagleDrafter.from_pretrained(folder, dtype=getattr(torch, args.head_dtype)).attach_target(
            target
        )
        head.eval()
        per_set = {}
        for spec, (where, prompts) in sets.items():
            stats, lossless = [], True
            for i, ids in enumerate(tqdm(prompts, desc=f"{Path(folder).name} {spec}")):
                if (spec, i) not in plain:
                    plain[spec, i] = timed_generate(target, ids, args.max_new_tokens).output
                run = timed_generate(
                    target,
                    ids,
                    args.max_new_tokens,
                    assistant=head,
                    num_assistant_tokens=args.num_speculative_tokens,
                    num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0,
                )
                lossless &= run.output == plain[spec, i]
                stats.append(run.stats)
            per_set[spec] = {**where, **summarise(PEagleGenerationStats.merge(stats), len(prompts), lossless)}
        results[folder] = pooled_summary(per_set)
    return results


def write_greedy(target, args) -> None:
    """Plain greedy's continuation of each `--examples` prompt, written as one shard per set to `--write-greedy`:
    prompt tokens unsupervised, the new tokens (up to `--max-new-tokens`, end of turn included) supervised.

    Held-out responses were generated in bfloat16 and longer; decoding runs this target in its own dtype, and where
    the two greedy continuations part, the walk over the stored response reads other text than decoding does.
    Over these references the walk reads decoding's own text."""
    from peagle.training.distill import example_of
    from peagle.training.shards import write_shard

    for spec, (where, prompts) in prompt_sets(args).items():
        examples = [
            example_of(ids[0].tolist(), timed_generate(target, ids, args.max_new_tokens).output)
            for ids in tqdm(prompts, desc=f"greedy {spec}")
        ]
        entry = write_shard(
            examples,
            args.write_greedy,
            source="greedy-reference",
            target_name=target.config.name_or_path,
            dtype=target.dtype,
            extra={"prompts_of": where, "max_new_tokens": args.max_new_tokens},
        )
        print(
            f"{spec}: {entry['examples']} continuations, {entry['response_tokens']} new tokens -> {entry['file']}"
        )


def summarise(total: PEagleGenerationStats, prompts: int, lossless: bool) -> dict:
    """One head's decoding over some prompts: the ratios, the counts behind them and the summed generation stats
    (which add up exactly when results are pooled)."""
    return {
        "tokens_per_target_pass": total.tokens_per_target_pass,
        "acceptance_length": total.acceptance_length,
        "acceptance_rate_per_depth": total.acceptance_rate_per_depth,
        "lossless": lossless,
        "prompts": prompts,
        "new_tokens": total.generated_tokens,
        "target_passes": total.target_passes,
        "drafting_rounds": total.rounds,
        "stats": total.to_dict(),
    }


def pooled_summary(per_set: dict[str, dict]) -> dict:
    """One head's `summarise` results on several example sets -> their pooled summary, each set under `per_set`."""
    total = PEagleGenerationStats.merge(
        [PEagleGenerationStats.from_dict(r["stats"]) for r in per_set.values()]
    )
    prompts = sum(r["prompts"] for r in per_set.values())
    out = summarise(total, prompts, all(r["lossless"] for r in per_set.values()))
    out["per_set"] = per_set
    return out


POOLED_SETTINGS = ("num_speculative_tokens", "max_new_tokens", "head_dtype")
"""Settings every pooled run must share: the measure is the same only under them."""


def pool_results(runs: list[dict]) -> dict:
    """Decoding results of several runs (their `--out` JSON) -> one result over all their example sets.

    The runs must share `POOLED_SETTINGS` and their heads, and no example may be counted twice (two sets over the
    same folder must not overlap); each head's generation stats are summed, so the pooled ratios are exact: total
    new tokens over total target passes."""
    if not runs:
        raise ValueError("nothing to pool")
    first = runs[0]
    for run in runs:
        if run["settings"].get("teacher_forced"):
            raise ValueError("a --teacher-forced result has no generation stats to pool")
        differ = [k for k in POOLED_SETTINGS if run["settings"].get(k) != first["settings"].get(k)]
        if differ:
            raise ValueError(f"the runs were measured with other settings: {', '.join(differ)}")
        if set(run["results"]) != set(first["results"]):
            raise ValueError("the runs evaluated different heads")
    results = {}
    for head in first["results"]:
        per_set: dict[str, dict] = {}
        for run in runs:
            sets = run["results"][head].get("per_set")
            if not sets or any("stats" not in r for r in sets.values()):
                raise ValueError(
                    f"{head}: a result without its generation stats (written before --pool existed)"
                )
            for spec, r in sets.items():
                for other_spec, other in per_set.items():
                    if other["examples"] == r["examples"] and (
                        r["skip"] < other["skip"] + other["limit"] and other["skip"] < r["skip"] + r["limit"]
                    ):
                        raise ValueError(f"{head}: example sets {other_spec} and {spec} overlap")
                per_set[spec] = r
        results[head] = pooled_summary(per_set)
    settings = {k: first["settings"].get(k) for k in POOLED_SETTINGS}
    settings["examples"] = [spec for run in runs for spec in run["settings"]["examples"]]
    return {"settings": settings, "results": results}


def report(results: dict, k: int) -> None:
    for folder, r in results.items():
        print(
            f"{folder}: {r['tokens_per_target_pass']:.3f} tokens/target pass, acceptance length "
            f"{r['acceptance_length']:.3f} (K={k}, {r['prompts']} prompts, {r['new_tokens']} new tokens in "
            f"{r['target_passes']} target passes, lossless {r['lossless']})"
        )
        if len(r["per_set"]) > 1:
            for spec, s in r["per_set"].items():
                print(
                    f"    {spec}: {s['tokens_per_target_pass']:.3f} ({s['prompts']} prompts, lossless {s['lossless']})"
                )


def teacher_forced(target, args) -> dict:
    import tempfile

    from peagle.training.features import FeatureCache
    from peagle.training.trainer import PEagleTrainer, PEagleTrainingArguments

    examples = load_examples(args.examples)[args.skip : args.skip + args.limit]
    if args.truncate:
        examples = [truncated(ex, args.max_new_tokens) for ex in examples]
    results = {}
    for folder in args.heads:
        head = PEagleDrafter.from_pretrained(folder, dtype=getattr(torch, args.head_dtype))
        cache = FeatureCache.build(
            target,
            examples,
            args.feature_cache,
            head.config.eagle_aux_hidden_state_layer_ids,
            dtype=torch.float32,
        )
        with tempfile.TemporaryDirectory() as tmp:
            targs = PEagleTrainingArguments(
                output_dir=tmp, per_device_eval_batch_size=4, report_to="none", disable_tqdm=True
            )
            trainer = PEagleTrainer(model=head, target_model=target, args=targs)
            result = trainer.evaluate_acceptance(
                cache, args.num_speculative_tokens, max_new_tokens=args.max_new_tokens
            )
        summary = Path(folder) / "train_summary.json"
        if summary.exists():
            result["train_summary"] = json.loads(summary.read_text())
        results[folder] = result
        print(
            f"{folder}: {result['tokens_per_target_pass']:.3f} tokens/target pass teacher-forced "
            f"(K={args.num_speculative_tokens}, {result['anchors']} anchors in {len(examples)} examples), "
            f"acceptance by depth {[round(x, 3) for x in result['acceptance_by_depth']]}; decoding walk "
            f"({args.max_new_tokens} new tokens per response): {result['decoded_tokens_per_target_pass']:.3f}"
        )
    return results


def truncated(example: dict, response_tokens: int) -> dict:
    """The example up to its first `response_tokens` supervised tokens (its prompt and the start of its response)."""
    mask = list(example["loss_mask"])
    first = mask.index(1) if 1 in mask else len(mask)
    end = first + response_tokens
    return {"input_ids": list(example["input_ids"])[:end], "loss_mask": mask[:end]}


if __name__ == "__main__":
    main()
