"""Static caches (`cache_implementation="static"`, a `StaticCache`): batches of left-padded prompts and draft trees
keep their holes on the cache's fixed slot axis, compact it in place, keep ended rows as frozen rows, and give
plain `generate()`'s output token for token (docs/DESIGN.md section 10.2)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, StaticCache

from helpers import LAYERS, Oracle, make_head, make_target, prompt_ids
from peagle.evaluation.bench_batch import left_pad
from peagle.generation import ragged
from peagle.generation.cost import VerifyCostModel

LENGTHS = [5, 17, 3, 11, 8, 2, 14, 6]  # left padding of up to 15 tokens


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


def prompts(n: int, seed: int = 0) -> list[torch.LongTensor]:
    return [prompt_ids(seed + i, LENGTHS[i % len(LENGTHS)])[0] for i in range(n)]


def generate(model, rows, **kw) -> torch.LongTensor:
    ids, mask = left_pad(rows)
    return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def references(model, rows, **kw) -> list[torch.LongTensor]:
    """Each prompt's own batch-1 greedy continuation (prompt included), for the oracle."""
    return [model.generate(r[None], do_sample=False, **kw)[0] for r in rows]


def early_eos(model, rows, new: int) -> list[int]:
    """Two EOS ids (tokens of the first and the last row's continuation) that end rows at different steps, none
    before step 3 and some before the end."""
    free = [r[len(p) :].tolist() for r, p in zip(references(model, rows, max_new_tokens=new), rows)]

    def end(row: list[int], eos: set[int]) -> int:
        return next((i + 1 for i, t in enumerate(row) if t in eos), len(row))

    for a in range(3, new):
        for c in range(3, new):
            eos = {free[0][a], free[-1][c]}
            ends = [end(row, eos) for row in free]
            if min(ends) >= 3 and min(ends) < new and len(set(ends)) > 1:
                return sorted(eos)
    raise AssertionError("no EOS pair ends the rows at different steps: pick other prompts")


