"""P-EAGLE drafting inside `generate()` on tiny random models: lossless output, one drafter pass per round,
the drafter cache across rounds, target features, stats, stopping, sampling distribution, errors, the hook."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import transformers
from scipy import stats as scipy_stats
from transformers import GenerationConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

import peagle
from helpers import LAYERS, Oracle, exact_distribution, greedy, make_head, make_target, prompt_ids
from peagle import generation as gen
from peagle.generation import checks as gen_checks
from peagle.generation.drafting import DraftingSession


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


class Recorder:
    """Forward hook recording the drafter's inputs and raw logits, and the order of drafter/target calls."""

    def __init__(self, head, target=None):
        self.calls: list[dict] = []
        self.events: list[str] = []
        self.handles = [head.register_forward_hook(self._head, with_kwargs=True)]
        if target is not None:
            self.handles.append(target.register_forward_hook(lambda *a: self.events.append("T")))

    def _head(self, module, args, kwargs, out):
        keep = (
            "input_ids",
            "target_hidden_states",
            "projected_hidden_states",
            "position_ids",
            "parallel_mask",
        )
        call = {
            k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in kwargs.items()
            if k in keep
        }
        call["logits"] = out.logits.detach().clone()
        self.calls.append(call)
        self.events.append("D")

    def remove(self):
        for h in self.handles:
            h.remove()


def _check_stats(head, prompt_len: int, output: torch.LongTensor) -> gen.PEagleGenerationStats:
    st = head.last_generation_stats
    new = output.shape[1] - prompt_len
    assert st.generated_tokens == new == st.accepted_tokens + st.rounds + st.plain_steps
    assert sum(st.accepted_per_depth) == st.accepted_tokens
    if not st.tree_rounds:  # a tree round drafts several nodes per depth
        assert sum(st.drafted_per_depth) == st.draft_tokens
    # a draft at depth d is kept only if depth d-1 was
    assert all(a >= b for a, b in itertools.pairwise(st.accepted_per_depth))
    if st.rounds:
        assert st.acceptance_length == pytest.approx((st.accepted_tokens + st.rounds) / st.rounds)
    return st


# ---------------------------------------------------------------------------------------------- lossless greedy
@pytest.mark.parametrize("k", range(1, 11))
def test_greedy_lossless_parallel(target, k):
    head = make_head(target, seed=k)
    for p, accuracy in enumerate((0.5, 0.8, 1.0, None, None)):  # oracle drafts, then the random head alone
        ids = prompt_ids(10 * k + p, 3 + (5 * k + 7 * p) % 17)
        ref = greedy(target, ids, max_new_tokens=14)
        use_oracle = accuracy is not None
        oracle = Oracle(head, ref, p=accuracy, seed=k) if use_oracle else None
        out = greedy(target, ids, max_new_tokens=14, assistant_model=head, num_assistant_tokens=k)
        if oracle:
            oracle.handle.remove()
        assert torch.equal(out, ref), (k, use_oracle)
        st = _check_stats(head, ids.shape[1], out)
        assert st.num_speculative_tokens == k and st.drafter_forward_calls == st.rounds
        if use_oracle and k > 1:
            assert st.accepted_tokens > 0


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_lossless_autoregressive(target, k):
    head = make_head(target, seed=3, drafting_mode="autoregressive")
    ids = prompt_ids(k, 9)
    ref = greedy(target, ids, max_new_tokens=16)
    oracle = Oracle(head, ref, seed=k)
    out = greedy(target, ids, max_new_tokens=16, assistant_model=head, num_assistant_tokens=k)
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = _check_stats(head, ids.shape[1], out)
    assert st.drafter_forward_calls == st.draft_tokens  # one pass per draft token


