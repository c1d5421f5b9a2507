"""How much KV cache a `generate()` call holds: the keys and values of the target's cache, counted after every target
pass, and their peak over the call (a count of bytes, not a timing).

`benchmarks/bench_sliding_memory.py` compares peagle's decoding with plain `generate()` on sliding-window targets
with it: each sliding layer of peagle's cache keeps about its window (`generation.ragged.KeptWindows`), as
transformers' own sliding layers do. docs/benchmarks.md section 21.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"


def layer_kinds(config: Any, layers: int) -> list[str]:
    """Each cache layer's kind (`"sliding_attention"` or `"full_attention"`) by the target's config: its
    `layer_types`, or every layer sliding where the config has a window and no layer types (Mistral)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)[:layers]
    window = getattr(config, "sliding_window", None)
    return [SLIDING if window is not None else "full_attention"] * layers


def layer_bytes(layer: Any) -> int:
    """Bytes of one cache layer's keys and values (the tensors' own sizes; 0 before its first update)."""
    total = 0
    for name in ("keys", "values"):
        tensor = getattr(layer, name, None)
        if tensor is not None:
            total += tensor.numel() * tensor.element_size()
    return total


def cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values every layer of `cache` holds."""
    return sum(layer_bytes(layer) for layer in getattr(cache, "layers", []))


@dataclass
class CachePeak:
    """A forward hook on a target: after each of its passes, the bytes its cache holds; the peak over the passes.

    Use as a context manager around one `generate()` call:

        with CachePeak(target) as peak:
            target.generate(ids, ...)
        peak.bytes, peak.sliding_slots

    Attributes:
        bytes: the most bytes of keys and values the cache held after a pass.
        sliding_slots: the most slots a sliding-window layer held after a pass (0 on a target without one).
        full_slots: the most slots a full-attention layer held after a pass.
        passes: target passes seen.
    """

    model: Any
    bytes: int = 0
    sliding_slots: int = 0
    full_slots: int = 0
    passes: int = 0
    _handle: Any = field(default=None, repr=False)

    def __enter__(self) -> CachePeak:
        self._handle = self.model.register_forward_hook(self._after_pass, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _after_pass(self, module, args, kwargs, output) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if cache is None:
            return
        self.passes += 1
        self.bytes = max(self.bytes, cache_bytes(cache))
        layers = list(getattr(cache, "layers", []))
        for layer, kind in zip(layers, layer_kinds(self.model.config, len(layers))):
            keys = getattr(layer, "keys", None)
            slots = 0 if keys is None or keys.dim() < 3 else int(keys.shape[-2])
            if kind == SLIDING:
                self.sliding_slots = max(self.sliding_slots, slots)
            else:
                self.full_slots = max(self.full_slots, slots)


__all__ = ["CachePeak", "cache_bytes", "layer_bytes", "layer_kinds"]