@pytest.mark.parametrize("tree", [0, 6], ids=["chains", "trees"])
@pytest.mark.parametrize(
    ("batch", "mode"),
    [(1, "parallel"), (2, "parallel"), (3, "parallel"), (3, "autoregressive"), (8, "parallel")],
)
def test_static_cache_batches_equal_plain(target, batch, mode, tree):
    """B left-padded prompts on a static cache, chains and trees, rows ending at EOS at different steps (ended rows
    stay in the batch, frozen): the output is plain static greedy's, which is plain dynamic greedy's."""
    head = make_head(target, drafting_mode=mode)
    rows = prompts(batch, seed=7 * batch)
    new = 24
    eos = early_eos(target, rows, new) if batch > 1 else None
    kw = dict(max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
    ref = generate(target, rows, cache_implementation="static", **kw)
    assert torch.equal(ref, generate(target, rows, **kw))
    if batch > 1:
        ends = (ref[:, -new:] != 0).sum(dim=1).tolist()
        assert min(ends) < new and len(set(ends)) > 1, "rows should end at different steps"
    oracle = Oracle(head, references(target, rows, **kw), p=0.7, seed=batch, second=True)
    out = generate(
        target, rows, cache_implementation="static", assistant_model=head, num_assistant_tokens=4,
        draft_tree_size=tree, **kw,
    )  # fmt: skip
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.batch_size == batch and st.accepted_tokens > batch
    assert (st.tree_rounds > 0) == bool(tree)


def test_static_cache_compacts_in_place(target, monkeypatch):
    """Rows keeping different numbers of drafts leave holes on the static slot axis; compaction gathers each row's
    slots in place (the same tensors, the layer's length set to the new width) and the output is plain's."""
    seen = []
    original = ragged.compact

    def spy(cache, mask, valid=None):
        layer = cache.layers[0]
        before = (layer.keys.data_ptr(), layer.keys.shape)
        new = original(cache, mask, valid)
        if isinstance(layer, transformers.cache_utils.StaticLayer) and new.shape[1] < mask.shape[1]:
            assert (layer.keys.data_ptr(), layer.keys.shape) == before
            assert int(layer.cumulative_length) == new.shape[1]
            seen.append(mask.shape[1] - new.shape[1])
        return new

    monkeypatch.setattr("peagle.generation.decoding.compact", spy)
    monkeypatch.setattr("peagle.generation.ragged.compact", spy)  # before a pass that might not fit
    head = make_head(target)
    rows = prompts(3, seed=21)
    new = 60
    ref = generate(target, rows, max_new_tokens=new, cache_implementation="static")
    oracle = Oracle(head, references(target, rows, max_new_tokens=new), p=[0.9, 0.1, 0.5], seed=2)
    out = generate(
        target, rows, max_new_tokens=new, cache_implementation="static", assistant_model=head,
        num_assistant_tokens=6,
    )  # fmt: skip
    oracle.handle.remove()
    assert torch.equal(out, ref) and len(seen) >= 2


def test_static_cache_of_the_exact_size_caps_the_last_passes(target):
    """A user's StaticCache of max_length - 1 slots (what generate() makes): near the end a tree of 16 nodes no
    longer fits, so the loop compacts and verifies only what the slots hold; the output is still plain's."""
    head = make_head(target)
    rows = prompts(3, seed=30)
    new = 14
    ids, mask = left_pad(rows)
    ref = generate(target, rows, max_new_tokens=new, cache_implementation="static")
    oracle = Oracle(
        head, references(target, rows, max_new_tokens=new), p=[1.0, 0.2, 0.6], seed=3, second=True
    )
    cache = StaticCache(config=target.config, max_cache_len=ids.shape[1] + new - 1)
    out = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=new, cache=cache, assistant_model=head,
        num_assistant_tokens=4, draft_tree_size=16,
    )  # fmt: skip
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert 0 < st.draft_tokens < 16 * st.tree_rounds  # some rounds verified fewer than 16 nodes


@pytest.mark.parametrize("tree", [0, 6], ids=["chains", "trees"])
def test_static_cache_sampling_equals_dynamic_sampling(target, tree):
    """Keyed sampling draws each row's tokens by (row, position): the same seed gives the same tokens on a static
    cache as on the default one, ended rows frozen or dropped."""
    head = make_head(target)
    rows = prompts(3, seed=50)
    kw = dict(max_new_tokens=16, do_sample=True, top_k=8, eos_token_id=[5, 9, 17], pad_token_id=0)
    ids, mask = left_pad(rows)
    outs = []
    for cache in ("static", None):
        torch.manual_seed(3)
        outs.append(
            target.generate(
                ids,
                attention_mask=mask,
                cache_implementation=cache,
                assistant_model=head,
                num_assistant_tokens=3,
                draft_tree_size=tree,
                **kw,
            )  # fmt: skip
        )
    assert torch.equal(outs[0], outs[1])


def test_static_cache_under_the_cost_rule(target):
    """The default rule (a flat cost model here) on a static cache at batch 2, trees "auto": plain's output."""
    head = make_head(target, confidence_threshold=None)
    head.cost_model = VerifyCostModel.flat(max_tokens=8)
    rows = prompts(2, seed=60)
    ref = generate(target, rows, max_new_tokens=12, cache_implementation="static")
    oracle = Oracle(head, references(target, rows, max_new_tokens=12), p=0.8, seed=6)
    out = generate(
        target, rows, max_new_tokens=12, cache_implementation="static", assistant_model=head,
        num_assistant_tokens=3,
    )  # fmt: skip
    oracle.handle.remove()
    assert torch.equal(out, ref)