def test_greedy_lossless_draft_vocab_subset(target):
    """draft_vocab_size < vocab_size: d2t offsets map draft ids to target ids; output stays the target's."""
    head = make_head(target, seed=5, draft_vocab_size=48)
    ids = prompt_ids(7, 8)
    ref = greedy(target, ids, max_new_tokens=20)
    rest = sorted(set(range(128)) - set(ref[0].tolist()))
    keep = sorted(set(ref[0].tolist()) | set(rest[: 48 - len(set(ref[0].tolist()))]))
    head.set_draft_vocab(torch.tensor(keep))
    assert bool(head.d2t.any())  # real offsets, not the identity
    rec = Recorder(head)
    oracle = Oracle(head, ref, p=0.8)
    out = greedy(target, ids, max_new_tokens=20, assistant_model=head, num_assistant_tokens=4)
    oracle.handle.remove()
    rec.remove()
    assert torch.equal(out, ref)
    st = _check_stats(head, ids.shape[1], out)
    assert st.accepted_tokens > 0  # the mapped drafts matched the target's tokens

    # a random subset head (most tokens outside its vocabulary) is useless but still lossless
    other = make_head(target, seed=6, draft_vocab_size=16)
    other.set_draft_vocab(torch.arange(3, 128, 8)[:16])
    out = greedy(target, ids, max_new_tokens=20, assistant_model=other, num_assistant_tokens=3)
    assert torch.equal(out, ref)


def test_reduced_precision_head_keeps_float32_target_lossless(target):
    """A bfloat16 drafter on a float32 target: target features are cast at the head's input, drafts are
    still proposals only, so the output is the float32 greedy output."""
    head = make_head(target, seed=8).to(torch.bfloat16)
    assert target.dtype == torch.float32 and head.dtype == torch.bfloat16
    ids = prompt_ids(11, 9)
    ref = greedy(target, ids, max_new_tokens=18)
    oracle = Oracle(head, ref, p=0.8)
    out = greedy(target, ids, max_new_tokens=18, assistant_model=head, num_assistant_tokens=4)
    oracle.handle.remove()
    assert torch.equal(out, ref)
    assert _check_stats(head, ids.shape[1], out).accepted_tokens > 0


# ---------------------------------------------------------------------------------------------- passes per round
def _rounds(events: list[str]) -> list[int]:
    """Drafter calls between consecutive target calls (the first target call is the prefill)."""
    counts, current = [], 0
    for e in events[1:]:
        if e == "D":
            current += 1
        else:
            counts.append(current)
            current = 0
    return counts


def test_one_drafter_forward_per_round(target):
    head = make_head(target, seed=2)
    ids = prompt_ids(3, 11)
    ref = greedy(target, ids, max_new_tokens=24)
    rec = Recorder(head, target)
    oracle = Oracle(head, ref, p=0.6)
    out = greedy(target, ids, max_new_tokens=24, assistant_model=head, num_assistant_tokens=5)
    oracle.handle.remove()
    rec.remove()
    assert torch.equal(out, ref)
    st = _check_stats(head, ids.shape[1], out)
    per_round = _rounds(rec.events)
    assert rec.events[0] == "T"
    assert len(per_round) == st.rounds + st.plain_steps - 1  # the prefill step has no round before it
    assert set(per_round) <= {0, 1} and sum(per_round) == st.rounds == st.drafter_forward_calls
    assert st.accepted_tokens > 0 and st.rounds < 23
    assert st.drafter_seconds > 0 and st.total_seconds >= st.drafter_seconds


def test_autoregressive_k_forwards_per_round(target):
    k = 4
    head = make_head(target, seed=2, drafting_mode="autoregressive")
    ids = prompt_ids(4, 10)
    ref = greedy(target, ids, max_new_tokens=30)
    rec = Recorder(head, target)
    oracle = Oracle(head, ref, p=0.6)
    out = greedy(target, ids, max_new_tokens=30, assistant_model=head, num_assistant_tokens=k)
    oracle.handle.remove()
    rec.remove()
    assert torch.equal(out, ref)
    per_round = [c for c in _rounds(rec.events) if c]
    # K passes per round; only rounds near max_length draft fewer
    assert per_round[:-2] == [k] * (len(per_round) - 2) and all(c <= k for c in per_round[-2:])
    assert sum(per_round) == head.last_generation_stats.drafter_forward_calls
    # the follow-up passes feed the previous last hidden state and skip fc
    steps = [c for c in rec.calls if c.get("projected_hidden_states") is not None]
    assert len(steps) == sum(per_round) - len(per_round)
    assert all(c["input_ids"].shape == (1, 1) for c in steps)


