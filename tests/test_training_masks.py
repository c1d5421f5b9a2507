"""The P-EAGLE training attention mask: the rule, the template, padding, the flex-attention block mask."""

from __future__ import annotations

import doctest

import pytest
import torch

from peagle.training import PEagleMaskTemplate, cod_sample, masks, peagle_attention_mask, peagle_block_mask
from peagle.training.masks import flex_attention_available


def test_docstring_examples():
    result = doctest.testmod(masks, verbose=False)
    assert result.failed == 0 and result.attempted > 0


def brute_force_mask(anchor, depth, valid, doc):
    """The attention rule of docs/DESIGN.md section 4, one pair at a time."""
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
    tpl = PEagleMaskTemplate(max_anchors=40, num_parallel_positions=6)
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
    tpl = PEagleMaskTemplate(max_anchors=16, num_parallel_positions=4)
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
