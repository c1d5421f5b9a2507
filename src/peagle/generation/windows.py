"""Sliding-window attention by position, not by slot: the masks of a verify pass on a target whose layers slide.

transformers' sliding-window layers count cache slots: a key is in the window when its slot index is less than
`W` before the query's. In a batched round, rejected drafts stay in the cache as masked holes, left padding
differs per row and a tree's slots share depths, so slot distance and position distance part. Here the window is
a mask on positions: key slot k is in the window of query q when `position(q) - position(k) < W`, the rule
transformers applies (`kv_idx > q_idx - W`) with positions for indices. Holes, padding and tree slots then never
shift a window. A decoding call's sliding layers become [`WindowLayer`]s, which keep the slots their window still
needs on a slot axis of their own (`ragged.KeptWindows` trims them each round), so they hold about a window, as
transformers' own do. docs/DESIGN.md section 10.1.

A target with layers of several kinds (`config.layer_types`: Gemma 2/3, GPT-OSS, Qwen 2/3, Cohere 2) takes a
dict of 4D masks keyed by layer kind, which its forward uses as is; one whose every layer slides
(`config.sliding_window` without `layer_types`: Mistral, Mixtral, Starcoder 2) takes one windowed 4D mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .attention import PACKED_SDPA

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class LayerWindows:
    """The attention windows of a target's layers.

    Attributes:
        windows: per mask key, the window in positions (None: full attention). Keys are the target's layer kinds
            (`"full_attention"`, `"sliding_attention"`) when `keyed`; otherwise one key, `"sliding_attention"`.
        keyed: the target's forward takes a dict of masks keyed by layer kind.
    """

    windows: dict[str, int | None]
    keyed: bool

    @property
    def slides(self) -> bool:
        return any(w is not None for w in self.windows.values())


def layer_windows(config) -> LayerWindows | None:
    """The windows of `config`'s attention layers, or None when no layer slides (a plain mask serves).

    Raises:
        ValueError: a layer kind peagle cannot mask by position (chunked attention).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        unknown = sorted(set(kinds) - {FULL, SLIDING})
        if unknown:
            raise ValueError(
                f"the target has {unknown} layers; batches and draft trees mask full and sliding-window attention "
                "only (generate with one row and chains there)."
            )
        if window is None or SLIDING not in kinds:
            return None
        return LayerWindows(
            {kind: (int(window) if kind == SLIDING else None) for kind in sorted(set(kinds))}, True
        )
    if window is None:
        return None
    return LayerWindows({SLIDING: int(window)}, False)


def windowed_masks(
    allowed: torch.BoolTensor,
    key_positions: torch.LongTensor,
    query_positions: torch.LongTensor,
    windows: LayerWindows,
) -> torch.BoolTensor | dict[str, torch.BoolTensor]:
    """The masks of one forward pass: `allowed (B, 1, Q, K)` (True = attend: validity, causality, tree ancestry)
    with each sliding layer kind's window applied by position.

    Args:
        allowed: what every layer may attend to before windows.
        key_positions: `(B, K)` the position of every key slot (any value where `allowed` is False throughout).
        query_positions: `(B, Q)` the position of every query.
        windows: from [`layer_windows`].

    Returns:
        One boolean 4D mask (`windows.keyed` False), or a dict of them keyed by layer kind.
    """
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    masks = {
        kind: allowed if window is None else allowed & (distance < window)
        for kind, window in windows.windows.items()
    }
    return masks if windows.keyed else masks[SLIDING]


def kept_masks(
    allowed: Callable[[torch.Tensor], torch.BoolTensor],
    valid: dict[str, torch.Tensor],
    query_positions: torch.LongTensor,
    next_positions: torch.LongTensor,
    windows: LayerWindows,
) -> torch.BoolTensor | dict[str, torch.BoolTensor]:
    """The masks of one verify pass when each layer kind keeps slots of its own: full-attention layers every slot
    of the call (`valid[FULL]`), sliding layers the slots their window still needs (`valid[SLIDING]`).

    Args:
        allowed: `valid (B, S) -> (B, 1, Q, S + Q)`, what a layer keeping slots `valid` may attend to before
            windows (validity, causality, tree ancestry).
        valid: per kept slot axis, its validity `(B, S_axis)`; each row's valid slots hold its last tokens, in
            order, ending at the position before `next_positions` ([`kept_positions`]).
        query_positions: `(B, Q)` the position of every query.
        next_positions: `(B,)` each row's first position not in the cache.
        windows: from [`layer_windows`].

    Returns:
        One boolean 4D mask (`windows.keyed` False), or a dict of them keyed by layer kind.
    """
    masks = {}
    for kind, window in windows.windows.items():
        kept = valid[FULL if window is None else SLIDING]
        keys = torch.cat([kept_positions(kept, next_positions), query_positions], dim=1)
        one = LayerWindows({SLIDING: window}, False)
        masks[kind] = windowed_masks(allowed(kept), keys, query_positions, one)
    return masks if windows.keyed else masks[SLIDING]