def test_the_rule_prices_a_pass_at_its_padded_width(target):
    """Under the cost rule a round costs what its padded pass costs: with `verify_widths="fixed"` (1 and K + 1) and a
    curve where only K + 1 tokens are dear, the rule never drafts; unpadded, the same curve makes short chains pay.
    Both outputs are plain's."""
    rows = prompts(2, seed=64)
    new = 12
    ref = generate(target, rows, max_new_tokens=new, cache_implementation="static")
    drafted = {}
    for widths in (None, "fixed"):
        head = make_head(target, confidence_threshold=None)
        head.cost_model = VerifyCostModel([1.0, 1.0, 1.0, 1.0, 40.0], drafter_seconds=0.01)
        oracle = Oracle(head, references(target, rows, max_new_tokens=new), p=1.0, seed=2)
        out = generate(
            target, rows, max_new_tokens=new, cache_implementation="static", assistant_model=head,
            num_assistant_tokens=4, draft_tree_size=0, verify_widths=widths,
        )  # fmt: skip
        oracle.handle.remove()
        assert torch.equal(out, ref)
        drafted[widths] = head.last_generation_stats.draft_tokens
    assert drafted[None] > 0 and drafted["fixed"] == 0, drafted


def _mixed_sliding_target():
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, use_sliding_window=True, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"] * 2, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_static_cache_on_a_sliding_target_decodes_one_prompt_and_refuses_batches():
    """Full and sliding layers on a static cache: one prompt with chains equals plain static greedy (the full
    layers' masks span the static slot axis); batches and trees are refused by name."""
    sliding = _mixed_sliding_target()
    head = make_head(sliding)
    one = prompts(1, seed=70)
    ref = generate(sliding, one, max_new_tokens=12, cache_implementation="static")
    oracle = Oracle(head, references(sliding, one, max_new_tokens=12), p=0.8)
    out = generate(
        sliding, one, max_new_tokens=12, cache_implementation="static", assistant_model=head,
        num_assistant_tokens=3, draft_tree_size=0,
    )  # fmt: skip
    oracle.handle.remove()
    assert torch.equal(out, ref) and head.last_generation_stats.accepted_tokens > 0
    with pytest.raises(ValueError, match=r"static cache with sliding-window layers"):
        generate(
            sliding,
            prompts(2, seed=71),
            max_new_tokens=4,
            cache_implementation="static",
            assistant_model=head,
        )
    with pytest.raises(ValueError, match=r"draft trees.*static cache with sliding-window layers"):
        generate(
            sliding, one, max_new_tokens=4, cache_implementation="static", assistant_model=head,
            draft_tree_size=4,
        )  # fmt: skip


def test_verify_widths_pad_every_pass_to_a_few_widths(target):
    """`verify_widths="fixed"` on a static cache with room for the widest pass past `max_length`: every verify pass
    after the prefill is 1, K + 1 or the tree budget + 1 wide (a compiled forward compiles once per width), and the
    output is plain's; listed widths pad to the smallest that holds a pass."""
    widths = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    rows = prompts(3, seed=21)
    new = 24
    kw = dict(max_new_tokens=new, eos_token_id=early_eos(target, rows, new), pad_token_id=0)
    ref = generate(target, rows, **kw)
    room = dict(cache_implementation="static", max_cache_len=left_pad(rows)[0].shape[1] + new - 1 + 7)
    try:
        for tree, asked, allowed in [(6, "fixed", {1, 5, 7}), (0, "fixed", {1, 5}), (0, [3, 8], {3, 8})]:
            head = make_head(target)
            oracle = Oracle(head, references(target, rows, **kw), p=0.7, seed=1, second=True)
            widths.clear()
            out = generate(
                target, rows, assistant_model=head, num_assistant_tokens=4, draft_tree_size=tree,
                verify_widths=asked, **room, **kw,
            )  # fmt: skip
            oracle.handle.remove()
            assert torch.equal(out, ref) and head.last_generation_stats.accepted_tokens > 3
            assert set(widths[1:]) <= allowed and len(widths) > 2, (asked, widths)
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="verify_widths"):
        generate(target, rows, assistant_model=make_head(target), max_new_tokens=2, verify_widths=[0, 4])
