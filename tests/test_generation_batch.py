"""Batched speculative decoding in `generate()`: B left-padded prompts through peagle's one decoding loop give
plain batched `generate()`'s output row for row (greedy), keep each row's distribution (sampling), with ragged
acceptance, early-finishing rows, per-row logits processors, compaction of the caches' holes and clear refusals."""

from __future__ import annotations

import pytest
import torch
import transformers
from scipy import stats as scipy_stats
from transformers import AutoModelForCausalLM
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import peagle
from helpers import LAYERS, Oracle, exact_distribution, make_head, make_target, prompt_ids
from peagle.evaluation.bench_batch import left_pad
from peagle.generation import ragged
from peagle.generation.cost import VerifyCostModel, cost_model_key

LENGTHS = [5, 17, 3, 11, 8, 2, 14, 6]  # very different prompt lengths: left padding of up to 15 tokens


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


def prompts(n: int, seed: int = 0) -> list[torch.LongTensor]:
    return [prompt_ids(seed + i, LENGTHS[i % len(LENGTHS)])[0] for i in range(n)]


def plain(target, rows, **kw) -> torch.LongTensor:
    ids, mask = left_pad(rows)
    return target.generate(ids, attention_mask=mask, do_sample=False, **kw)


def drafted(target, head, rows, **kw):
    ids, mask = left_pad(rows)
    return target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=head, **kw)


def references(target, rows, **kw) -> list[torch.LongTensor]:
    """Each prompt's own batch-1 greedy continuation (prompt included), for the oracle."""
    return [target.generate(r[None], do_sample=False, **kw)[0] for r in rows]


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
def test_batched_greedy_equals_plain_batched_greedy(target, mode, batch):
    """Oracle drafts right 70% of the time: every round, rows accept different numbers of drafts."""
    head = make_head(target, drafting_mode=mode)
    rows = prompts(batch, seed=10 * batch)
    ref = plain(target, rows, max_new_tokens=24)
    oracle = Oracle(head, references(target, rows, max_new_tokens=24), p=0.7, seed=batch)
    out = drafted(target, head, rows, max_new_tokens=24, num_assistant_tokens=4)
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.batch_size == batch and st.generated_tokens == 24 * batch
    assert st.generated_tokens == st.accepted_tokens + st.rounds + st.plain_steps
    assert st.accepted_tokens > 3 * batch and st.target_batch_passes < 24


def test_ragged_rounds_with_forced_acceptance(target):
    """An oracle that is always right for some rows and never for others: the right rows advance K + 1 tokens a
    round while the others advance one, so holes pile up in the target's cache, and the output is still plain."""
    head = make_head(target)
    rows = prompts(4, seed=3)
    refs = references(target, rows, max_new_tokens=40)
    ref = plain(target, rows, max_new_tokens=40)
    oracle = Oracle(head, refs, p=[1.0, 0.0, 1.0, 0.0])
    out = drafted(target, head, rows, max_new_tokens=40, num_assistant_tokens=5)
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    # the right rows finish in about 40 / 6 passes; the others need 40
    assert st.accepted_tokens >= 2 * (40 - 8) * 5 // 6
    assert st.target_batch_passes <= 41


def test_holes_are_compacted(target, monkeypatch):
    """Rows that keep different numbers of drafts leave holes; once enough pile up, the caches are compacted and
    the output is unchanged."""
    calls = []
    original = ragged.compact

    def spy(cache, mask, valid=None):
        # the loop passes the most valid slots of a row, known without reading the mask (at least the true count)
        assert valid is not None and valid >= int(mask.sum(dim=1).max())
        calls.append(mask.shape[1])
        return original(cache, mask, valid)

    monkeypatch.setattr(ragged, "compact", spy)
    monkeypatch.setattr("peagle.generation.decoding.compact", spy)
    monkeypatch.setattr("peagle.generation.drafter_cache.compact", spy)
    head = make_head(target)
    rows = prompts(3, seed=21)
    refs = references(target, rows, max_new_tokens=60)
    ref = plain(target, rows, max_new_tokens=60)
    oracle = Oracle(head, refs, p=[0.9, 0.1, 0.5], seed=2)
    out = drafted(target, head, rows, max_new_tokens=60, num_assistant_tokens=6)
    oracle.handle.remove()
    assert torch.equal(out, ref) and len(calls) >= 2


