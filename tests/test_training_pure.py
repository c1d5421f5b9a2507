"""The pure functions of the training method: COD, the attention mask, the partition plan, losses, planning."""

from __future__ import annotations

import doctest
import importlib
import itertools

import pytest
import torch

from peagle.training import (
    PEagleMaskTemplate,
    cod_counts,
    cod_sample,
    distillation_loss,
    partition_boundaries,
    partition_plan,
    peagle_attention_mask,
    peagle_block_mask,
    plan_example,
)
from peagle.training.masks import flex_attention_available


@pytest.mark.parametrize(
    "module",
    ["cod", "masks", "partition", "losses", "trainer", "data"],
)
def test_docstring_examples(module):
    mod = importlib.import_module(f"peagle.training.{module}")
    result = doctest.testmod(mod, verbose=False)
    assert result.failed == 0


# ---------------------------------------------------------------------------------------------------- COD
@pytest.mark.parametrize(
    "n,k,r,rmin",
    [(10, 4, 0.5, 0.2), (57, 8, 0.8, 0.2), (100, 6, 0.7, 0.0), (5, 3, 1.0, 0.0), (9, 4, 0.0, 0.0)],
)
def test_cod_counts_and_nested_chains(n, k, r, rmin):
    expected = [n] + [min(n, int(max(r**d, rmin) * n + 0.5)) for d in range(1, k)]
    for d in range(1, k):
        expected[d] = min(expected[d], expected[d - 1])
    assert cod_counts(n, k, r, rmin) == expected
    for seed in range(5):
        keep = cod_sample(n, k, r, rmin, generator=torch.Generator().manual_seed(seed))
        assert keep.shape == (k, n)
        assert keep[0].all()
        assert keep.sum(1).tolist() == expected
        assert bool((keep[1:] <= keep[:-1]).all()), "a kept (a, d) needs its (a, d-1)"


