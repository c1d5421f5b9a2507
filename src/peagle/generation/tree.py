"""Draft trees from one drafting round, pure: growth, prompt-lookup branches, the tree mask and the accepted path.

A P-EAGLE round gives a distribution at each of the K depths from ONE forward pass, and the draft at depth d does
not depend on which token was picked at depth d - 1 (the parallel slots see mask embeddings, not drafts).  So a
tree is a selection from the product of the per-depth candidates:

    depth:        1          2          3
    candidates:  [a, b]     [c, d]     [e]
    tree:        root(bonus)
                 +- a (0.6)  +- c (0.6 * 0.5)  +- e (0.6 * 0.5 * 0.7)
                 |           +- d (0.6 * 0.2)
                 +- b (0.3)  +- c (0.3 * 0.5)

[`grow_tree`] adds nodes best-first by path probability (the probability that every draft from the root down to
the node is accepted: EAGLE-2's rule), so parents always come before their children, the first n nodes of the
result are a tree for every n, and a tree of the first n nodes emits `1 + sum(values[:n])` tokens in
expectation.  A prompt-lookup branch (the continuation of an earlier occurrence of the context's last tokens,
[`prompt_lookup`]) joins the same tree with its own per-depth probabilities ([`LookupEstimate`]).

Verification ([`decoding`]) lays the n nodes out flat after the root (slot 0 = the bonus token), gives slot i the
position `root + depth(i)` and lets it attend to the valid past and its own ancestors ([`ancestor_mask`]); the
target's choice at each slot then decides the path ([`greedy_path`]: the argmax, or under sampling the draw keyed by
the slot's position, [`sampling.KeyedSampler`], lossless for the target's distribution; docs/DESIGN.md section 11).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

VOID = -2
"""Parent of a padding node: a slot that keeps a batch's trees one size, sees only itself, and is never accepted."""

CANDIDATES_PER_DEPTH = 8
"""How many of the head's top tokens per depth a tree may use."""
LOOKUP_PRIOR = 0.3
"""A prompt-lookup token's acceptance probability before any round of this generation has tested one."""
LOOKUP_MAX_NGRAM = 3
"""Longest suffix of the context [`prompt_lookup`] searches for (then shorter ones)."""


@dataclass
class DraftTree:
    """One row's draft tree, nodes in best-first order (every parent before its children) as grown, depth first
    once laid out for a verify pass ([`preordered`]).

    Args:
        tokens: `[n]` target token of each node.
        parents: `[n]` index of each node's parent, -1 for children of the root (the bonus token), [`VOID`] for
            padding.
        depths: `[n]` 1 for the first draft after the bonus token.
        values: `[n]` estimated probability that the node is accepted (the product of the probabilities on its
            path); non-increasing in best-first order.
        chain: `[n]` the node is on the head's own chain (the token the round's drafting picked at every depth
            down to it): what a chain-only round would have verified.
        lookup: `[n]` the node is on the prompt-lookup branch.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    chain: list[bool] = field(default_factory=list)
    lookup: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> DraftTree:
        """The tree of the first n nodes, padded with [`VOID`] nodes when it has fewer."""
        out = DraftTree(*(list(getattr(self, f)[:n]) for f in _FIELDS))
        while len(out) < n:
            out.tokens.append(0)
            out.parents.append(VOID)
            out.depths.append(1)
            out.values.append(0.0)
            out.chain.append(False)
            out.lookup.append(False)
        return out

    def preordered(self) -> DraftTree:
        """The same tree laid out for a verify pass: depth first, each node's children best first (as best-first
        growth added them), [`VOID`] padding last.  The path of best children takes slots 1, 2, ...: a pass that
        accepts along it keeps a prefix of its slots, which the target's cache keeps by a crop, without moving a
        slot (docs/DESIGN.md section 11).

        >>> t = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2], [1, 1, 2, 3], [0.6, 0.3, 0.3, 0.2], [True] * 4, [False] * 4)
        >>> p = t.preordered()
        >>> p.tokens, p.parents
        ([5, 7, 8, 6], [-1, 0, 1, -1])
        """
        kids = children(self.parents)
        order: list[int] = []
        stack = kids[0][::-1]
        while stack:
            slot = stack.pop()
            order.append(slot - 1)
            stack.extend(kids[slot][::-1])
        order += [k for k, p in enumerate(self.parents) if p == VOID]
        moved = {old: new for new, old in enumerate(order)}
        out = DraftTree(*([getattr(self, f)[k] for k in order] for f in _FIELDS))
        out.parents = [p if p < 0 else moved[p] for p in out.parents]
        return out

    def gains(self) -> list[float]:
        """`[n]` the expected tokens each node adds (its value): a tree of the first n nodes emits
        `1 + sum(gains[:n])` in expectation."""
        return list(self.values)


_FIELDS = ("tokens", "parents", "depths", "values", "chain", "lookup")


class TreeRow(NamedTuple):
    """One row's tree shape as the path rules read it: `[n]` node tokens and parents (see [`DraftTree`])."""

    tokens: list[int]
    parents: list[int]


