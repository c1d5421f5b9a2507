"""Prepare a 20K-token training run on the CPU: a long-range copy of the embedded target and long examples.

1. The target: SmolLM2-135M-Instruct stops at 8,192 positions.  This writes a copy of its config with
   `max_position_embeddings` raised (RoPE is computed on the fly, so nothing else changes) and its first
   `--layers` decoder layers' weights (the full 30 layers work too; fewer make a CPU run affordable).  Its
   features past 8,192 positions are not what a target trained at that length would give: the run measures
   memory and time, not a head worth shipping.
2. The examples: self-distilled conversations from the repository's training shards, joined end to end (the
   target's own responses supervised, the prompts not) until each example holds `--tokens` tokens.

    python examples/long_context/prepare.py --out long_run --tokens 20480 --examples 4 --layers 6
    peagle train --target long_run/target --examples long_run/examples.jsonl --output_dir long_run/head \\
        --max_length 20480 --partition_memory_budget 4GB --max_steps 2 --save_steps 1 --logging_steps 1
    peagle train ... --max_steps 3 --resume_from_checkpoint last   # the same command, resumed
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def long_examples(source: str, tokens: int, count: int) -> list[dict]:
    from peagle.training import load_examples

    rows = load_examples(source)
    out, ids, mask, used = [], [], [], 0
    for row in rows:
        ids += list(row["input_ids"])
        mask += list(row["loss_mask"])
        used += 1
        if len(ids) >= tokens:
            out.append({"input_ids": ids[:tokens], "loss_mask": mask[:tokens], "conversations": used})
            ids, mask, used = [], [], 0
            if len(out) == count:
                return out
    raise ValueError(f"{source} holds {len(rows)} examples: not enough for {count} x {tokens} tokens.")


def long_range_target(out: str, layers: int, positions: int) -> None:
    from peagle.targets import load_default_target

    target, tokenizer = load_default_target(torch.float32)
    config = target.config
    if layers < config.num_hidden_layers:
        target.model.layers = target.model.layers[:layers]
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.max_position_embeddings = positions
    target.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="long_run")
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--examples", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6, help="target decoder layers kept (SmolLM2 has 30)")
    ap.add_argument("--positions", type=int, default=32768)
    ap.add_argument("--source", default="training_data/smollm2-135m-instruct/train")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    examples = long_examples(args.source, args.tokens, args.examples)
    with open(os.path.join(args.out, "examples.jsonl"), "w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(json.dumps(ex) + "\n")
    long_range_target(os.path.join(args.out, "target"), args.layers, args.positions)
    print(
        f"wrote {len(examples)} examples of {args.tokens} tokens ({sum(e['conversations'] for e in examples)} "
        f"conversations) and a {args.layers}-layer target with {args.positions} positions under {args.out}/"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
