"""Draft trees (`generation/tree.py` and the loop's `verify`): growth by path probability, prompt-lookup
branches, the tree mask, the greedy and sampled path rules, and `generate()` with trees: identical to plain greedy
at every batch size and attention implementation, logits processors, returned scores and hidden states, the cost
rule's choice of tree size, and clear refusals."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import peagle
from helpers import LAYERS, Oracle, check_tree_logits, make_head, make_target, prompt_ids
from peagle.evaluation.bench_batch import left_pad
from peagle.generation import ragged
from peagle.generation import settings as gen
from peagle.generation.cost import VerifyCostModel, monotone
from peagle.generation.drafting import DraftingSession
from peagle.generation.rule import choose_batch_num_drafts, choose_batch_tree_size
from peagle.generation.tree import (
    VOID,
    DraftCandidates,
    DraftTree,
    LookupEstimate,
    ancestor_mask,
    greedy_path,
    grow_tree,
    prompt_lookup,
    sibling_probabilities,
    tree_attention_mask,
)
from peagle.generation.tree_drafting import TreeLevels


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


# ---------------------------------------------------------------------------------------------- growth
def _is_tree_in_order(tree: DraftTree) -> bool:
    return all(p < i for i, p in enumerate(tree.parents))


def test_growth_is_best_first_and_every_prefix_is_a_tree():
    g = torch.Generator().manual_seed(0)
    cands = []
    for d in range(6):
        probs = torch.rand(8, generator=g).sort(descending=True).values.tolist()
        cands.append([(10 * d + i, 0.9 * p) for i, p in enumerate(probs)])
    tree = grow_tree(cands, budget=40)
    assert len(tree) == 40 and _is_tree_in_order(tree)
    assert tree.values == sorted(tree.values, reverse=True)
    for i, (p, d) in enumerate(zip(tree.parents, tree.depths)):
        assert d == (1 if p == -1 else tree.depths[p] + 1)
        token_prob = dict(cands[d - 1])[tree.tokens[i]]
        parent_value = 1.0 if p == -1 else tree.values[p]
        assert tree.values[i] == pytest.approx(parent_value * token_prob)
    # no node is missing a better sibling or child: the best candidate left out is worth at most the last node
    chosen = {(p, t) for p, t in zip(tree.parents, tree.tokens)}
    for parent in [-1, *range(len(tree))]:
        depth = 0 if parent == -1 else tree.depths[parent]
        if depth >= len(cands):
            continue
        base = 1.0 if parent == -1 else tree.values[parent]
        for token, p in cands[depth]:
            if (parent, token) not in chosen:
                assert base * p <= tree.values[-1] + 1e-12
    # siblings never share a token
    assert len(chosen) == len(tree)


def _preorder(parents: list[int]) -> list[int]:
    """Node indices depth first, each node's children in node order, VOID nodes last."""
    kids = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    out, stack = [], kids.get(-1, [])[::-1]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(kids.get(node, [])[::-1])
    return out + [i for i, p in enumerate(parents) if p == VOID]


def test_a_tree_laid_out_for_verifying_puts_the_best_path_first():
    """`preordered()`: the same nodes depth first, each node's children best first, padding last; the path of best
    children takes slots 1..d, so a pass that accepts along it keeps a prefix of its slots (a crop)."""
    g = torch.Generator().manual_seed(3)
    cands = [[(10 * d + i, p) for i, p in enumerate(torch.rand(4, generator=g).sort(descending=True).values.tolist())]
             for d in range(5)]  # fmt: skip
    tree = grow_tree(cands, budget=14).truncated(16)
    laid = tree.preordered()
    assert _is_tree_in_order(laid) and laid.parents[-2:] == [VOID, VOID]
    assert _preorder(laid.parents) == list(range(16)) != _preorder(tree.parents)
    order = _preorder(tree.parents)  # the same nodes, each with its own token, depth, value and parent
    for new, old in enumerate(order):
        assert (laid.tokens[new], laid.depths[new], laid.values[new]) == (
            tree.tokens[old],
            tree.depths[old],
            tree.values[old],
        )
        assert tree.parents[old] in (-1, VOID) or order[laid.parents[new]] == tree.parents[old]
    best = [0]  # the first child at every depth, on the grown tree
    while kids := [i for i, p in enumerate(tree.parents) if p == best[-1] - 1]:
        best.append(kids[0] + 1)
    assert best != list(range(len(best)))  # grown best first, it is not a prefix of the slots
    choices = [0] * (len(tree) + 1)
    for slot, nxt in zip(best, best[1:]):
        choices[slot] = tree.tokens[nxt - 1]
    assert greedy_path(tree, choices) == best
    laid_choices = [0] + [choices[order[k] + 1] for k in range(len(order))]
    assert greedy_path(laid, laid_choices) == list(range(len(best)))