def test_compaction_index_right_aligns_each_rows_slots():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0]])
    index, new = ragged.compaction_index(mask)
    assert new.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert index[0, 2:].tolist() == [1, 2, 4] and index[1].tolist() == [0, 1, 2, 3, 5] and index[2, 4] == 2
    # given the most valid slots of a row, the same without a read; given more (a bound), more leading padding
    assert all(torch.equal(a, b) for a, b in zip(ragged.compaction_index(mask, 5), (index, new)))
    assert ragged.compaction_index(mask, 6) is None  # nothing freed
    upper = torch.cat([torch.zeros(3, 2, dtype=torch.long), mask], dim=1)
    wider_index, wider = ragged.compaction_index(upper, 6)
    assert wider[:, 1:].tolist() == new.tolist() and not wider[:, 0].any()
    assert torch.equal(wider_index[:, 1:][new.bool()], index[new.bool()] + 2)


def test_early_finishing_rows_are_padded_as_plain_generate_pads_them():
    """Per-row EOS (here two EOS ids): rows that end early get `pad_token_id` after their EOS, the batch runs on
    for the others, and the output equals plain batched greedy's."""
    target = make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)
    head = make_head(target)
    rows = prompts(5, seed=40)
    free = references(target, rows, max_new_tokens=30)
    eos = [int(free[0][len(rows[0]) + 4]), int(free[3][len(rows[3]) + 9])]
    ref = plain(target, rows, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    lengths = (ref != 0).sum(dim=1)
    assert len(set(lengths.tolist())) > 1, "no row ended early: pick other EOS ids"
    oracle = Oracle(head, free, p=1.0)  # drafts run past each row's EOS: the loop must cut there
    out = drafted(
        target, head, rows, max_new_tokens=30, eos_token_id=eos, pad_token_id=0, num_assistant_tokens=5
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_processors_see_each_rows_history(target, mode):
    """`repetition_penalty`, `no_repeat_ngram_size` and `min_new_tokens` depend on each row's own history and
    length; a row ahead of the others must still see exactly what plain batched generate() shows it."""
    head = make_head(target, drafting_mode=mode)
    rows = prompts(4, seed=60)
    kw = dict(
        max_new_tokens=30, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=10, eos_token_id=5
    )
    ref = plain(target, rows, **kw)
    refs = [target.generate(r[None], do_sample=False, **kw)[0] for r in rows]
    oracle = Oracle(head, refs, p=[0.9, 0.3, 1.0, 0.6], seed=4)
    out = drafted(target, head, rows, num_assistant_tokens=4, **kw)
    oracle.handle.remove()
    assert torch.equal(out, ref)
    assert head.last_generation_stats.accepted_tokens > 10


def test_return_dict_scores_and_hidden_states(target):
    head = make_head(target)
    rows = prompts(3, seed=70)
    kw = dict(
        max_new_tokens=8, return_dict_in_generate=True, output_scores=True, output_logits=True,
        output_hidden_states=True,
    )  # fmt: skip
    ids, mask = left_pad(rows)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, **kw)
    oracle = Oracle(head, references(target, rows, max_new_tokens=8), p=0.8)
    out = target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=head, **kw)
    oracle.handle.remove()
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 8 and len(out.logits) == 8 and len(out.hidden_states) == 8
    for mine, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert out.hidden_states[0][0].shape == ref.hidden_states[0][0].shape
    assert out.hidden_states[3][-1].shape == ref.hidden_states[3][-1].shape
    torch.testing.assert_close(out.hidden_states[5][-1], ref.hidden_states[5][-1], atol=1e-4, rtol=1e-4)


