"""Sequence partitioning (P-EAGLE paper, Algorithm 1, with causal completion).

One long example has elements ``(a, d)`` (anchor, depth; see `masks.py`).  Partitioning splits the anchor range
``[0, n)`` at boundaries ``0 = B_0 <= B_1 <= ... <= B_S = n`` into S segments and gives every element one
*owning* segment:

- a depth-0 element ``(a, 0)`` belongs to the segment holding position ``a``;
- a depth-1 element ``(a, 1)`` belongs to the segment holding its own position ``a + 1`` (clamped to ``n - 1``);
- a depth-g element, g >= 2, belongs to the segment of its depth g-1 element, so whole chains
  ``(a, 1), (a, 2), ...`` follow their anchor + 1.

Causal completion: segment s also carries every depth-0 element before its end ``B_{s+1}`` as key/value
context, recomputed in that segment's forward pass but without loss.  Every element an owned element attends to
(depth-0 elements up to its anchor, its own chain) is then inside the same forward pass, so the segment's
activations equal those of the unpartitioned pass, and the sum of the per-segment losses (each divided by the
global supervised count) has exactly the unpartitioned gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """One forward/backward pass of a partitioned example.

    Attributes:
        index: s.
        start, end: the anchor range ``[B_s, B_{s+1})`` the segment owns.
        elements: `(E_s,)` int64 indices into the example's element list (its depth-major order): the depth-0
            context elements and the owned elements, in element-list order.
        owned: `(E_s,)` bool, True for the elements this segment owns (computes the loss of).
    """

    index: int
    start: int
    end: int
    elements: torch.Tensor
    owned: torch.Tensor

    def __len__(self) -> int:
        return int(self.elements.numel())


def element_positions(anchor: torch.Tensor, depth: torch.Tensor, num_anchors: int) -> torch.Tensor:
    """The position that decides an element's segment: ``a`` at depth 0, ``min(a + 1, n - 1)`` for a chain.

    Example:

    >>> element_positions(torch.tensor([0, 4, 0, 4]), torch.tensor([0, 0, 1, 2]), num_anchors=5).tolist()
    [0, 4, 1, 4]
    """
    chain_pos = torch.clamp(anchor + 1, max=max(num_anchors - 1, 0))
    return torch.where(depth == 0, anchor, chain_pos)


def partition_boundaries(
    anchor: torch.Tensor, depth: torch.Tensor, num_anchors: int, num_segments: int, balance: bool = True
) -> list[int]:
    """Segment boundaries ``[B_0 = 0, ..., B_S = n]`` (length S + 1, non-decreasing).

    With ``balance=False`` the anchor range is cut into equal parts.  With ``balance=True`` (default) the
    boundaries minimise the largest segment, counted in forward-pass elements (depth-0 elements up to the end
    plus owned chain elements): later segments carry more depth-0 context, so they get fewer anchors.  Trailing
    segments may be empty when the example is short.

    Example (6 anchors, depths 0 and 1 all kept, 2 segments):

    >>> a = torch.arange(6).repeat(2); d = torch.arange(2).repeat_interleave(6)
    >>> partition_boundaries(a, d, 6, 2, balance=False)
    [0, 3, 6]
    >>> partition_boundaries(a, d, 6, 2)  # passes of 5 + 4 and 6 + 2 elements instead of 3 + 2 and 6 + 4
    [0, 5, 6]
    """
    if num_segments < 1:
        raise ValueError(f"num_segments is {num_segments}; expected >= 1.")
    n = int(num_anchors)
    if not balance or n == 0:
        return [round(s * n / num_segments) for s in range(num_segments + 1)]
    pos = element_positions(anchor, depth, n)[depth > 0]
    chains_at = torch.bincount(pos, minlength=n)[:n] if pos.numel() else torch.zeros(n, dtype=torch.long)
    cum = torch.cat(
        [torch.zeros(1, dtype=torch.long), chains_at.cumsum(0)]
    )  # cum[e] = chain elements at p < e
    f = torch.arange(n + 1) + cum  # cost(b, e) = f[e] - cum[b]

    def greedy(limit: int) -> list[int] | None:
        bounds, b = [0], 0
        while b < n:
            e = int(torch.searchsorted(f, torch.tensor(limit + int(cum[b])), right=True)) - 1
            if e <= b or len(bounds) > num_segments:
                return None
            bounds.append(e)
            b = e
        return bounds if len(bounds) <= num_segments + 1 else None

    lo, hi = 1, int(f[-1])
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = greedy(lo)
    assert bounds is not None
    return bounds + [n] * (num_segments + 1 - len(bounds))


def partition_plan(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    num_anchors: int,
    num_segments: int,
    boundaries: list[int] | None = None,
    balance: bool = True,
) -> list[Segment]:
    """Split one example's elements into S segments (Algorithm 1 with causal completion).

    Args:
        anchor, depth: `(E,)` coordinates of the example's elements (e.g. from `PEagleMaskTemplate.coordinates`);
            chains must be nested (``(a, d)`` present implies ``(a, d - 1)`` present).
        num_anchors: n; anchors lie in ``[0, n)``.
        num_segments: S.
        boundaries: explicit ``[0, ..., n]`` of length S + 1; default from [`partition_boundaries`].

    Returns:
        S [`Segment`]s; every element is owned by exactly one of them.

    Example (4 anchors, K = 2 all kept, S = 2 equal halves; elements in depth-major order
    ``0:(0,0) 1:(1,0) 2:(2,0) 3:(3,0) 4:(0,1) 5:(1,1) 6:(2,1) 7:(3,1)``):

    >>> a = torch.arange(4).repeat(2); d = torch.arange(2).repeat_interleave(4)
    >>> s0, s1 = partition_plan(a, d, 4, 2, balance=False)
    >>> s0.elements.tolist(), s0.owned.tolist()   # anchors 0-1 and the chain of anchor 0 (its depth 1 is at 1)
    ([0, 1, 4], [True, True, True])
    >>> s1.elements.tolist(), s1.owned.tolist()   # context (0,0) (1,0); owns (2,0) (3,0) and chains of 1, 2, 3
    ([0, 1, 2, 3, 5, 6, 7], [False, False, True, True, True, True, True])
    """
    anchor = anchor.cpu()
    depth = depth.cpu()
    if boundaries is None:
        boundaries = partition_boundaries(anchor, depth, num_anchors, num_segments, balance=balance)
    if len(boundaries) != num_segments + 1 or boundaries[0] != 0 or boundaries[-1] != num_anchors:
        raise ValueError(
            f"boundaries {boundaries} must have {num_segments + 1} entries from 0 to num_anchors={num_anchors}."
        )
    if any(b > c for b, c in zip(boundaries[:-1], boundaries[1:])):
        raise ValueError(f"boundaries {boundaries} must be non-decreasing.")
    pos = element_positions(anchor, depth, num_anchors)
    owner = torch.searchsorted(torch.tensor(boundaries[1:]), pos, right=True).clamp(max=num_segments - 1)
    segments = []
    for s in range(num_segments):
        end = boundaries[s + 1]
        member = (owner == s) | ((depth == 0) & (anchor < end))
        idx = member.nonzero().flatten()
        segments.append(Segment(s, boundaries[s], end, idx, owner[idx] == s))
    return segments


__all__ = ["Segment", "element_positions", "partition_boundaries", "partition_plan"]
