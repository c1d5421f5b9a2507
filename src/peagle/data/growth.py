"""Grow the self-distilled training data of the default heads, one resumable cycle at a time.

Each cycle: the target writes user turns itself (Magpie) under a system prompt drawn from a varied list
(chat, writing, maths, many coding domains) at a sampled temperature, adds a slice of stdlib coding
prompts, then answers every prompt greedily with the same system prompt (self-distillation).  Rows
`{"input_ids", "loss_mask", "source"}` are appended to OUT after every cycle, so an interrupted run
loses at most one cycle; the library's evaluation-set guard keeps MT-Bench/HumanEval prompts out.
`peagle pack` turns OUT into the compact token-id shards kept in git.

`--prompt_set 2` (the default; the cycles packed before it, 1-78 and 500-512, used set 1) broadens the kinds
of prompt: system prompts for role-play, reasoning puzzles, extraction, STEM, humanities and completing code
stubs join the list, and half of each cycle's code slice becomes stdlib function stubs to complete
(`stdlib_stub_prompts`), the kind of request HumanEval makes, on functions that are not HumanEval's.  A
cycle's data is fixed by its number, the seed and the prompt set.

With `--engine vllm` the target is served by vLLM (`peagle.training.VLLMEngine`) in the environment that
`--vllm_python` or `$PEAGLE_VLLM_PYTHON` names, with continuous batching; same prompts, seeds and row format.

Usage:  OMP_NUM_THREADS=1 peagle grow-data --out data/grow/rows.jsonl --cycles 1000
        VLLM_CPU_OMP_THREADS_BIND=0 peagle grow-data --out data/grow/rows.jsonl --engine vllm \
            --vllm_python "$(bash tests/interop/peer_env.sh)"
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime import DTYPE_CHOICES, resolve_dtype_name
from .prompts import DEFAULT_SET_MODULES, STDLIB_MODULES, stdlib_code_prompts, stdlib_stub_prompts
from .shards import dataset_folders, packed_cycles

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


@dataclass
class GrowDataArguments:
    """The settings of `peagle grow-data` (each field is a flag of the same name)."""

    out: str = field(metadata={"help": "JSONL file the rows are appended to"})
    cycles: int = field(default=1000, metadata={"help": "generate cycles [first_cycle, cycles)"})
    first_cycle: int = field(
        default=0, metadata={"help": "first cycle: runs side by side take disjoint ranges"}
    )
    magpie_per_cycle: int = 96
    code_per_cycle: int = 24
    max_new_tokens: int = 320
    batch_size: int = 32
    seed: int = 31
    prompt_set: int = field(default=2, metadata={"choices": sorted(PROMPT_SETS)})
    engine: str = field(default="transformers", metadata={"choices": ["transformers", "vllm"]})
    dtype: str = field(
        default="auto",
        metadata={
            "choices": DTYPE_CHOICES,
            "help": "the target's dtype while it writes (auto: bfloat16 where this machine computes it natively, "
            "else float32); float32 gives the continuations float32 decoding follows",
        },
    )
    vllm_python: str | None = field(
        default=None, metadata={"help": "the vLLM environment's interpreter (default $PEAGLE_VLLM_PYTHON)"}
    )
    packed: list[str] = field(
        default_factory=lambda: dataset_folders("training_data/smollm2-135m-instruct"),
        metadata={
            "help": "shard folders whose manifests list cycles already generated (skipped; default: every shard "
            "folder of training_data/smollm2-135m-instruct, the held-out sets included)"
        },
    )


def cycles_done(out: Path, packed: list[str]) -> set[int]:
    """Cycles already in `out` or in the manifests of the `packed` shard folders (same seed -> same data)."""
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                done.add(json.loads(line).get("cycle"))
    for folder in packed:
        if Path(folder, "manifest.json").is_file():
            done |= packed_cycles(folder)
    return done


def load_writer(engine: str, dtype: str, vllm_python: str | None = None):
    """The default target that writes the data, and its tokenizer: in transformers, or served by vLLM
    (transformers then only tokenizes)."""
    import torch
    from transformers import AutoTokenizer

    from ..targets import default_target_path, load_default_target

    if engine == "vllm":
        from .vllm_engine import VLLMEngine

        tokenizer = AutoTokenizer.from_pretrained(default_target_path())
        return VLLMEngine(default_target_path(), python=vllm_python, dtype=dtype), tokenizer
    return load_default_target(dtype=getattr(torch, dtype))


def cycle_rows(
    target, tokenizer, args: GrowDataArguments, cycle: int, pools: tuple[list[str], list[str]]
) -> list[dict]:
    """One cycle's rows: Magpie user turns and a slice of stdlib coding prompts (and stubs, prompt set 2),
    each answered greedily by the target under the cycle's system prompt; fixed by cycle, seed and prompt set."""
    from .distill import self_distill, synthesize_prompts

    rng = random.Random(args.seed * 100_003 + cycle)
    system = rng.choice(PROMPT_SETS[args.prompt_set])
    temperature = rng.choice([0.7, 0.85, 1.0, 1.1])
    num_stubs = args.code_per_cycle // 2 if args.prompt_set >= 2 else 0
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
    code = pool_slice(pools[0], cycle, args.code_per_cycle - num_stubs)
    stubs = pool_slice(pools[1], cycle, num_stubs)
    common: dict[str, Any] = dict(
        tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=False
    )
    rows = [dict(r, source="magpie") for r in self_distill(target, keep, **common)]
    code_rows = self_distill(target, code + stubs, system=system, **common)
    rows += [dict(r, source="stdlib-code") for r in code_rows[: len(code)]]
    rows += [dict(r, source="stdlib-stub") for r in code_rows[len(code) :]]
    made = dict(cycle=cycle, system=system, temperature=temperature, engine=args.engine)
    return [dict(r, **made, prompt_set=args.prompt_set) for r in rows]


def grow_data(args: GrowDataArguments) -> int:
    """Run the cycles of `args` not done yet, appending each cycle's rows to `args.out`; returns the number run."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = cycles_done(out, args.packed)
    dtype = resolve_dtype_name(args.dtype)  # auto: bfloat16 only where this machine computes it natively
    target, tokenizer = load_writer(args.engine, dtype, args.vllm_python)
    modules = sorted({*STDLIB_MODULES, *DEFAULT_SET_MODULES})
    pools = (
        stdlib_code_prompts(100_000, seed=args.seed),
        stdlib_stub_prompts(100_000, seed=args.seed, modules=modules),
    )
    ran = 0
    for cycle in range(args.first_cycle, args.cycles):
        if cycle in done:
            continue
        t0 = time.time()
        rows = [dict(r, dtype=dtype) for r in cycle_rows(target, tokenizer, args, cycle, pools)]
        with open(out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        resp, dt = sum(sum(r["loss_mask"]) for r in rows), time.time() - t0
        print(
            f"cycle {cycle} ({args.engine}): {len(rows)} rows, {resp} response tokens in {dt:.0f} s "
            f"({resp / dt:.1f} resp tok/s)",
            flush=True,
        )
        ran += 1
    return ran


def pool_slice(pool: list[str], cycle: int, n: int) -> list[str]:
    """Cycle `cycle`'s `n` prompts of `pool`, taken in turn (short at the pool's end, as set 1 always was)."""
    if n <= 0 or not pool:
        return []
    start = (cycle * n) % len(pool)
    return pool[start : start + n]


__all__ = ["GrowDataArguments", "grow_data", "cycle_rows", "cycles_done", "pool_slice", "PROMPT_SETS"]