def test_default_cost_rule_at_batch_size_two(target, tmp_path, monkeypatch):
    """Default settings (the cost rule) measure a curve for the batch size at hand, under its own key."""
    from peagle.generation.cost import forget_cost_models

    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path))
    forget_cost_models()
    head = make_head(target, confidence_threshold=None)
    rows = prompts(2, seed=80)
    ref = plain(target, rows, max_new_tokens=16)
    oracle = Oracle(head, references(target, rows, max_new_tokens=16), p=0.9)
    try:
        out = drafted(target, head, rows, max_new_tokens=16)
    finally:
        oracle.handle.remove()
        forget_cost_models()
    assert torch.equal(out, ref)
    assert head.last_generation_stats.draft_policy == "cost"
    assert cost_model_key(target, head, 2)["batch_size"] == 2 and "batch_size" not in cost_model_key(
        target, head
    )
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_batch_rule_sums_the_rows():
    from peagle.generation.rule import choose_batch_num_drafts, choose_num_drafts

    curve = [1.0, 1.2, 1.4, 1.6]
    assert choose_batch_num_drafts([[0.9, 0.9, 0.9]], curve) == choose_num_drafts([0.9, 0.9, 0.9], curve) == 3
    # one confident row cannot pay for three hopeless ones on a dear curve
    assert choose_batch_num_drafts([[0.9, 0.9, 0.9]] + [[0.05] * 3] * 3, [1.0, 1.5, 2.0, 2.5]) == 0


def test_flat_curve_batch_tokens_per_pass_hold(target):
    """All K drafts every round: tokens per target pass per row at B = 4 match B = 1 on the same prompts (the
    ragged handling loses no acceptance)."""
    rows = prompts(4, seed=90)
    refs = references(target, rows, max_new_tokens=20)
    per_row = []
    for r, ref in zip(rows, refs, strict=True):
        head = make_head(target)
        oracle = Oracle(head, ref[None], p=0.7, seed=1)
        target.generate(
            r[None], do_sample=False, max_new_tokens=20, assistant_model=head, num_assistant_tokens=4
        )
        oracle.handle.remove()
        per_row.append(head.last_generation_stats)
    head = make_head(target)
    oracle = Oracle(head, refs, p=0.7, seed=1)
    drafted(target, head, rows, max_new_tokens=20, num_assistant_tokens=4)
    oracle.handle.remove()
    single = peagle.PEagleGenerationStats.merge(per_row).tokens_per_target_pass
    batched = head.last_generation_stats.tokens_per_target_pass
    assert batched == pytest.approx(single, rel=0.25) and batched > 1.5


# ---------------------------------------------------------------------------------------------- sampling
def _sampling_models(kind: str = "llama"):
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    target = make_target(
        seed=3, vocab_size=8, num_hidden_layers=2, eos_token_id=None, pad_token_id=0, **small
    )
    if kind == "sliding":  # the same shape with a window of 2 that every row's prompt and drafts run past
        cfg = transformers.MistralConfig(
            **{k: getattr(target.config, k) for k in ("vocab_size", "num_hidden_layers", "pad_token_id")},
            **small, eos_token_id=None, sliding_window=2, max_position_embeddings=64,
        )  # fmt: skip
        torch.manual_seed(3)
        target = AutoModelForCausalLM.from_config(cfg).eval()
    head = make_head(target, seed=4, mask_token_id=7, draft_vocab_size=6)
    head.set_draft_vocab(torch.tensor([0, 1, 2, 4, 5, 6]))
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
        head.lm_head.weight.mul_(3.0)
    return target, head


@pytest.mark.parametrize("kind", ["llama", "sliding"])
def test_sampling_keeps_each_rows_distribution(kind):
    """B = 2 left-padded prompts of different lengths, temperature + top-k: each row's continuations follow the
    target's exact distribution for that prompt (chi-square against full enumeration); drafts from the target's
    own logits plus noise are accepted often but not always, so both branches of the rule shape the output. Also on
    a sliding-window target (window 2, masked by position past holes and padding)."""
    target, head = _sampling_models(kind)
    rows = [torch.tensor([1, 3, 5, 6, 2]), torch.tensor([4, 1, 6])]
    ids, mask = left_pad(rows)
    steps = 3
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])
    exact = [exact_distribution(target, r[None], steps, processors) for r in rows]
    noise = torch.Generator().manual_seed(5)

    def target_like(module, args, kwargs, out):
        out.logits = torch.randn(out.logits.shape, generator=noise) * 0.5
        return out

    handle = head.register_forward_hook(target_like, with_kwargs=True)
    torch.manual_seed(2)
    n = 400
    counts = [dict.fromkeys(e, 0) for e in exact]
    for _ in range(n):
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=steps, do_sample=True, temperature=0.8, top_k=3,
            assistant_model=head, num_assistant_tokens=3,
        )  # fmt: skip
        for b in range(2):
            counts[b][tuple(out[b, ids.shape[1] :].tolist())] += 1
    handle.remove()
    st = head.last_generation_stats
    assert st.batch_size == 2
    for b in range(2):
        big = [s for s in exact[b] if exact[b][s] * n >= 5]
        observed = [counts[b][s] for s in big] + [n - sum(counts[b][s] for s in big)]
        expected = [exact[b][s] * n for s in big] + [n - sum(exact[b][s] * n for s in big)]
        assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3


