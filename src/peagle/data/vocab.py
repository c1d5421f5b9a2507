"""The draft vocabulary: which target ids a head can propose (its `t2d`/`d2t` maps), and how many.

[`token_counts`] counts ids on response and on all tokens; [`select_draft_vocab`] keeps the most frequent ones;
[`draft_vocab_coverage`] tells which share of response tokens a vocabulary of each size covers, and
[`coverage_vocab_size`] gives the smallest size that covers `VOCAB_COVERAGE` (99.5%) of them (the size rule keeps
that many ids before a second layer), and [`choose_draft_vocab_size`] the smallest in the range
`peagle.sizing.plan_head` allows (docs/families.md has the measurements behind these defaults).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def token_counts(examples: Iterable[dict[str, Any]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(response, all)`: how often each id occurs on response tokens (`loss_mask == 1`) and on all tokens,
    two int64 tensors of shape `(vocab_size,)`."""
    resp = torch.zeros(vocab_size, dtype=torch.long)
    allc = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = torch.as_tensor(ex["input_ids"], dtype=torch.long).flatten()
        mask = torch.as_tensor(ex["loss_mask"], dtype=torch.bool).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"an example holds token ids outside [0, {vocab_size}): {int(ids.max())}.")
        allc += torch.bincount(ids, minlength=vocab_size)
        resp += torch.bincount(ids[mask], minlength=vocab_size)
    return resp, allc


def _ranking(resp: torch.Tensor, allc: torch.Tensor, extra_ids: Iterable[int] = ()) -> torch.Tensor:
    """All ids, best first: `extra_ids`, then by response count, then by total count, then by id."""
    vocab_size = resp.numel()
    big = int(allc.max()) + 1 if allc.numel() else 1
    score = (resp * big + allc).double() * (vocab_size + 1) + (vocab_size - torch.arange(vocab_size)).double()
    extra = [int(i) for i in extra_ids]
    score[extra] = float("inf")
    return torch.argsort(score, descending=True, stable=True)


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
    resp, allc = token_counts(examples, vocab_size)
    return _ranking(resp, allc, extra_ids)[:draft_vocab_size].sort().values


def draft_vocab_coverage(
    examples: Sequence[dict[str, Any]],
    vocab_size: int,
    sizes: Iterable[int],
    heldout: Sequence[dict[str, Any]] | None = None,
) -> dict[int, float]:
    """Share of response tokens the draft vocabulary of each size in `sizes` covers.

    The vocabulary of size n is what [`select_draft_vocab`] keeps from `examples`; the share is measured on the
    response tokens of `heldout` when given (what a head meets after training), else of `examples` themselves.

    Example:

        >>> ex = [{"input_ids": [5, 6, 6, 7, 7, 7], "loss_mask": [0, 1, 1, 1, 1, 1]}]
        >>> draft_vocab_coverage(ex, 10, [1, 2])
        {1: 0.6, 2: 1.0}
    """
    resp, allc = token_counts(examples, vocab_size)
    order = _ranking(resp, allc)
    measured = token_counts(heldout, vocab_size)[0] if heldout is not None else resp
    total = int(measured.sum())
    if total == 0:
        raise ValueError("no response tokens (loss_mask == 1) to measure coverage on.")
    covered = measured[order].cumsum(0)
    return {int(n): round(float(covered[min(int(n), vocab_size) - 1]) / total, 6) for n in sizes}


def coverage_vocab_size(
    examples: Sequence[dict[str, Any]],
    vocab_size: int,
    coverage: float | None = None,
    step: int | None = None,
) -> int | None:
    """The smallest draft vocabulary (a multiple of `step`, at most `vocab_size`) whose [`select_draft_vocab`]
    choice covers `coverage` (default `VOCAB_COVERAGE`, 99.5%) of the examples' response tokens; None when they
    have none.  `peagle.sizing.plan_head(..., needed_vocab=...)` keeps a vocabulary this large before it keeps
    a second layer.

    Example:

        >>> ex = [{"input_ids": list(range(40)) + [3] * 400, "loss_mask": [1] * 440}]
        >>> coverage_vocab_size(ex, 100, step=8)
        40
    """
    from ..sizing import VOCAB_COVERAGE, VOCAB_STEP

    coverage = VOCAB_COVERAGE if coverage is None else float(coverage)
    step = VOCAB_STEP if step is None else int(step)
    resp, allc = token_counts(examples, vocab_size)
    total = int(resp.sum())
    if total == 0:
        return None
    covered = resp[_ranking(resp, allc)].cumsum(0).double() / total
    needed = int(torch.searchsorted(covered, torch.tensor([coverage], dtype=covered.dtype))[0]) + 1
    return min(-(-needed // step) * step, vocab_size)


def choose_draft_vocab_size(
    examples: Sequence[dict[str, Any]],
    vocab_size: int,
    smallest: int,
    largest: int,
    coverage: float | None = None,
    step: int | None = None,
) -> int:
    """The smallest draft vocabulary in `[smallest, largest]` (a multiple of `step`, or `largest`) whose
    [`select_draft_vocab`] choice covers `coverage` of the examples' response tokens.

    Defaults: `coverage = peagle.sizing.VOCAB_COVERAGE` (0.995), `step = VOCAB_STEP` (1024).  The range comes
    from `peagle.sizing.plan_head` (the head-size rule); the data only chooses within it.

    Example:

        >>> ex = [{"input_ids": list(range(40)) + [3] * 400, "loss_mask": [1] * 440}]
        >>> choose_draft_vocab_size(ex, 100, smallest=8, largest=64, step=8)
        40
    """
    if not 0 < smallest <= largest <= vocab_size:
        raise ValueError(
            f"expected 0 < smallest <= largest <= vocab_size, got {smallest}, {largest}, {vocab_size}."
        )
    size = coverage_vocab_size(examples, vocab_size, coverage, step)
    if size is None:
        return largest
    return max(smallest, min(largest, size))


__all__ = [
    "select_draft_vocab",
    "token_counts",
    "draft_vocab_coverage",
    "choose_draft_vocab_size",
    "coverage_vocab_size",
]