# ---------------------------------------------------------------------------------------------- features and cache
def _full_features(target, head, seq: torch.LongTensor, shift: int = 0) -> torch.Tensor:
    with torch.no_grad():
        states = target(seq, output_hidden_states=True).hidden_states
    return torch.cat([states[i + shift] for i in head.config.eagle_aux_hidden_state_layer_ids], dim=-1)


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_features_and_cache_match_full_forward(target, mode):
    """Features passed are `output_hidden_states[i]` (index 0 = embeddings), and each round's drafter logits
    (with the cache kept across rounds) equal a fresh forward over all the slots without a cache."""
    head = make_head(target, seed=4, drafting_mode=mode)
    assert head.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    ids = prompt_ids(11, 9)
    ref = greedy(target, ids, max_new_tokens=18)
    rec = Recorder(head)
    oracle = Oracle(head, ref, p=0.7, seed=1)
    out = greedy(target, ids, max_new_tokens=18, assistant_model=head, num_assistant_tokens=4)
    oracle.handle.remove()
    rec.remove()
    assert torch.equal(out, ref)
    assert head.last_generation_stats.accepted_tokens > 0  # rounds appended several real slots
    feats = _full_features(target, head, out)
    shifted = _full_features(target, head, out, shift=1)  # the DFlash-style i+1 indexing
    mask_id = head.config.mask_token_id
    checked = 0
    for call in rec.calls:
        if call.get("projected_hidden_states") is not None:
            continue  # autoregressive follow-up steps: no target features
        par = call["parallel_mask"][0]
        real = int((~par).sum())
        k = call["logits"].shape[1]
        start = int(call["position_ids"][0, 0])
        last = start + real - 1  # last real slot = bonus slot
        got = call["target_hidden_states"][:, :real]
        torch.testing.assert_close(got, feats[:, start : last + 1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, shifted[:, start : last + 1], atol=1e-3)
        assert torch.equal(call["input_ids"][:, :real], out[:, start + 1 : last + 2])
        # fresh forward: every real slot 0..last, then the same speculative slots, no cache
        extra = int(par.sum())
        fresh_ids = torch.cat([out[:, 1 : last + 2], torch.full((1, extra), mask_id)], dim=1)
        fresh_feats = torch.cat([feats[:, : last + 1], feats.new_zeros(1, extra, feats.shape[-1])], dim=1)
        fresh_par = torch.zeros_like(fresh_ids, dtype=torch.bool)
        fresh_par[:, last + 1 :] = True
        with torch.no_grad():
            fresh = head(
                fresh_ids,
                fresh_feats,
                position_ids=torch.arange(fresh_ids.shape[1])[None],
                parallel_mask=fresh_par,
                logits_to_keep=k,
            ).logits
        torch.testing.assert_close(fresh, call["logits"], atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked == head.last_generation_stats.rounds


# ---------------------------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("max_new", [1, 2, 3, 6])
def test_max_new_tokens(target, max_new):
    head = make_head(target, seed=8)
    ids = prompt_ids(20 + max_new, 6)
    ref = greedy(target, ids, max_new_tokens=max_new)
    oracle = Oracle(head, greedy(target, ids, max_new_tokens=12), p=1.0)
    out = greedy(target, ids, max_new_tokens=max_new, assistant_model=head, num_assistant_tokens=5)
    oracle.handle.remove()
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + max_new
    st = _check_stats(head, ids.shape[1], out)
    if max_new == 1:
        assert st.rounds == 0 and st.plain_steps == 1


def test_eos_stops_inside_accepted_drafts(target):
    head = make_head(target, seed=9)
    ids = prompt_ids(31, 7)
    free = greedy(target, ids, max_new_tokens=20)
    new = free[0, ids.shape[1] :].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 4 and t not in new[:i])  # first occurrence, mid-output
    ref = greedy(target, ids, max_new_tokens=20, eos_token_id=eos)
    assert ref.shape[1] < free.shape[1] and ref[0, -1] == eos
    oracle = Oracle(head, free, p=1.0)  # drafts run past the EOS: transformers must cut there
    out = greedy(
        target, ids, max_new_tokens=20, eos_token_id=eos, assistant_model=head, num_assistant_tokens=6
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)
    _check_stats(head, ids.shape[1], out)


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1))

    def end(self):
        self.ended = True


