"""Caches with holes: the target's and the drafter's KV caches in a batched round keep the slots of rejected
drafts (and the left padding of ragged blocks) as masked holes; once enough pile up, each row's valid slots are
gathered to the right and the holes become left padding.  A sliding-window target's sliding layers keep a slot
axis of their own, trimmed to their window each round ([`KeptWindows`]).  A static cache's layers do the same in
place, on their fixed slot axis ([`static_slots`]).  docs/DESIGN.md sections 10, 10.1 and 10.2."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from .windows import MASKED_ATTENTION, WindowLayer, kept_positions

COMPACT_MIN_SLOTS = 16
"""Compact a cache once compaction would free at least this many slots per row ..."""
COMPACT_FRACTION = 0.125
"""... and at least this fraction of the cache's length."""
_HOLED = (DynamicLayer, WindowLayer, StaticLayer)
"""Cache layers that can keep holes: transformers' dynamic and static full-attention layers and peagle's window
layer (exactly these classes: a subclass may hold more state than keys and values)."""


def static_slots(cache: Cache | None) -> int | None:
    """The fixed slot axis of `cache`'s static full-attention layers (their `max_cache_len`), or None when it has
    none.  Such a layer holds `(B, H, max_cache_len, D)` tensors from its first update on and writes each update
    at its length (`cumulative_length`); peagle's ops on it ([`keep_tail`], [`compact`], `crop`) work in place and
    set that length, so the tensors never change shape or identity (what a compiled forward needs)."""
    sizes = {layer.max_cache_len for layer in getattr(cache, "layers", []) if type(layer) is StaticLayer}
    return min(sizes) if sizes else None


def compaction_index(
    mask: torch.Tensor, width: int | None = None
) -> tuple[torch.LongTensor, torch.LongTensor] | None:
    """Where each row's valid slots go when holes are squeezed out: `(index (B, S'), new_mask (B, S'))` with
    every row's valid slots right-aligned in their order (`index` says which old slot each new one takes;
    leading padding repeats slot 0 and is masked), or None when nothing would be freed.  `width`: the most valid
    slots of a row, when the caller knows it without reading the mask."""
    valid = mask.bool()
    counts = valid.sum(dim=1)
    width = int(counts.max()) if width is None else width
    if width == mask.shape[1]:
        return None
    # stable sort puts holes (False) first and keeps the valid slots in order; keep the last `width`
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
    new_mask = (torch.arange(width, device=mask.device) >= (width - counts)[:, None]).long()
    index = torch.where(new_mask.bool(), order, torch.zeros_like(order))
    return index, new_mask


def static_room(cache: Cache, mask: torch.Tensor, slots: int, most: int) -> tuple[torch.Tensor, int]:
    """`(mask, room)`: the slots a verify pass may write on a static cache of `slots` slots whose first ones are in
    use (validity `mask (B, S)`), compacted first when a pass of `most` slots might not fit (the new mask)."""
    if mask.shape[1] + most > slots and not bool(mask.all()):
        mask = compact(cache, mask)
    if mask.shape[1] >= slots:
        raise RuntimeError(
            f"the static cache's {slots} slots are full: a row holds {mask.shape[1]} tokens. Give it room for "
            "max_length - 1 tokens (generate() sizes the caches it makes so)."
        )
    return mask, slots - mask.shape[1]


def span_slots(mask: torch.Tensor | None, slots: int | None) -> torch.Tensor | None:
    """A mask over the slots in use, padded (masked) to a static cache's `slots` when given: the keys a static
    layer returns, one shape for every pass of a width."""
    if mask is None or slots is None or mask.shape[-1] >= slots:
        return mask
    return torch.nn.functional.pad(mask, (0, slots - mask.shape[-1]))


def compact_cache(cache: Cache, index: torch.LongTensor, used: int) -> None:
    """Gather every layer's keys and values along the sequence axis: slot j of row b becomes old slot
    `index[b, j]` (of the `used` slots the layers hold).  Full-attention layers only; a [`WindowLayer`] keeps its
    own slot axis and is left alone ([`KeptWindows`] compacts it)."""
    layers = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, WindowLayer)]
    keep_tail(cache, index, None, "compact", layers, used)


