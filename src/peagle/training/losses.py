"""Distillation losses over the draft vocabulary.

The target's distribution at a supervised position is restricted to the draft vocabulary and renormalised
(softmax over the draft rows of the target's `lm_head` only), so no `(N, V_target)` tensor is ever built.
Every element (a, d) that predicts position p shares the target's distribution at p: [`TargetDistribution`]
computes it once per position of a micro-batch and the K_train elements that use it gather their row, instead
of each element recomputing the same `(V_draft, H_t)` projection and softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("kl", "ce")


def target_draft_logits(
    last_hidden: torch.Tensor, draft_lm_weight: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """Target logits over the draft vocabulary from the target's final (normed) hidden states.

    Args:
        last_hidden: `(..., H_t)` the target's `last_hidden_state` at the positions that predict the labels.
        draft_lm_weight: `(V_draft, H_t)` the rows of the target's `lm_head` for the draft vocabulary
            (``lm_head.weight[i + d2t[i]]``).
        softcap: the target's `final_logit_softcapping`, if it has one.

    Returns:
        `(..., V_draft)` float32 logits.
    """
    logits = F.linear(last_hidden.float(), draft_lm_weight.float())
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@dataclass
class TargetDistribution:
    """The target's distribution over the draft vocabulary at every position of a micro-batch.

    Attributes:
        argmax: `(B, T)` the target's top token (draft-vocabulary index) at each position.
        probs: `(B, T, V_draft)` float32 probabilities (KL only; None for CE).
        neg_entropy: `(B, T)` sum of p log p (KL only), so KL(p || q) = neg_entropy - sum p log q.
        finite: whether every target logit was finite (check it before learning from it).
        argmax_is_global: `(B, T)` bool, the draft-vocabulary argmax is also the argmax over the target's whole
            vocabulary (set by [`TargetDistribution.mark_global_argmax`]; None until then).
        offset: the position of the first row: built from a window ``[offset, offset + T)`` of a longer example,
            position p is row ``p - offset`` (positions passed to [`loss`] and [`at`] are the example's).
    """

    argmax: torch.Tensor
    probs: torch.Tensor | None
    neg_entropy: torch.Tensor | None
    finite: bool
    argmax_is_global: torch.Tensor | None = None
    offset: int = 0

    def at(self, table: torch.Tensor, batch_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`table[batch_idx, pos]` for a `(B, T, ...)` table of this distribution, at the example's positions."""
        return table[batch_idx, pos - self.offset]

    def mark_global_argmax(
        self, last_hidden: torch.Tensor, lm_weight: torch.Tensor, draft_to_target: torch.Tensor, softcap=None
    ) -> None:
        """Record where the target's own greedy token (over its whole vocabulary) is the draft-vocabulary
        argmax, i.e. where a drafter that matches `argmax` is accepted by greedy verification.

        Args:
            last_hidden: `(B, T, H_t)`; lm_weight: `(V, H_t)` the target's `lm_head` weight;
            draft_to_target: `(V_draft,)` target token id of each draft index (``i + d2t[i]``).
        """
        with torch.no_grad():
            rows = []
            for b in range(last_hidden.shape[0]):  # one row at a time: (T, V) logits, not (B, T, V)
                full = target_draft_logits(last_hidden[b], lm_weight, softcap).argmax(-1)
                rows.append(full == draft_to_target.to(full.device)[self.argmax[b]])
            self.argmax_is_global = torch.stack(rows)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, loss_type: str = "kl") -> TargetDistribution:
        """From target logits over the draft vocabulary, `(B, T, V_draft)`."""
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type is {loss_type!r}; expected one of {LOSS_TYPES}.")
        logits = logits.float()
        finite = bool(torch.isfinite(logits).all()) if logits.numel() else True
        probs = neg_entropy = None
        if loss_type == "kl":
            log_p = F.log_softmax(logits, dim=-1)
            probs = log_p.clamp(min=-80.0).exp()  # below e^-80 exp() returns denormals, 10-20x slower on CPUs
            neg_entropy = (probs * log_p).sum(-1)
        return cls(logits.argmax(-1), probs, neg_entropy, finite)

    @classmethod
    def from_hidden(
        cls,
        last_hidden: torch.Tensor,
        draft_lm_weight: torch.Tensor,
        softcap: float | None = None,
        loss_type: str = "kl",
    ) -> TargetDistribution:
        """From the target's final hidden states `(B, T, H_t)` (see [`target_draft_logits`])."""
        with torch.no_grad():
            return cls.from_logits(target_draft_logits(last_hidden, draft_lm_weight, softcap), loss_type)

    def loss(
        self,
        draft_logits: torch.Tensor,
        batch_idx: torch.Tensor,
        pos: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss of N drafter rows against the target at `(batch_idx, pos)`.

        Args:
            draft_logits: `(N, V_draft)` drafter logits (any float dtype; computed in float32).
            batch_idx, pos: `(N,)` where in the batch each row's label is predicted.
            weights: optional `(N,)` per-element weights (EAGLE-3's 0.8**step).

        Returns:
            `(loss_sum, correct)`: the weighted sum of the N per-element losses and `(N,)` bool, drafter argmax
            == target argmax. The loss is KL(p_target || p_draft) when built with `"kl"`, else cross-entropy on
            the target's argmax.
        """
        draft = draft_logits.float()
        target_ids = self.at(self.argmax, batch_idx, pos)
        if (
            self.probs is not None
        ):  # KL = cross-entropy with the target's probabilities - the target's entropy
            per = F.cross_entropy(draft, self.at(self.probs, batch_idx, pos), reduction="none")
            per = per + self.at(self.neg_entropy, batch_idx, pos)
        else:
            per = F.cross_entropy(draft, target_ids, reduction="none")
        if weights is not None:
            per = per * weights
        correct = draft.detach().argmax(-1) == target_ids
        return per.sum(), correct


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
    if draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft logits {tuple(draft_logits.shape)} and target logits {tuple(target_logits.shape)} differ."
        )
    target = TargetDistribution.from_logits(target_logits[None], loss_type)
    n = draft_logits.shape[0]
    rows = torch.arange(n, device=draft_logits.device)
    return target.loss(draft_logits, torch.zeros_like(rows), rows, weights)


__all__ = ["LOSS_TYPES", "target_draft_logits", "TargetDistribution", "distillation_loss"]
