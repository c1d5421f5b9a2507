"""Magpie prompts for the default head: the SmolLM2 target writes user turns itself.

The templated prompts of `default_prompts.py` are narrow (12 chat templates x topics, stdlib coding); the
target's own user turns, sampled from its chat template's user prefix, cover far more tasks and phrasings.
`peagle.training.distill.synthesize_prompts` drops MT-Bench and HumanEval turns; each remaining turn is decoded
to text and written as `{"prompt": text}`, ready for `distill_default_data.py` (whose `self_distill` refuses
evaluation prompts again).

Usage:
    python scripts/magpie_default_prompts.py --num 750 --seed 1000 --out data/prompts_magpie_a.jsonl
    # two processes with different seeds; merge and de-duplicate with --merge:
    python scripts/magpie_default_prompts.py --merge a.jsonl b.jsonl --out data/prompts_magpie.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from peagle.targets import load_default_target
from peagle.training.distill import synthesize_prompts
from peagle.training.prompts import user_turn_template


def user_turns(token_prompts: list[list[int]], tokenizer) -> list[str]:
    """The user-turn text of Magpie prompts (`prefix + turn + suffix` token ids)."""
    prefix, suffix = user_turn_template(tokenizer)
    turns = []
    for ids in token_prompts:
        body = ids[len(prefix) : len(ids) - len(suffix)]
        text = tokenizer.decode(body, skip_special_tokens=True).strip()
        if text:
            turns.append(text)
    return turns


def keep(texts: list[str], min_chars: int = 12) -> list[str]:
    """Drop very short turns and duplicates; keep the first occurrence's order."""
    seen, out = set(), []
    for t in texts:
        key = " ".join(t.split()).lower()
        if len(key) < min_chars or key in seen:
            continue
        seen.add(key)
        out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=750, help="user turns to sample")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="longest user turn")
    ap.add_argument("--merge", nargs="+", default=None, help="merge these prompt files instead of sampling")
    args = ap.parse_args()

    if args.merge:
        texts = [json.loads(line)["prompt"] for f in args.merge for line in Path(f).read_text().splitlines()]
        texts = keep(texts)
        random.Random(args.seed).shuffle(texts)
    else:
        target, tokenizer = load_default_target(dtype=torch.bfloat16)
        t0 = time.time()
        raw = synthesize_prompts(
            target, args.num, tokenizer=tokenizer, batch_size=args.batch_size, seed=args.seed,
            max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
        texts = keep(user_turns(raw, tokenizer))
        print(f"sampled {len(raw)} user turns in {time.time() - t0:.0f} s")
    with open(args.out, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"prompt": t}) + "\n")
    print(f"{len(texts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