@dataclass(frozen=True)
class DraftCandidates:
    """One round's drafts for every row of the batch, what the drafting side hands the verify pass.

    Each row has a tree of n nodes (the same n in every row, padded with [`VOID`] nodes), laid out flat after the
    row's bonus token; a chain is the tree with one path, node i under node i - 1.  n = 0 is a plain step.

    Args:
        tokens: `(B, n)` target token of each node.
        depths: `(B, n)` 1 for the first draft after the bonus token.
        parents: per row `[n]` each node's parent (-1: the root), or None for a chain, which needs no tree mask:
            plain causal attention over the row's valid past is exactly each node's view.
    """

    tokens: torch.LongTensor
    depths: torch.LongTensor
    parents: list[list[int]] | None = None
    host_tokens: list[list[int]] | None = field(default=None, repr=False)
    """The same tokens on the host, where the drafting side has them (trees): reading a row reads no tensor."""

    @classmethod
    def chain(cls, tokens: torch.LongTensor) -> DraftCandidates:
        """`tokens (B, k)` as one path per row."""
        depths = torch.arange(1, tokens.shape[1] + 1, device=tokens.device).expand(tokens.shape[0], -1)
        return cls(tokens, depths, None)

    @classmethod
    def of_trees(cls, trees: Sequence[DraftTree], device: torch.device | str) -> DraftCandidates:
        """Every row's tree, all of one size."""
        tokens = torch.tensor([t.tokens for t in trees], dtype=torch.long, device=device)
        depths = torch.tensor([t.depths for t in trees], dtype=torch.long, device=device)
        return cls(tokens, depths, [list(t.parents) for t in trees], [list(t.tokens) for t in trees])

    def __len__(self) -> int:
        return self.tokens.shape[1]

    def padded(self, nodes: int) -> DraftCandidates:
        """The same candidates as trees of `nodes >= len(self)` nodes per row: [`VOID`] nodes after the real ones
        (each sees only itself and is never accepted), so that a verify pass has a chosen width."""
        batch, extra = self.tokens.shape[0], nodes - len(self)
        parents = self.parents or [list(range(-1, len(self) - 1)) for _ in range(batch)]
        host = None if self.host_tokens is None else [list(t) + [0] * extra for t in self.host_tokens]
        return DraftCandidates(
            torch.cat([self.tokens, self.tokens.new_zeros(batch, extra)], dim=1),
            torch.cat([self.depths, self.depths.new_ones(batch, extra)], dim=1),
            [list(p) + [VOID] * extra for p in parents],
            host,
        )

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def row(self, b: int) -> TreeRow:
        """Row b's tokens and parents (a chain's parents are 0..n-1 shifted by one)."""
        tokens = self.host_tokens[b] if self.host_tokens is not None else self.tokens[b].tolist()
        parents = list(range(-1, len(tokens) - 1)) if self.parents is None else self.parents[b]
        return TreeRow(tokens, parents)

    def path_to(self, b: int, slot: int) -> list[int]:
        """Row b's slots from the root's first child down to `slot` (empty for the root): the drafts a slot's
        logits follow."""
        if self.parents is None:
            return list(range(1, slot + 1))
        out, parents = [], self.parents[b]
        while slot > 0:
            out.append(slot)
            parent = parents[slot - 1]
            slot = parent + 1 if parent >= 0 else 0
        return out[::-1]

    def attention_mask(self, past: torch.Tensor, gaps: bool | None = None) -> torch.Tensor | None:
        """What the verify pass attends to, given the rows' valid past `past (B, S)` (0 at left padding and
        holes): a chain's 2D mask (None without any 0 in it; `gaps`: whether there is one, when the caller knows
        it without reading `past`), a tree's 4D `(B, 1, n + 1, S + n + 1)` [`tree_attention_mask`]."""
        width = len(self) + 1
        if self.parents is None:
            if not (bool((past == 0).any()) if gaps is None else gaps):
                return None
            return torch.cat([past, past.new_ones(past.shape[0], width)], dim=1)
        return tree_attention_mask([TreeRow([], p) for p in self.parents], past)


