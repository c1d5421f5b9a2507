"""The draft vocabulary: most frequent response tokens, then all tokens, then ids; extra ids kept."""

from __future__ import annotations

import doctest

import pytest
import torch

from peagle.data import load_examples, save_examples, select_draft_vocab, vocab


def test_docstring_examples():
    result = doctest.testmod(vocab, verbose=False)
    assert result.failed == 0 and result.attempted > 0


def test_examples_round_trip_and_draft_vocab(tmp_path):
    examples = [
        {"input_ids": [1, 5, 6, 6, 9, 2], "loss_mask": [0, 0, 1, 1, 1, 1]},
        {"input_ids": torch.tensor([1, 7, 6, 9]), "loss_mask": torch.tensor([0, 0, 1, 1])},
    ]
    save_examples(examples, tmp_path / "ex.jsonl")
    loaded = load_examples(tmp_path / "ex.jsonl")
    assert loaded[1] == {"input_ids": [1, 7, 6, 9], "loss_mask": [0, 0, 1, 1]}
    # response counts: 6 x3, 9 x2, 2 x1; then prompt-only tokens by total count (1 x2), ties by id
    assert select_draft_vocab(loaded, 3, 16).tolist() == [2, 6, 9]
    assert select_draft_vocab(loaded, 4, 16).tolist() == [1, 2, 6, 9]
    assert select_draft_vocab(loaded, 3, 16, extra_ids=[15]).tolist() == [6, 9, 15]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(loaded, 17, 16)
