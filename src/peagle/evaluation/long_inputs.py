"""Long inputs for long-context measurements: a held-out prompt after a long context of whole earlier examples
(`benchmarks/bench_long_context.py`, `benchmarks/bench_long_heads.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def prompt_part(example: dict[str, Any]) -> list[int]:
    """An example's prompt: its tokens before the first supervised one (`loss_mask` 1)."""
    mask = list(example["loss_mask"])
    cut = mask.index(1) if 1 in mask else len(mask)
    return list(example["input_ids"])[:cut]


def build_input(
    examples: Sequence[dict[str, Any]], index: int, context: int, separator: Sequence[int] = ()
) -> tuple[list[int], dict[str, Any]]:
    """The input of prompt `index` at context `context`: whole other examples (each followed by `separator`), the
    ones before `index` going back and wrapping round, as many as fit in `context` tokens, oldest first, then the
    prompt part of example `index`.  Returns `(ids, info)`, info with the real context length and the examples
    used."""
    prompt = prompt_part(examples[index])
    picked: list[int] = []
    total = 0
    for step in range(1, len(examples)):
        j = (index - step) % len(examples)
        size = len(examples[j]["input_ids"]) + len(separator)
        if total + size > context:
            break
        picked.append(j)
        total += size
    picked.reverse()
    ids: list[int] = []
    for j in picked:
        ids += list(examples[j]["input_ids"]) + list(separator)
    info = {
        "prompt_example": index,
        "context_examples": picked,
        "context_tokens": len(ids),
        "prompt_tokens": len(prompt),
    }
    return ids + prompt, info


__all__ = ["build_input", "prompt_part"]
