"""What apps run through generate(), with a head exactly as without it: stop strings and stopping criteria (an agent),
a cache passed back turn after turn (a chat) or copied for several questions (a prefilled document), and seeds
that fix sampled tokens whatever the drafting rule chooses."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from helpers import LAYERS, Oracle, make_head, make_target
from peagle.evaluation.bench_batch import left_pad
from peagle.generation.resume import CATCH_UP_SLOTS, STATE_ATTRIBUTE

VOCAB = 101  # the tiny tokenizer's: stop strings are matched on its token strings
MASK = 100


@pytest.fixture(scope="module", params=[2, None], ids=["eos", "no-eos"])
def target(request):
    """With an EOS criterion plain decoding pads a stopped row; without one the row goes on until all stop."""
    return make_target(seed=0, num_hidden_layers=LAYERS, vocab_size=VOCAB, eos_token_id=request.param)


def stop_tokenizer():
    """A word-level tokenizer over the tiny target's whole vocabulary (token `i` reads `w<i>`), with the word
    transformers' `StopStringCriteria` probes a vocabulary with."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        "<pad>": 0,
        "<s>": 1,
        "</s>": 2,
        "abcdef": 3,
        "<unk>": 4,
        **{f"w{i}": i for i in range(5, VOCAB)},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )


def _prompt(seed: int, length: int) -> torch.LongTensor:
    return torch.randint(5, 100, (length,), generator=torch.Generator().manual_seed(seed))


def _rows(n: int, seed: int) -> list[torch.LongTensor]:
    return [_prompt(seed + i, [7, 12, 4, 9, 15, 6, 10, 5][i % 8]) for i in range(n)]


def _head(target, **kw):
    return make_head(target, mask_token_id=MASK, **kw)


def _generate(target, rows, head=None, oracle_p=0.8, **kw):
    """Left-padded batched greedy of `rows`, with `head` drafting from an oracle that knows each row's plain
    continuation (so rounds accept several drafts and the criteria see multi-token rounds)."""
    ids, mask = left_pad(rows)
    kw.setdefault("max_new_tokens", 24)
    if head is None:
        return target.generate(ids, attention_mask=mask, do_sample=False, **kw)
    refs = [target.generate(r[None], do_sample=False, max_new_tokens=kw["max_new_tokens"])[0] for r in rows]
    oracle = Oracle(head, refs, p=oracle_p, seed=len(rows))
    try:
        return target.generate(ids, attention_mask=mask, do_sample=False, assistant_model=head, **kw)
    finally:
        oracle.handle.remove()


class CallRecorder(StoppingCriteria):
    """A stateful criterion: it records every call and stops a row on its `n`-th call after a row's token hits
    `token` (so a criterion called a different number of times, or with other inputs, stops elsewhere)."""

    def __init__(self, token: int, after: int = 1):
        self.token, self.after, self.calls, self.seen = token, after, [], None

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        if self.seen is None:
            self.seen = torch.zeros(input_ids.shape[0], dtype=torch.long)
        self.seen += (input_ids[:, -1] == self.token).long()
        return self.seen >= self.after


