"""Self-distilled training data for the default head: the SmolLM2 target answers every prompt itself.

Reads prompts (JSONL with a "prompt" field, e.g. from `default_prompts.py`), regenerates each response
with the target's chat template (batched, left-padded, greedy), and appends rows
`{"input_ids": [...], "loss_mask": [...]}` (loss_mask = 1 on response tokens) to the output JSONL.
Rows already present are skipped, so an interrupted run resumes.  `self_distill` refuses MT-Bench and HumanEval
prompts.

Usage:
    python scripts/distill_default_data.py --prompts prompts.jsonl --out data.jsonl \
        --max-new-tokens 256 --batch-size 32 --dtype bfloat16
    # two processes, one thread each, on the two halves:  --limit 576 --out a.jsonl  /  --start 576 --out b.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from peagle.targets import load_default_target
from peagle.training.distill import self_distill

CHUNK = 64  # prompts per appended chunk, so an interrupted run resumes


def main() -> None:
    ap = argparse.ArgumentParser(description="self-distil training data for the default head")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--start", type=int, default=0, help="skip the first START prompts (to split the work)")
    ap.add_argument("--limit", type=int, default=None, help="stop before prompt number LIMIT")
    args = ap.parse_args()

    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][args.start : args.limit]
    out = Path(args.out)
    done = sum(1 for line in out.read_text().splitlines() if line.strip()) if out.exists() else 0
    todo = prompts[done:]
    print(f"{len(prompts)} prompts, {done} already distilled, {len(todo)} to go")
    target, tokenizer = load_default_target(dtype=getattr(torch, args.dtype))
    t0 = time.time()
    tokens = 0
    with open(args.out, "a") as fh:
        for start in range(0, len(todo), CHUNK):
            chunk = todo[start : start + CHUNK]
            rows = self_distill(
                target,
                chunk,
                tokenizer=tokenizer,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
            )
            for row in rows:
                fh.write(json.dumps(row) + "\n")
                tokens += int(sum(row["loss_mask"]))
            fh.flush()
    dt = time.time() - t0
    print(f"{tokens} response tokens in {dt:.0f} s ({tokens / max(dt, 1e-9):.0f} tok/s) -> {args.out}")


if __name__ == "__main__":
    main()
