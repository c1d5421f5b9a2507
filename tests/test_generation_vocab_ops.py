"""`generation/vocab_ops.py`: the blockwise argmax, max and top k over the vocabulary axis give torch's own results
(the first index of the maximum, NaN counted as the maximum; the same top-k values, largest first) for every shape,
vocabulary size (whole blocks and a rest), tie, infinity and layout, and serve the loop's large verify passes."""

from __future__ import annotations

import pytest
import torch

from peagle.generation import vocab_ops
from peagle.generation.vocab_ops import vocab_argmax, vocab_max, vocab_topk


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    for trial in range(120):
        vocab = int(torch.randint(2 * vocab_ops.BLOCK, 5 * vocab_ops.BLOCK, (1,), generator=g))
        if trial % 4 == 0:
            vocab -= vocab % vocab_ops.BLOCK  # whole blocks only
        shape = [int(torch.randint(1, 4, (1,), generator=g)) for _ in range(1 + trial % 2)] + [vocab]
        x = (
            torch.randn(*shape, generator=g)
            if trial % 5 == 0
            else torch.randint(-3, 3, shape, generator=g).float()
        )
        if trial % 5 == 2:
            x[torch.rand(shape, generator=g) < 0.01] = float("nan")
        if trial % 5 == 3:
            x[torch.rand(shape, generator=g) < 0.3] = float("-inf")
        if trial % 5 == 4:
            x[torch.rand(shape, generator=g) < 0.01] = float("inf")
        yield x.transpose(0, -2) if x.dim() > 2 and trial % 3 == 0 else x  # not contiguous


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5))


@pytest.fixture
def blocks_always(monkeypatch):
    monkeypatch.setattr(vocab_ops, "MIN_ENTRIES", 0)  # small inputs take the blocks too


def test_argmax_and_max_are_torchs_own(blocks_always):
    for x in _inputs(0):
        assert vocab_ops._blocks(x) is not None
        assert torch.equal(vocab_argmax(x), x.argmax(dim=-1))
        values, index = vocab_max(x)
        ref = x.max(dim=-1)
        assert torch.equal(index, ref.indices) and _same(values, ref.values)


def test_topk_is_torchs_own(blocks_always):
    for x in _inputs(1):
        for k in (1, 2, 8):
            values, index = vocab_topk(x, k)
            ref = x.topk(k, dim=-1)
            assert _same(values, ref.values)
            assert _same(x.gather(-1, index), values)  # the indices point at those values
            assert all(len(set(row)) == k for row in index.reshape(-1, k).tolist())


def test_only_large_inputs_take_the_blocks():
    verify = torch.randn(1, 33, 49152)  # a tree's verify pass over a SmolLM2-sized vocabulary
    assert vocab_ops._blocks(verify) is not None
    assert torch.equal(vocab_argmax(verify), verify.argmax(dim=-1))
    assert vocab_ops._blocks(torch.randn(1, 49152)) is None  # a plain step: torch's one kernel
    assert vocab_ops._blocks(torch.randn(1, 7, 8192)) is None  # a drafter round
    assert vocab_ops._blocks(torch.randn(2, 4)) is None
