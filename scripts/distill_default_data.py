"""Self-distilled training data for the default head: the SmolLM2 target answers every prompt itself.

Reads prompts (JSONL with a "prompt" field, e.g. from `default_prompts.py`), regenerates each response
with the target's chat template (batched, left-padded, greedy), and appends rows
`{"input_ids": [...], "loss_mask": [...]}` (loss_mask = 1 on response tokens) to the output JSONL.
Rows already present are skipped, so an interrupted run resumes.

Usage:
    python scripts/distill_default_data.py --prompts prompts.jsonl --out data.jsonl \
        --max-new-tokens 256 --batch-size 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peagle.targets import load_default_target


def self_distill(target, tokenizer, prompts, max_new_tokens=256, batch_size=32):
    """Yield `{"input_ids", "loss_mask"}` rows in prompt order: chat prompt + the target's greedy answer."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    with tqdm(total=len(chats), desc="self-distil", unit="prompt") as bar:
        for start in range(0, len(chats), batch_size):
            enc = tokenizer(
                chats[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            with torch.inference_mode():
                out = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            width = enc["input_ids"].shape[1]
            for i in range(out.shape[0]):
                prompt = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
                resp = out[i, width:].tolist()
                if tokenizer.eos_token_id in resp:
                    resp = resp[: resp.index(tokenizer.eos_token_id) + 1]
                yield {"input_ids": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp)}
            bar.update(out.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser(description="self-distil training data for the default head")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()

    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.limit]
    out = Path(args.out)
    done = sum(1 for line in out.read_text().splitlines() if line.strip()) if out.exists() else 0
    todo = prompts[done:]
    print(f"{len(prompts)} prompts, {done} already distilled, {len(todo)} to go")
    target, tokenizer = load_default_target(dtype=getattr(torch, args.dtype))
    t0 = time.time()
    tokens = 0
    with open(args.out, "a") as fh:
        for row in self_distill(
            target, tokenizer, todo, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
        ):
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            tokens += int(sum(row["loss_mask"]))
    dt = time.time() - t0
    print(f"{tokens} response tokens in {dt:.0f} s ({tokens / max(dt, 1e-9):.0f} tok/s) -> {args.out}")


if __name__ == "__main__":
    main()
