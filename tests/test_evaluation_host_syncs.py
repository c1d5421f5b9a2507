"""Host synchronisations: the counter itself, and the loop's plain steps reading the host at most ~2 times each."""

from __future__ import annotations

import pytest
import torch

from helpers import greedy, make_head, make_target, prompt_ids
from peagle.evaluation.host_syncs import count_host_syncs
from peagle.generation import policy as policy_mod
from peagle.generation.cost import VerifyCostModel


def test_the_counter_counts_each_read_once_and_restores_torch():
    x = torch.arange(6)
    with count_host_syncs() as syncs:
        x.tolist()
        bool(x.any())
        int(x.sum())
        x[x > 2].nonzero()
        x.sum().item()
        x + 1  # no read
    assert syncs.count == 5 and syncs.by_name["nonzero"] == 1 and syncs.by_name["__bool__"] == 1
    with count_host_syncs() as again:
        pass
    assert again.count == 0
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the wrappers are gone


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=2)


@pytest.mark.parametrize("rows", [1, 4])
def test_skipped_steps_read_the_host_at_most_twice(target, monkeypatch, rows):
    """With the cost rule skipping the drafter every step, a step makes at most 2 host reads, counted as the
    difference between a 40- and a 16-token call (so the one-time setup does not count), with left padding and an
    EOS token in play: one for the step's tokens and, with padding, transformers' own mask check, which plain
    greedy `generate()` makes too (plain: about 1 per step without padding, 2 with).  The output is plain's."""
    head = make_head(target, confidence_threshold=None)
    head.cost_model = VerifyCostModel.flat(max_tokens=40)  # no timing in the counted calls
    monkeypatch.setattr(policy_mod.CostPolicy, "_skips", lambda self, state: True)
    ids = torch.cat([prompt_ids(90 + b, 10) for b in range(rows)])
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0  # rows after the first are left-padded
    counts = []
    for new in (16, 40):
        kw = dict(max_new_tokens=new, attention_mask=mask, pad_token_id=0, eos_token_id=2)
        ref = greedy(target, ids, **kw)
        with count_host_syncs() as syncs:
            out = greedy(target, ids, assistant_model=head, **kw)
        assert torch.equal(out, ref)
        st = head.last_generation_stats
        assert st.drafter_forward_calls == 0
        counts.append((syncs.count, st.target_batch_passes))
    (short, short_steps), (long, long_steps) = counts
    assert long_steps - short_steps >= 20
    assert (long - short) <= 2 * (long_steps - short_steps), (counts, dict(syncs.by_name))


@pytest.mark.parametrize("rows, tree, window", [(1, 0, None), (1, 8, None), (3, 8, None), (3, 8, 16)])
def test_a_drafting_round_reads_the_host_twice(target, rows, tree, window):
    """A default drafting round of a parallel head (greedy, no logits processors) reads the host twice outside
    the target's forward: once for the round's figures after the drafter (probabilities and, for trees, the top
    tokens per depth, together), once for the verify pass's outcome.  Counted per round by
    `RunResult.rounds()` (the first round, which also finishes the prefill, left out), with left padding and
    prompt lookup in play; a per-depth read, a tree row read back from its tensor or prompt lookup searching a
    tensor would each add reads every round; with a drafter window, its cache's compaction check is read along
    with the round's figures.  Compacting a cache reads nothing: the loop knows each row's valid slots.  The output is
    plain's."""
    from peagle.evaluation.timing import timed_generate

    head = make_head(target)  # threshold 0.0: every round drafts
    ids = torch.cat([prompt_ids(120 + b, 12) for b in range(rows)])
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0
    kw = dict(attention_mask=mask, pad_token_id=0, num_assistant_tokens=4, draft_tree_size=tree)
    if tree:
        kw["prompt_lookup_num_tokens"] = 3
    if window:
        kw["drafter_window"] = window
    run = timed_generate(target, ids, 24, head, count_syncs=True, **kw)
    assert torch.equal(
        greedy(target, ids, assistant_model=head, max_new_tokens=24, **kw),
        greedy(target, ids, max_new_tokens=24, attention_mask=mask, pad_token_id=0),
    )
    drafting = [r.host_syncs for r in run.rounds() if r.drafted]
    assert len(drafting) >= 4 and sorted(drafting)[len(drafting) // 2] <= 2, drafting
    assert max(drafting) <= 2, drafting
