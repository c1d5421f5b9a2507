"""The prefix of a partitioned training step: the drafter's keys and values of the depth-0 stream, by anchor.

Segment s of a partitioned example ([`peagle.training.partition`]) reads the depth-0 elements of earlier
segments as keys and values only.  [`PrefixKV`] holds them per drafter layer, `(B, kv_heads, n, head_dim)` indexed
by anchor, fills them from forward passes ([`PrefixKV.record`]), hands them to a segment as a pre-filled cache
([`PrefixKV.cache`]; as gradient leaves when the segment runs backward), and carries the gradient they receive
back to the segment that computed them ([`PrefixKV.collect`], then [`PrefixKV.surrogate`]).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .plan import SegmentRows


class PrefixKV:
    """Keys and values of the depth-0 elements of one micro-batch, per drafter layer, and their gradients.

    Args:
        config: the drafter's config (for the cache).
        num_anchors: the longest example's anchor count n (the store's length).
    """

    def __init__(self, config, num_anchors: int):
        self.config = config
        self.num_anchors = int(num_anchors)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] | None = None  # keys' then values' gradient of every layer

    @staticmethod
    def _depth0(rows: SegmentRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, col = ((rows.depth == 0) & rows.valid).nonzero(as_tuple=True)
        return b, col, rows.anchor[b, col]

    def cache(self, length: int, leaves: bool) -> tuple[DynamicCache, list[torch.Tensor]]:
        """A drafter cache holding the keys and values of anchors ``0 .. length-1``; with `leaves`, as fresh tensors
        that require grad (returned in the order [`collect`] takes)."""
        cache = DynamicCache(config=self.config)
        held: list[torch.Tensor] = []
        if length == 0 or not self.keys:
            return cache, held
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k, v = k[:, :, :length], v[:, :, :length]
            if leaves:
                k, v = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
                held += [k, v]
            cache.update(k, v, layer)
        return cache, held

    def _new(self, cache: DynamicCache, past: int, width: int):
        for layer in cache.layers:
            yield layer.keys[:, :, past : past + width], layer.values[:, :, past : past + width]

    def record(self, cache: DynamicCache, past: int, rows: SegmentRows) -> None:
        """Store the keys and values a forward pass appended after `past` cache entries for the depth-0 elements
        of `rows` (its queries)."""
        b, col, anchor = self._depth0(rows)
        for layer, (k, v) in enumerate(self._new(cache, past, rows.width)):
            if len(self.keys) <= layer:
                shape = (k.shape[0], k.shape[1], self.num_anchors, k.shape[3])
                self.keys.append(k.new_zeros(shape))
                self.values.append(v.new_zeros(shape))
            self.keys[layer][b, :, anchor] = k[b, :, col].detach()
            self.values[layer][b, :, anchor] = v[b, :, col].detach()

    def surrogate(self, cache: DynamicCache, past: int, rows: SegmentRows) -> torch.Tensor | None:
        """A scalar whose gradient is the gradient later segments sent to the depth-0 keys and values of `rows`
        (``sum <kv, grad>`` with the gradients constant); None before any was collected."""
        if self.grads is None:
            return None
        b, col, anchor = self._depth0(rows)
        term = None
        for layer, (k, v) in enumerate(self._new(cache, past, rows.width)):
            gk, gv = self.grads[2 * layer], self.grads[2 * layer + 1]
            part = (k[b, :, col] * gk[b, :, anchor].to(k.dtype)).sum() + (
                v[b, :, col] * gv[b, :, anchor].to(v.dtype)
            ).sum()
            term = part if term is None else term + part
        return term

    def collect(self, leaves: list[torch.Tensor], scale: float = 1.0) -> None:
        """Add the gradients the leaves of [`cache`] received (divided by `scale`, a loss scaler's factor)."""
        if not leaves:
            return
        if self.grads is None:
            self.grads = [
                torch.zeros_like(t, dtype=torch.float32) for pair in zip(self.keys, self.values) for t in pair
            ]
        for store, leaf in zip(self.grads, leaves):
            if leaf.grad is not None:
                store[:, :, : leaf.shape[2]] += leaf.grad.float() / scale


__all__ = ["PrefixKV"]
