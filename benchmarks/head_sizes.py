"""The numbers behind docs/families.md: draft-vocabulary coverage by size, and default head sizes and costs.

1. Coverage: on self-distilled token-id shards, the share of response tokens a draft vocabulary of each size covers
   (chosen on `--examples`, measured on them and on `--heldout`), and the size `choose_draft_vocab_size` picks.
2. Sizes: `PEagleConfig.for_target`'s default head for a few target shapes (random weights, built from config
   classes, nothing downloaded): layers, draft vocabulary, own parameters and their share of the target's.
   With the modeled round / step cost ratio the rule budgets (`peagle.sizing.round_cost`, `ROUND_BUDGET`).
3. Costs (`--time`): for the targets small enough for this CPU, one target step (1 new token after a 256-token
   context) against one drafting round of the default head (2 real slots + K-1 parallel slots): the median over
   3 interleaved repeats of the ratio of medians of 7, in the thread count of the run; also for the real SmolLM2-135M-Instruct (`peagle.targets.load_default_target`)
   and for the head shapes of the previous rule (`--compare`: 2 layers and the parameter budget's vocabulary).

Usage:
    OMP_NUM_THREADS=1 python benchmarks/head_sizes.py --examples training_data/smollm2-135m-instruct/train \
        --heldout training_data/smollm2-135m-instruct/heldout --time --compare --out docs/results/head_sizes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from peagle import PEagleConfig, PEagleDrafter
from peagle.data.shards import load_examples
from peagle.data.vocab import choose_draft_vocab_size, draft_vocab_coverage
from peagle.modeling_peagle import cache_kwarg
from peagle.sizing import plan_head, round_cost

SIZES = [1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768]
REPEATS = 3
"""Timing rounds per target: each times one target step and every head's round (medians of 7), interleaved."""
COMPARE = {
    "SmolLM2-135M": {
        "shipped (2 layers, 8192)": {"num_hidden_layers": 2, "draft_vocab_size": 8192},
        "1 layer, 10240": {"num_hidden_layers": 1, "draft_vocab_size": 10240},
    },
    "Gemma-3-270M": {
        "previous rule (2 layers, 20480)": {"num_hidden_layers": 2, "draft_vocab_size": 20480},
        "2 layers, 8192": {"num_hidden_layers": 2, "draft_vocab_size": 8192},
        "1 layer, 8192": {"num_hidden_layers": 1, "draft_vocab_size": 8192},
    },
}
"""Heads timed next to the default one with `--compare`: the previous rule's and the shipped head's shapes."""


def shapes() -> dict[str, transformers.PreTrainedConfig]:
    """Target shapes from their published configs (widths, layers, vocabulary), built locally."""
    return {
        "SmolLM2-135M": transformers.LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
        ),
        "Gemma-3-270M": transformers.Gemma3TextConfig(
            vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
            query_pre_attn_scalar=256, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        "Qwen3-0.6B": transformers.Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        ),
        "Llama-3.2-1B": transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        ),
    }  # fmt: skip


def coverage(examples: str, heldout: str | None, vocab_size: int) -> dict:
    train = load_examples(examples)
    held = load_examples(heldout) if heldout else None
    result = {
        "examples": examples,
        "response_tokens": int(sum(sum(e["loss_mask"]) for e in train)),
        "train": draft_vocab_coverage(train, vocab_size, SIZES),
        "chosen": choose_draft_vocab_size(train, vocab_size, 1024, 32768),
    }
    if held is not None:
        result["heldout"] = heldout
        result["heldout_coverage"] = draft_vocab_coverage(train, vocab_size, SIZES, heldout=held)
    return result


def _median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


@torch.no_grad()
def costs(config, context: int = 256, target=None, heads: dict | None = None) -> dict:
    """Milliseconds of one target step and of one drafting round of the default head (random weights, fp32), and
    of the heads `heads` gives (`{label: PEagleConfig overrides}`) next to the same target."""
    torch.manual_seed(0)
    if target is None:
        target = transformers.AutoModelForCausalLM.from_config(config).eval()
    config = target.config
    ids = torch.randint(0, config.vocab_size, (1, context + 1))
    past = transformers.DynamicCache(config=config)
    target(ids[:, :context], use_cache=True, **cache_kwarg(past))

    def target_step():
        target(ids[:, context:], use_cache=True, **cache_kwarg(past))
        past.crop(-1)  # transformers 5.23: a negative count drops that many tokens

    step_cost = plan_head(target).step_cost
    heads = {
        label: PEagleDrafter(PEagleConfig.for_target(target, **overrides)).attach_target(target).eval()
        for label, overrides in {"default": {}, **(heads or {})}.items()
    }
    steps, rounds = [], {label: [] for label in heads}
    for _ in range(REPEATS):  # interleaved, so that the machine's drift hits every head alike
        step = _median_ms(target_step)
        steps.append(step)
        for label, head in heads.items():
            rounds[label].append(_round_ms(head, ids, context) / step)
    step = statistics.median(steps)
    result = {
        "target_step_ms": round(step, 2),
        "target_step_ms_range": [round(min(steps), 2), round(max(steps), 2)],
    }
    for label, head in heads.items():
        ratios = rounds[label]
        entry = {
            "layers": head.config.num_hidden_layers,
            "draft_vocab_size": head.config.draft_vocab_size,
            "ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "draft_round_ms": round(statistics.median(ratios) * step, 2),
            "modeled_ratio": round(round_cost(head.config.to_dict()) / step_cost, 3),
            "k": head.config.num_speculative_tokens,
        }
        if label == "default":
            result.update(entry)
        else:
            result.setdefault("compare", {})[label] = entry
    return result


