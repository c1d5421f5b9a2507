"""Grow the self-distilled training data of the default heads, one resumable cycle at a time.

Each cycle: the target writes user turns itself (Magpie) under a system prompt drawn from a varied list
(chat, writing, maths, many coding domains) at a sampled temperature, adds a slice of stdlib coding
prompts, then answers every prompt greedily with the same system prompt (self-distillation).  Rows
`{"input_ids", "loss_mask", "source"}` are appended to OUT after every cycle, so an interrupted run
loses at most one cycle; the library's evaluation-set guard keeps MT-Bench/HumanEval prompts out.
`scripts/pack_shards.py` turns OUT into the compact token-id shards kept in git.

`--prompt-set 2` (the default; the cycles packed before it, 1-78 and 500-512, used set 1) broadens the kinds
of prompt: system prompts for role-play, reasoning puzzles, extraction, STEM, humanities and completing code
stubs join the list, and half of each cycle's code slice becomes stdlib function stubs to complete
(`stdlib_stub_prompts`), the kind of request HumanEval makes, on functions that are not HumanEval's.  A
cycle's data is fixed by its number, the seed and the prompt set.

With `--engine vllm` the target is served by vLLM (`peagle.training.VLLMEngine`) in the environment that
`--vllm-python` or `$PEAGLE_VLLM_PYTHON` names, with continuous batching; same prompts, seeds and row format.

Usage:  OMP_NUM_THREADS=1 python scripts/grow_data.py --out data/grow/rows.jsonl --cycles 1000
        VLLM_CPU_OMP_THREADS_BIND=0 python scripts/grow_data.py --out data/grow/rows.jsonl --engine vllm \
            --vllm-python "$(bash tests/interop/peer_env.sh)"
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from peagle.runtime import DTYPE_CHOICES, resolve_dtype_name
from peagle.targets import default_target_path, load_default_target
from peagle.training.distill import self_distill, synthesize_prompts
from peagle.training.prompts import (
    DEFAULT_SET_MODULES,
    STDLIB_MODULES,
    stdlib_code_prompts,
    stdlib_stub_prompts,
)
from peagle.training.shards import dataset_folders, packed_cycles
from peagle.training.vllm_engine import VLLMEngine

SYSTEM_PROMPTS = [
    None,  # the template's own default system prompt
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
    "You are a patient teacher who explains things step by step.",
    "You are a creative writing assistant.",
    "You are a math tutor. Users ask you to solve problems.",
    "You are a Python programming assistant. Users ask you to write Python functions and scripts.",
    "You are an expert Python developer. Users ask about data processing with lists, dicts and files.",
    "You are a coding assistant. Users ask you to write SQL queries and explain databases.",
    "You are a JavaScript and web development assistant.",
    "You are a coding assistant. Users ask for algorithms and data structures implemented in Python.",
    "You are a helpful assistant for command-line tools, shell scripts and Linux.",
    "You are a coding assistant. Users ask you to fix bugs and write unit tests.",
    "You are a travel and lifestyle advisor.",
    "You are a science explainer for curious adults.",
    "You are a business and career coach.",
    "You are a cooking assistant who writes recipes.",
    "You are a history enthusiast who answers questions about the past.",
    "You are an assistant that writes emails, letters and summaries.",
    "You are a health and fitness assistant. You give general advice, not medical diagnoses.",
]

# prompt set 2: the kinds of request chat and code benchmarks make that set 1 lacks (never their prompts)
SYSTEM_PROMPTS_2 = SYSTEM_PROMPTS + [
    "You are a role-play partner. Users ask you to act as a character or a professional and stay in role.",
    "You are a logical reasoning assistant. Users give you riddles and logic puzzles; reason step by step.",
    "You are an assistant that extracts names, dates, numbers and facts from text the user pastes, "
    "answering in JSON or a table.",
    "You are a physics, chemistry and engineering tutor.",
    "You are a tutor in philosophy, literature, economics and the social sciences.",
    "You are a writing assistant. Users ask for blog posts, stories, poems and persuasive essays.",
    "You are a maths assistant. Users ask about probability, geometry, algebra and number theory.",
    "You are a Python assistant. Users paste a function signature with a docstring and ask you to "
    "complete the function.",
]
PROMPT_SETS = {1: SYSTEM_PROMPTS, 2: SYSTEM_PROMPTS_2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cycles", type=int, default=1000, help="generate cycles [--first-cycle, --cycles)")
    ap.add_argument(
        "--first-cycle", type=int, default=0, help="first cycle: runs side by side take disjoint ranges"
    )
    ap.add_argument("--magpie-per-cycle", type=int, default=96)
    ap.add_argument("--code-per-cycle", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--prompt-set", type=int, choices=sorted(PROMPT_SETS), default=2)
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the target's dtype while it writes (auto: bfloat16 where this machine computes it natively, else "
        "float32); float32 gives the continuations float32 decoding follows (docs/training.md section 4)",
    )
    ap.add_argument("--vllm-python", help="the vLLM environment's interpreter (default $PEAGLE_VLLM_PYTHON)")
    ap.add_argument(
        "--packed",
        nargs="*",
        default=dataset_folders("training_data/smollm2-135m-instruct"),
        help="shard folders whose manifests list cycles already generated (skipped; default: every shard folder "
        "of training_data/smollm2-135m-instruct, the held-out sets included)",
    )
    args = ap.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done_cycles = set()
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                done_cycles.add(json.loads(line).get("cycle"))
    for folder in args.packed:  # cycles already in git: never generated again (same seed -> same data)
        if Path(folder, "manifest.json").is_file():
            done_cycles |= packed_cycles(folder)
    # auto: bfloat16 only where this machine computes it natively (AVX2 CPUs crawl in bf16)
    dtype = resolve_dtype_name(args.dtype)
    if args.engine == "vllm":  # the same target served by vLLM; transformers only tokenizes
        tokenizer = AutoTokenizer.from_pretrained(default_target_path())
        target = VLLMEngine(default_target_path(), python=args.vllm_python, dtype=dtype)
    else:
        target, tokenizer = load_default_target(dtype=getattr(torch, dtype))
    system_prompts = PROMPT_SETS[args.prompt_set]
    code_pool = stdlib_code_prompts(100_000, seed=args.seed)
    stub_pool = stdlib_stub_prompts(
        100_000, seed=args.seed, modules=sorted({*STDLIB_MODULES, *DEFAULT_SET_MODULES})
    )
    num_stubs = args.code_per_cycle // 2 if args.prompt_set >= 2 else 0
    for cycle in range(args.first_cycle, args.cycles):
        if cycle in done_cycles:
            continue
        rng = random.Random(args.seed * 100_003 + cycle)
        system = rng.choice(system_prompts)
        temperature = rng.choice([0.7, 0.85, 1.0, 1.1])
        t0 = time.time()
        # Magpie: the library drops user turns that are evaluation prompts (and logs how many)
        keep = synthesize_prompts(
            target,
            args.magpie_per_cycle,
            tokenizer=tokenizer,
            system=system,
            temperature=temperature,
            top_p=0.95,
            batch_size=args.batch_size,
            seed=args.seed * 1000 + cycle,
            max_rounds=2,
            progress=False,
        )
        code = pool_slice(code_pool, cycle, args.code_per_cycle - num_stubs)
        stubs = pool_slice(stub_pool, cycle, num_stubs)
        t1 = time.time()
        rows = self_distill(
            target,
            keep,
            tokenizer=tokenizer,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            progress=False,
        )
        rows = [dict(r, source="magpie") for r in rows]
        code_rows = self_distill(
            target,
            code + stubs,
            tokenizer=tokenizer,
            system=system,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            progress=False,
        )
        rows += [dict(r, source="stdlib-code") for r in code_rows[: len(code)]]
        rows += [dict(r, source="stdlib-stub") for r in code_rows[len(code) :]]
        resp = sum(sum(r["loss_mask"]) for r in rows)
        with open(out, "a") as fh:
            for r in rows:
                row = dict(
                    r,
                    cycle=cycle,
                    system=system,
                    temperature=temperature,
                    engine=args.engine,
                    prompt_set=args.prompt_set,
                    dtype=dtype,
                )
                fh.write(json.dumps(row) + "\n")
        dt = time.time() - t0
        print(
            f"cycle {cycle} ({args.engine}): {len(rows)} rows, {resp} response tokens, prompts {t1 - t0:.0f} s, "
            f"total {dt:.0f} s ({resp / dt:.1f} resp tok/s)",
            flush=True,
        )


def pool_slice(pool: list[str], cycle: int, n: int) -> list[str]:
    """Cycle `cycle`'s `n` prompts of `pool`, taken in turn (short at the pool's end, as set 1 always was)."""
    if n <= 0 or not pool:
        return []
    start = (cycle * n) % len(pool)
    return pool[start : start + n]


if __name__ == "__main__":
    main()