def test_cod_reproducible_and_random():
    a = cod_sample(200, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(3))
    b = cod_sample(200, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(3))
    c = cod_sample(200, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_cod_eligible_restricts_the_pool():
    n, k = 30, 5
    eligible = torch.zeros(k, n, dtype=torch.bool)
    eligible[:, 10:20] = True
    keep = cod_sample(n, k, 0.9, 0.2, generator=torch.Generator().manual_seed(0), eligible=eligible)
    assert keep[0].all()
    assert not keep[1:, :10].any() and not keep[1:, 20:].any()
    assert keep[1].sum() == 9  # round(0.9 * 10 eligible)
    assert bool((keep[1:] <= keep[:-1]).all())
    with pytest.raises(ValueError, match="ratios"):
        cod_sample(4, 2, 1.5)


# ---------------------------------------------------------------------------------------------------- mask
def brute_force_mask(anchor, depth, valid, doc):
    """The attention rule of DESIGN.md section 4, one pair at a time."""
    e = len(anchor)
    out = torch.zeros(e, e, dtype=torch.bool)
    for i in range(e):
        for j in range(e):
            a, d, a2, d2 = int(anchor[i]), int(depth[i]), int(anchor[j]), int(depth[j])
            same = doc is None or int(doc[i]) == int(doc[j])
            ok = valid is None or (bool(valid[i]) and bool(valid[j]))
            out[i, j] = same and ok and ((d2 == 0 and a2 <= a) or (a2 == a and d2 <= d))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mask_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    keep = cod_sample(12, 4, 0.7, 0.2, generator=g)
    tpl = PEagleMaskTemplate(max_anchors=40, num_depths=6)
    anchor, depth = tpl.coordinates(keep)
    assert torch.equal(tpl.mask(keep), brute_force_mask(anchor, depth, None, None))
    # documents and padding, in a shuffled order (the rule must not depend on the layout)
    perm = torch.randperm(anchor.numel(), generator=g)
    anchor, depth = anchor[perm], depth[perm]
    doc = (anchor >= 6).long()
    valid = torch.rand(anchor.numel(), generator=g) > 0.15
    dense = peagle_attention_mask(anchor, depth, valid, doc)
    assert torch.equal(dense, brute_force_mask(anchor, depth, valid, doc))
    # batched, rectangular (queries against a different key set)
    keys = slice(0, anchor.numel() // 2)
    rect = peagle_attention_mask(
        anchor[None], depth[None], key_anchor=anchor[None, keys], key_depth=depth[None, keys]
    )[0]
    assert torch.equal(rect, brute_force_mask(anchor, depth, None, None)[:, keys])


def test_mask_template_slices_and_orders_depth_major():
    tpl = PEagleMaskTemplate(max_anchors=16, num_depths=4)
    keep = torch.zeros(3, 5, dtype=torch.bool)
    keep[0] = True
    keep[1, [1, 3]] = True
    keep[2, 3] = True
    anchor, depth = tpl.coordinates(keep)
    assert anchor.tolist() == [0, 1, 2, 3, 4, 1, 3, 3]
    assert depth.tolist() == [0, 0, 0, 0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="exceeds the template"):
        tpl.coordinates(torch.ones(2, 17, dtype=torch.bool))


def test_pad_self_keeps_padding_rows_finite():
    anchor = torch.tensor([0, 1, 0, 0])
    depth = torch.tensor([0, 0, 1, 0])
    valid = torch.tensor([True, True, True, False])
    m = peagle_attention_mask(anchor, depth, valid, pad_self=True)
    assert m[3].tolist() == [False, False, False, True]
    assert not m[:3, 3].any()


@pytest.mark.skipif(not flex_attention_available(), reason="needs torch flex attention")
def test_block_mask_matches_dense_mask():
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    e = 40
    anchor = torch.randint(0, 12, (2, e), generator=g)
    depth = torch.randint(0, 3, (2, e), generator=g)
    valid = torch.rand(2, e, generator=g) > 0.2
    block = peagle_block_mask(anchor, depth, valid, pad_self=True, block_size=16)
    dense = peagle_attention_mask(anchor, depth, valid, pad_self=True)
    q, k, v = (torch.randn(2, 2, e, 8, generator=g) for _ in range(3))
    out_flex = flex_attention(q, k, v, block_mask=block)
    out_dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)
    # queries appended to a KV cache: the last 15 of the 40 keys
    qs = slice(25, 40)
    kw = dict(key_anchor=anchor, key_depth=depth, key_valid=valid, pad_self=True)
    block = peagle_block_mask(anchor[:, qs], depth[:, qs], valid[:, qs], block_size=16, **kw)
    dense = peagle_attention_mask(anchor[:, qs], depth[:, qs], valid[:, qs], **kw)
    assert torch.equal(dense, peagle_attention_mask(anchor, depth, valid, pad_self=True)[:, qs])
    out_flex = flex_attention(q[:, :, qs], k, v, block_mask=block)
    out_dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, qs], k, v, attn_mask=dense[:, None])
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- partition
def _check_plan(anchor, depth, n, segments):
    owners = torch.zeros(anchor.numel(), dtype=torch.long)
    for seg in segments:
        owners[seg.elements[seg.owned]] += 1
        members = set(seg.elements.tolist())
        for i in seg.elements[seg.owned].tolist():
            a, d = int(anchor[i]), int(depth[i])
            # everything the element attends to is in the same forward pass
            needs = ((depth == 0) & (anchor <= a)) | ((anchor == a) & (depth <= d))
            assert set(needs.nonzero().flatten().tolist()) <= members, (a, d, seg.index)
        # context-only elements are depth-0 elements before the segment's end
        ctx = seg.elements[~seg.owned]
        assert bool((depth[ctx] == 0).all()) and bool((anchor[ctx] < seg.end).all())
    assert owners.tolist() == [1] * anchor.numel(), "every element is owned by exactly one segment"


