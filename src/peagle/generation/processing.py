"""Per-row logits processing: the call's logits processors applied to each row of a ragged batch with that row's
own history ([`grouped_processing`]), and the drafting round's selector that turns one depth's drafter logits into
each row's draft through them ([`draft_selector`]; docs/DESIGN.md sections 3.3 and 10)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.logits_process import LogitsProcessorList

from ..drafting_peagle import DraftSelector
from ..modeling_peagle import PEagleDrafter
from .sampling import KeyedSampler


def grouped_processing(
    processors: LogitsProcessorList,
    histories: list[torch.LongTensor],
    scores: torch.Tensor,
    rows: list[int] | None = None,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Apply `processors` to each row's `(V,)` scores with that row's own history, as plain `generate()` would.

    Rows of a ragged batch sit at different lengths.  Rows whose histories have one length go through the
    processors together, each at its place in the original batch (`rows[b]` of `batch_size`; the other places
    repeat one of the group's histories), so a processor sees each row's own length (`min_new_tokens`) and its
    batch index (per-row state such as the repetition penalty's prompt padding, `prefix_allowed_tokens_fn`).
    `histories[b]` is `(1, L_b)`; returns the processed `(B, V)` scores."""
    if len(processors) == 0:
        return scores
    rows = list(range(len(histories))) if rows is None else rows
    batch_size = len(histories) if batch_size is None else batch_size
    out = scores.clone()
    groups: dict[int, list[int]] = {}
    for b, h in enumerate(histories):
        groups.setdefault(h.shape[1], []).append(b)
    for members in groups.values():
        first = histories[members[0]].to(scores.device)
        ctx = first.expand(batch_size, -1).clone()
        full = scores[members[0]].expand(batch_size, -1).clone()
        for b in members:
            ctx[rows[b]] = histories[b][0].to(scores.device)
            full[rows[b]] = scores[b]
        done = processors(ctx, full)
        for b in members:
            out[b] = done[rows[b]]
    return out


def draft_selector(
    head: PEagleDrafter,
    processors: LogitsProcessorList,
    do_sample: bool,
    histories: list[torch.LongTensor],
    rows: list[int] | None,
    batch_size: int,
    confidences: list[list[float]],
    stop: Callable[[list[list[float]]], bool],
    sampler: KeyedSampler | None = None,
) -> DraftSelector:
    """The round's `select(logits, depth)` for [`PEagleDrafter.draft_round`].

    Each depth's `(B, V_draft)` logits become target-vocabulary scores (`-inf` outside the draft vocabulary), pass
    through `processors` with each row's history plus its drafts so far (`rows`: each row's index in the call's
    `batch_size` rows), and give one token per row (argmax, or when `do_sample` the `sampler`'s keyed draw for the
    row's position, the noise the target's own draw there will use: [`sampling.KeyedSampler`]).  The scores returned
    are exactly those the token was drawn from.  Nothing is proposed when the
    processors leave some row no admissible token (e.g. a forced token outside the draft vocabulary).  The head's
    probability of each draft goes to `confidences[depth][row]`; `stop(confidences)` ends the round (the drafting
    policy's cut).  Greedy without processors skips the target vocabulary: no scores go back to the loop.
    """
    contexts = list(histories)
    keys = list(range(len(histories))) if rows is None else list(rows)
    starts = [h.shape[1] for h in histories]  # each row's next position: its first draft's
    if do_sample and sampler is None:
        raise ValueError("sampled drafts need the call's KeyedSampler")
    if not do_sample and len(processors) == 0:

        def select_greedy(logits: torch.Tensor, depth: int):
            prob, index = logits.softmax(dim=-1).max(dim=-1)
            confidences.append(prob.tolist())
            return head.draft_to_target(index), None, stop(confidences)

        return select_greedy

    def select(logits: torch.Tensor, depth: int):
        scores = head.draft_logits_to_target(logits)
        if len(processors) > 0:
            scores = grouped_processing(processors, contexts, scores, rows, batch_size)
            if not bool(torch.isfinite(scores).any(dim=-1).all()):
                return None
        if do_sample:
            token = sampler.sample(scores, keys, [start + depth for start in starts])
        else:
            token = scores.argmax(dim=-1)
        prob = scores.softmax(dim=-1).gather(-1, token[:, None])[:, 0]
        confidences.append(prob.tolist())
        if len(processors) > 0:
            for b in range(len(contexts)):
                contexts[b] = torch.cat([contexts[b], token[b : b + 1, None].to(contexts[b].device)], dim=-1)
        return token, scores, stop(confidences)

    return select


__all__ = ["draft_selector", "grouped_processing"]
