"""The drafting side of draft trees: each row's candidates from one round of the head ([`parallel_candidates`]
for a P-EAGLE head's K distributions) or from EAGLE-2's level-by-level expansion of an autoregressive head
([`LevelSelector`], through the head's own round).  [`tree`] grows the trees from them; docs/DESIGN.md section 11."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .rule import AcceptanceCorrection, calibrated_probabilities, calibrated_probability
from .tree import CANDIDATES_PER_DEPTH, sibling_probabilities
from .vocab_ops import vocab_topk

FRONTIER_WIDTH = 8
"""Nodes an autoregressive head's tree expands per level (one drafter pass over all of them, EAGLE-2's top-k)."""


def top_candidates(probs: torch.Tensor, head: Any = None) -> tuple[torch.LongTensor, torch.Tensor]:
    """The top `CANDIDATES_PER_DEPTH` entries of `probs (..., V)`, largest first: `(ids, probabilities)`, the ids
    mapped from the draft vocabulary to the target's through `head` (None: `probs` spans the target's already)."""
    head_p, ids = vocab_topk(probs, min(CANDIDATES_PER_DEPTH, probs.shape[-1]))
    return (ids if head is None else head.draft_to_target(ids)), head_p


def candidate_tensors(draft: Any, head: Any) -> tuple[torch.LongTensor, torch.Tensor]:
    """A drafting round's top tokens per row and depth, `(ids (B, k, C), head probabilities (B, k, C))` in the target
    vocabulary, from the processed scores when there are any (read on the host with the round's other figures).  A
    greedy round without processors has them already ([`processing.WholeRound`]'s `top`)."""
    if draft.scores is not None:
        return top_candidates(draft.scores.float().softmax(dim=-1))
    return top_candidates(draft.logits.float().softmax(dim=-1), head)


def parallel_candidates(
    ids: list[list[list[int]]],
    head_p: list[list[list[float]]],
    drafted: list[list[int]],
    confidences: list[list[float]],
    calibration: dict[str, Any] | None,
    correction: AcceptanceCorrection,
) -> list[list[list[tuple[int, float]]]]:
    """Per row and depth, a tree's candidates `[(token, acceptance probability), ...]` from one drafting round of a
    P-EAGLE head, on the host: `ids[b][d]` and `head_p[b][d]` its top tokens and their probabilities
    ([`candidate_tensors`]), `drafted[b][d]` the drafted tokens and `confidences[d][b]` their probabilities.  The
    drafted token comes first with its calibrated, corrected probability, then the head's other top tokens sharing
    the rest ([`tree.sibling_probabilities`])."""
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
    the slot of its level whose logits proposed it (whose hidden state the entry's own slot is fed)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self.values: list[float] = []
        self.chain: list[bool] = []
        self.depths: list[int] = []
        self.proposer: list[int] = []
        self._chain_conf: dict[int, float] = {}

    def add_children(
        self,
        parent: int,
        tokens: list[int],
        head_probs: list[float],
        proposer: int,
        depth: int,
        calibration: dict[str, Any] | None,
        correction: AcceptanceCorrection,
    ) -> None:
        """The head's top tokens after `parent` at 0-based `depth`, best first, proposed by the level's slot
        `proposer`."""
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
            self.proposer.append(proposer)

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


class TreeLevels:
    """Which slots each level of an autoregressive head's tree sees (EAGLE-2's expansion, vectorised over rows).

    `real (B, S)` is the validity of the drafter cache's slots before the first level (0: padding or a hole); every
    level's slot sees those and its own ancestors among the levels, nothing else.
    """

    def __init__(self, real: torch.Tensor):
        self.real = real.bool()
        self.ancestors = torch.zeros(real.shape[0], 0, 0, dtype=torch.bool, device=real.device)
        self.width = (
            1  # slots of the level whose outputs the next level's parents index (first: the bonus slot)
        )

    def feed(
        self, last_hidden_state: torch.Tensor, parents: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.BoolTensor]:
        """The next level, each slot under `parents (B, W)` (indices into the previous level's slots):
        `(hidden inputs (B, W, H), 4D attention mask (B, 1, W, S + N + W))` for N earlier level slots."""
        bsz, width = parents.shape
        previous = last_hidden_state[:, -self.width :]
        hidden = previous.gather(1, parents[..., None].expand(-1, -1, previous.shape[-1]))
        held = self.ancestors.shape[1]
        if held:  # a slot sees what its parent sees, and its parent
            index = parents + (held - self.width)
            above = self.ancestors.gather(1, index[..., None].expand(-1, -1, held))
        else:  # the first level's parent is the bonus slot, a real slot
            above = self.ancestors.new_zeros(bsz, width, 0)
        own = torch.eye(width, dtype=torch.bool, device=parents.device).expand(bsz, -1, -1)
        rows = torch.cat([above, own], dim=-1)
        self.ancestors = torch.cat(
            [torch.cat([self.ancestors, self.ancestors.new_zeros(bsz, held, width)], dim=-1), rows], dim=1
        )
        self.width = width
        mask = torch.cat([self.real[:, None, :].expand(-1, width, -1), rows], dim=-1)[:, None]
        return hidden, mask


class LevelSelector:
    """The selector of an autoregressive (EAGLE-3-style) head's round that grows every row's tree as EAGLE-2 does,
    through the head's own [`PEagleDrafter.draft_round`].

    Depth 1's candidates come from the bonus slot's logits.  Each further level feeds every row's best
    [`FRONTIER_WIDTH`] candidates of the newest depth (the chain's among them) as the round's next slots: token =
    the candidate, hidden input = the output of the slot that proposed it, each seeing the row's valid real slots
    and its own ancestors; their logits propose the children.  The round stops after `depth_limit` levels, or
    earlier when `keep_going(confidences)` says another level does not pay (the cost rule).

    `real (B, S)`: the validity of the drafter cache's slots once the round's real slots are in it ([`TreeLevels`]).
    After the round: `pools[b]`, row b's [`CandidatePool`], and `confidences[depth][row]` of the chain's drafts.
    """

    def __init__(
        self,
        head: Any,
        real: torch.Tensor,
        depth_limit: int,
        calibration: dict[str, Any] | None,
        correction: AcceptanceCorrection,
        keep_going: Callable[[list[list[float]]], bool] | None = None,
    ):
        self.head, self.depth_limit, self.keep_going = head, depth_limit, keep_going
        self.calibration, self.correction = calibration, correction
        self.levels = TreeLevels(real)
        self.pools = [CandidatePool() for _ in range(real.shape[0])]
        self.frontier: list[list[int]] = [
            [-1] for _ in range(real.shape[0])
        ]  # pool index of each fed slot (-1: root)
        self.confidences: list[list[float]] = []

    def __call__(self, logits: torch.Tensor, depth: int) -> tuple[Any, None, bool, Any]:
        if logits.dim() == 2:  # the bonus slot's logits
            logits = logits[:, None]
        ids, top_p = top_candidates(logits.softmax(dim=-1), self.head)
        ids, top_p = ids.tolist(), top_p.tolist()
        for b, pool in enumerate(self.pools):
            for f, parent in enumerate(self.frontier[b]):
                pool.add_children(parent, ids[b][f], top_p[b][f], f, depth, self.calibration, self.correction)
        self.confidences.append([pool.chain_confidence(depth) for pool in self.pools])
        last = depth == self.depth_limit - 1
        if last or (self.keep_going is not None and not self.keep_going(self.confidences)):
            return None, None, True, None
        frontier = [pool.frontier(depth, FRONTIER_WIDTH) for pool in self.pools]
        width = min(len(f) for f in frontier)
        self.frontier = [f[:width] for f in frontier]
        device = logits.device
        tokens = torch.tensor(
            [[p.tokens[i] for i in f] for p, f in zip(self.pools, self.frontier)], device=device
        )
        parents = torch.tensor(
            [[p.proposer[i] for i in f] for p, f in zip(self.pools, self.frontier)], device=device
        )
        return tokens, None, False, lambda last_hidden_state: self.levels.feed(last_hidden_state, parents)


__all__ = [
    "CandidatePool",
    "FRONTIER_WIDTH",
    "LevelSelector",
    "TreeLevels",
    "candidate_tensors",
    "parallel_candidates",
    "top_candidates",
]
