"""The distillation losses (KL and CE over the draft vocabulary)."""

from __future__ import annotations

import doctest

import pytest
import torch

from peagle.training import distillation_loss, losses


def test_docstring_examples():
    result = doctest.testmod(losses, verbose=False)
    assert result.failed == 0 and result.attempted > 0


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