def test_the_loop_verifies_trees_laid_out_best_path_first(target, monkeypatch):
    """Every tree a call verifies is in `preordered()` order (depth first, best child first)."""
    laid = []
    original = DraftCandidates.of_trees.__func__

    def of_trees(cls, trees, device):
        laid.extend(list(t.parents) for t in trees)
        return original(cls, trees, device)

    monkeypatch.setattr(DraftCandidates, "of_trees", classmethod(of_trees))
    head = make_head(target)
    ids = prompt_ids(40, 9)
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    oracle = Oracle(head, _refs(target, [ids[0]], 20), p=0.5, seed=1, second=True)
    out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=head, draft_tree_size=12)
    oracle.handle.remove()
    assert torch.equal(out, ref) and laid
    assert all(_preorder(parents) == list(range(len(parents))) for parents in laid)


def test_autoregressive_trees_branch_only_from_the_chain():
    cands = [[(1, 0.9), (2, 0.5)], [(3, 0.9), (4, 0.5)], [(5, 0.9)]]
    tree = grow_tree(cands, budget=10, chain_parents_only=True)
    for i, p in enumerate(tree.parents):
        if p >= 0:
            assert tree.chain[p], f"node {i} hangs off a non-chain node"
    assert [t for t, c in zip(tree.tokens, tree.chain) if c] == [1, 3, 5]
    assert len(tree) == 5  # the chain plus one leaf per depth that has a second candidate


def test_lookup_branch_merges_with_head_candidates():
    cands = [[(5, 0.6), (6, 0.3)], [(7, 0.5)]]
    tree = grow_tree(cands, budget=10, lookup=[6, 9, 11], lookup_probs=[0.8, 0.8, 0.8])
    by_token = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    six = by_token[(-1, 6)]
    assert tree.values[six] == pytest.approx(0.8) and tree.lookup[six]  # merged: the larger probability
    nine = by_token[(six, 9)]
    assert tree.lookup[nine] and by_token[(nine, 11)] is not None
    assert sum(tree.lookup) == 3 and _is_tree_in_order(tree)
    assert not tree.lookup[by_token[(-1, 5)]]


def test_sibling_probabilities_never_sum_past_one():
    probs = sibling_probabilities(0.7, [0.5, 0.3, 0.1, 0.05])
    assert probs[0] == 0.7 and sum(probs) <= 1.0 + 1e-12
    assert probs[1] > probs[2] > probs[3]


def test_prompt_lookup_prefers_the_longest_latest_match():
    ids = torch.tensor([4, 5, 6, 7, 1, 5, 6, 8, 9, 4, 5, 6])
    assert prompt_lookup(ids, 2) == [7, 1]  # "4 5 6" recurs at the start (3-gram beats the later "5 6")
    assert prompt_lookup(torch.tensor([1, 2, 3, 2, 3, 9, 3]), 4) == [
        9,
        3,
    ]  # only "3" recurs: its latest place
    assert prompt_lookup(torch.tensor([1, 2, 3]), 4) == []
    assert prompt_lookup(torch.tensor([5, 6, 5, 6]), 0) == []


def test_lookup_estimate_follows_the_record():
    est = LookupEstimate(prior=0.3, weight=2.0)
    for _ in range(20):
        est.observe(tested=3, accepted=3)
    assert all(p > 0.9 for p in est.probabilities(3))
    assert est.probabilities(4)[3] == pytest.approx(0.3)  # an untested depth keeps the prior


# ---------------------------------------------------------------------------------------------- mask and paths
def test_ancestor_mask_and_void_nodes():
    parents = [-1, 0, -1, 1, VOID]
    mask = ancestor_mask(parents)
    assert mask[4].tolist() == [True, True, True, False, True, False]  # node 3: root, 0, 1, itself
    assert mask[3].tolist() == [True, False, False, True, False, False]
    assert mask[5].tolist() == [False, False, False, False, False, True]  # a void node sees only itself


