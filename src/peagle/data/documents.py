"""Long training examples from real documents: teacher-forced self-distillation over long text (issue #67).

A head trained only on short conversations drafts worse after thousands of tokens of context.  Long examples need
no generation: the target reads real text, and at every position the label is the target's own distribution (the
trainer's loss reads the target's logits there), so every token of a document is supervised.  The pieces:

- [`read_documents`]: the text files of a folder (or `"stdlib"`: the Python standard library's own sources, present
  on every machine), in a fixed order, skipping files that are not UTF-8 text;
- [`document_examples`]: examples of given lengths, each whole documents joined end to end (a header line naming
  each file) and cut to the length, with `loss_mask` 1 on every token after the first;
- [`default_document_lengths`]: 2K tokens doubling up to the target's position range (8K for the embedded target);
- [`document_questions`]: chat prompts that ask about long documents, for the target to answer itself (long
  self-distilled examples; the recipe generates their answers).

Examples carry `source="documents"` and the `length` asked for; they are ready for `peagle train --examples` or
[`peagle.training.recipe.train_head`]'s `examples`.  Evaluation sets never enter: a document whose text holds an
MT-Bench or HumanEval prompt is skipped (`peagle.data.evalsets.is_evaluation_prompt`).
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers.utils import logging

from . import evalsets

logger = logging.get_logger(__name__)

DOCUMENT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".tex", ".html", ".json", ".c", ".h", "")
"""The file kinds [`read_documents`] reads from a folder ("": names without a suffix, such as LICENSE or README)."""
MIN_DOCUMENT_LENGTH = 2048
"""The shortest example [`default_document_lengths`] makes: shorter text is what the conversations already cover."""
MAX_DOCUMENT_LENGTH = 8192
"""The longest example [`default_document_lengths`] makes by default (longer ones: pass `lengths`)."""


def is_document_source(source: str | os.PathLike) -> bool:
    """Whether [`read_documents`] can read `source`: `"stdlib"` or an existing folder."""
    return str(source) == "stdlib" or Path(source).expanduser().is_dir()


def read_documents(
    source: str | os.PathLike, suffixes: Sequence[str] = DOCUMENT_SUFFIXES
) -> list[tuple[str, str]]:
    """`(name, text)` of every file under `source` whose suffix is in `suffixes`, sorted by path: a folder, or
    `"stdlib"` for the Python standard library's `.py` sources (tests and site-packages left out).  Files that
    are not UTF-8, are empty, or hold an evaluation-set prompt are skipped; the skipped count is logged."""
    if str(source) == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [
            f
            for f in sorted(root.rglob("*.py"))
            if not {"site-packages", "test", "tests", "idle_test", "__pycache__"}
            & set(f.relative_to(root).parts)
        ]
    else:
        if not is_document_source(source):
            raise ValueError(
                f"documents: {source} is not a folder (expected a folder of text files, or 'stdlib')."
            )
        root = Path(source).expanduser()
        files = [
            f
            for f in sorted(root.rglob("*"))
            if f.is_file() and f.suffix.lower() in suffixes and not f.name.startswith(".")
        ]
    documents, skipped = [], 0
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        if not text.strip() or evalsets.is_evaluation_prompt(text):
            skipped += 1
            continue
        documents.append((str(file.relative_to(root)), text))
    if skipped:
        logger.info(
            f"documents: skipped {skipped} of {len(files)} files (not UTF-8, empty or an evaluation prompt)"
        )
    if not documents:
        raise ValueError(
            f"documents: no readable text files under {source} (suffixes {', '.join(suffixes)})."
        )
    return documents


def default_document_lengths(max_positions: int, max_length: int = MAX_DOCUMENT_LENGTH) -> list[int]:
    """Example lengths for a target with `max_positions` positions: 2K doubling up to `min(max_positions,
    max_length)` (the last one that fits); empty where the target's range is under 2K.

    >>> default_document_lengths(8192), default_document_lengths(32768), default_document_lengths(1024)
    ([2048, 4096, 8192], [2048, 4096, 8192], [])
    """
    top = min(int(max_positions), int(max_length))
    lengths, n = [], MIN_DOCUMENT_LENGTH
    while n <= top:
        lengths.append(n)
        n *= 2
    return lengths


class _DocumentStream:
    """Documents in a shuffled order (fixed by `seed`), each encoded once after a header line naming it, taken in
    turn and wrapping round: `take(n)` joins whole documents until they hold at least `n` tokens."""

    def __init__(self, tokenizer: Any, documents: Sequence[tuple[str, str]], seed: int):
        self.tokenizer, self.documents = tokenizer, documents
        self.order = list(range(len(documents)))
        random.Random(seed).shuffle(self.order)
        self.encoded: dict[int, list[int]] = {}
        self.cursor = 0

    def take(self, length: int) -> tuple[list[int], list[str]]:
        ids: list[int] = []
        names: list[str] = []
        start = self.cursor
        while len(ids) < length:
            i = self.order[self.cursor % len(self.order)]
            self.cursor += 1
            if self.cursor - start > len(self.order):
                raise ValueError(
                    f"documents: the {len(self.documents)} documents hold {len(ids)} tokens; an example of {length} "
                    "needs more text."
                )
            if i not in self.encoded:
                name, text = self.documents[i]
                self.encoded[i] = self.tokenizer(f"# {name}\n{text}\n", add_special_tokens=False).input_ids
            ids += self.encoded[i]
            names.append(self.documents[i][0])
        return ids, names


def document_examples(
    tokenizer: Any,
    documents: Sequence[tuple[str, str]],
    lengths: Iterable[int],
    per_length: int,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """`per_length` examples of each length in `lengths`: documents in a shuffled order (fixed by `seed`), each
    after a header line naming it, joined end to end and cut to the length; every token after the first is
    supervised.  A document longer than the example is cut too (its start is kept), so one example may be one
    long file or many short ones.  Raises `ValueError` when the documents hold fewer tokens than one example."""
    from tqdm.auto import tqdm

    lengths = [int(n) for n in lengths]
    if per_length < 1 or not lengths or min(lengths) < 2:
        raise ValueError(
            f"document_examples: lengths {lengths} x {per_length}; expected lengths >= 2 and a count >= 1."
        )
    stream = _DocumentStream(tokenizer, documents, seed)
    examples = []
    bar = tqdm(total=len(lengths) * per_length, desc="document examples", disable=not progress)
    for length in lengths:
        for _ in range(per_length):
            ids, names = stream.take(length)
            ids = ids[:length]
            examples.append(
                {
                    "input_ids": ids,
                    "loss_mask": [0] + [1] * (length - 1),
                    "source": "documents",
                    "length": length,
                    "documents": names,
                }
            )
            bar.update(1)
    bar.close()
    return examples


DOCUMENT_QUESTIONS = (
    "Summarise what the text above does or says, part by part.",
    "Which functions, classes or sections does the text above define, and what is each one for?",
    "Explain the most intricate part of the text above step by step.",
    "What would make the text above easier to follow? Point to the places you would change.",
    "Write a short guide for someone who has to work with the text above.",
    "List the main ideas of the text above and where each one appears.",
    "What could go wrong when using what the text above describes? Refer to the relevant parts.",
    "Describe how the parts of the text above depend on each other.",
)
"""The questions [`document_questions`] asks about a document (none from an evaluation set)."""


def document_questions(
    tokenizer: Any,
    documents: Sequence[tuple[str, str]],
    lengths: Iterable[int],
    count: int,
    answer_tokens: int = 256,
    seed: int = 0,
) -> list[str]:
    """`count` prompts, each a user message that holds documents (joined as in [`document_examples`], cut so
    the prompt and an answer of `answer_tokens` fit the length) and then one of [`DOCUMENT_QUESTIONS`]; the lengths
    take turns.  The target's own answers to them ([`peagle.data.distill`]) are long-context self-distilled examples:
    their loss covers the answer, which reads the whole document back."""
    lengths = [int(n) for n in lengths]
    if count < 1 or not lengths:
        return []
    rng = random.Random(seed)
    stream = _DocumentStream(tokenizer, documents, seed)
    prompts = []
    for q in range(count):
        budget = max(lengths[q % len(lengths)] - answer_tokens - 64, 64)
        ids, _ = stream.take(budget)
        body = tokenizer.decode(ids[:budget])
        question = DOCUMENT_QUESTIONS[rng.randrange(len(DOCUMENT_QUESTIONS))]
        prompts.append(f"{body}\n\n{question}")
    return prompts


__all__ = [
    "DOCUMENT_QUESTIONS",
    "default_document_lengths",
    "document_examples",
    "document_questions",
    "is_document_source",
    "read_documents",
]
