"""Caches with holes: the target's and the drafter's KV caches in a batched round keep the slots of rejected
drafts (and the left padding of ragged blocks) as masked holes; once enough pile up, each row's valid slots are
gathered to the right and the holes become left padding.  docs/DESIGN.md section 10."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .windows import MASKED_ATTENTION

COMPACT_MIN_SLOTS = 16
"""Compact a cache once compaction would free at least this many slots per row ..."""
COMPACT_FRACTION = 0.125
"""... and at least this fraction of the cache's length."""


def compaction_index(mask: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor] | None:
    """Where each row's valid slots go when holes are squeezed out: `(index (B, S'), new_mask (B, S'))` with
    every row's valid slots right-aligned in their order (`index` says which old slot each new one takes;
    leading padding repeats slot 0 and is masked), or None when nothing would be freed."""
    valid = mask.bool()
    counts = valid.sum(dim=1)
    width = int(counts.max())
    if width == mask.shape[1]:
        return None
    # stable sort puts holes (False) first and keeps the valid slots in order; keep the last `width`
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
    new_mask = (torch.arange(width, device=mask.device) >= (width - counts)[:, None]).long()
    index = torch.where(new_mask.bool(), order, torch.zeros_like(order))
    return index, new_mask


def compact_cache(cache: Cache, index: torch.LongTensor) -> None:
    """Gather every layer's keys and values along the sequence axis: slot j of row b becomes old slot
    `index[b, j]`.  Dynamic (full-attention) layers only."""
    keep_tail(cache, index, None, "compact")


def worth_compacting(mask: torch.Tensor) -> bool:
    free = mask.shape[1] - int(mask.sum(dim=1).max())
    return free >= COMPACT_MIN_SLOTS and free >= COMPACT_FRACTION * mask.shape[1]


def batch_refusal(cache: Cache) -> str | None:
    """Why a batch cannot keep holes in this (target's) cache, or None.  Holes need full-attention layers of
    transformers' dynamic kind: a sliding window counts slots, so holes would shrink it; recurrent (linear
    attention) state cannot skip a slot; static layers cannot drop finished rows or be compacted."""
    layers = list(getattr(cache, "layers", []))
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return "sliding-window layers, where rejected drafts left as masked holes would shift the window"
    others = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if others:
        return (
            f"cache layers of kind {others}; batched rounds need transformers' dynamic full-attention layers "
            "(drop cache_implementation, or use the default DynamicCache)"
        )
    return None


def keep_tail(cache: Cache, index: torch.LongTensor, width: int | None, what: str = "keep a path in") -> None:
    """Of the last `width` slots of every layer (None: all of them), keep `index (B, L)` per row (slot j of the
    new tail is old tail slot `index[b, j]`) and drop the rest: a verified draft tree leaves only its accepted
    path in the cache, and compaction gathers each row's valid slots.  Dynamic (full-attention) layers only."""
    keep = index.shape[1]
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or type(layer) is not DynamicLayer:
            raise TypeError(f"cannot {what} a {type(layer).__name__} cache layer")
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        gather = index.to(layer.keys.device)[:, None, :, None]
        for name in ("keys", "values"):
            full = getattr(layer, name)
            cut = full.shape[2] - (full.shape[2] if width is None else width)
            picked = full[:, :, cut:].gather(2, gather.expand(-1, full.shape[1], keep, full.shape[-1]))
            setattr(layer, name, torch.cat([full[:, :, :cut], picked], dim=2))


def drop_oldest(cache: Cache, count: int) -> None:
    """Drop the first `count` slots of every layer (a drafter's attention window).  Dynamic layers only."""
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"cannot drop the oldest slots of a {type(layer).__name__} cache layer")
        if layer.is_initialized and layer.keys.numel():
            layer.keys, layer.values = layer.keys[:, :, count:], layer.values[:, :, count:]


def tree_refusal(model, cache: Cache) -> str | None:
    """Why draft trees cannot be verified on this target, or None: a tree needs a custom 4D attention mask (eager
    or SDPA attention) and a cache that can keep only the accepted path (dynamic full-attention layers)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION:
        return f"{impl!r} attention, which takes no custom tree mask (eager and sdpa do)"
    return batch_refusal(cache)


def compact(cache: Cache, mask: torch.Tensor) -> torch.Tensor:
    """Squeeze the holes out of `cache` (its validity `mask (B, S)`); returns the new mask."""
    found = compaction_index(mask)
    if found is None:
        return mask
    index, new_mask = found
    compact_cache(cache, index)
    return new_mask


__all__ = [
    "batch_refusal",
    "compact",
    "compact_cache",
    "compaction_index",
    "drop_oldest",
    "keep_tail",
    "tree_refusal",
    "worth_compacting",
]