def test_tree_attention_mask_keeps_the_rows_past():
    trees = [DraftTree([3, 4], [-1, 0], [1, 2], [0.5, 0.2], [True, True], [False, False])] * 2
    past = torch.tensor([[0, 1, 1], [1, 0, 1]])
    mask = tree_attention_mask(trees, past)
    assert mask.shape == (2, 1, 3, 6)
    assert mask[0, 0, :, :3].tolist() == [[False, True, True]] * 3
    assert mask[1, 0, 2].tolist() == [True, False, True, True, True, True]


def test_a_chain_is_a_tree_with_one_path():
    """`DraftCandidates`: a chain's node i hangs under node i - 1 and needs only the 2D mask of the rows' valid past
    (None without holes); a tree's candidates carry its parents and a 4D mask."""
    chain = DraftCandidates.chain(torch.tensor([[5, 6, 7], [1, 2, 3]]))
    assert chain.is_chain and len(chain) == 3 and chain.depths.tolist() == [[1, 2, 3]] * 2
    assert (
        chain.row(1) == ([1, 2, 3], [-1, 0, 1])
        and chain.path_to(0, 3) == [1, 2, 3]
        and chain.path_to(0, 0) == []
    )
    assert chain.attention_mask(torch.ones(2, 4, dtype=torch.long)) is None
    holes = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert chain.attention_mask(holes).tolist() == [[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8]
    assert greedy_path(chain.row(0), [5, 6, 9, 0]) == [0, 1, 2]
    tree = DraftTree([3, 4, 8], [-1, -1, 1], [1, 1, 2], [0.5, 0.2, 0.1], [True, False, False], [False] * 3)
    both = DraftCandidates.of_trees([tree, tree], "cpu")
    assert not both.is_chain and both.depths.tolist() == [[1, 1, 2]] * 2 and both.path_to(1, 3) == [2, 3]
    assert torch.equal(both.attention_mask(holes), tree_attention_mask([tree, tree], holes))


def test_an_autoregressive_round_grows_tree_levels(target):
    """The head's own `draft_round` grows tree levels ([`TreeLevels`]): every level's slot gets the logits of a plain
    chain over the real slots and its own ancestors (its parent's hidden state fed, its depth's position), whatever
    its siblings and cousins in the same passes."""
    head = make_head(target, drafting_mode="autoregressive").eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (2, 5), generator=g)
    feats = torch.randn(2, 5, 3 * head.config.target_hidden_size, generator=g)
    levels = [
        (torch.tensor([[11, 12], [13, 14]]), torch.tensor([[0, 0], [0, 0]])),
        (torch.tensor([[21, 22, 23], [24, 25, 26]]), torch.tensor([[1, 0, 1], [0, 0, 1]])),
    ]
    seen, tree = [], TreeLevels(torch.ones(2, 5, dtype=torch.long))

    def select(logits, depth):
        seen.append(logits)
        if depth == len(levels):
            return None, None, True, None
        tokens, parents = levels[depth]
        return tokens, None, False, lambda last: tree.feed(last, parents)

    draft = head.draft_round(ids, feats, 4, DynamicCache(config=head.config), 0, select)
    assert draft.forward_calls == 3 and draft.speculative_slots == 5 and draft.tokens.shape == (2, 0)
    for b in range(2):
        for level, (tokens, _) in enumerate(levels):
            for w in range(tokens.shape[1]):
                path, slot = [], w  # the slot's ancestors, root first
                for up in range(level, -1, -1):
                    path.insert(0, int(levels[up][0][b, slot]))
                    slot = int(levels[up][1][b, slot])
                out = head(
                    ids[b : b + 1], feats[b : b + 1], cache=DynamicCache(config=head.config), use_cache=True
                )
                for depth, token in enumerate(path):
                    out = head(
                        torch.tensor([[token]]),
                        projected_hidden_states=out.last_hidden_state[:, -1:],
                        position_ids=torch.tensor([[5 + depth]]),
                        cache=out.cache,
                        use_cache=True,
                    )
                torch.testing.assert_close(
                    seen[level + 1][b, w], out.logits[0, -1].float(), atol=1e-5, rtol=1e-5
                )