def sibling_probabilities(chosen_probability: float, head_probs: Sequence[float]) -> list[float]:
    """Acceptance probabilities of one depth's candidates: the drafted token (first) gets its calibrated
    probability, the others share the rest in proportion to the head's probabilities, so siblings never sum
    past 1.

    >>> [round(p, 3) for p in sibling_probabilities(0.5, [0.6, 0.3, 0.1])]
    [0.5, 0.375, 0.125]
    """
    if not head_probs:
        return []
    top = min(max(float(chosen_probability), 0.0), 1.0)
    rest = max(1.0 - float(head_probs[0]), 1e-12)
    return [top] + [(1.0 - top) * max(float(h), 0.0) / rest for h in head_probs[1:]]


def grow_tree(
    candidates: Sequence[Sequence[tuple[int, float]]],
    budget: int,
    lookup: Sequence[int] = (),
    lookup_probs: Sequence[float] = (),
    chain_parents_only: bool = False,
) -> DraftTree:
    """Grow a draft tree best-first by path probability from per-depth candidates, up to `budget` nodes.

    Args:
        candidates: per depth d (0 = the first draft), `[(token, probability), ...]` with the round's drafted token
            first (it extends the head's chain); probabilities are acceptance probabilities given the parent was
            accepted.  Any depth-d candidate may hang under any depth-(d-1) node (a P-EAGLE round's depths do
            not depend on each other's tokens).
        budget: the most nodes.
        lookup: a prompt-lookup branch: one token per depth from depth 0, a path from the root.
        lookup_probs: `[len(lookup)]` acceptance probability of each lookup token (given the one before was
            accepted).  A lookup token equal to a head candidate under the same parent is one node, with the
            larger probability.
        chain_parents_only: only chain nodes get head children (candidates drafted after the chain's tokens).

    Returns:
        [`DraftTree`] with at most `budget` nodes, depth at most `max(len(candidates), len(lookup))`.

    >>> t = grow_tree([[(5, 0.6), (6, 0.3)], [(7, 0.5), (8, 0.2)]], budget=4)
    >>> t.tokens, t.parents, [round(v, 2) for v in t.values]
    ([5, 6, 7, 7], [-1, -1, 0, 1], [0.6, 0.3, 0.3, 0.15])
    """

    def head_children(on_chain: Any, depth: int) -> list[tuple[int, float, bool, Any]]:
        if depth >= len(candidates) or not (on_chain or not chain_parents_only):
            return []
        return [
            (t, p, bool(on_chain) and i == 0, bool(on_chain) and i == 0)
            for i, (t, p) in enumerate(candidates[depth])
        ]

    return _best_first(budget, head_children, True, lookup, lookup_probs)


def grow_tree_from_pool(
    tokens: Sequence[int],
    parents: Sequence[int],
    probs: Sequence[float],
    chain: Sequence[bool],
    budget: int,
    lookup: Sequence[int] = (),
    lookup_probs: Sequence[float] = (),
) -> DraftTree:
    """Select a draft tree best-first by path probability from an explicit pool of candidates (EAGLE-2's
    expansion: each drafter pass gives the children of the frontier nodes it was fed), plus a lookup branch.

    Args:
        tokens, parents, probs, chain: per pool entry, its token, the pool index of its parent (-1: the root), its
            acceptance probability given the parent was accepted, and whether it is on the head's chain.
        budget, lookup, lookup_probs: as in [`grow_tree`].

    >>> t = grow_tree_from_pool([5, 6, 7], [-1, -1, 0], [0.6, 0.3, 0.9], [True, False, True], budget=2)
    >>> t.tokens, t.parents
    ([5, 7], [-1, 0])
    """
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(int(p), []).append(i)

    def head_children(key: Any, depth: int) -> list[tuple[int, float, bool, Any]]:
        if key is None:  # a node only the lookup branch proposed: the head drafted nothing under it
            return []
        return [(int(tokens[i]), float(probs[i]), bool(chain[i]), i) for i in kids.get(key, [])]

    return _best_first(budget, head_children, -1, lookup, lookup_probs)