@pytest.mark.parametrize("n,k,segments", [(1, 3, 1), (5, 3, 7), (23, 4, 2), (64, 8, 4), (101, 6, 7)])
@pytest.mark.parametrize("balance", [False, True])
def test_partition_plan_covers_each_element_once(n, k, segments, balance):
    keep = cod_sample(n, k, 0.75, 0.2, generator=torch.Generator().manual_seed(n))
    anchor, depth = PEagleMaskTemplate(n, k).coordinates(keep)
    plan = partition_plan(anchor, depth, n, segments, balance=balance)
    assert len(plan) == segments
    _check_plan(anchor, depth, n, plan)


def test_partition_chains_follow_anchor_plus_one():
    n, k = 12, 4
    keep = torch.ones(k, n, dtype=torch.bool)
    anchor, depth = PEagleMaskTemplate(n, k).coordinates(keep)
    plan = partition_plan(anchor, depth, n, 3, boundaries=[0, 4, 8, 12])
    owner = torch.full((anchor.numel(),), -1)
    for seg in plan:
        owner[seg.elements[seg.owned]] = seg.index
    for i in range(anchor.numel()):
        a, d = int(anchor[i]), int(depth[i])
        pos = a if d == 0 else min(a + 1, n - 1)
        assert int(owner[i]) == pos // 4
    with pytest.raises(ValueError, match="boundaries"):
        partition_plan(anchor, depth, n, 3, boundaries=[0, 4, 12])


def test_balanced_boundaries_shrink_the_largest_pass():
    n, k = 400, 8
    keep = cod_sample(n, k, 0.8, 0.2, generator=torch.Generator().manual_seed(0))
    anchor, depth = PEagleMaskTemplate(n, k).coordinates(keep)
    for s in (2, 4, 7):
        equal = max(len(x) for x in partition_plan(anchor, depth, n, s, balance=False))
        balanced = max(len(x) for x in partition_plan(anchor, depth, n, s, balance=True))
        single = len(partition_plan(anchor, depth, n, 1)[0])
        assert balanced <= equal < single
        b = partition_boundaries(anchor, depth, n, s)
        assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in itertools.pairwise(b))


# ---------------------------------------------------------------------------------------------------- planning
def test_plan_example_supervision_and_draft_vocab():
    ids = torch.tensor([1, 5, 6, 7, 8, 9, 2])
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    vocab = torch.ones(10, dtype=torch.bool)
    vocab[8] = False  # token 8 (position 4) is outside the draft vocabulary
    plan = plan_example(ids, loss_mask, vocab, 4, 1.0, 1.0)
    for a, d, sup in zip(plan.anchor.tolist(), plan.depth.tolist(), plan.supervised.tolist()):
        p = a + d + 2
        assert sup == (p < 7 and p >= 3 and p != 4), (a, d)
    # chains that cannot reach a supervised label are never built
    assert all(a + d + 2 < 7 for a, d in zip(plan.anchor.tolist(), plan.depth.tolist()) if d > 0)
    assert plan.num_supervised == int(plan.supervised.sum())
    assert sum(int(s.owned.sum()) for s in plan.segments) == plan.anchor.numel()


def test_distillation_loss_kl_and_ce():
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(5, 11, generator=g)
    target = torch.randn(5, 11, generator=g)
    loss, correct = distillation_loss(draft, target, "kl")
    p = target.softmax(-1)
    expected = (p * (p.log() - draft.log_softmax(-1))).sum()
    torch.testing.assert_close(loss, expected)
    ce, _ = distillation_loss(draft, target, "ce", weights=torch.full((5,), 0.5))
    torch.testing.assert_close(
        ce, 0.5 * torch.nn.functional.cross_entropy(draft, target.argmax(-1), reduction="sum")
    )
    assert correct.tolist() == (draft.argmax(-1) == target.argmax(-1)).tolist()
    with pytest.raises(ValueError, match="loss_type"):
        distillation_loss(draft, target, "mse")