def test_a_parallel_round_picks_every_depth_at_once_as_depth_by_depth(target):
    """Greedy without processors or a cut, a parallel head's round takes all its depths in one `whole_round` call:
    the same drafts, logits and draft probabilities as the selector gives depth by depth, and, asked for a tree's
    candidates, the top tokens `candidate_tensors` computes, from the same softmax."""
    from peagle.generation.processing import draft_selector
    from peagle.generation.tree_drafting import candidate_tensors

    head = make_head(target).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 120, (2, 5), generator=g)
    feats = torch.randn(2, 5, 3 * head.config.target_hidden_size, generator=g)
    hist = [ids[b : b + 1] for b in range(2)]
    drafts, rounds = [], []
    for whole in (True, False):
        probabilities = []
        select = draft_selector(head, LogitsProcessorList(), False, hist, None, 2, probabilities, [], None)
        rounds.append(select.whole_round)
        select.whole_round.tree = True
        if not whole:
            del select.whole_round
        draft = head.draft_round(ids, feats, 4, DynamicCache(config=head.config), 0, select)
        drafts.append((draft, torch.stack(probabilities)))
    (one, p_one), (each, p_each) = drafts
    assert (
        one.forward_calls == each.forward_calls == 1 and one.speculative_slots == each.speculative_slots == 3
    )
    assert torch.equal(one.tokens, each.tokens) and one.tokens.shape == (2, 4)
    torch.testing.assert_close(one.logits, each.logits)
    torch.testing.assert_close(p_one, p_each)
    assert p_one.shape == (4, 2)
    softmax = one.logits.softmax(-1).max(-1).values.T
    torch.testing.assert_close(p_one, softmax)
    assert rounds[0].top is not None and rounds[1].top is None  # the per-depth round never called it
    ids, head_p = candidate_tensors(each, head)
    from_round = rounds[0].top
    assert torch.equal(from_round[0], ids) and ids.shape == (2, 4, 8)
    torch.testing.assert_close(from_round[1], head_p)
    assert torch.equal(ids[..., 0], one.tokens)


@pytest.mark.parametrize("rows", [1, 2])
def test_keeping_a_path_moves_only_the_slots_after_the_shared_prefix(rows):
    """`keep_tail(..., in_place=j)` leaves the first j kept slots where they are and moves the rest (one row: an
    index_select, several: a gather); every layer's kept tail is the path's slots either way."""
    gen = torch.Generator().manual_seed(0)
    width, prefix = 6, 5
    index = torch.tensor([[0, 1, 4, 5], [0, 1, 2, 3]][:rows])  # row 0 keeps slots 0, 1 then moves 4, 5

    def filled():
        cache = DynamicCache()
        for layer in range(2):
            kv = torch.randn(rows, 2, prefix + width, 3, generator=gen)
            cache.update(kv, kv + 1, layer)
        return cache

    cache = filled()
    expected = [
        torch.cat(
            [t[:, :, :prefix], t[:, :, prefix:].gather(2, index[:, None, :, None].expand(-1, 2, -1, 3))], 2
        )
        for layer in cache.layers
        for t in (layer.keys.clone(), layer.values.clone())
    ]
    ragged.keep_tail(cache, index, width, in_place=2)
    got = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert cache.get_seq_length() == prefix + 4


def test_greedy_path_follows_the_targets_choices():
    tree = grow_tree([[(5, 0.6), (6, 0.3)], [(7, 0.5), (8, 0.4)]], budget=6)
    # slots: 0 root, then nodes; the target picks 6, then 8, then 9
    choices = [0] * (len(tree) + 1)
    choices[0] = 6
    six = tree.tokens.index(6) + 1
    choices[six] = 8
    eight = next(i + 1 for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p == six - 1 and t == 8)
    choices[eight] = 9
    assert greedy_path(tree, choices) == [0, six, eight]
    choices[0] = 42
    assert greedy_path(tree, choices) == [0]


# ---------------------------------------------------------------------------------------------- the rule
def test_tree_rule_on_flat_and_steep_curves():
    gains = [[0.9, 0.5, 0.4, 0.3, 0.1, 0.05]]
    flat = [1.0] * 7
    steep = [1.0 + 0.5 * n for n in range(7)]
    assert choose_batch_tree_size(gains, flat) == 6
    assert choose_batch_tree_size(gains, steep) == 1
    assert choose_batch_tree_size(gains, [1.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]) == 0
    # the chain rule is the same function given the running products
    probs = [0.9, 0.8, 0.5]
    running = [[0.9, 0.72, 0.36]]
    curve = [1.0, 1.2, 1.3, 1.45]
    assert choose_batch_num_drafts([probs], curve) == choose_batch_tree_size(running, curve)


def test_monotone_curve_ignores_a_busy_plain_step():
    assert monotone([0.46, 0.12, 0.15, 0.2]) == [0.12, 0.12, 0.15, 0.2]