def _best_first(
    budget: int,
    head_children: Callable[[Any, int], list[tuple[int, float, bool, Any]]],
    root_key: Any,
    lookup: Sequence[int],
    lookup_probs: Sequence[float],
) -> DraftTree:
    """The growth both tree builders share: a heap of candidate children keyed by path probability; popping a
    node adds it and pushes its children (`head_children(key, depth) -> [(token, p, chain, child_key)]`, merged
    with the lookup branch's token while the node is on that branch)."""
    tree = DraftTree()
    if budget <= 0:
        return tree
    heap: list[tuple[float, int, int, int, int, bool, bool, Any]] = []
    counter = 0

    def push_children(parent: int, depth: int, value: float, key: Any, on_lookup: bool) -> None:
        nonlocal counter
        options: dict[int, list] = {}
        for token, p, chain, child_key in head_children(key, depth):
            if p > 0 and token not in options:
                options[token] = [float(p), chain, False, child_key]
        if on_lookup and depth < len(lookup):
            token, p = int(lookup[depth]), float(lookup_probs[depth])
            entry = options.setdefault(token, [0.0, False, False, None])
            entry[0] = max(entry[0], p)
            entry[2] = True
        for token, (p, chain, look, child_key) in options.items():
            counter += 1
            heapq.heappush(heap, (-value * p, counter, parent, depth + 1, token, chain, look, child_key))

    push_children(-1, 0, 1.0, root_key, True)
    while heap and len(tree) < budget:
        neg, _, parent, depth, token, chain, look, key = heapq.heappop(heap)
        index = len(tree)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.values.append(-neg)
        tree.chain.append(chain)
        tree.lookup.append(look)
        push_children(index, depth, -neg, key, look)
    return tree


def prompt_lookup(history: torch.LongTensor, num_tokens: int, max_ngram: int = LOOKUP_MAX_NGRAM) -> list[int]:
    """The continuation (up to `num_tokens` tokens) of the latest earlier occurrence of the context's last
    `max_ngram`, then `max_ngram - 1`, ... 1 tokens, or `[]` when none recurs ([`NgramIndex`] over `history`; the
    decoding loop keeps one index per row instead).

    >>> prompt_lookup(torch.tensor([1, 2, 3, 9, 1, 2]), 3)
    [3, 9, 1]
    """
    index = NgramIndex(max_ngram)
    index.sync(history.reshape(-1).tolist())
    return index.lookup(num_tokens)


class NgramIndex:
    """One row's tokens on the host with the latest earlier occurrence of each of their n-grams (n <= `max_ngram`),
    kept as tokens arrive: [`lookup`] gives what [`prompt_lookup`] gives for the same tokens without reading a
    tensor or scanning the history each round.

    >>> index = NgramIndex()
    >>> index.sync([1, 2, 3, 9, 1, 2])
    >>> index.lookup(3)
    [3, 9, 1]
    """

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: dict[
            tuple[int, ...], int
        ] = {}  # n-gram -> end of its latest occurrence with a token after it

    def sync(self, tokens: list[int]) -> None:
        """Catch up with the row's `tokens` (a row only grows while it drafts; anything else starts over)."""
        have = len(self.tokens)
        if have > len(tokens) or (have and tokens[have - 1] != self.tokens[-1]):
            self.tokens, self._ends, have = [], {}, 0
        for token in tokens[have:]:
            end = len(self.tokens)
            for n in range(
                1, min(self.max_ngram, end) + 1
            ):  # the n-grams ending here now have a continuation
                self._ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def lookup(self, num_tokens: int) -> list[int]:
        """The continuation (up to `num_tokens` tokens) of the latest earlier occurrence of the row's last
        `max_ngram`, then `max_ngram - 1`, ... 1 tokens, or `[]`."""
        ids, length = self.tokens, len(self.tokens)
        if num_tokens <= 0 or length < 2:
            return []
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            end = self._ends.get(tuple(ids[length - n :]))
            if end is not None:
                return ids[end : end + num_tokens]
        return []