def test_num_return_sequences_with_sampling(target):
    head = make_head(target)
    rows = prompts(2, seed=100)
    ids, mask = left_pad(rows)
    torch.manual_seed(0)
    out = target.generate(
        ids, attention_mask=mask, do_sample=True, top_k=5, max_new_tokens=6, num_return_sequences=3,
        assistant_model=head,
    )  # fmt: skip
    assert out.shape == (6, ids.shape[1] + 6)
    assert torch.equal(out[:3, : ids.shape[1]], ids[:1].expand(3, -1))
    assert head.last_generation_stats.batch_size == 6


# ---------------------------------------------------------------------------------------------- refusals
def test_refusals_name_the_option(target):
    head = make_head(target)
    rows = prompts(2, seed=110)
    ids, mask = left_pad(rows)
    with pytest.raises(ValueError, match="streamer supports a single sequence"):
        target.generate(ids, attention_mask=mask, max_new_tokens=3, assistant_model=head, streamer=object())


def test_prefix_allowed_tokens_fn_sees_each_rows_batch_index(target):
    """Processors that keep per-row state get every row at its index in the original batch, also after rows
    ended and left the batch."""
    head = make_head(target)
    rows = prompts(3, seed=115)

    def allowed(batch_id, ids):
        return list(range(10 + 20 * batch_id, 30 + 20 * batch_id))

    kw = dict(max_new_tokens=10, prefix_allowed_tokens_fn=allowed)
    ref = plain(target, rows, **kw)
    out = drafted(target, head, rows, num_assistant_tokens=3, **kw)
    assert torch.equal(out, ref)


def test_sliding_window_targets_decode_batches():
    """A target whose every layer slides (Mistral, window 8): a batch of prompts generates past the window, rows
    keeping holes and left padding, and equals plain batched greedy; one prompt equals plain greedy too."""
    cfg = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, sliding_window=8, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    sliding = AutoModelForCausalLM.from_config(cfg).eval()
    head = peagle.PEagleDrafter(
        peagle.PEagleConfig.for_target(
            sliding, num_hidden_layers=1, mask_token_id=127, confidence_threshold=0.0
        )
    ).eval()
    rows = prompts(3, seed=120)
    oracle = Oracle(head, references(sliding, rows, max_new_tokens=24), p=0.6, seed=5)
    try:
        assert torch.equal(
            drafted(sliding, head, rows, max_new_tokens=24, num_assistant_tokens=4),
            plain(sliding, rows, max_new_tokens=24),
        )
    finally:
        oracle.handle.remove()
    assert head.last_generation_stats.accepted_tokens > 0
    one = rows[1][None]
    assert torch.equal(
        sliding.generate(one, do_sample=False, max_new_tokens=12, assistant_model=head),
        sliding.generate(one, do_sample=False, max_new_tokens=12),
    )


def test_flat_cost_model_at_batch_size_four_drafts_every_round(target):
    head = make_head(target, confidence_threshold=None)
    head.cost_model = VerifyCostModel.flat(max_tokens=8)
    rows = prompts(4, seed=130)
    ref = plain(target, rows, max_new_tokens=12)
    out = drafted(target, head, rows, max_new_tokens=12, num_assistant_tokens=3)
    assert torch.equal(out, ref)
    assert head.last_generation_stats.chosen_k_histogram[0] == 0