class _StopOn(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -8:] == self.token).any(dim=-1)


def test_streamer_and_custom_stopping_criteria(target):
    head = make_head(target, seed=10)
    ids = prompt_ids(41, 8)
    free = greedy(target, ids, max_new_tokens=20)
    oracle = Oracle(head, free, p=1.0)
    streamer = _Collect()
    out = greedy(
        target, ids, max_new_tokens=20, assistant_model=head, num_assistant_tokens=4, streamer=streamer
    )
    assert torch.equal(out, free) and streamer.ended
    assert torch.equal(torch.cat(streamer.chunks), out[0])  # prompt, then every emitted chunk in order

    # a custom criterion stops where plain greedy stops (inside a round the oracle keeps whole)
    stop = int(free[0, ids.shape[1] + 6])
    crit = dict(max_new_tokens=20, stopping_criteria=StoppingCriteriaList([_StopOn(stop)]))
    ref = greedy(target, ids, **crit)
    streamer = _Collect()
    out = greedy(target, ids, assistant_model=head, num_assistant_tokens=4, streamer=streamer, **crit)
    oracle.handle.remove()
    assert torch.equal(out, ref) and out.shape[1] < free.shape[1]
    assert torch.equal(torch.cat(streamer.chunks), out[0])


def test_return_dict_with_hidden_states(target, monkeypatch):
    """The output carries the target's cache under the installed transformers' field name, without its
    deprecation warning (5.24 renamed `past_key_values` to `cache`)."""
    import transformers.utils.generic as generic

    from peagle.drafting_peagle import CACHE_KWARG

    head = make_head(target, seed=12)
    ids = prompt_ids(51, 6)
    kw = dict(max_new_tokens=6, return_dict_in_generate=True, output_hidden_states=True, output_scores=True)
    ref = greedy(target, ids, **kw)

    def no_deprecation(message, *args, **kwargs):
        raise AssertionError(message)

    monkeypatch.setattr(generic.logger, "warning_once", no_deprecation)
    out = greedy(target, ids, assistant_model=head, num_assistant_tokens=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == 6 and len(out.hidden_states) == 6
    assert getattr(out, CACHE_KWARG) is not None


# ---------------------------------------------------------------------------------------------- K resolution
def test_num_speculative_tokens_default_and_warning(target, caplog):
    head = make_head(target, seed=13, num_speculative_tokens=3, num_parallel_positions=4)
    ids = prompt_ids(61, 6)
    greedy(target, ids, max_new_tokens=8, assistant_model=head)
    assert head.last_generation_stats.num_speculative_tokens == 3  # head default when not given
    with caplog.at_level(logging.WARNING):
        greedy(target, ids, max_new_tokens=8, assistant_model=head, num_assistant_tokens=6)
        greedy(target, ids, max_new_tokens=8, assistant_model=head, num_assistant_tokens=6)
    assert head.last_generation_stats.num_speculative_tokens == 6
    warned = [r for r in caplog.records if "trained for 4 parallel positions" in r.getMessage()]
    assert len(warned) == 1
    with pytest.raises(ValueError, match=r"expected an integer in \[1, 64\]"):
        greedy(target, ids, max_new_tokens=8, assistant_model=head, num_assistant_tokens=0)
    with pytest.raises(
        ValueError, match=r"num_assistant_tokens \(K\) is 300; expected an integer in \[1, 64\]"
    ):
        greedy(target, ids, max_new_tokens=8, assistant_model=head, num_assistant_tokens=300)


# ---------------------------------------------------------------------------------------------- confidence cut
def test_confidence_threshold_resolution():
    from transformers import GenerationConfig

    # transformers' 0.4 default reads as "not given"
    assert gen.resolve_confidence_threshold(GenerationConfig()) == 0.0
    assert gen.resolve_confidence_threshold(GenerationConfig(assistant_confidence_threshold=0.25)) == 0.25
    assert gen.resolve_confidence_threshold(GenerationConfig(assistant_confidence_threshold=0.0)) == 0.0
    with pytest.raises(ValueError, match="probability"):
        gen.resolve_confidence_threshold(GenerationConfig(assistant_confidence_threshold=1.5))
    # True and "0.5" were converted with float() and ran, while K and draft_tree_size refuse bools and strings
    for bad in (True, "0.5"):
        with pytest.raises(
            ValueError, match=r"assistant_confidence_threshold is .*expected a number in \[0, 1\]"
        ):
            gen.resolve_confidence_threshold(GenerationConfig(assistant_confidence_threshold=bad))


def test_head_default_confidence_threshold(target):
    """A head's `config.confidence_threshold` applies when generate() is not given one; 0.0 turns it off."""
    from transformers import GenerationConfig

    head = make_head(target, seed=21)
    head.config.confidence_threshold = 1.0
    assert gen.resolve_confidence_threshold(GenerationConfig(), head) == 1.0
    assert gen.resolve_confidence_threshold(GenerationConfig(assistant_confidence_threshold=0.0), head) == 0.0
    assert gen.resolve_confidence_threshold(GenerationConfig(assistant_confidence_threshold=0.3), head) == 0.3
    ids = prompt_ids(71, 9)
    ref = greedy(target, ids, max_new_tokens=20)
    out = greedy(target, ids, max_new_tokens=20, assistant_model=head, num_assistant_tokens=4)
    st = head.last_generation_stats
    assert torch.equal(out, ref)
    # every draft is "unsure": one per round
    assert st.confidence_threshold == 1.0 and st.draft_tokens == st.rounds
    out = greedy(
        target,
        ids,
        max_new_tokens=20,
        assistant_model=head,
        num_assistant_tokens=4,
        assistant_confidence_threshold=0.0,
    )
    st = head.last_generation_stats
    assert torch.equal(out, ref) and st.confidence_threshold == 0.0 and st.draft_tokens > st.rounds


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_confidence_threshold_cuts_rounds_losslessly(target, mode):
    k = 5
    head = make_head(target, seed=21, drafting_mode=mode)
    ids = prompt_ids(71, 9)
    ref = greedy(target, ids, max_new_tokens=30)
    seen = {}
    for threshold in (None, 0.5, 1.0):
        oracle = Oracle(head, ref, p=0.7, seed=5)
        kw = {} if threshold is None else {"assistant_confidence_threshold": threshold}
        out = greedy(target, ids, max_new_tokens=30, assistant_model=head, num_assistant_tokens=k, **kw)
        oracle.handle.remove()
        assert torch.equal(out, ref), threshold
        seen[threshold] = st = _check_stats(head, ids.shape[1], out)
        assert st.confidence_threshold == (threshold or 0.0)
    full, half, one = seen[None], seen[0.5], seen[1.0]
    assert full.truncated_rounds <= 2  # only the rounds at the length limit draft fewer than K
    # threshold 1.0: every draft is "unsure", so each round keeps exactly one
    assert one.draft_tokens == one.rounds and one.truncated_rounds >= one.rounds - 2
    # 0.5: oracle hits (p ~ 0.99) continue a round, the random head's guesses (p << 0.5) end it
    assert half.truncated_rounds > 2 and half.rounds < half.draft_tokens < half.rounds * k
    assert half.accepted_tokens > 0
    if mode == "autoregressive":  # a cut round also skips the rest of its drafter passes
        assert one.drafter_forward_calls == one.rounds
        assert half.drafter_forward_calls == half.draft_tokens < full.drafter_forward_calls


# ---------------------------------------------------------------------------------------------- sampling
def _sampling_models(**head_overrides):
    """A 2-layer, 8-token target with logits of order 1 and a head whose draft vocabulary skips ids 3 and 7."""
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    target = make_target(seed=3, vocab_size=8, num_hidden_layers=2, eos_token_id=None, **small)
    head = make_head(target, seed=4, mask_token_id=7, draft_vocab_size=6, **head_overrides)
    head.set_draft_vocab(torch.tensor([0, 1, 2, 4, 5, 6]))
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
        head.lm_head.weight.mul_(3.0)
    return target, head


SAMPLING = dict(do_sample=True, temperature=0.8, top_k=3)


def _sampling_processors() -> LogitsProcessorList:
    return LogitsProcessorList(
        [TemperatureLogitsWarper(SAMPLING["temperature"]), TopKLogitsWarper(SAMPLING["top_k"])]
    )


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_sampled_drafts_come_with_their_distribution(monkeypatch, mode):
    """The scores a drafting round returns with its drafts are exactly the (processed, target-vocabulary)
    distribution each draft was sampled from, given the drafts before it (what a tree's candidates are read from)."""
    target, head = _sampling_models()
    head.config.drafting_mode = mode
    returned, rounds_scores = [], []
    original, original_round = DraftingSession.propose, head.draft_round

    def spy_round(*args, **kwargs):
        draft = original_round(*args, **kwargs)
        rounds_scores.append(draft.scores)
        return draft

    def spy(self, histories, max_drafts, **kwargs):
        rounds_scores.clear()
        candidates = original(self, histories, max_drafts, **kwargs)
        drafts = candidates.tokens
        logits = rounds_scores[0][:, : drafts.shape[1]] if rounds_scores and drafts.shape[1] else None
        if histories:  # one row: its history, then the round's drafts after it
            returned.append((histories[0], torch.cat([histories[0], drafts], dim=1), logits))
        return candidates

    head.draft_round = spy_round
    monkeypatch.setattr(DraftingSession, "propose", spy)
    rec = Recorder(head)
    torch.manual_seed(0)
    for _ in range(4):
        target.generate(torch.tensor([[1, 3, 5, 6, 2]]), max_new_tokens=8, assistant_model=head, **SAMPLING)
    rec.remove()
    rounds = [r for r in returned if r[2] is not None]
    assert rounds
    processors, calls = _sampling_processors(), iter(rec.calls)
    for context, candidates, logits in rounds:
        k = candidates.shape[1] - context.shape[1]
        if mode == "parallel":
            raw = next(calls)["logits"]
        else:
            raw = torch.cat([next(calls)["logits"][:, -1:] for _ in range(k)], dim=1)
        assert logits.shape == (1, k, 8)
        for d in range(k):
            expected = processors(
                candidates[:, : context.shape[1] + d], head.draft_logits_to_target(raw[:, d])
            )
            torch.testing.assert_close(logits[:, d], expected, atol=0, rtol=0)
            token = int(candidates[0, context.shape[1] + d])
            assert torch.isfinite(logits[0, d, token]) and token not in (3, 7)  # drawn from that support
            assert torch.isinf(logits[0, d, [3, 7]]).all()  # -inf outside the draft vocabulary


@pytest.mark.parametrize("tree, mode", [(0, "parallel"), (6, "parallel"), (6, "autoregressive")])
def test_sampling_matches_target_distribution(monkeypatch, tree, mode):
    """Speculative sampling (temperature + top-k, draft vocabulary subset) reproduces the target's own sampling
    distribution: chi-square goodness of fit of 500 samples against the exact probabilities.

    The first new token is forced (`prefix_allowed_tokens_fn`), so every speculative round starts from one
    context; the head drafts from the target's own next-token logits plus noise, so drafts are often but not
    always accepted and both the accept and the resample branch shape the output.  Returning the draft
    logits without the d2t mapping, or uniform logits, fails it (p < 1e-14); subtler mismatches (e.g. a
    temperature left out) are below its power and caught exactly by `test_sampled_drafts_come_with_their_distribution`.
    With `tree=6`, each round verifies a 6-node draft tree by recursive rejection sampling over siblings.
    """
    target, head = _sampling_models(drafting_mode=mode)
    prompt = torch.tensor([[1, 3, 5, 6, 2]])
    forced = torch.cat([prompt, torch.tensor([[3]])], dim=1)

    def allowed(batch_id, ids):
        return [3] if ids.shape[-1] == prompt.shape[1] else list(range(8))

    steps = 3  # after the forced token
    exact = exact_distribution(target, forced, steps, _sampling_processors())
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)

    context = {}
    original = DraftingSession.propose

    def remember_context(self, histories, max_drafts, **kwargs):
        if histories:
            context["ids"] = histories[0]
        return original(self, histories, max_drafts, **kwargs)

    monkeypatch.setattr(DraftingSession, "propose", remember_context)
    draft_ids = torch.arange(6) + head.d2t
    noise = torch.Generator().manual_seed(123)

    def target_like(module, args, kwargs, out):
        with torch.no_grad():
            row = target(context["ids"]).logits[0, -1, draft_ids]
        k = out.logits.shape[1]
        out.logits = row.expand(1, k, -1) + 2.0 * torch.randn(1, k, 6, generator=noise)
        return out

    handle = head.register_forward_hook(target_like, with_kwargs=True)
    torch.manual_seed(1)
    n, counts, accepted, drafted = 500, dict.fromkeys(exact, 0), 0, 0
    for _ in range(n):
        out = target.generate(
            prompt,
            max_new_tokens=steps + 1,
            prefix_allowed_tokens_fn=allowed,
            assistant_model=head,
            num_assistant_tokens=3,
            draft_tree_size=tree,
            **SAMPLING,
        )
        counts[tuple(out[0, forced.shape[1] :].tolist())] += 1
        st = _check_stats(head, prompt.shape[1], out)
        accepted += st.accepted_tokens
        drafted += st.draft_tokens
        assert st.tree_rounds == (st.rounds if tree else 0)
    handle.remove()
    assert 0.05 * drafted < accepted < 0.5 * drafted  # both branches of the rule ran often
    big = [s for s in exact if exact[s] * n >= 5]  # merge cells expected below 5 samples into one
    observed = [counts[s] for s in big] + [n - sum(counts[s] for s in big)]
    expected = [exact[s] * n for s in big] + [n - sum(exact[s] * n for s in big)]
    assert len(big) >= 10
    p_value = scipy_stats.chisquare(observed, expected).pvalue
    assert p_value > 1e-3, p_value


