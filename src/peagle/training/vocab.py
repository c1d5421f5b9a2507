"""The draft vocabulary: which target ids a head can propose (its `t2d`/`d2t` maps)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def select_draft_vocab(
    examples: Iterable[dict[str, Any]], draft_vocab_size: int, vocab_size: int, extra_ids: Iterable[int] = ()
) -> torch.Tensor:
    """The `draft_vocab_size` target ids to keep in the draft vocabulary, sorted ascending.

    Ranks ids by frequency on response tokens (`loss_mask == 1`), then on all tokens, then by id; `extra_ids`
    (e.g. EOS) are always kept.  Pass the result to `PEagleDrafter.set_draft_vocab`.

    Example:

        >>> ex = [{"input_ids": [5, 6, 6, 7, 7, 7], "loss_mask": [0, 1, 1, 1, 1, 1]}]
        >>> select_draft_vocab(ex, 3, vocab_size=10, extra_ids=[2]).tolist()
        [2, 6, 7]
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size is {draft_vocab_size}; expected 1..{vocab_size}.")
    resp = torch.zeros(vocab_size, dtype=torch.long)
    allc = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(ex["loss_mask"], dtype=torch.bool)
        allc += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
        resp += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    big = int(allc.max()) + 1 if allc.numel() else 1
    score = (resp * big + allc).double() * (vocab_size + 1) + (vocab_size - torch.arange(vocab_size)).double()
    extra = [int(i) for i in extra_ids]
    score[extra] = float("inf")
    chosen = torch.topk(score, draft_vocab_size).indices
    return chosen.sort().values


__all__ = ["select_draft_vocab"]
