"""The decoding walk: what greedy decoding with K drafts every round yields through one example, from which drafts
are correct at each anchor (counted teacher-forced in one pass by `teacher_forced.evaluate_acceptance`)."""

from __future__ import annotations

import torch


def decoding_walk(
    correct: torch.Tensor, loss_mask: torch.Tensor, max_new_tokens: int | None = None
) -> tuple[int, int]:
    """New tokens and target passes of greedy decoding that drafts K tokens every round through one example.

    Args:
        correct: `(T, K)` bool, `correct[a, d]`: the draft at depth d of a round after anchor a (target features
            up to a, tokens up to a + 1 known) equals token a + d + 2.
        loss_mask: `(T,)`: the response tokens. Each contiguous response is decoded on its own: the prefill
            yields its first token in one pass, then every round yields 1 + the leading run of correct drafts,
            cut at the response's end (and at `max_new_tokens`), and the next round starts after the last of them.
        max_new_tokens: tokens decoded per response at most (default: all of it).

    Returns:
        `(tokens, passes)`, summed over the example's responses.
    """
    mask = [bool(m) for m in loss_mask.tolist()]
    k = correct.shape[1]
    correct = correct.tolist()  # read element by element below: Python lists, not tensor indexing
    tokens = passes = 0
    start = 0
    while start < len(mask):
        if not mask[start] or start == 0:  # a response needs a prompt before it
            start += 1
            continue
        end = start
        while end + 1 < len(mask) and mask[end + 1]:
            end += 1
        limit_tokens = end - start + 1 if max_new_tokens is None else min(end - start + 1, max_new_tokens)
        made, rounds, anchor = 1, 1, start - 1  # the prefill pass yields token `start`
        while made < limit_tokens:
            run, limit = 0, min(k, limit_tokens - made - 1)
            while run < limit and correct[anchor][run]:
                run += 1
            made, rounds, anchor = made + 1 + run, rounds + 1, anchor + 1 + run
        tokens, passes = tokens + made, passes + rounds
        start = end + 1
    return tokens, passes


__all__ = ["decoding_walk"]
