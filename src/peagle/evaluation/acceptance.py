"""Held-out acceptance of heads: new tokens per target pass with K drafts every round (no timing involved).

The scaling study's measurement: each head drafts exactly K tokens every round (`assistant_confidence_threshold=0`)
under the float32 SmolLM2 target, greedy, on the prompt part of held-out self-distilled examples (never trained
on, never MT-Bench or HumanEval); every output is checked against plain greedy.  Acceptance does not depend on
the machine, so the numbers hold on any hardware.

`--teacher_forced` measures the same quantity without decoding: `PEagleTrainer.evaluate_acceptance` drafts a
round at every anchor of the held-out responses in one pass (their tokens are the target's greedy continuation)
and counts the drafts greedy verification accepts; the target's features are computed once and cached
(`--feature_cache`), so a checkpoint costs seconds.

`--examples` takes several held-out sets, each `FOLDER` or `FOLDER:SKIP:LIMIT`; decoding pools them (counts summed
over every prompt, then divided) and also reports each set.  A long decoding split over the two cores, one process
per core, is pooled afterwards with `--pool`: the runs' `--out` files hold each head's summed generation stats, so
the pooled figure is exact.

Usage:
    peagle evaluate --heads HEAD_A HEAD_B --examples training_data/smollm2-135m-instruct/heldout --skip 48 \
        --limit 24 --num_speculative_tokens 7 --out eval.json
    peagle evaluate --heads HEAD --examples data/heldout:48:16 data/heldout-set2:40:80 --out a.json
    peagle evaluate --pool a.json b.json --out pooled.json
    peagle evaluate --heads HEAD... --examples ... --skip 48 --limit 72 --teacher_forced
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..configuration_peagle import DEFAULT_NUM_SPECULATIVE_TOKENS
from ..data.shards import load_examples
from ..generation import PEagleGenerationStats
from ..generation.calibration import prompts_of_examples
from ..modeling_peagle import PEagleDrafter
from ..runtime import DTYPE_CHOICES
from .teacher_forced import evaluate_acceptance
from .timing import timed_generate


@dataclass
class EvaluateArguments:
    """The settings of `peagle evaluate` (each field is a flag of the same name)."""

    heads: list[str] = field(default_factory=list, metadata={"help": "head folders"})
    examples: list[str] = field(
        default_factory=list,
        metadata={
            "help": "held-out examples (shards or JSONL), each FOLDER or FOLDER:SKIP:LIMIT (default skip, limit)"
        },
    )
    skip: int = field(default=48, metadata={"help": "skip the first N (the calibration/comparison ones)"})
    limit: int = 24
    pool: list[str] | None = field(
        default=None,
        metadata={
            "help": "pool earlier decoding runs' --out files (disjoint example ranges, same settings) instead of "
            "decoding"
        },
    )
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    max_new_tokens: int = field(
        default=128, metadata={"help": "tokens decoded per prompt (teacher_forced: per response in the walk)"}
    )
    head_dtype: str = field(
        default="auto",
        metadata={
            "choices": DTYPE_CHOICES,
            "help": "the heads' dtype (auto: bfloat16 where this machine computes it natively, else float32)",
        },
    )
    out: str | None = None
    teacher_forced: bool = field(
        default=False,
        metadata={"help": "count the accepted drafts of a round at every anchor of the held-out responses"},
    )
    truncate: bool = field(
        default=False,
        metadata={
            "help": "teacher_forced: keep each example's prompt and the first max_new_tokens response tokens, all "
            "that the decoding walk reads (about half the cost)"
        },
    )
    write_greedy: str | None = field(
        default=None,
        metadata={
            "help": "decode no head: write plain greedy's continuation of every examples prompt to this shard "
            "folder, one shard per set; the decoding walk over them counts what decoding with a head gives"
        },
    )
    feature_cache: str = field(
        default="runs/cache-heldout",
        metadata={"help": "teacher_forced: where the target's features of the examples are cached"},
    )


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
    prompt tokens unsupervised, the new tokens (up to `--max_new_tokens`, end of turn included) supervised.

    Held-out responses were generated in bfloat16 and longer; decoding runs this target in its own dtype, and where
    the two greedy continuations part, the walk over the stored response reads other text than decoding does.
    Over these references the walk reads decoding's own text."""
    from ..data.distill import example_of
    from ..data.shards import write_shard

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
            raise ValueError("a teacher-forced result has no generation stats to pool")
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

    from ..data.features import FeatureCache
    from ..training.arguments import PEagleTrainingArguments
    from ..training.trainer import PEagleTrainer

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
            result = evaluate_acceptance(
                trainer, cache, args.num_speculative_tokens, max_new_tokens=args.max_new_tokens
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


__all__ = [
    "EvaluateArguments",
    "decode",
    "teacher_forced",
    "write_greedy",
    "heldout_spec",
    "pool_results",
    "pooled_summary",
    "summarise",
    "report",
]
