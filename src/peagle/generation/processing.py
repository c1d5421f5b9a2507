"""Per-row logits processing: the call's logits processors applied to each row of a ragged batch with that row's
own history ([`grouped_processing`]), and the drafting round's selector that turns one depth's drafter logits into
each row's draft through them ([`draft_selector`]; docs/DESIGN.md sections 3.3 and 10)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessorList

from ..drafting_peagle import DraftSelector
from ..modeling_peagle import PEagleDrafter
from .sampling import KeyedSampler
from .tree_drafting import top_candidates
from .vocab_ops import vocab_argmax, vocab_max


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
    probabilities: list[torch.Tensor],
    confidences: list[list[float]],
    cut: Callable[[list[list[float]]], bool] | None,
    sampler: KeyedSampler | None = None,
) -> DraftSelector:
    """The round's `select(logits, depth)` for [`PEagleDrafter.draft_round`].

    Each depth's `(B, V_draft)` logits become target-vocabulary scores (`-inf` outside the draft vocabulary), pass
    through `processors` with each row's history plus its drafts so far (`rows`: each row's index in the call's
    `batch_size` rows), and give one token per row (argmax, or when `do_sample` the `sampler`'s keyed draw for the
    row's position, the noise the target's own draw there will use: [`sampling.KeyedSampler`]).  The scores returned
    are exactly those the token was drawn from.  Nothing is proposed when the processors leave some row no
    admissible token (e.g. a forced token outside the draft vocabulary).  Greedy without processors skips the
    target vocabulary: no scores go back to the loop, and when there is no `cut` the selector also has
    `whole_round(logits (B, k, V_draft)) -> tokens (B, k)`, which a parallel head's round calls once for all its
    depths instead of once per depth ([`WholeRound`], which can keep the round's top tokens for the tree candidates).

    The head's probability of each row's draft goes to `probabilities[depth]` as a `(B,)` tensor, read on the host
    by the caller once the round is over.  `cut` (None: never), for a head that runs one pass per depth: whether
    the round ends after the drafts picked so far, given their probabilities `[depth][row]`; it reads each depth's
    probabilities as it goes (into `confidences`, which the caller then need not read again), since the next pass
    depends on it.  A parallel head's drafts all come from one pass, so its caller applies any cut after the round
    (one host read for the whole round).
    """
    contexts = list(histories)
    keys = list(range(len(histories))) if rows is None else list(rows)
    starts = [h.shape[1] for h in histories]  # each row's next position: its first draft's
    if do_sample and sampler is None:
        raise ValueError("sampled drafts need the call's KeyedSampler")

    def stop(prob: torch.Tensor) -> bool:
        probabilities.append(prob)
        if cut is None:
            return False
        confidences.append(prob.tolist())
        return cut(confidences)

    if not do_sample and len(processors) == 0:

        def select_greedy(logits: torch.Tensor, depth: int):
            prob, index = vocab_max(logits.softmax(dim=-1))
            return head.draft_to_target(index), None, stop(prob)

        if cut is None:  # no depth's pick waits on an earlier one's probability
            select_greedy.whole_round = WholeRound(head, probabilities)
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
            token = vocab_argmax(scores)
        prob = scores.softmax(dim=-1).gather(-1, token[:, None])[:, 0]
        if len(processors) > 0:
            for b in range(len(contexts)):
                contexts[b] = torch.cat([contexts[b], token[b : b + 1, None].to(contexts[b].device)], dim=-1)
        return token, scores, stop(prob)

    return select


class WholeRound:
    """A greedy selector's `whole_round(logits (B, k, V_draft)) -> tokens (B, k)` ([`draft_selector`]): each depth's
    argmax from one softmax over all of them, its probability appended per depth to `probabilities`.  Where the
    caller sets `tree` (the round grows trees), the argmax is the first of each depth's top tokens, kept in `top` as
    [`tree_drafting.candidate_tensors`] gives them: `(ids (B, k, C) target ids, probabilities)`."""

    def __init__(self, head: PEagleDrafter, probabilities: list[torch.Tensor]):
        self.head, self.probabilities = head, probabilities
        self.tree = False
        self.top: tuple[torch.LongTensor, torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor) -> torch.LongTensor:
        probs = logits.softmax(dim=-1)
        if self.tree:
            self.top = ids, head_p = top_candidates(probs, self.head)
            self.probabilities.extend(head_p[..., 0].unbind(dim=1))
            return ids[..., 0]
        prob, index = vocab_max(probs)
        self.probabilities.extend(prob.unbind(dim=1))
        return self.head.draft_to_target(index)


def read_together(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """Several small tensors read on the host in ONE read (one synchronisation on an accelerator): each comes back
    as the nested lists `tolist()` gives, integer tensors as ints.  Values travel as float64, exact for token ids
    and for float32 probabilities."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        part = flat[at : at + n]
        at += n
        if not t.is_floating_point():
            part = [int(v) for v in part]
        out.append(_nest(part, list(t.shape)))
    return out


def _nest(values: list[Any], shape: list[int]) -> Any:
    if len(shape) <= 1:
        return values if shape else values[0]
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


__all__ = ["draft_selector", "grouped_processing", "read_together"]