@dataclass
class LookupEstimate:
    """Per-depth acceptance probability of prompt-lookup tokens, corrected online from this generation's rounds:
    `(accepted_d + prior * weight) / (tested_d + weight)`.

    >>> e = LookupEstimate()
    >>> e.observe(tested=2, accepted=1)
    >>> [round(p, 3) for p in e.probabilities(3)]
    [0.533, 0.2, 0.3]
    """

    prior: float = LOOKUP_PRIOR
    weight: float = 2.0
    tested: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def probabilities(self, n: int) -> list[float]:
        out = []
        for d in range(n):
            t = self.tested[d] if d < len(self.tested) else 0
            a = self.accepted[d] if d < len(self.accepted) else 0
            out.append((a + self.prior * self.weight) / (t + self.weight))
        return out

    def observe(self, tested: int, accepted: int) -> None:
        """A verified round whose lookup branch was tested down to depth `tested` (the path followed it to
        `tested - 1`) and accepted to depth `accepted`."""
        while len(self.tested) < tested:
            self.tested.append(0)
            self.accepted.append(0)
        for d in range(tested):
            self.tested[d] += 1
            self.accepted[d] += 1 if d < accepted else 0


# ---------------------------------------------------------------------------------------------- verification
def ancestor_mask(parents: Sequence[int]) -> torch.BoolTensor:
    """`(n + 1, n + 1)` slot i may attend to slot j: j is i or one of its ancestors (slot 0 is the root, the
    bonus token; node k is slot k + 1).  A [`VOID`] node sees only itself.

    >>> ancestor_mask([-1, 0, -1]).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    """
    n = len(parents)
    rows = [[False] * (n + 1) for _ in range(n + 1)]  # built on the host, one tensor at the end
    rows[0][0] = True
    for k, p in enumerate(parents):
        slot = k + 1
        if p != VOID:
            rows[slot] = list(rows[p + 1])
        rows[slot][slot] = True
    return torch.tensor(rows, dtype=torch.bool)


def tree_attention_mask(trees: Sequence[DraftTree | TreeRow], past: torch.Tensor) -> torch.BoolTensor:
    """`(B, 1, n + 1, S + n + 1)` what each slot of a batch's verify pass attends to: the row's valid past
    (`past (B, S)`, 0 at left padding and holes) and its own ancestors in the row's tree (True = attend)."""
    width = len(trees[0].parents) + 1
    tree = torch.stack([ancestor_mask(t.parents) for t in trees]).to(past.device)
    return torch.cat([past.bool()[:, None, :].expand(-1, width, -1), tree], dim=-1)[:, None]


def children(parents: Sequence[int]) -> list[list[int]]:
    """`[n + 1]` per slot (0 = root), the slots of its children in node order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for k, p in enumerate(parents):
        if p != VOID:
            out[p + 1].append(k + 1)
    return out


def greedy_path(tree: DraftTree | TreeRow, choices: Sequence[int]) -> list[int]:
    """The accepted path under greedy decoding: slots `[0, s_1, ..., s_m]` from the root, where each s_i is the
    child whose token is the target's choice at the slot before.  `choices[i]` is the target's token at slot i;
    the round emits the path's tokens and then `choices[s_m]`."""
    kids = children(tree.parents)
    path = [0]
    while True:
        want = int(choices[path[-1]])
        nxt = next((c for c in kids[path[-1]] if tree.tokens[c - 1] == want), None)
        if nxt is None:
            return path
        path.append(nxt)


__all__ = [
    "CANDIDATES_PER_DEPTH",
    "DraftCandidates",
    "DraftTree",
    "LookupEstimate",
    "NgramIndex",
    "VOID",
    "ancestor_mask",
    "children",
    "greedy_path",
    "grow_tree",
    "grow_tree_from_pool",
    "prompt_lookup",
    "sibling_probabilities",
    "tree_attention_mask",
    "TreeRow",
]
