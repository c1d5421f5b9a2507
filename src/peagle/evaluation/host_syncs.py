"""Counting host synchronisations: the tensor reads on the host that stall an accelerator's queue.

On a GPU, `.item()`, `.tolist()`, `bool(t)`, `int(t)`, `.cpu()`, `.nonzero()` and the like wait until every
kernel queued before them has run; a decoding loop that makes many of them per step cannot keep the GPU busy.
[`count_host_syncs`] counts them on any device (a CPU run counts the reads a GPU run would make) by wrapping those
`torch.Tensor` methods for the length of a `with` block:

>>> import torch
>>> with count_host_syncs() as syncs:
...     x = torch.arange(4)
...     _ = int(x.sum()), x.tolist(), bool(x.any())
>>> syncs.count, syncs.by_name["tolist"]
(3, 1)

The count is an upper bound of what a GPU would stall on: a read of a tensor that lives on the host anyway
counts too (on a CPU every tensor does).  Reads inside other wrapped reads count once (`bool(t)` calling
`t.item()` internally is one read).  Not thread-safe: count one loop at a time.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
"""The `torch.Tensor` methods counted: each reads a tensor's values (or its data-dependent shape) on the host."""


@dataclass
class HostSyncs:
    """What [`count_host_syncs`] counted: `count` reads in all, `by_name` per method."""

    count: int = 0
    by_name: Counter = field(default_factory=Counter)


_ACTIVE = threading.local()


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count the host reads of tensors ([`SYNC_METHODS`]) made inside the block; yields the running count."""
    found = HostSyncs()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name, method):
        @functools.wraps(method)
        def counted(self, *args, **kwargs):
            if getattr(_ACTIVE, "inside", False):  # a read made by another counted read
                return method(self, *args, **kwargs)
            found.count += 1
            found.by_name[name] += 1
            _ACTIVE.inside = True
            try:
                return method(self, *args, **kwargs)
            finally:
                _ACTIVE.inside = False

        return counted

    for name, method in originals.items():
        setattr(torch.Tensor, name, wrap(name, method))
    try:
        yield found
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


__all__ = ["SYNC_METHODS", "HostSyncs", "count_host_syncs"]
