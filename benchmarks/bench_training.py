"""Training throughput of the standard recipe: response tokens trained per second and where the time goes.

Runs `--steps` optimizer steps of `PEagleTrainer` on self-distilled examples (a shard folder or JSONL) for the
embedded SmolLM2 target, with the head of the standard recipe (its default depth, 8k draft vocabulary, the
target's frozen embeddings, K_train 8 and COD 0.7 unless given), and splits the wall time with hooks into: target
features (the frozen target's forward), drafter forward, backward, loss, attention-mask building, and the rest
(data, optimizer, bookkeeping).  Prints a table and writes JSON.  Run it on an otherwise idle machine.

Usage:
    python benchmarks/bench_training.py --examples training_data/smollm2-135m-instruct/train --steps 20 --out bench_results/training.json
    python benchmarks/bench_training.py --examples ... --bf16          # the same with bf16 autocast
    python benchmarks/bench_training.py --examples ... --bf16 --feature-cache runs/cache-bench   # features read, not computed
    python benchmarks/bench_training.py --examples ... --bf16 --cod-ratio 0.5 --num-parallel-positions 4  # the levers
    python benchmarks/bench_training.py --examples ... --bf16 --trainable-parameters '^(?!lm_head)'  # LM head frozen
    python benchmarks/bench_training.py --examples ... --bf16 --num-layers 4   # the shipped P-EAGLE head's depth
    # one 20K-token step with S chosen from a 4 GB budget (examples/long_context/prepare.py makes the inputs)
    python benchmarks/bench_training.py --examples long_run/examples.jsonl --target long_run/target \
        --max-length 20480 --steps 1 --grad-accum 1 --limit 1 --num-layers 4 --partition-memory-budget 4GB --no-warmup
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from peagle.configuration_peagle import DEFAULT_NUM_HIDDEN_LAYERS, DEFAULT_NUM_PARALLEL_POSITIONS
from peagle.data.shards import load_examples
from peagle.evaluation.timing import machine_description
from peagle.targets import DEFAULT_TARGET_NAME, load_target
from peagle.training.arguments import HeadArguments, PEagleTrainingArguments
from peagle.training.recipe import build_head, training_arguments
from peagle.training.step import PartitionedStep
from peagle.training.trainer import PEagleTrainer

MASK_TOKEN_ID = 16  # SmolLM2's "<empty_output>"


class Timers:
    """Wall-time totals of named phases; a phase nested in another is subtracted from it."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.stack.append([name, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                phase, t0, inner = self.stack.pop()
                total = time.perf_counter() - t0
                self.seconds[phase] += total - inner
                if self.stack:
                    self.stack[-1][2] += total

        return timed


def parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", required=True)
    ap.add_argument("--limit", type=int, default=256, help="examples to draw batches from")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps to time (after one warm-up step)")
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the drafter")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--num-parallel-positions",
        type=int,
        default=DEFAULT_NUM_PARALLEL_POSITIONS,
        help="K_train (the recipe's)",
    )
    ap.add_argument(
        "--cod-ratio",
        type=float,
        default=PEagleTrainingArguments.cod_ratio,
        help="COD keep ratio per depth (the recipe's)",
    )
    ap.add_argument(
        "--num-layers",
        type=int,
        default=DEFAULT_NUM_HIDDEN_LAYERS,
        help="the head's decoder layers (the recipe's)",
    )
    ap.add_argument(
        "--trainable-parameters",
        default=None,
        help="a regular expression over the head's parameter names: only those train (e.g. '^(?!lm_head)', the "
        "LM head frozen, as the P-EAGLE head's stages since 35)",
    )
    ap.add_argument(
        "--feature-cache",
        default=None,
        help="directory of a feature cache for the examples (built first if missing, timed separately): "
        "training then reads the target's features instead of running the target",
    )
    ap.add_argument("--target", default="default", help="target: 'default' (SmolLM2) or a folder")
    ap.add_argument("--no-warmup", action="store_true", help="time from the first step (long examples)")
    ap.add_argument("--sequence-partitions", type=int, default=1, help="S (the minimum, with a budget)")
    ap.add_argument("--partition-memory-budget", default=None, help="choose S from this size, e.g. 4GB")
    ap.add_argument("--out", default="bench_results/training.json")
    return ap


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, object, dict | None]:
    """`(target, head, dataset, cache)`: the target, a fresh head of the recipe, the examples (or their feature
    cache, built or loaded and timed here) and the cache's description (None without `--feature-cache`)."""
    examples = load_examples(args.examples)[: args.limit]
    target, _ = load_target(args.target, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    head = build_head(
        target,
        examples,
        HeadArguments(
            num_hidden_layers=args.num_layers,
            draft_vocab_size=8192,
            embed_from_target=True,
            mask_token_id=MASK_TOKEN_ID,
        ),
        num_parallel_positions=args.num_parallel_positions,
        target_model_name=DEFAULT_TARGET_NAME,
    )
    if not args.feature_cache:
        return target, head, examples, None
    from peagle.data.features import FeatureCache

    t0 = time.perf_counter()
    dataset = FeatureCache.build(
        target, examples, args.feature_cache, head.config.eagle_aux_hidden_state_layer_ids
    )
    cache = {
        "path": args.feature_cache,
        "build_or_load_seconds": time.perf_counter() - t0,
        "tokens": dataset.index["num_tokens"],
        "bytes": dataset.size_bytes,
    }
    print(f"{dataset} ready in {cache['build_or_load_seconds']:.1f} s")
    return target, head, dataset, cache


def instrument(trainer: PEagleTrainer, head: torch.nn.Module, timers: Timers) -> dict[str, int]:
    """Wrap the trainer's phases in `timers`; returns the running count of response tokens trained."""
    trainer._features = timers.wrap("target features", trainer._features)
    # the step object is built per micro-batch: its phases are timed on the class
    PartitionedStep._attention = timers.wrap("attention mask", PartitionedStep._attention)
    PartitionedStep._prefix_pass = timers.wrap(
        "prefix keys/values (forward, no grad)", PartitionedStep._prefix_pass
    )
    PartitionedStep._score = timers.wrap("loss", PartitionedStep._score)
    PartitionedStep._target_distribution = timers.wrap("loss", PartitionedStep._target_distribution)
    trainer.accelerator.backward = timers.wrap("backward", trainer.accelerator.backward)
    original_forward = head.forward
    head.forward = timers.wrap("drafter forward", original_forward)
    tokens = {"response": 0}
    original_step = trainer.training_step

    def counting_step(model, inputs, num_items_in_batch=None):
        if "loss_mask" in inputs:
            tokens["response"] += int(inputs["loss_mask"].sum())
        return original_step(model, inputs, num_items_in_batch)

    trainer.training_step = counting_step
    return tokens


def train_timed(args: argparse.Namespace, target, head, dataset, timers: Timers) -> tuple[float, int]:
    """Train `--steps` optimizer steps (after one warm-up step unless `--no-warmup`) with the phases timed; returns
    `(wall seconds, response tokens trained)` of the timed steps."""
    from transformers import TrainerCallback

    with tempfile.TemporaryDirectory() as tmp:
        targs = training_arguments(
            tmp,
            max_steps=args.steps + (0 if args.no_warmup else 1),
            gradient_accumulation_steps=args.grad_accum,
            max_length=args.max_length,
            num_parallel_positions=args.num_parallel_positions,
            cod_ratio=args.cod_ratio,
            bf16=args.bf16,
            save_strategy="no",
            logging_steps=10_000,
            progress=False,
            trainable_parameters=args.trainable_parameters,
            sequence_partitions=args.sequence_partitions,
            partition_memory_budget=args.partition_memory_budget,
        )
        trainer = PEagleTrainer(
            model=head.attach_target(target), target_model=target, args=targs, train_dataset=dataset
        )
        tokens = instrument(trainer, head, timers)
        start = {}

        class Clock(TrainerCallback):
            def on_train_begin(self, args_, state, control, **kw):
                if args.no_warmup:
                    start["t"] = time.perf_counter()
                    start["tokens"] = tokens["response"]

            def on_step_end(self, args_, state, control, **kw):
                if state.global_step == 1 and not args.no_warmup:  # the first step warms up: time from here
                    start["t"] = time.perf_counter()
                    start["tokens"] = tokens["response"]
                    timers.seconds.clear()

        trainer.add_callback(Clock())
        trainer.train()
        wall = time.perf_counter() - start["t"]
    return wall, tokens["response"] - start["tokens"]


def report(args: argparse.Namespace, wall: float, trained: int, timers: Timers, cache: dict | None) -> None:
    """Print the throughput and the split of the wall time; write the JSON to `--out`."""
    split = dict(timers.seconds)
    split["other (data, optimizer, bookkeeping)"] = max(0.0, wall - sum(split.values()))
    result = {
        "response_tokens_per_second": trained / wall,
        "response_tokens": trained,
        "seconds": wall,
        "optimizer_steps": args.steps,
        "split_seconds": split,
        "settings": vars(args),
        "feature_cache": cache,
        "machine": machine_description(),
    }
    print(f"{trained} response tokens in {wall:.1f} s: {trained / wall:.1f} tokens/s")
    for name, sec in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {sec:8.1f} s  {100 * sec / wall:5.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def main() -> None:
    args = parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, head, dataset, cache = build(args)
    timers = Timers()
    wall, trained = train_timed(args, target, head, dataset, timers)
    report(args, wall, trained, timers, cache)


if __name__ == "__main__":
    main()
