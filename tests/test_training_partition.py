"""Sequence partitioning: every element owned once, what it attends to in its pass or its prefix, balanced."""

from __future__ import annotations

import doctest
import itertools

import pytest
import torch

from peagle.training import PEagleMaskTemplate, cod_sample, partition, partition_boundaries, partition_plan


def test_docstring_examples():
    result = doctest.testmod(partition, verbose=False)
    assert result.failed == 0 and result.attempted > 0


def _check_plan(anchor, depth, n, segments):
    owners = torch.zeros(anchor.numel(), dtype=torch.long)
    for seg in segments:
        owners[seg.elements] += 1
        members = set(seg.elements.tolist())
        # the prefix: depth-0 elements of earlier segments, read as keys and values
        prefix = set(((depth == 0) & (anchor < seg.start)).nonzero().flatten().tolist())
        for i in seg.elements.tolist():
            a, d = int(anchor[i]), int(depth[i])
            assert seg.start <= a < seg.end
            needs = ((depth == 0) & (anchor <= a)) | ((anchor == a) & (depth <= d))
            assert set(needs.nonzero().flatten().tolist()) <= members | prefix, (a, d, seg.index)
    assert owners.tolist() == [1] * anchor.numel(), "every element is owned by exactly one segment"


@pytest.mark.parametrize("n,k,segments", [(1, 3, 1), (5, 3, 7), (23, 4, 2), (64, 8, 4), (101, 6, 7)])
@pytest.mark.parametrize("balance", [False, True])
def test_partition_plan_covers_each_element_once(n, k, segments, balance):
    keep = cod_sample(n, k, 0.75, 0.2, generator=torch.Generator().manual_seed(n))
    anchor, depth = PEagleMaskTemplate(n, k).coordinates(keep)
    plan = partition_plan(anchor, depth, n, segments, balance=balance)
    assert len(plan) == segments
    _check_plan(anchor, depth, n, plan)


def test_partition_chains_stay_with_their_anchor():
    n, k = 12, 4
    keep = torch.ones(k, n, dtype=torch.bool)
    anchor, depth = PEagleMaskTemplate(n, k).coordinates(keep)
    plan = partition_plan(anchor, depth, n, 3, boundaries=[0, 4, 8, 12])
    owner = torch.full((anchor.numel(),), -1)
    for seg in plan:
        owner[seg.elements] = seg.index
    assert owner.tolist() == (anchor // 4).tolist()
    with pytest.raises(ValueError, match="boundaries"):
        partition_plan(anchor, depth, n, 3, boundaries=[0, 4, 12])


def test_balanced_boundaries_even_out_the_passes():
    n, k = 400, 8
    # a 100-token prompt: COD keeps no chain there, so equal anchor ranges give uneven passes
    eligible = torch.ones(k, n, dtype=torch.bool)
    eligible[1:, :100] = False
    keep = cod_sample(n, k, 0.8, 0.2, generator=torch.Generator().manual_seed(0), eligible=eligible)
    anchor, depth = PEagleMaskTemplate(n, k).coordinates(keep)
    for s in (2, 4, 7):
        equal = max(len(x) for x in partition_plan(anchor, depth, n, s, balance=False))
        balanced = max(len(x) for x in partition_plan(anchor, depth, n, s, balance=True))
        single = len(partition_plan(anchor, depth, n, 1)[0])
        assert balanced < equal < single
        assert balanced <= single / s + k  # within one anchor's chain of the even share
        b = partition_boundaries(anchor, depth, n, s)
        assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in itertools.pairwise(b))