def worth_compacting(mask: torch.Tensor, valid: int | None = None) -> bool:
    """Whether compacting `mask (B, S)` frees enough slots; `valid`: the most valid slots of a row, when the caller
    knows it without reading the mask."""
    free = mask.shape[1] - (int(mask.sum(dim=1).max()) if valid is None else valid)
    return free >= COMPACT_MIN_SLOTS and free >= COMPACT_FRACTION * mask.shape[1]


def batch_refusal(cache: Cache) -> str | None:
    """Why a batch cannot keep holes in this (target's) cache, or None.  Holes need full-attention layers of
    transformers' dynamic or static kind (or peagle's window layers, without static ones): a sliding window
    counts slots, so holes would shrink it; recurrent (linear attention) state cannot skip a slot; a static cache
    on a sliding-window target is not supported (its window layers and its fixed slot axis would part)."""
    layers = list(getattr(cache, "layers", []))
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return "sliding-window layers, where rejected drafts left as masked holes would shift the window"
    if static_slots(cache) is not None and any(isinstance(layer, WindowLayer) for layer in layers):
        return (
            "a static cache with sliding-window layers (StaticSlidingWindowLayer); batches and trees on a static "
            "cache need full-attention layers only (drop cache_implementation: the default cache takes both)"
        )
    others = sorted({type(layer).__name__ for layer in layers if type(layer) not in _HOLED})
    if others:
        return (
            f"cache layers of kind {others}; batched rounds need transformers' dynamic or static full-attention "
            "layers (drop cache_implementation, or use the default DynamicCache)"
        )
    return None


def keep_tail(
    cache: Cache,
    index: torch.LongTensor,
    width: int | None,
    what: str = "keep a path in",
    layers: list[int] | None = None,
    used: int | None = None,
    in_place: int = 0,
) -> None:
    """Of the last `width` slots of every layer (None: all of them; `layers`: those layers only), keep
    `index (B, L)` per row (slot j of the new tail is old tail slot `index[b, j]`) and drop the rest: a verified
    draft tree leaves only its accepted path in the cache, and compaction gathers each row's valid slots.  The
    first `in_place` slots of the new tail are known to be where they are (`index[:, j] == j`) and are not moved.
    Dynamic layers (full-attention, or a [`WindowLayer`]) are cut to the new length; a static layer, whose first
    `used` slots are the ones in use, gets the kept slots written in place and its length set ([`static_slots`])."""
    keep = index.shape[1]
    moved = index[:, in_place:]
    one_row = index.shape[0] == 1  # one row: an index_copy_ of the moved slots
    expanded: dict[tuple[Any, ...], Any] = {}  # the index (one row: from and to) per layer shape (built once)
    for i, layer in enumerate(cache.layers):
        if layers is not None and i not in layers:
            continue
        if type(layer) not in _HOLED:
            raise TypeError(f"cannot {what} a {type(layer).__name__} cache layer")
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        static = type(layer) is StaticLayer
        if static and used is None:
            raise TypeError(f"cannot {what} a StaticLayer without the number of slots in use")
        for name in ("keys", "values"):
            full = getattr(layer, name)
            end = used if static else full.shape[2]
            cut = end - (end if width is None else width)
            shape = (full.device, full.shape[1], full.shape[-1], cut)
            if shape not in expanded:
                if one_row:  # (from, to): the two indices of one index_copy_
                    to = torch.arange(cut + in_place, cut + keep, device=full.device)
                    expanded[shape] = (moved[0].to(full.device) + cut, to)
                else:
                    gather = moved.to(full.device)[:, None, :, None]
                    expanded[shape] = gather.expand(-1, full.shape[1], moved.shape[1], full.shape[-1])
            # written in place: a static layer keeps its tensor (the slots after the kept ones are never
            # attended); a dynamic one becomes a view of its first slots, so no round copies the whole cache
            if one_row:
                source, to = expanded[shape]
                full.index_copy_(2, to, full.index_select(2, source))
            else:
                picked = full[:, :, cut:end].gather(2, expanded[shape])
                full.narrow(2, cut + in_place, keep - in_place).copy_(picked)
            if not static:
                setattr(layer, name, full.narrow(2, 0, cut + keep))
        if static:
            layer.cumulative_length.fill_(cut + keep)


