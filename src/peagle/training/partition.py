"""Sequence partitioning (P-EAGLE paper, Algorithm 1), with the depth-0 stream shared as keys and values.

One long example has elements ``(a, d)`` (anchor, depth; see `masks.py`).  Partitioning splits the anchor range
``[0, n)`` at boundaries ``0 = B_0 <= B_1 <= ... <= B_S = n`` into S segments; segment s owns every element whose
anchor lies in ``[B_s, B_{s+1})``, its depth-0 element and the whole chain ``(a, 1), (a, 2), ...`` above it.

An owned element attends to its own chain (same segment) and to the depth-0 elements up to its anchor: those
of its own segment, and those of earlier segments, its *prefix*.  The paper's causal completion recomputes the
prefix in every segment's forward pass, so a segment's pass is as long as the depth-0 stream before its end
and the work of a step grows with S.  peagle passes the prefix as keys and values instead (the drafter's cache,
one entry per layer), computed once per step by a forward pass over the depth-0 stream without gradients.  The
segments then run backward in reverse order: each backward pass also returns the gradient of the prefix keys
and values it read, which is added to the gradient the owning segment's keys and values receive when its turn
comes.  The sum of the per-segment losses (each divided by the global supervised count) has the gradient of
the unpartitioned pass, up to float rounding; a segment's pass holds its own elements, and its attention mask
spans its elements times the depth-0 stream before its end (see `PEagleTrainer.training_step`).

The paper moves a chain to the segment of its anchor + 1; with the prefix passed as keys and values a chain can
stay with its anchor, which lets EAGLE-3's training-time test read its anchor's output in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """One forward/backward pass of a partitioned example.

    Attributes:
        index: s.
        start, end: the anchor range ``[B_s, B_{s+1})`` the segment owns; the depth-0 elements of anchors below
            `start` are its prefix (keys and values only).
        elements: `(E_s,)` int64 indices into the example's element list (its depth-major order) of the elements
            the segment owns, in element-list order.
    """

    index: int
    start: int
    end: int
    elements: torch.Tensor

    def __len__(self) -> int:
        return int(self.elements.numel())


def partition_boundaries(
    anchor: torch.Tensor, depth: torch.Tensor, num_anchors: int, num_segments: int, balance: bool = True
) -> list[int]:
    """Segment boundaries ``[B_0 = 0, ..., B_S = n]`` (length S + 1, non-decreasing).

    With ``balance=False`` the anchor range is cut into equal parts.  With ``balance=True`` (default) each
    segment owns about the same number of elements: COD keeps fewer deep elements where the response is short
    or absent (a prompt), so equal anchor ranges can hold very different passes.  Trailing segments may be
    empty when the example is short.

    Example (6 anchors; depth 1 kept at the last 3 only, 2 segments):

    >>> a = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4, 5]); d = torch.tensor([0] * 6 + [1] * 3)
    >>> partition_boundaries(a, d, 6, 2, balance=False)  # passes of 3 and 6 elements
    [0, 3, 6]
    >>> partition_boundaries(a, d, 6, 2)  # passes of 5 and 4 elements
    [0, 4, 6]
    """
    if num_segments < 1:
        raise ValueError(f"num_segments is {num_segments}; expected >= 1.")
    n = int(num_anchors)
    if not balance or n == 0:
        return [round(s * n / num_segments) for s in range(num_segments + 1)]
    per_anchor = torch.bincount(anchor.cpu(), minlength=n)[:n].double()
    cum = per_anchor.cumsum(0)  # cum[a] = elements of anchors <= a
    total = float(cum[-1])
    goals = torch.tensor([total * s / num_segments for s in range(1, num_segments)], dtype=torch.float64)
    cuts = (torch.searchsorted(cum, goals, right=False) + 1).clamp(max=n).tolist()
    bounds = [0]
    for c in cuts:
        bounds.append(max(int(c), bounds[-1]))
    return bounds + [n]


def partition_plan(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    num_anchors: int,
    num_segments: int,
    boundaries: list[int] | None = None,
    balance: bool = True,
) -> list[Segment]:
    """Split one example's elements into S segments by anchor.

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
    >>> s0.elements.tolist(), s1.elements.tolist()  # s1 reads (0,0) and (1,0) as its prefix
    ([0, 1, 4, 5], [2, 3, 6, 7])
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
    owner = torch.searchsorted(torch.tensor(boundaries[1:]), anchor, right=True).clamp(max=num_segments - 1)
    return [
        Segment(s, boundaries[s], boundaries[s + 1], (owner == s).nonzero().flatten())
        for s in range(num_segments)
    ]


__all__ = ["Segment", "partition_boundaries", "partition_plan"]
