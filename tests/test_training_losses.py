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


@pytest.mark.parametrize("loss_type", ["kl", "ce"])
def test_target_distribution_shared_by_position_matches_per_element(loss_type):
    """Elements that predict the same position share one row of the target's distribution; the loss and the
    agreement are those of computing the target's logits for every element separately."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 4, generator=g)
    weight = torch.randn(9, 4, generator=g)
    batch_idx = torch.tensor([0, 0, 1, 1, 1, 0])
    pos = torch.tensor([1, 1, 2, 5, 2, 4])  # repeated positions, as K_train depths produce
    draft = torch.randn(6, 9, generator=g, requires_grad=True)
    weights = torch.linspace(1.0, 0.5, 6)
    shared = losses.TargetDistribution.from_hidden(hidden, weight, loss_type=loss_type)
    loss, correct = shared.loss(draft, batch_idx, pos, weights)
    per_element = losses.target_draft_logits(hidden[batch_idx, pos], weight)
    ref, ref_correct = distillation_loss(draft, per_element, loss_type, weights)
    torch.testing.assert_close(loss, ref)
    assert correct.tolist() == ref_correct.tolist()
    (grad,) = torch.autograd.grad(loss, draft)
    (ref_grad,) = torch.autograd.grad(ref, draft)
    torch.testing.assert_close(grad, ref_grad)
    assert not losses.TargetDistribution.from_logits(torch.tensor([[[0.0, float("nan")]]])).finite