def slots_in_place(paths: list[list[int]], lengths: list[int]) -> int:
    """How many leading slots of the kept paths are where they were in the verify pass (`paths[b][j] == j` for every
    row's first `lengths[b]` slots): [`keep_tail`]'s `in_place`.

    >>> slots_in_place([[0, 1, 4], [0, 1, 2]], [3, 3]), slots_in_place([[0, 3], [0]], [2, 1])
    (2, 1)
    """
    return min(next((j for j, s in enumerate(p[:n]) if s != j), n) for p, n in zip(paths, lengths))


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


def compact(cache: Cache, mask: torch.Tensor, valid: int | None = None) -> torch.Tensor:
    """Squeeze the holes out of `cache` (its validity `mask (B, S)`: the slots its layers hold); returns the new
    mask.  `valid`: the most valid slots of a row, when the caller knows it (no read of the mask then)."""
    found = compaction_index(mask, valid)
    if found is None:
        return mask
    index, new_mask = found
    compact_cache(cache, index, mask.shape[1])
    return new_mask


class KeptWindows:
    """The slots a call's sliding layers ([`WindowLayer`]s) keep: their own validity mask, trimmed before every
    verify pass to what the window still needs.

    A row's query at position q sees keys at positions p with q - p < W; every later query of the row sits at its
    next position or after, so a slot whose position is at most `next - W` is never seen again. Before each verify
    pass [`trim`] drops them: leading slots that no row needs are cut off, and once at least
    [`COMPACT_MIN_SLOTS`] slots of the layers are holes or out of the window, each row's needed slots are gathered
    to the right (as [`compact`] does). The layers then hold at most `W - 1 + COMPACT_MIN_SLOTS - 1` slots before
    a pass and the pass's own slots after it; plain decoding's sliding layers hold `W - 1`. Full-attention layers
    keep the call's slot axis (the loop's `kv_mask`).

    Attributes:
        layers: the cache's [`WindowLayer`] indices.
        window: their window in positions.
        valid: `(B, S_w)` which of their slots hold a token (1) or a hole, padding or an expired slot (0); each
            row's valid slots are its last tokens in order ([`windows.kept_positions`]).
    """

    def __init__(self, cache: Cache, call_valid: torch.Tensor):
        """After the prefill: the window layers kept the last `W - 1` slots of the call's slot axis (validity
        `call_valid (B, S)`)."""
        self.layers = [i for i, layer in enumerate(cache.layers) if isinstance(layer, WindowLayer)]
        first = cache.layers[self.layers[0]]
        self.window = first.window
        held = first.keys.shape[-2] if first.is_initialized else 0
        self.valid = call_valid[:, call_valid.shape[1] - held :]

    def extend(self, new_valid: torch.Tensor) -> None:
        """The verify pass's kept slots `(B, L)` were appended to every layer (the rest cropped)."""
        self.valid = torch.cat([self.valid, new_valid.to(self.valid)], dim=1)

    def select_rows(self, index: torch.LongTensor) -> None:
        self.valid = self.valid[index]

    def trim(self, cache: Cache, next_positions: torch.LongTensor) -> None:
        """Drop the slots no later query sees (`next_positions (B,)`: each row's first position not cached)."""
        positions = kept_positions(self.valid, next_positions)
        needed = self.valid.bool() & (positions > next_positions[:, None] - self.window)
        used = needed.any(dim=0)
        lead = int(used.int().argmax()) if bool(used.any()) else needed.shape[1]
        most = int(needed.sum(dim=1).max()) if needed.numel() else 0
        if needed.shape[1] - lead - most >= COMPACT_MIN_SLOTS:
            index, self.valid = compaction_index(needed)
            keep_tail(cache, index, None, "trim", self.layers)
            return
        self.valid = needed[:, lead:].long()
        if lead:
            for i in self.layers:
                layer = cache.layers[i]
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    def restore(self, cache: Cache, slots: int) -> None:
        """One sequence of `slots` slots at the end of a call: give back transformers' own sliding layers, holding
        what plain decoding's hold ([`WindowLayer.as_sliding_layer`]), so the returned cache reads as plain
        `generate()`'s."""
        for i in self.layers:
            cache.layers[i] = cache.layers[i].as_sliding_layer(slots)


__all__ = [
    "KeptWindows",
    "batch_refusal",
    "compact",
    "compact_cache",
    "compaction_index",
    "drop_oldest",
    "keep_tail",
    "span_slots",
    "static_room",
    "static_slots",
    "tree_refusal",
    "worth_compacting",
]