# ---------------------------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("tree", [0, 6], ids=["chains", "trees"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_stateful_criterion_sees_plain_decodings_calls(target, batch, tree):
    """Every call plain decoding makes, with the same `(B, prompt + t)` inputs, in the same order; the rows stop
    where plain decoding stops them."""
    rows = _rows(batch, seed=batch)
    free = _generate(target, rows)
    token = int(free[0, -18])  # a token row 0 emits early on (other rows may emit it too, or never)
    plain = CallRecorder(token, after=2)
    ref = _generate(target, rows, stopping_criteria=StoppingCriteriaList([plain]))
    spec = CallRecorder(token, after=2)
    head = _head(target)
    out = _generate(
        target, rows, head, stopping_criteria=StoppingCriteriaList([spec]), num_assistant_tokens=4,
        draft_tree_size=tree,
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert ref.shape[1] < free.shape[1] or batch > 1  # the criterion stopped something
    assert len(spec.calls) == len(plain.calls)
    assert all(torch.equal(a, b) for a, b in zip(spec.calls, plain.calls))
    assert head.last_generation_stats.accepted_tokens > 0  # rounds kept several tokens


@pytest.mark.parametrize("batch", [1, 4])
def test_stop_strings_stop_where_plain_decoding_stops(target, batch):
    tok = stop_tokenizer()
    rows = _rows(batch, seed=20 + batch)
    free = _generate(target, rows)
    stop = tok.convert_ids_to_tokens(int(free[0, -15]))
    kw = dict(stop_strings=[stop, "never-emitted"], tokenizer=tok)
    ref = _generate(target, rows, **kw)
    out = _generate(target, rows, _head(target), num_assistant_tokens=5, **kw)
    assert torch.equal(out, ref)
    assert (
        tok.convert_ids_to_tokens(int(ref[0, -1])) == stop or batch > 1 or target.config.eos_token_id is None
    )


def test_stop_strings_in_a_generation_config(target):
    """Stop strings given in a `GenerationConfig` (as a model's own config may carry them) work like the keyword."""
    from transformers import GenerationConfig

    tok = stop_tokenizer()
    rows = _rows(1, seed=27)
    free = _generate(target, rows)
    config = GenerationConfig(
        stop_strings=[tok.convert_ids_to_tokens(int(free[0, -12]))], max_new_tokens=24, do_sample=False,
        eos_token_id=target.config.eos_token_id, pad_token_id=0,
    )  # fmt: skip
    ids = rows[0][None]
    ref = target.generate(ids, generation_config=config, tokenizer=tok)
    out = target.generate(ids, generation_config=config, tokenizer=tok, assistant_model=_head(target))
    assert torch.equal(out, ref) and ref.shape[1] < free.shape[1]
    assert config.stop_strings is not None  # the caller's config is left as it was


def test_streamer_gets_only_what_the_criteria_kept(target):
    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1))

        def end(self):
            pass

    rows = _rows(1, seed=30)
    free = _generate(target, rows)
    crit = StoppingCriteriaList([CallRecorder(int(free[0, -14]))])
    ref = _generate(target, rows, stopping_criteria=crit)
    streamer = Collect()
    out = _generate(
        target, rows, _head(target), num_assistant_tokens=6, streamer=streamer,
        stopping_criteria=StoppingCriteriaList([CallRecorder(int(free[0, -14]))]),
    )  # fmt: skip
    assert torch.equal(out, ref) and ref.shape[1] < free.shape[1]
    assert torch.equal(torch.cat(streamer.chunks), out[0])


def test_stopped_rows_return_what_plain_returns(target):
    """Scores, logits and hidden states per step end where the criterion stopped the row, as plain decoding's do;
    the criterion gets the scores plain decoding passes it."""
    rows = _rows(2, seed=35)
    free = _generate(target, rows)
    seen = []

    class ScoresSeen(CallRecorder):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(None if scores is None else len(scores))
            return super().__call__(input_ids, scores)

    kw = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)
    ref = _generate(
        target, rows, stopping_criteria=StoppingCriteriaList([ScoresSeen(int(free[0, -14]))]), **kw
    )
    plain_seen, seen[:] = list(seen), []
    out = _generate(
        target, rows, _head(target), num_assistant_tokens=4,
        stopping_criteria=StoppingCriteriaList([ScoresSeen(int(free[0, -14]))]), **kw,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref.sequences) and seen == plain_seen
    assert len(out.scores) == len(ref.scores) == len(out.logits) == len(out.hidden_states)
    assert (
        not (torch.isfinite(out.scores[-1]).sum(dim=-1) > 1).all() or ref.sequences.shape[1] == free.shape[1]
    )
    for a, b in zip(out.scores, ref.scores):
        live = torch.isfinite(a).sum(dim=-1) > 1  # peagle's rows past their end read -inf but at the pad id
        torch.testing.assert_close(a[live], b[live], rtol=1e-4, atol=1e-4)


