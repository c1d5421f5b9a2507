"""Reductions over the vocabulary axis (the last one) that every round runs on each slot it verifies or drafts: the
first argmax, the maximum with its index, and the top k.

On a CPU, torch's `argmax`, `max(dim)` and `topk` walk that axis one row at a time, about ten times slower than its
vectorised `amax` (the argmax of a verify pass of 33 slots over a 49K vocabulary: 1.4 ms on fresh logits, against
0.6-0.7 ms here).  Here each runs as an `amax` over blocks of `BLOCK` entries, then the index
reduction over the block maxima and over the one block (or the k blocks) holding the answer; the entries after the
last whole block form a block of their own.  The results are torch's own (docs/DESIGN.md section 10.3): the first
index of the maximum, NaN counted as the maximum as torch counts it; the top k as a set, sorted descending (torch
leaves the order of equal values unspecified).  Other devices keep torch's kernels, which are fast there.
"""

from __future__ import annotations

import torch

BLOCK = 128
"""Entries per block (timed on an AMD EPYC: 64 to 512 ran within 20% of each other)."""

MIN_ENTRIES = 1 << 19
"""The fewest entries (rows x vocabulary) the blocks serve: below it torch's one kernel beats their few more ops (a
plain step's `(8, 49152)` argmax at B = 8, a drafter round's `(8, 7, 8192)` top k; a verify pass of 14 slots over
49K entries gains)."""


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(whole blocks (R, n, BLOCK), the rest (R, r))` of `x (..., V)` as views, or None where torch's own kernel
    serves (not a CPU tensor, fewer than two blocks, or fewer than `MIN_ENTRIES` entries)."""
    if x.numel() < MIN_ENTRIES or x.device.type != "cpu" or (vocab := x.shape[-1]) < 2 * BLOCK:
        return None
    flat = x.reshape(-1, vocab)
    whole = vocab - vocab % BLOCK
    return flat[:, :whole].reshape(flat.shape[0], whole // BLOCK, BLOCK), flat[:, whole:]


def vocab_argmax(x: torch.Tensor) -> torch.LongTensor:
    """`x.argmax(dim=-1)`, the same indices.

    >>> x = torch.zeros(8, 40000)
    >>> x[0, 260] = x[0, 39999] = 5.0
    >>> vocab_argmax(x).tolist()
    [260, 0, 0, 0, 0, 0, 0, 0]
    """
    parts = _blocks(x)
    if parts is None:
        return x.argmax(dim=-1)
    return _max_of(*parts, values=False)[1].reshape(x.shape[:-1])


def vocab_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor]:
    """`x.max(dim=-1)`: the maxima and their (first) indices."""
    parts = _blocks(x)
    if parts is None:
        out = x.max(dim=-1)
        return out.values, out.indices
    values, index = _max_of(*parts)
    return values.reshape(x.shape[:-1]), index.reshape(x.shape[:-1])


def _max_of(
    blocks: torch.Tensor, rest: torch.Tensor, values: bool = True
) -> tuple[torch.Tensor | None, torch.LongTensor]:
    rows, n = blocks.shape[0], blocks.shape[1]
    tops = blocks.amax(dim=-1)
    if rest.shape[-1]:
        tops = torch.cat([tops, rest.amax(dim=-1, keepdim=True)], dim=-1)
    best = tops.argmax(dim=-1)  # the first block holding the maximum (NaN first, as torch's argmax)
    inner = blocks[torch.arange(rows, device=blocks.device), best.clamp(max=n - 1)]
    within = inner.argmax(dim=-1)
    index = best * BLOCK + within
    if rest.shape[-1]:
        index = torch.where(best < n, index, n * BLOCK + rest.argmax(dim=-1))
    return (tops.gather(-1, best[:, None])[:, 0] if values else None), index


def vocab_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.LongTensor]:
    """`x.topk(k, dim=-1)`: `(values, indices)`, each `(..., k)`, largest first."""
    parts = _blocks(x)
    if parts is None or k > parts[0].shape[1]:
        out = x.topk(k, dim=-1)
        return out.values, out.indices
    blocks, rest = parts
    rows, width = blocks.shape[0], blocks.shape[-1]
    chosen = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (R, k): the top k lie in these blocks or the rest
    pool = blocks.gather(1, chosen[..., None].expand(-1, -1, width)).reshape(rows, k * width)
    if rest.shape[-1]:
        pool = torch.cat([pool, rest], dim=-1)
    values, at = pool.topk(k, dim=-1)
    inside = at < k * width
    index = chosen.gather(1, (at // width).clamp(max=k - 1)) * width + at % width
    index = torch.where(inside, index, blocks.shape[1] * width + at - k * width)
    lead = x.shape[:-1]
    return values.reshape(*lead, k), index.reshape(*lead, k)


__all__ = ["BLOCK", "vocab_argmax", "vocab_max", "vocab_topk"]