# ---------------------------------------------------------------------------------------------- errors and the hook
def test_unsupported_requests_raise(target):
    head = make_head(target)
    ids = prompt_ids(71, 5)
    with pytest.raises(ValueError, match="num_beams=1; got num_beams=2"):
        target.generate(ids, max_new_tokens=3, num_beams=2, assistant_model=head)
    with pytest.raises(ValueError, match="num_return_sequences"):  # greedy: transformers refuses it itself
        target.generate(ids, max_new_tokens=3, num_return_sequences=2, assistant_model=head)
    with pytest.raises(
        ValueError, match="prompt_lookup_num_tokens.*passed to generate"
    ):  # in a config object
        config = GenerationConfig(max_new_tokens=3, prompt_lookup_num_tokens=3)
        target.generate(ids, generation_config=config, assistant_model=head)

    wide = make_target(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="hidden size 64, target has 32"):
        wide.generate(ids, max_new_tokens=3, assistant_model=head)
    other_vocab = make_target(vocab_size=100, num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="vocab size 128, target has 100"):
        other_vocab.generate(ids % 100, max_new_tokens=3, assistant_model=head)
    deeper = make_target(num_hidden_layers=8)
    with pytest.raises(ValueError, match="4 layers, target has 8"):
        deeper.generate(ids, max_new_tokens=3, assistant_model=head)