@torch.no_grad()
def _round_ms(head, ids, context: int) -> float:
    """Median milliseconds of one parallel drafting round after `context` slots (2 real slots + K-1)."""
    from transformers.cache_utils import DynamicCache

    feats = torch.randn(1, context, 3 * head.config.target_hidden_size)
    cache = DynamicCache(config=head.config)
    head(ids[:, 1 : context - 1], feats[:, : context - 2], cache=cache, use_cache=True)
    k = head.config.num_speculative_tokens

    def draft_round():
        head.draft(ids[:, context - 1 : context + 1], feats[:, context - 2 :], k, cache, context - 2)
        cache.crop(-(2 + k - 1))

    return _median_ms(draft_round)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--examples", default=None, help="token-id shards or JSON lines of self-distilled examples"
    )
    ap.add_argument("--heldout", default=None, help="held-out examples to measure coverage on")
    ap.add_argument("--vocab-size", type=int, default=49152, help="the examples' target vocabulary")
    ap.add_argument(
        "--time", action="store_true", help="time target steps and drafting rounds (small targets)"
    )
    ap.add_argument(
        "--compare", action="store_true", help="with --time: also time the previous rule's heads (2 layers)"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results: dict = {"threads": torch.get_num_threads()}
    if args.examples:
        cov = coverage(args.examples, args.heldout, args.vocab_size)
        results["coverage"] = cov
        print(f"draft-vocabulary coverage of response tokens ({cov['response_tokens']:,} training tokens)")
        print(f"{'size':>7} {'train':>8} {'held-out':>9}")
        for n in SIZES:
            held = cov.get("heldout_coverage", {}).get(n)
            print(f"{n:>7} {100 * cov['train'][n]:7.2f}% {'' if held is None else f'{100 * held:8.2f}%'}")
        print(f"choose_draft_vocab_size (99.5% of training response tokens): {cov['chosen']}\n")
    rows = []
    for name, config in shapes().items():
        plan = plan_head(config)
        row = {
            "target": name,
            "target_parameters": plan.target_parameters,
            "layers": plan.values["num_hidden_layers"],
            "draft_vocab_size": plan.values["draft_vocab_size"],
            "vocab_size": plan.values["vocab_size"],
            "head_parameters": plan.head_parameters,
            "fraction": round(plan.fraction, 4),
            "vocab_range": list(plan.vocab_range),
            "modeled_round_fraction": round(plan.round_fraction, 3),
        }
        if args.time and plan.target_parameters < 400e6:
            row.update(costs(config, heads=COMPARE.get(name) if args.compare else None))
        rows.append(row)
        timing = (
            f"  step {row['target_step_ms']} ms, round {row['draft_round_ms']} ms ({row['ratio']}), "
            f"compare {row.get('compare')}"
            if "ratio" in row
            else ""
        )
        print(
            f"{name:14} {plan.target_parameters / 1e6:7.1f}M  head {row['layers']} layers, vocab "
            f"{row['draft_vocab_size']:>6}/{row['vocab_size']:<6} {plan.head_parameters / 1e6:6.2f}M "
            f"({100 * plan.fraction:4.1f}%), round/step {plan.round_fraction:.2f} modeled{timing}"
        )
    if args.time:  # the real default target, not a random-weights shape
        from peagle.targets import load_default_target

        target, _ = load_default_target()
        real = costs(
            target.config,
            target=target.float().eval(),
            heads=COMPARE["SmolLM2-135M"] if args.compare else None,
        )
        rows.append({"target": "SmolLM2-135M-Instruct (real weights)", **real})
        print(
            f"SmolLM2-135M-Instruct (real)  head {real['layers']} layers, vocab {real['draft_vocab_size']}: step "
            f"{real['target_step_ms']} ms, round {real['draft_round_ms']} ms ({real['ratio']}, modeled "
            f"{real['modeled_ratio']}), compare {real.get('compare')}"
        )
    results["heads"] = rows
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
