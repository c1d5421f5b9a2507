"""Long inputs for long-context measurements: a held-out prompt after a long context of whole earlier examples or
of documents (`benchmarks/bench_long_context.py`, `benchmarks/bench_long_heads.py`)."""

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


def document_contexts(
    tokenizer, documents: Sequence[tuple[str, str]], count: int, length: int
) -> list[list[int]]:
    """`count` contexts of up to `length` tokens from `documents` (`(name, text)` pairs, as
    `peagle.data.documents.read_documents` returns them), each starting at another document."""
    from ..data.documents import document_examples

    rows = document_examples(tokenizer, documents, [length], count, seed=7, progress=False)
    return [r["input_ids"] for r in rows]


def long_inputs(
    examples: Sequence[dict[str, Any]],
    contexts: Sequence[int],
    prompts: Sequence[int],
    separator: Sequence[int] = (),
    tokenizer: Any = None,
    documents: str | None = None,
) -> dict[int, list[tuple[list[int], dict[str, Any]]]]:
    """Per context length, `(input ids, info)` for every prompt index of `prompts`: earlier whole examples before
    the prompt ([`build_input`]) or, with `documents` (a folder, or `"stdlib"`; needs `tokenizer`), document text of
    up to the context's length (less the prompt) before it, another document per prompt."""
    from ..data.documents import read_documents

    document_texts = (
        None if documents is None else read_documents(documents)
    )  # once, for every context length
    out: dict[int, list[tuple[list[int], dict[str, Any]]]] = {}
    for context in contexts:
        if document_texts is None or context == 0:
            out[context] = [build_input(examples, i, context, separator) for i in prompts]
            continue
        texts = document_contexts(tokenizer, document_texts, len(prompts), context)
        rows = []
        for text, index in zip(texts, prompts):
            prompt = prompt_part(examples[index])
            ctx = text[: max(0, context - len(prompt))]
            info = {
                "prompt_example": index,
                "context_documents": documents,
                "context_tokens": len(ctx),
                "prompt_tokens": len(prompt),
            }
            rows.append((ctx + prompt, info))
        out[context] = rows
    return out


def checked_long_inputs(
    examples: Sequence[dict[str, Any]],
    tokenizer: Any,
    contexts: Sequence[int],
    prompts: Sequence[int],
    context_source: str = "conversations",
) -> tuple[list[int], dict[int, list[tuple[list[int], dict[str, Any]]]]]:
    """`(separator, inputs)`: [`long_inputs`] with a newline between examples, after earlier examples
    (`context_source="conversations"`) or documents (a folder, or `"stdlib"`); raises `ValueError` when a prompt or
    an example used as context is an MT-Bench or HumanEval prompt."""
    from ..data.prompts import check_not_evaluation

    check_not_evaluation(
        [prompt_part(examples[i]) for i in prompts], tokenizer, source="long-context prompts"
    )
    separator = tokenizer("\n", add_special_tokens=False).input_ids
    documents = None if context_source == "conversations" else context_source
    inputs = long_inputs(examples, contexts, prompts, separator, tokenizer, documents)
    used = sorted(
        {j for rows in inputs.values() for _, info in rows for j in info.get("context_examples", ())}
    )
    check_not_evaluation([prompt_part(examples[j]) for j in used], tokenizer, source="long-context contexts")
    return separator, inputs


__all__ = ["build_input", "checked_long_inputs", "document_contexts", "long_inputs", "prompt_part"]