def test_version_guard(target, monkeypatch):
    head = make_head(target)
    monkeypatch.setattr(transformers, "__version__", "5.22.0")
    gen_checks._integration_problem.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"transformers 5\.22\.0 .*older than 5\.24"):
            target.generate(prompt_ids(81, 5), max_new_tokens=3, assistant_model=head)
    finally:
        monkeypatch.undo()
        gen_checks._integration_problem.cache_clear()
    assert gen_checks._integration_problem() is None


def test_hook_is_idempotent_and_leaves_other_assistants_alone(target):
    hooked = GenerationMixin.generate
    assert hooked._peagle_hook
    assert peagle.install_generate_hook()
    assert GenerationMixin.generate is hooked
    assert not getattr(hooked.__wrapped__, "_peagle_hook", False)  # wrapped once, not twice

    # an ordinary assistant goes through transformers' own AssistedCandidateGenerator
    torch.manual_seed(0)
    assistant = LlamaForCausalLM(target.config).eval()
    ids = prompt_ids(91, 6)
    ref = greedy(target, ids, max_new_tokens=8)
    seen = []
    dispatch = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        result = dispatch(self, *args, **kwargs)
        seen.append(type(result).__name__)
        return result

    try:
        GenerationMixin._get_candidate_generator = spy
        peagle.uninstall_generate_hook()
        assert GenerationMixin.generate is hooked.__wrapped__
        peagle.install_generate_hook()  # wraps whatever is there, once
        out = greedy(target, ids, max_new_tokens=8, assistant_model=assistant)
    finally:
        GenerationMixin._get_candidate_generator = dispatch
    assert torch.equal(out, ref) and seen == ["AssistedCandidateGenerator"]
    assert GenerationMixin.generate._peagle_hook