# ---------------------------------------------------------------------------------------------- plain steps
def test_plain_steps_queue_the_whole_batchs_slots_as_one_chunk(target, monkeypatch):
    """A plain step (the rule declined the drafter) hands the drafter every row's new slot as one chunk, not one
    per row; the drafting rounds between, whose rows keep different numbers of drafts, queue theirs per row, and
    the drafter's next block joins both.  The output is plain batched greedy's."""
    from peagle.generation import decoding, drafter_cache, policy

    rounds = []
    original = policy.DraftPolicy.plan

    def every_third(self, state):  # two plain steps, then a drafting round
        rounds.append(state)
        return original(self, state) if len(rounds) % 3 == 0 else policy.RoundPlan(state.context, skip=True)

    passes = []  # per verify pass: (its width, [kind of each add])
    row_add, shared_add = (
        drafter_cache.DrafterCache.add_real_slots,
        drafter_cache.DrafterCache.add_shared_slots,
    )
    verify = decoding._Decoder.verify

    def count(kind, add):
        def spy(self, *args):
            if passes:  # the prefill's adds come before any verify pass
                passes[-1][1].append(kind)
            return add(self, *args)

        return spy

    def counted_verify(self, emitted, candidates):
        passes.append((len(candidates) + 1, []))
        return verify(self, emitted, candidates)

    monkeypatch.setattr(policy.DraftPolicy, "plan", every_third)
    monkeypatch.setattr(decoding._Decoder, "verify", counted_verify)
    monkeypatch.setattr(drafter_cache.DrafterCache, "add_real_slots", count("row", row_add))
    monkeypatch.setattr(drafter_cache.DrafterCache, "add_shared_slots", count("shared", shared_add))
    head = make_head(target)
    rows = prompts(4, seed=5)
    ref = plain(target, rows, max_new_tokens=30)
    oracle = Oracle(head, references(target, rows, max_new_tokens=30), p=[1.0, 0.0, 1.0, 0.0])
    out = drafted(
        target, head, rows, max_new_tokens=30, num_assistant_tokens=4, assistant_confidence_threshold=0.0
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)
    steps = [adds for width, adds in passes if width == 1]
    ragged_rounds = [adds for width, adds in passes if width > 1 and "row" in adds]
    assert len(steps) > 5 and ragged_rounds
    assert all(adds == ["shared"] for adds in steps)  # one chunk per plain step, whatever the batch's size
    assert all(adds == ["row"] * len(adds) for adds in ragged_rounds)


def test_slots_queued_together_make_the_same_block_as_slots_queued_per_row():
    from peagle.generation.drafter_cache import DrafterCache

    head = make_head(make_target(seed=1))
    width = 3 * head.config.target_hidden_size
    feats = torch.randn(2, 6, width)
    tokens = torch.randint(0, 50, (2, 6))
    together, apart = DrafterCache(head, 2, None), DrafterCache(head, 2, None)
    # row 0's own 2 slots, row 1's own 1, then two chunks of both rows together, then row 1's own 2
    for cache in (together, apart):
        cache.add_real_slots(0, tokens[0, :2], feats[0, :2], 10)
        cache.add_real_slots(1, tokens[1, :1], feats[1, :1], 4)
    for at in (2, 3):
        together.add_shared_slots(tokens[:, at : at + 1], feats[:, at : at + 1], [10 + at, 3 + at])
        for b, start in enumerate([10 + at, 3 + at]):
            apart.add_real_slots(b, tokens[b, at : at + 1], feats[b, at : at + 1], start)
    for cache in (together, apart):
        cache.add_real_slots(1, tokens[1, 4:6], feats[1, 4:6], 6)
    assert together.pending_slots() == apart.pending_slots() == 5
    one, two = together.next_block(), apart.next_block()
    assert one.starts == two.starts and torch.equal(one.new_mask, two.new_mask)
    assert torch.equal(one.tokens, two.tokens) and torch.equal(one.features, two.features)
    # a batch whose only queued slots are shared ones: their chunks joined, no per-row copies
    fresh = DrafterCache(head, 2, None)
    fresh.add_shared_slots(tokens[:, :1], feats[:, :1], [7, 2])
    fresh.add_shared_slots(tokens[:, 1:3], feats[:, 1:3], [8, 3])
    block = fresh.next_block()
    assert block.starts == [7, 2] and block.attention_mask is None and fresh.pending_slots() == 0
    assert torch.equal(block.tokens, tokens[:, :3]) and torch.equal(block.features, feats[:, :3])
