"""The drafting side of draft trees: each row's candidates from one round of the head ([`parallel_candidates`]
for a P-EAGLE head's K distributions) or from EAGLE-2's level-by-level expansion of an autoregressive head
([`expand_autoregressive_tree`]).  [`tree`] grows the trees from them; docs/DESIGN.md section 11."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .rule import AcceptanceCorrection, calibrated_probabilities, calibrated_probability
from .tree import CANDIDATES_PER_DEPTH, sibling_probabilities

FRONTIER_WIDTH = 8
"""Nodes an autoregressive head's tree expands per level (one drafter pass over all of them, EAGLE-2's top-k)."""


def parallel_candidates(
    draft: Any,
    confidences: list[list[float]],
    head: Any,
    calibration: dict[str, Any] | None,
    correction: AcceptanceCorrection,
) -> list[list[list[tuple[int, float]]]]:
    """Per row and depth, a tree's candidates `[(token, acceptance probability), ...]` from one drafting round
    ([`PEagleDrafter.draft_round`]'s result `draft`, `confidences[depth][row]` of its drafted tokens): the
    drafted token first with its calibrated, corrected probability, then the head's other top tokens (from the
    processed scores when there are any) sharing the rest ([`tree.sibling_probabilities`])."""
    if draft.scores is not None:
        probs = draft.scores.float().softmax(dim=-1)
        head_p, ids = probs.topk(min(CANDIDATES_PER_DEPTH, probs.shape[-1]), dim=-1)
    else:
        probs = draft.logits.float().softmax(dim=-1)
        head_p, ids = probs.topk(min(CANDIDATES_PER_DEPTH, probs.shape[-1]), dim=-1)
        ids = head.draft_to_target(ids)
    ids, head_p, drafted = ids.tolist(), head_p.tolist(), draft.tokens.tolist()
    out = []
    for b, column in enumerate(zip(*confidences, strict=True)):
        corrected = correction.apply(calibrated_probabilities(calibration, list(column)))
        row = []
        for d, chosen in enumerate(drafted[b]):
            tokens, hp = list(ids[b][d]), list(head_p[b][d])
            if chosen in tokens:
                i = tokens.index(chosen)
                tokens.insert(0, tokens.pop(i))
                hp.insert(0, hp.pop(i))
            else:  # a sampled draft outside the top tokens
                tokens, hp = [chosen] + tokens[:-1], [column[d]] + hp[:-1]
            row.append(list(zip(tokens, sibling_probabilities(corrected[d], hp))))
        out.append(row)
    return out


class CandidatePool:
    """One row's candidates while an autoregressive head's tree is expanded: per entry its token, parent (pool
    index, -1 the root), acceptance probability given the parent, path value, chain flag, depth (0-based) and
    the hidden state of the drafter slot whose logits proposed it (what the entry's own slot is fed)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self.values: list[float] = []
        self.chain: list[bool] = []
        self.depths: list[int] = []
        self.source: list[torch.Tensor] = []
        self._chain_conf: dict[int, float] = {}

    def add_children(
        self,
        parent: int,
        tokens: list[int],
        head_probs: list[float],
        source: torch.Tensor,
        depth: int,
        calibration: dict[str, Any] | None,
        correction: AcceptanceCorrection,
    ) -> None:
        """The head's top tokens after `parent` at 0-based `depth`, best first, proposed by a slot whose output
        hidden state is `source`."""
        top = min(1.0, calibrated_probability(calibration, depth, head_probs[0]) * correction.factor(depth))
        base = 1.0 if parent < 0 else self.values[parent]
        on_chain = parent < 0 or self.chain[parent]
        if on_chain:
            self._chain_conf[depth] = float(head_probs[0])
        for i, (token, p) in enumerate(zip(tokens, sibling_probabilities(top, head_probs))):
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.probs.append(p)
            self.values.append(base * p)
            self.chain.append(on_chain and i == 0)
            self.depths.append(depth)
            self.source.append(source)

    def chain_confidence(self, depth: int) -> float:
        """The head's probability of the chain's draft at `depth` (what a chain-only round would verify)."""
        return self._chain_conf.get(depth, 0.0)

    def frontier(self, depth: int, width: int) -> list[int]:
        """The best `width` entries of 0-based depth `depth` by value, the chain's entry always among them."""
        level = sorted((i for i, d in enumerate(self.depths) if d == depth), key=lambda i: -self.values[i])
        chosen = level[:width]
        chain = [i for i in level if self.chain[i]]
        if chain and chain[0] not in chosen:
            chosen = chosen[: width - 1] + chain[:1]
        return chosen

    def ancestors(self, node: int) -> set[int]:
        """`node` and every entry above it."""
        out = set()
        while node >= 0:
            out.add(node)
            node = self.parents[node]
        return out


@torch.no_grad()
def expand_autoregressive_tree(
    head: Any,
    cache: Any,
    real_mask: torch.Tensor,
    tokens: torch.LongTensor,
    feats: torch.Tensor,
    starts: torch.LongTensor,
    mask: torch.Tensor | None,
    depth_limit: int,
    calibration: dict[str, Any] | None,
    correction: AcceptanceCorrection,
    keep_going: Callable[[list[list[float]]], bool] | None = None,
) -> tuple[list[CandidatePool], list[list[float]], int, int]:
    """EAGLE-2's tree expansion for an autoregressive (EAGLE-3-style) head, for a batch of rows.

    One pass over the new real slots (`tokens (B, R)`, `feats (B, R, F)` at positions `starts (B,)` onwards, with
    `mask`, the 2D validity of the cache plus the block, or None) gives depth 1's candidates.  Each further pass
    feeds every row's best [`FRONTIER_WIDTH`] candidates of the newest depth (the chain's among them) as
    autoregressive slots: token = the candidate, hidden input = the output of the slot that proposed it,
    position = the root's + depth; each sees the row's valid real slots (`real_mask (B, S + R)`) and its own
    ancestors among the speculative slots (a 4D mask), and proposes its children.  At most `depth_limit` passes;
    fewer when `keep_going(confidences)` says another level does not pay (the cost rule).

    Returns:
        `(pools, confidences, passes, speculative_slots)`: per row its [`CandidatePool`], `confidences[depth][row]`
        of the chain's drafts, the drafter passes made, and the speculative slots now after the real ones in
        `cache` (drop them before the next round).
    """
    rows, device = tokens.shape[0], tokens.device
    positions = starts.to(device)[:, None] + torch.arange(tokens.shape[1], device=device)
    out = head(
        input_ids=tokens,
        target_hidden_states=feats,
        position_ids=positions,
        cache=cache,
        attention_mask=mask,
        parallel_mask=torch.zeros_like(tokens, dtype=torch.bool),
        use_cache=True,
        logits_to_keep=1,
    )
    real = real_mask.bool()
    root = positions[:, -1]
    pools = [CandidatePool() for _ in range(rows)]
    frontier = [[-1] for _ in range(rows)]  # pool index of the node each fed slot stands for (-1: root)
    logits, hidden = out.logits[:, -1:].float(), out.last_hidden_state[:, -1:]
    spec: list[list[int]] = [[] for _ in range(rows)]  # pool index held by each speculative cache slot
    confidences: list[list[float]] = []
    passes = 1
    for depth in range(depth_limit):
        top_p, top_i = logits.softmax(dim=-1).topk(min(CANDIDATES_PER_DEPTH, logits.shape[-1]), dim=-1)
        ids, top_p = head.draft_to_target(top_i).tolist(), top_p.tolist()
        for b in range(rows):
            for f, parent in enumerate(frontier[b]):
                pools[b].add_children(
                    parent, ids[b][f], top_p[b][f], hidden[b, f], depth, calibration, correction
                )
        confidences.append([pool.chain_confidence(depth) for pool in pools])
        if depth == depth_limit - 1 or (keep_going is not None and not keep_going(confidences)):
            break
        frontier = [pool.frontier(depth, FRONTIER_WIDTH) for pool in pools]
        width = min(len(f) for f in frontier)
        frontier = [f[:width] for f in frontier]
        ids_in = torch.tensor([[pools[b].tokens[i] for i in frontier[b]] for b in range(rows)], device=device)
        hid_in = torch.stack([torch.stack([pools[b].source[i] for i in frontier[b]]) for b in range(rows)])
        seen = torch.zeros(rows, width, len(spec[0]) + width, dtype=torch.bool)
        for b in range(rows):
            for f, node in enumerate(frontier[b]):
                above = pools[b].ancestors(node)
                seen[b, f, : len(spec[b])] = torch.tensor(
                    [held in above for held in spec[b]], dtype=torch.bool
                )
                seen[b, f, len(spec[b]) + f] = True
        full = torch.cat([real[:, None, :].expand(-1, width, -1), seen.to(device)], dim=-1)[:, None]
        out = head(
            input_ids=ids_in,
            projected_hidden_states=hid_in,
            position_ids=(root[:, None] + depth + 1).expand(-1, width),
            cache=cache,
            attention_mask=full,
            parallel_mask=torch.zeros_like(ids_in, dtype=torch.bool),
            use_cache=True,
        )
        for b in range(rows):
            spec[b].extend(frontier[b])
        logits, hidden = out.logits.float(), out.last_hidden_state
        passes += 1
    return pools, confidences, passes, len(spec[0])


__all__ = ["CandidatePool", "FRONTIER_WIDTH", "expand_autoregressive_tree", "parallel_candidates"]