# ---------------------------------------------------------------------------------------------- the real target
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_smollm2_greedy_lossless(mode):
    """The embedded SmolLM2-135M target with a random head (and with oracle drafts): plain greedy output."""
    try:
        smol, tokenizer = peagle.load_default_target()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(f"embedded target unavailable: {err}")
    torch.manual_seed(0)
    head = peagle.PEagleDrafter(
        peagle.PEagleConfig.for_target(
            smol.config, num_hidden_layers=1, drafting_mode=mode, confidence_threshold=0.0
        )
    )
    head.eval()
    assert head.config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    for i, text in enumerate(["def fibonacci(n):", "The capital of France is"]):
        ids = tokenizer(text, return_tensors="pt").input_ids
        ref = greedy(smol, ids, max_new_tokens=16)
        oracle = Oracle(head, ref, p=0.8, seed=i) if i == 0 else None
        out = greedy(smol, ids, max_new_tokens=16, assistant_model=head, num_assistant_tokens=5)
        if oracle:
            oracle.handle.remove()
        assert torch.equal(out, ref), text
        st = _check_stats(head, ids.shape[1], out)
        expected_calls = st.rounds if mode == "parallel" else st.draft_tokens
        assert st.drafter_forward_calls == expected_calls
        if oracle:
            assert st.accepted_tokens > 0