def test_sampled_stop_cuts_the_seeded_continuation(target):
    """Sampling: a stop string cuts the very sequence the same seed gives without it, right after its first
    occurrence (keyed draws make the tokens before the stop independent of the rounds)."""
    tok = stop_tokenizer()
    head = _head(target)
    ids = _prompt(40, 8)[None]
    kw = dict(
        do_sample=True, temperature=1.5, max_new_tokens=24, assistant_model=head, num_assistant_tokens=4
    )
    torch.manual_seed(5)
    free = target.generate(ids, **kw)
    at = ids.shape[1] + 6
    stop = tok.convert_ids_to_tokens(int(free[0, at]))
    first = next(i for i in range(ids.shape[1], free.shape[1]) if int(free[0, i]) == int(free[0, at]))
    torch.manual_seed(5)
    out = target.generate(ids, stop_strings=[stop], tokenizer=tok, **kw)
    assert torch.equal(out, free[:, : first + 1])


# ---------------------------------------------------------------------------------------------- a cache reused
def _turns(target, head, turns: int = 3, **kw) -> tuple[list[torch.LongTensor], list, DynamicCache]:
    """A chat: each turn's input is the last output plus a new user message; the cache goes back every turn."""
    cache, outs, stats = DynamicCache(config=target.config), [], []
    ids = _prompt(50, 9)[None]
    for turn in range(turns):
        extra = {} if head is None else dict(assistant_model=head, num_assistant_tokens=4)
        out = target.generate(ids, cache=cache, do_sample=False, max_new_tokens=10 + 3 * turn, **kw, **extra)
        outs.append(out)
        stats.append(None if head is None else head.last_generation_stats)
        assert (
            cache.get_seq_length() == out.shape[1] - 1
        )  # what plain decoding leaves: all but the last token
        ids = torch.cat([out, _prompt(60 + turn, 5 + turn)[None]], dim=1)
    return outs, stats, cache


@pytest.mark.parametrize("tree", [0, 6], ids=["chains", "trees"])
def test_chat_passing_its_cache_back_equals_plain(target, tree):
    head = _head(target)
    plain, _, plain_cache = _turns(target, None)
    spec, stats, cache = _turns(target, head, draft_tree_size=tree)
    assert all(torch.equal(a, b) for a, b in zip(spec, plain))
    for a, b in zip(cache.layers, plain_cache.layers):
        torch.testing.assert_close(a.keys, b.keys)
    assert stats[0].cached_tokens == 0
    for before, st in zip(spec, stats[1:]):  # each later turn resumed from the state the turn before left
        assert st.cached_tokens == before.shape[1] - 1 and st.catch_up_tokens == 0


def test_resumed_head_drafts_as_if_the_conversation_were_one_prompt():
    """The state left on the cache is the drafter's whole context: a resumed turn drafts exactly what a head that
    read the whole conversation as one prompt drafts (the drafts, not only the output, are the same)."""
    target = make_target(seed=0, num_hidden_layers=LAYERS, vocab_size=VOCAB)
    head = _head(target)
    drafts = []
    original = head.draft_round

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        drafts.append(out.tokens.clone())
        return out

    head.draft_round = spy
    first = _prompt(70, 8)[None]
    cache = DynamicCache(config=target.config)
    kw = dict(assistant_model=head, num_assistant_tokens=3, do_sample=False, draft_tree_size=0)
    out = target.generate(first, cache=cache, max_new_tokens=6, **kw)
    ids = torch.cat([out, _prompt(71, 4)[None]], dim=1)
    drafts.clear()
    resumed = target.generate(ids, cache=cache, max_new_tokens=12, **kw)
    resumed_drafts = list(drafts)
    drafts.clear()
    whole = target.generate(ids, max_new_tokens=12, **kw)
    assert torch.equal(resumed, whole)
    assert len(resumed_drafts) == len(drafts)
    assert all(torch.equal(a, b) for a, b in zip(resumed_drafts, drafts))