def kept_positions(valid: torch.Tensor, next_positions: torch.LongTensor) -> torch.LongTensor:
    """`(B, S)` the position of every valid slot of a cache whose validity is `valid (B, S)` and whose valid slots
    hold each row's last tokens in order, up to the position before `next_positions (B,)` (holes and padding get
    some position; they are masked anyway).

    >>> kept_positions(torch.tensor([[0, 1, 0, 1, 1]]), torch.tensor([9])).tolist()
    [[6, 6, 7, 7, 8]]
    """
    after = valid.long().flip(-1).cumsum(-1).flip(-1)  # valid slots from each slot to the end
    return next_positions[:, None] - after


def slot_positions(valid: torch.Tensor) -> torch.LongTensor:
    """`(B, S)` the position of every valid slot of a cache whose validity is `valid (B, S)`: each row's valid slots
    hold its tokens in order from position 0 (holes and padding get 0; they are masked anyway)."""
    valid = valid.long()
    return ((valid.cumsum(-1) - 1) * valid).clamp(min=0)


def causal_block(valid: torch.Tensor, width: int) -> torch.BoolTensor:
    """`(B, 1, width, S + width)` what a chain's verify pass attends to: the rows' valid past (`valid (B, S)`) and the
    block's own earlier slots (True = attend)."""
    past = valid.bool()[:, None, None, :].expand(-1, 1, width, -1)
    block = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
    return torch.cat([past, block[None, None].expand(valid.shape[0], 1, -1, -1)], dim=-1)


MASKED_ATTENTION = ("eager", "sdpa", PACKED_SDPA)
"""Attention implementations that take a custom 4D mask (the packed SDPA of `attention.py` included)."""


def positional_windows(model, cache: Cache, trim: bool = False) -> LayerWindows | None:
    """The windows a `generate()` call masks by position, after its cache's sliding-window layers became
    [`WindowLayer`]s (`trim`: what the decoding loop trims to the window) or plain dynamic layers that keep every
    slot ([`full_cache_layers`]); None where transformers' own sliding layers stay, and with them the batch-1
    chains they allow: no layer slides, the attention takes no 4D mask (flash attention), a layer kind other than
    full and sliding, or a cache that already holds keys."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION or not any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        return None
    try:
        windows = layer_windows(model.config)
        if windows is None:
            return None
        full_cache_layers(cache, windows.windows[SLIDING] if trim else None)
    except ValueError:
        return None
    return windows


class WindowLayer(DynamicLayer):
    """A sliding-window layer of a decoding call's cache: a dynamic layer (crop, gather, row selection as usual)
    that keeps only the slots its window by position still needs, on a slot axis of its own.

    Its first update is the prefill, where each row's padding is on the left, so slots are positions within a row:
    like transformers' `DynamicSlidingWindowLayer` it attends over all the new slots and keeps the last
    `window - 1`. Later updates append, as a `DynamicLayer`'s do; the loop's [`ragged.KeptWindows`] tracks which
    kept slots are valid and drops those no later query sees. `is_sliding` stays False: transformers never sees a
    window it would count in slots, the masks come from the loop ([`kept_masks`])."""

    def __init__(self, window: int):
        super().__init__()
        self.window = int(window)
        self.filled = False

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states)
        if not self.filled:
            self.filled = True
            keep = max(keys.shape[-2] - (self.window - 1), 0)
            self.keys, self.values = keys[:, :, keep:], values[:, :, keep:]
        return keys, values

    def as_sliding_layer(self, slots: int) -> DynamicSlidingWindowLayer:
        """transformers' own sliding layer for a cache of `slots` slots of one row (no holes) that this layer ends:
        its last `window - 1` slots, with zeros on the left for slots it dropped as padding (masked anyway)."""
        layer = DynamicSlidingWindowLayer(sliding_window=self.window)
        if not self.is_initialized:
            return layer
        layer.lazy_initialization(self.keys, self.values)
        want, have = min(slots, self.window - 1), self.keys.shape[-2]
        for name in ("keys", "values"):
            kept = getattr(self, name)[:, :, max(have - want, 0) :]
            if want > have:
                pad = kept.new_zeros(kept.shape[0], kept.shape[1], want - have, kept.shape[-1])
                kept = torch.cat([pad, kept], dim=-2)
            setattr(layer, name, kept)
        layer.cumulative_length = slots
        return layer


def full_cache_layers(cache: Cache, window: int | None = None) -> bool:
    """Give every sliding-window layer of an empty `cache` a plain dynamic layer, which keeps all its slots (or, with
    `window`, a [`WindowLayer`] that keeps what the window needs): the window is then applied by position in the
    masks. Returns whether any layer changed.

    Raises:
        ValueError: the cache already holds keys (its sliding layers have dropped what a window by position
            still needs).
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        return False
    changed = False
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_sliding", False):
            continue
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            raise ValueError(
                "the cache's sliding-window layers already hold keys; replace them before the prefill."
            )
        new = DynamicLayer() if window is None else WindowLayer(window)
        if type(layer) is type(new):
            continue
        layers[i] = new
        changed = True
    return changed


__all__ = [
    "FULL",
    "SLIDING",
    "LayerWindows",
    "WindowLayer",
    "full_cache_layers",
    "kept_masks",
    "kept_positions",
    "layer_windows",
    "positional_windows",
    "slot_positions",
    "windowed_masks",
]
