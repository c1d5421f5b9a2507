"""Continuing from a filled cache: the next turn of a chat, or a prefilled document reused for several questions.

`generate(ids, cache=<a filled cache>, assistant_model=head)` runs the target over the tokens after the cache only,
as plain `generate()` does.  The head drafts from the target's features at every position it reads, and a cache
holds no features.  Two ways to get them (docs/DESIGN.md section 12.2):

- **The head's state travels with the cache.**  A call with one prompt leaves the drafter's own cache on the
  target's cache it returns (attribute [`STATE_ATTRIBUTE`], a [`DrafterState`]): the drafter's slots up to the
  sequence's last token, matched to the target cache's length.  The next call that passes the same cache object
  (or a `copy.deepcopy` of it: the state copies with it, the head is shared) resumes drafting at no cost.
- **Catch-up** when a cache arrives without it (filled by plain `generate()` or a plain forward, or used since
  without the head): the target re-reads the cache's last W tokens (the drafter's window, else
  [`CATCH_UP_SLOTS`]) on a *view* of the cache's first slots ([`prefix_view`]), which gives their features and
  leaves the cache itself untouched, so the target's own output stays exactly plain `generate()`'s.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .drafter_cache import DrafterCache

STATE_ATTRIBUTE = "peagle_drafter_state"
"""The attribute of a target cache that carries the head's state from one `generate()` call to the next."""
CATCH_UP_SLOTS = 256
"""Cached tokens a head without a drafter window re-reads when a cache arrives without its state (a windowed
head re-reads its window)."""


@dataclass
class DrafterState:
    """The head's side of a target cache: what the next call resumes from.

    Args:
        drafter: the drafter's cache, its real slots ending at the target cache's last position.
        length: the target cache's length (slots) the state matches.
        next_token: the token after the cache (the sequence's last; the next call's first new token).
        head: the head it belongs to (a weak reference: the state never keeps a head alive).
    """

    drafter: DrafterCache
    length: int
    next_token: int
    head: weakref.ref

    def __deepcopy__(self, memo: dict) -> DrafterState:
        return DrafterState(copy.deepcopy(self.drafter, memo), self.length, self.next_token, self.head)


def leave_state(cache: Any, drafter: DrafterCache, head: Any, next_token: int) -> None:
    """Put the head's state on `cache` (its length now) for the next call."""
    setattr(
        cache,
        STATE_ATTRIBUTE,
        DrafterState(drafter, cache.get_seq_length(), int(next_token), weakref.ref(head)),
    )


def take_state(cache: Any, head: Any, input_ids: torch.LongTensor) -> DrafterCache | None:
    """The drafter cache an earlier call left on `cache`, when it still matches: the same head, the cache as that
    call left it, and `input_ids (1, L)` continuing its sequence.  The state leaves the cache either way (this call
    changes both)."""
    state = getattr(cache, STATE_ATTRIBUTE, None)
    if state is None:
        return None
    setattr(cache, STATE_ATTRIBUTE, None)
    n = state.length
    if (
        state.head() is not head
        or cache.get_seq_length() != n
        or input_ids.shape[0] != 1
        or input_ids.shape[1] <= n
        or int(input_ids[0, n]) != state.next_token
    ):
        return None
    return state.drafter


def prefix_view(cache: Any, length: int) -> Any | None:
    """A cache that reads the first `length` slots of `cache` and grows on its own (new tensors), leaving `cache`
    as it was; None when some layer is not a plain full-attention `DynamicLayer` (nothing to view safely)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    view = copy.copy(cache)
    view.layers = []
    for layer in layers:
        clone = copy.copy(layer)
        if layer.is_initialized and layer.keys is not None and layer.keys.numel():
            clone.keys = layer.keys[..., :length, :]
            clone.values = layer.values[..., :length, :]
        view.layers.append(clone)
    if hasattr(view, STATE_ATTRIBUTE):
        setattr(view, STATE_ATTRIBUTE, None)
    return view


__all__ = ["CATCH_UP_SLOTS", "STATE_ATTRIBUTE", "DrafterState", "leave_state", "prefix_view", "take_state"]