def test_prefilled_document_reused_through_copies(target):
    """A document prefilled by a plain forward, copied for each question: the head catches up on the cache's last
    tokens without touching it, and every answer is plain generate()'s with the same copy."""
    head = _head(target, drafter_window=16)
    doc = _prompt(80, 40)[None]
    prefilled = DynamicCache(config=target.config)
    with torch.no_grad():
        target(doc, cache=prefilled, use_cache=True)
    keys = prefilled.layers[0].keys.clone()
    for q in range(3):
        ids = torch.cat([doc, _prompt(90 + q, 4 + q)[None]], dim=1)
        ref = target.generate(ids, cache=copy.deepcopy(prefilled), do_sample=False, max_new_tokens=12)
        out = target.generate(
            ids, cache=copy.deepcopy(prefilled), do_sample=False, max_new_tokens=12, assistant_model=head
        )
        assert torch.equal(out, ref)
        st = head.last_generation_stats
        assert st.cached_tokens == 40 and st.catch_up_tokens == 16 and st.catch_up_seconds > 0
    assert prefilled.get_seq_length() == 40 and torch.equal(prefilled.layers[0].keys, keys)


def test_copied_cache_carries_the_heads_state(target):
    head = _head(target)
    cache = DynamicCache(config=target.config)
    out = target.generate(
        _prompt(100, 10)[None], cache=cache, do_sample=False, max_new_tokens=8, assistant_model=head
    )
    assert getattr(cache, STATE_ATTRIBUTE) is not None
    ids = torch.cat([out, _prompt(101, 3)[None]], dim=1)
    for _ in range(2):
        copied = copy.deepcopy(cache)
        assert getattr(copied, STATE_ATTRIBUTE).head() is head  # the copy shares the head, not a copy of it
        res = target.generate(ids, cache=copied, do_sample=False, max_new_tokens=8, assistant_model=head)
        assert head.last_generation_stats.catch_up_tokens == 0
        ref = target.generate(ids, cache=copy.deepcopy(cache), do_sample=False, max_new_tokens=8)
        assert torch.equal(res, ref)


def test_stale_or_foreign_state_is_not_used(target):
    """A cache used since without the head, or passed to another head, is caught up on instead."""
    head, other = _head(target), _head(target, seed=5)
    cache = DynamicCache(config=target.config)
    out = target.generate(
        _prompt(110, 10)[None], cache=cache, do_sample=False, max_new_tokens=6, assistant_model=head
    )
    ids = torch.cat([out, _prompt(111, 3)[None]], dim=1)
    ref = target.generate(ids, cache=copy.deepcopy(cache), do_sample=False, max_new_tokens=6)
    res = target.generate(
        ids, cache=copy.deepcopy(cache), do_sample=False, max_new_tokens=6, assistant_model=other
    )
    assert torch.equal(res, ref)
    assert other.last_generation_stats.catch_up_tokens == min(out.shape[1] - 1, CATCH_UP_SLOTS)
    plain_next = target.generate(ids, cache=cache, do_sample=False, max_new_tokens=6)  # plain use in between
    ids2 = torch.cat([plain_next, _prompt(112, 2)[None]], dim=1)
    ref2 = target.generate(ids2, cache=copy.deepcopy(cache), do_sample=False, max_new_tokens=6)
    res2 = target.generate(ids2, cache=cache, do_sample=False, max_new_tokens=6, assistant_model=head)
    assert torch.equal(res2, ref2) and head.last_generation_stats.catch_up_tokens > 0