# ---------------------------------------------------------------------------------------------- generate()
def _refs(target, rows, n):
    return [target.generate(r[None], do_sample=False, max_new_tokens=n)[0] for r in rows]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_tree_greedy_equals_plain_greedy(target, attn, batch, mode):
    target.config._attn_implementation = attn
    try:
        head = make_head(target, drafting_mode=mode)
        rows = [prompt_ids(40 + i, [6, 13, 9][i])[0] for i in range(batch)]
        ids, mask = left_pad(rows)
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
        oracle = Oracle(head, _refs(target, rows, 30), p=0.5, seed=batch, second=True)
        out = target.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=30,
            assistant_model=head,
            draft_tree_size=12,
        )
        oracle.handle.remove()
    finally:
        target.config._attn_implementation = "sdpa"
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.tree_rounds == st.rounds > 0 and st.draft_tokens == 12 * st.rounds
    assert st.generated_tokens == st.accepted_tokens + st.rounds + st.plain_steps == 30 * batch
    # the right token is first half the time and second otherwise: trees pass more per target pass than chains
    oracle = Oracle(head, _refs(target, rows, 30), p=0.5, seed=batch, second=True)
    chain = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=head
    )
    oracle.handle.remove()
    assert torch.equal(chain, ref)
    chained = head.last_generation_stats
    assert chained.tree_rounds == 0
    assert st.tokens_per_target_pass > chained.tokens_per_target_pass + 0.3


def test_tree_processors_scores_and_hidden_states_match_plain(target):
    head = make_head(target)
    ids = prompt_ids(3, 9)
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    kw = dict(do_sample=False, max_new_tokens=16, return_dict_in_generate=True, output_scores=True)
    ref = target.generate(ids, logits_processor=procs, output_hidden_states=True, **kw)
    oracle = Oracle(head, ref.sequences, p=0.6)
    out = target.generate(
        ids, logits_processor=procs, output_hidden_states=True, assistant_model=head, draft_tree_size=10, **kw
    )
    oracle.handle.remove()
    assert torch.equal(out.sequences, ref.sequences)
    assert head.last_generation_stats.accepted_tokens > 0
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(out.hidden_states) == len(ref.hidden_states)
    for step_a, step_b in zip(out.hidden_states[1:], ref.hidden_states[1:]):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_prompt_lookup_branch_in_generate(target):
    """A prompt that repeats itself: the lookup branch is accepted (a random head alone almost never is)."""
    head = make_head(target)
    ref_ids = prompt_ids(7, 8)
    plain = target.generate(ref_ids, do_sample=False, max_new_tokens=40)
    # feed the model its own continuation twice, so the continuation recurs in the context
    ids = torch.cat([plain, plain[:, :10]], dim=1)
    ref = target.generate(ids, do_sample=False, max_new_tokens=24)
    out = target.generate(
        ids, do_sample=False, max_new_tokens=24, assistant_model=head, draft_tree_size=16,
        prompt_lookup_num_tokens=8,
    )  # fmt: skip
    assert torch.equal(out, ref)
    with_lookup = head.last_generation_stats.accepted_tokens
    target.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=head, draft_tree_size=16,
                    prompt_lookup_num_tokens=0)  # fmt: skip
    assert with_lookup > head.last_generation_stats.accepted_tokens + 5


def test_cost_rule_sizes_trees_by_the_curve(target):
    head = make_head(target, confidence_threshold=None)
    ids = prompt_ids(11, 8)
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    for curve, expect_trees in [(VerifyCostModel.flat(40, 0.01), True), (None, False)]:
        if curve is None:  # verifying costs grow fast: no tree pays
            curve = VerifyCostModel([0.01 * (1 + 3 * n) for n in range(40)], source="user")
        peagle.set_cost_model(head, curve)
        oracle = Oracle(head, ref, p=0.7)
        out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=head)
        oracle.handle.remove()
        assert torch.equal(out, ref)
        st = head.last_generation_stats
        assert st.draft_policy == "cost" and st.draft_tree_size == gen.AUTO_TREE_NODES
        if expect_trees:
            assert st.tree_rounds > 0 and max(i for i, c in enumerate(st.tree_size_histogram) if c) > 8
        else:
            assert sum(st.tree_size_histogram[9:]) == 0
    peagle.set_cost_model(head, None)


