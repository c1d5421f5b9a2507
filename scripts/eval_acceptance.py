"""Held-out acceptance of heads: new tokens per target pass with K drafts every round (no timing involved).

The scaling study's measurement: each head drafts exactly K tokens every round (`assistant_confidence_threshold=0`)
under the float32 SmolLM2 target, greedy, on the prompt part of held-out self-distilled examples (never trained
on, never MT-Bench or HumanEval); every output is checked against plain greedy.  Acceptance does not depend on
the machine, so the numbers hold on any hardware.

`--teacher-forced` measures the same quantity without decoding: `PEagleTrainer.evaluate_acceptance` drafts a
round at every anchor of the held-out responses in one pass (their tokens are the target's greedy continuation)
and counts the drafts greedy verification accepts; the target's features are computed once and cached
(`--feature-cache`), so a checkpoint costs seconds, which is what the scaling curve needs.

Usage:
    python scripts/eval_acceptance.py src/peagle/default_heads/smollm2-135m-peagle runs/stage3-peagle \
        --examples training_data/smollm2-135m-instruct/heldout --skip 48 --limit 24 -k 7 --out eval.json
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
    ap.add_argument("heads", nargs="+", help="head folders")
    ap.add_argument("--examples", required=True, help="held-out examples (shards or JSONL)")
    ap.add_argument("--skip", type=int, default=48, help="skip the first N (the calibration/comparison ones)")
    ap.add_argument("--limit", type=int, default=24)
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
        "--feature-cache",
        default="runs/cache-heldout",
        help="--teacher-forced: where the target's features of the examples are cached",
    )
    args = ap.parse_args()
    args.head_dtype = resolve_dtype_name(args.head_dtype)  # recorded resolved

    target, _ = load_default_target()
    if args.teacher_forced:
        results = teacher_forced(target, args)
        if args.out:
            Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))
        return
    prompts = prompts_of_examples(load_examples(args.examples)[args.skip : args.skip + args.limit])
    results = {}
    for folder in args.heads:
        head = PEagleDrafter.from_pretrained(folder, dtype=getattr(torch, args.head_dtype)).attach_target(
            target
        )
        head.eval()
        stats, lossless = [], True
        for ids in tqdm(prompts, desc=Path(folder).name):
            plain = timed_generate(target, ids, args.max_new_tokens)
            run = timed_generate(
                target,
                ids,
                args.max_new_tokens,
                assistant=head,
                num_assistant_tokens=args.num_speculative_tokens,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
            )
            lossless &= run.output == plain.output
            stats.append(run.stats)
        total = PEagleGenerationStats.merge(stats)
        results[folder] = {
            "tokens_per_target_pass": total.tokens_per_target_pass,
            "acceptance_length": total.acceptance_length,
            "acceptance_rate_per_depth": total.acceptance_rate_per_depth,
            "lossless": lossless,
            # the counts behind the ratios, so runs over several example ranges pool exactly
            "prompts": len(prompts),
            "new_tokens": total.generated_tokens,
            "target_passes": total.target_passes,
            "drafting_rounds": total.rounds,
        }
        print(
            f"{folder}: {total.tokens_per_target_pass:.3f} tokens/target pass, acceptance length "
            f"{total.acceptance_length:.3f} (K={args.num_speculative_tokens}, {len(prompts)} prompts, "
            f"lossless {lossless})"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))


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