def test_filled_cache_refusals_name_the_problem(target):
    head = _head(target)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(_prompt(120, 6)[None], cache=cache, use_cache=True)
    ids, mask = left_pad(_rows(2, seed=121))
    with pytest.raises(ValueError, match="batch of 2 prompts"):
        target.generate(ids, attention_mask=mask, cache=cache, assistant_model=head, max_new_tokens=3)
    with pytest.raises(ValueError, match="input_ids hold 6 tokens and the cache already holds 6"):
        target.generate(_prompt(120, 6)[None], cache=cache, assistant_model=head, max_new_tokens=3)


# ---------------------------------------------------------------------------------------------- seeds
def test_seeded_sampling_repeats_whatever_the_rule_chooses(target):
    """The default (cost) rule, fixed K of several sizes, trees, and no head at all in some rounds: the same seed
    gives the same tokens (keyed draws), and another seed gives others."""
    head = make_head(target, mask_token_id=MASK, confidence_threshold=None)
    ids = _prompt(130, 8)[None]
    kw = dict(do_sample=True, temperature=1.3, top_k=40, max_new_tokens=30, assistant_model=head)
    outs = []
    for extra in (
        {},
        {},
        dict(num_assistant_tokens=2),
        dict(num_assistant_tokens=6),
        dict(draft_tree_size=8),
    ):
        torch.manual_seed(3)
        outs.append(target.generate(ids, **kw, **extra))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.manual_seed(4)
    assert not torch.equal(target.generate(ids, **kw), outs[0])


# ---------------------------------------------------------------------------------------------- the README's loops
@pytest.mark.slow
def test_agent_and_chat_loops_on_the_embedded_target_with_the_shipped_head():
    """The README's two loops on SmolLM2-135M with the shipped head, each step against plain generate() doing the
    same: an agent's call that stops on a string, and a chat that passes its cache back for three turns."""
    import peagle

    try:
        target, tok = peagle.load_default_target()
        head = peagle.load_default_drafter(target)
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(f"embedded target or shipped heads unavailable: {err}")
    ids = tok("Question: What is 17 * 23?\nThought:", return_tensors="pt")["input_ids"]
    free = target.generate(ids, max_new_tokens=64, do_sample=False)
    words = tok.decode(free[0, ids.shape[1] + 12 :]).split()
    stop = next(w for w in words if len(w) > 3)  # a word the answer reaches after a dozen tokens
    kw = dict(stop_strings=[stop], tokenizer=tok, max_new_tokens=64, do_sample=False)
    plain = target.generate(ids, **kw)
    out = target.generate(ids, assistant_model=head, **kw)
    assert torch.equal(out, plain) and out.shape[1] < free.shape[1]
    assert tok.decode(out[0, ids.shape[1] :]).endswith(stop)

    sides = {}
    for name, extra in (("plain", {}), ("peagle", dict(assistant_model=head))):
        chat, cache = [{"role": "user", "content": "Name a green tea."}], DynamicCache(config=target.config)
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"]
        turns = []
        for follow_up in ("How do I brew it?", "For how long?", None):
            out = target.generate(
                ids, cache=cache, max_new_tokens=48, do_sample=False, return_dict_in_generate=True, **extra
            )
            turns.append(out.sequences)
            if name == "peagle" and len(turns) > 1:
                assert out.peagle_stats.cached_tokens > 0 and out.peagle_stats.catch_up_tokens == 0
            if follow_up is None:
                break
            answer = tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
            chat.append({"role": "assistant", "content": answer})
            done = len(tok.apply_chat_template(chat)["input_ids"])
            chat.append({"role": "user", "content": follow_up})
            whole = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")[
                "input_ids"
            ]
            ids = torch.cat([out.sequences, whole[:, done:]], dim=1)
        sides[name] = turns
    assert all(torch.equal(a, b) for a, b in zip(sides["plain"], sides["peagle"]))
