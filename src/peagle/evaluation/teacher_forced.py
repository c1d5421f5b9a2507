"""Acceptance of a head measured teacher-forced: every drafting round of greedy decoding scored in one pass over
held-out examples, and the decoding walk through the same grid (`walk.decoding_walk`)."""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from .walk import decoding_walk


@torch.no_grad()
def evaluate_acceptance(
    trainer,
    eval_dataset=None,
    num_speculative_tokens: int | None = None,
    progress: bool = True,
    max_new_tokens: int | None = None,
) -> dict[str, Any]:
    """Acceptance of greedy verification on held-out examples, measured teacher-forced in one pass.

    A drafting round that starts after token a proposes depths 0..K-1; greedy verification accepts the
    leading drafts that equal the target's own greedy tokens. Up to the first miss, a drafter that sees its
    own drafts (EAGLE-3) sees exactly the reference tokens, and a P-EAGLE drafter never sees them, so the
    number of accepted drafts is the leading run of correct depths of the training elements of anchor a,
    computed with every depth kept (no COD) against the target's argmax over its whole vocabulary. Every
    anchor whose K labels lie in a response counts once: `tokens_per_target_pass` = 1 + mean run, the
    quantity `generate()` reports, averaged over every possible round start instead of the starts one
    decoding visits. Easy stretches of a response are crossed in few rounds and hard ones token by token, so
    this average over anchors reads higher than decoding does; `decoded_tokens_per_target_pass` walks the
    same grid as greedy decoding with K drafts every round would ([`decoding_walk`]: a round after anchor a
    moves to anchor a + 1 + run, the prefill counts as a pass) and equals what `generate()` reports when the
    responses are the target's own greedy continuations, at the cost of the one teacher-forced pass.

    Args:
        trainer: a [`PEagleTrainer`] holding the head and its target.
        eval_dataset: examples (or a [`FeatureCache`]); default the trainer's `eval_dataset`.
        num_speculative_tokens: K (default: K_train).
        max_new_tokens: the decoding walk stops each response after this many tokens, as `generate()` with
            `max_new_tokens` would (default: the whole response).

    Returns:
        dict with `tokens_per_target_pass`, `acceptance_by_depth` (share of anchors whose first d + 1 drafts
        are all accepted), `accuracy_by_depth` (top-1 agreement at each depth on its own), `anchors`, and the
        decoding walk's `decoded_tokens_per_target_pass`, `decoded_tokens` and `decoded_target_passes`.
    """
    width = trainer.num_parallel_positions
    k = int(num_speculative_tokens or width)
    if not 1 <= k <= width:
        raise ValueError(f"num_speculative_tokens is {k}; expected 1..{width} (K_train).")
    model = trainer.model
    was_training = model.training
    model.eval()
    runs, hits, counts = [], torch.zeros(k), torch.zeros(k)
    walked_tokens = walked_passes = 0
    try:
        for batch in tqdm(
            trainer.get_eval_dataloader(eval_dataset), desc="acceptance", unit="batch", disable=not progress
        ):
            b_idx, anchor, depth, ok = trainer.acceptance_records(batch).unbind(1)
            bsz, length = batch["input_ids"].shape
            grid = torch.zeros(bsz, length, width)
            grid[b_idx, anchor, depth] = ok.float()
            loss_mask = batch["loss_mask"].cpu().bool()
            labels = torch.arange(length)[:, None] + torch.arange(k)[None] + 2  # x_{a+d+2}
            inside = labels < length
            full = torch.zeros(bsz, length, dtype=torch.bool)
            for b in range(bsz):
                full[b] = (loss_mask[b][labels.clamp(max=length - 1)] & inside).all(-1)
                made, passes = decoding_walk(grid[b, :, :k].bool(), loss_mask[b], max_new_tokens)
                walked_tokens += made
                walked_passes += passes
            chains = grid[..., :k][full]
            runs.append(chains.cumprod(-1).sum(-1))
            hits += chains.sum(0)
            counts += chains.shape[0]
    finally:
        model.train(was_training)
    runs = torch.cat(runs) if runs else torch.zeros(0)
    if runs.numel() == 0:
        raise ValueError(f"no anchor has {k} response tokens after it in the evaluation examples.")
    leading = [float((runs > d).float().mean()) for d in range(k)]
    return {
        "tokens_per_target_pass": 1.0 + float(runs.mean()),
        "acceptance_by_depth": leading,
        "accuracy_by_depth": (hits / counts.clamp(min=1)).tolist(),
        "anchors": int(runs.numel()),
        "num_speculative_tokens": k,
        "decoded_tokens_per_target_pass": walked_tokens / walked_passes if walked_passes else 0.0,
        "decoded_tokens": walked_tokens,
        "decoded_target_passes": walked_passes,
    }


__all__ = ["evaluate_acceptance"]