def test_tree_settings_are_checked():
    assert gen.resolve_tree_settings("auto", None, "cost") == (gen.AUTO_TREE_NODES, gen.DEFAULT_LOOKUP_TOKENS)
    assert gen.resolve_tree_settings("auto", None, "threshold") == (0, 0)
    assert gen.resolve_tree_settings("auto", 5, "fixed") == (gen.AUTO_TREE_NODES, 5)
    assert gen.resolve_tree_settings(16, 0, "fixed") == (16, 0)
    assert gen.resolve_tree_settings(0, None, "cost") == (0, 0)
    for bad in (-1, 1000, "big", 2.5, True):
        with pytest.raises(ValueError, match="draft_tree_size"):
            gen.resolve_tree_settings(bad, None, "cost")
    with pytest.raises(ValueError, match="chains only"):
        gen.resolve_tree_settings(0, 4, "cost")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        gen.resolve_tree_settings(8, -2, "cost")


def test_draft_tree_size_reads_the_same_through_a_generation_config(target):
    """`draft_tree_size` on a `GenerationConfig` passed as `generation_config=` was ignored (trees stayed off with no
    word) while the keyword worked; a keyword still wins over the config, as transformers' own options do."""
    from transformers import GenerationConfig

    head = make_head(target)  # a fixed K: "auto" means chains, so only an explicit size makes trees
    ids = prompt_ids(90, 8)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, draft_tree_size=8)
    out = target.generate(ids, generation_config=config, assistant_model=head)
    st = head.last_generation_stats
    assert torch.equal(out, plain) and st.draft_tree_size == 8 and st.tree_rounds == st.rounds > 0
    out = target.generate(ids, generation_config=config, assistant_model=head, draft_tree_size=0)
    assert torch.equal(out, plain) and head.last_generation_stats.tree_rounds == 0
    with pytest.raises(ValueError, match="draft_tree_size"):
        target.generate(ids, generation_config=GenerationConfig(max_new_tokens=4, draft_tree_size=-3),
                        assistant_model=head)  # fmt: skip


def test_trees_refused_by_name_where_they_cannot_run_and_run_past_a_sliding_window(target):
    class Model:
        class config:
            _attn_implementation = "flash_attention_2"

    assert "flash_attention_2" in ragged.tree_refusal(Model(), None)
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, sliding_window=8, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    windowed = MistralForCausalLM(cfg).eval()
    head = peagle.PEagleDrafter(
        peagle.PEagleConfig.for_target(
            windowed, num_hidden_layers=1, mask_token_id=127, confidence_threshold=0.0
        )
    ).eval()
    ids = prompt_ids(2, 10)
    ref = windowed.generate(ids, do_sample=False, max_new_tokens=24)
    out = windowed.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=head, draft_tree_size=8)
    assert torch.equal(out, ref) and head.last_generation_stats.tree_rounds > 0  # the window by position


def test_tree_mask_gives_each_slot_its_paths_logits(target):
    """The verify pass over a flat tree gives every slot the logits of a plain forward over the row's past and
    that slot's path (eager and SDPA, with left padding in the past)."""
    tree = grow_tree([[(5, 0.6), (6, 0.3)], [(7, 0.5), (8, 0.4)], [(9, 0.5)]], budget=9)
    for attn in ("eager", "sdpa"):
        target.config._attn_implementation = attn
        try:
            check_tree_logits(target, tree)
        finally:
            target.config._attn_implementation = "sdpa"


def test_autoregressive_trees_expand_level_by_level(target, monkeypatch):
    """An EAGLE-3-style head's trees grow as EAGLE-2's: one drafter pass per level over the level's best nodes,
    so nodes off the chain get children too, and the output is plain greedy's."""
    head = make_head(target, drafting_mode="autoregressive")
    ids = prompt_ids(21, 7)
    ref = target.generate(ids, do_sample=False, max_new_tokens=30)
    seen = []
    original = DraftingSession._tree_candidates

    def record(self, trees, *args, **kwargs):
        seen.extend(trees)
        return original(self, trees, *args, **kwargs)

    monkeypatch.setattr(DraftingSession, "_tree_candidates", record)
    oracle = Oracle(head, ref, p=0.5, seed=2, second=True)
    out = target.generate(
        ids,
        do_sample=False,
        max_new_tokens=30,
        assistant_model=head,
        draft_tree_size=24,
        num_assistant_tokens=4,
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.tree_rounds == st.rounds > 0
    assert st.drafter_forward_calls <= 4 * st.rounds and st.drafter_forward_calls > 3 * st.rounds
    off_chain_parents = [p for t in seen for p in t.parents if p >= 0 and not t.chain[p]]
    assert off_chain_parents, "no node off the chain was expanded"
    assert all(_is_tree_in_order(t) and t.values == sorted(t.values, reverse=True) for t in seen)
