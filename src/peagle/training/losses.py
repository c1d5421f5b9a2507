"""Distillation losses over the draft vocabulary.

The target's distribution at a supervised position is restricted to the draft vocabulary and renormalised
(softmax over the draft rows of the target's `lm_head` only), so no `(N, V_target)` tensor is ever built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("kl", "ce")


def target_draft_logits(
    last_hidden: torch.Tensor, draft_lm_weight: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """Target logits over the draft vocabulary from the target's final (normed) hidden states.

    Args:
        last_hidden: `(N, H_t)` the target's `last_hidden_state` at the positions that predict the labels.
        draft_lm_weight: `(V_draft, H_t)` the rows of the target's `lm_head` for the draft vocabulary
            (``lm_head.weight[i + d2t[i]]``).
        softcap: the target's `final_logit_softcapping`, if it has one.

    Returns:
        `(N, V_draft)` float32 logits.
    """
    logits = F.linear(last_hidden.float(), draft_lm_weight.float())
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def distillation_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    loss_type: str = "kl",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed per-element loss of the drafter against the target over the draft vocabulary.

    Args:
        draft_logits: `(N, V_draft)` drafter logits (any float dtype; computed in float32).
        target_logits: `(N, V_draft)` target logits restricted to the draft vocabulary.
        loss_type: `"kl"`: KL(p_target || p_draft) with both renormalised over the draft vocabulary;
            `"ce"`: cross-entropy on the target's argmax over the draft vocabulary.
        weights: optional `(N,)` per-element weights (EAGLE-3's 0.8**step).

    Returns:
        `(loss_sum, correct)`: the weighted sum of the N per-element losses (divide by the global supervised
        count yourself) and `(N,)` bool, drafter argmax == target argmax.

    Example:

        >>> t = torch.tensor([[2.0, 0.0, 0.0]])
        >>> loss, correct = distillation_loss(t.clone(), t, "kl")
        >>> round(loss.item(), 6), correct.tolist()
        (0.0, [True])
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type is {loss_type!r}; expected one of {LOSS_TYPES}.")
    if draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft logits {tuple(draft_logits.shape)} and target logits {tuple(target_logits.shape)} differ."
        )
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    target_ids = target_logits.argmax(-1)
    if loss_type == "kl":
        log_p = F.log_softmax(target_logits.float(), dim=-1)
        per = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    else:
        per = F.nll_loss(log_q, target_ids, reduction="none")
    if weights is not None:
        per = per * weights
    correct = draft_logits.argmax(-1) == target_ids
    return per.sum(), correct


__all__ = ["LOSS_TYPES", "target_draft_logits", "distillation_loss"]
