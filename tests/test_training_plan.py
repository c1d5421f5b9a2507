"""Planning the elements of an example: supervision, the draft vocabulary, segments."""

from __future__ import annotations

import doctest

import torch

from peagle.training import plan, plan_example


def test_docstring_examples():
    result = doctest.testmod(plan, verbose=False)
    assert result.failed == 0 and result.attempted > 0


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
    assert sum(len(s) for s in plan.segments) == plan.anchor.numel()
