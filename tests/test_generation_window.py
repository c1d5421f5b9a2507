"""The drafter's attention window (`drafter_window`, issue #67): each drafting round the head attends over its
last W slots only, whatever the context's length; the output stays plain greedy's, through both doors
(a keyword or a `GenerationConfig`) and the head's config."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from helpers import LAYERS, Oracle, make_head, make_target, prompt_ids
from peagle.evaluation.bench_batch import left_pad

PROMPT, NEW, K, W = 40, 20, 3, 8


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


class Spy:
    """Forward pre-hook: the drafter cache's slots before each round's first drafter pass and its real slots."""

    def __init__(self, head):
        self.passes: list[tuple[int, int]] = []
        self.handle = head.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if kwargs.get("projected_hidden_states") is not None:
            return  # an autoregressive head's later passes in a round: its own drafts, on top of the window
        cache = kwargs.get("cache")
        held = cache.get_seq_length() if cache is not None else 0
        parallel = kwargs.get("parallel_mask")
        real = kwargs["input_ids"].shape[1] - (int(parallel[0].sum()) if parallel is not None else 0)
        self.passes.append((held, real))

    def span(self) -> int:
        """The most slots a pass's first real slot could attend to (cached ones plus itself)."""
        return max(held + 1 for held, real in self.passes if real)


def run(target, head, ids, **kw):
    ref = target.generate(ids, do_sample=False, max_new_tokens=NEW)
    oracle = Oracle(head, ref, p=0.7)
    spy = Spy(head)
    out = target.generate(
        ids, do_sample=False, max_new_tokens=NEW, assistant_model=head, num_assistant_tokens=K, **kw
    )
    oracle.handle.remove()
    spy.handle.remove()
    return out, ref, spy


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_window_bounds_what_the_drafter_attends_to(target, mode):
    head = make_head(target, drafting_mode=mode)
    ids = prompt_ids(3, PROMPT)
    out, ref, spy = run(target, head, ids, drafter_window=W)
    assert torch.equal(out, ref)
    # a round's new real slots all fit in the window, and the cache before them holds the rest of it
    assert all(held + min(real, W) <= W for held, real in spy.passes if real), spy.passes
    assert head.last_generation_stats.accepted_tokens > 0
    _, _, whole = run(target, head, ids)  # without a window the drafter reads the whole prompt
    assert whole.span() > PROMPT


def test_window_through_both_doors_and_the_heads_config(target):
    head = make_head(target)
    ids = prompt_ids(4, PROMPT)
    _, _, by_keyword = run(target, head, ids, drafter_window=W)
    _, _, by_config = run(target, head, ids, generation_config=GenerationConfig(drafter_window=W))
    head.config.drafter_window = W
    _, _, by_head = run(target, head, ids)
    _, _, overridden = run(target, head, ids, drafter_window=0)  # 0: the whole context, over the head's W
    assert by_keyword.passes == by_config.passes == by_head.passes
    assert by_keyword.span() <= W < overridden.span()


@pytest.mark.parametrize("value", [-1, True, "8", 2.5])
def test_bad_windows_are_refused_by_name(target, value):
    head = make_head(target)
    with pytest.raises(ValueError, match="drafter_window"):
        target.generate(prompt_ids(1, 6), max_new_tokens=3, assistant_model=head, drafter_window=value)


def test_window_on_a_ragged_batch_with_trees(target):
    """Left padding and holes of rejected drafts: every row still gives plain batched greedy's output."""
    head = make_head(target)
    rows = [prompt_ids(20 + i, n)[0] for i, n in enumerate([30, 7, 19])]
    ids, mask = left_pad(rows)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    refs = [target.generate(r[None], do_sample=False, max_new_tokens=NEW)[0] for r in rows]
    oracle = Oracle(head, refs, p=0.6, second=True)
    spy = Spy(head)
    out = target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW,
        assistant_model=head,
        num_assistant_tokens=K,
        draft_tree_size=6,
        drafter_window=W,
    )
    oracle.handle.remove()
    spy.handle.remove()
    assert torch.equal(out, ref)
    assert spy.span() <= W
