"""Cost-aware drafting: the k rule, the cost model and its cache, calibration, and lossless output under any k."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from helpers import LAYERS, Oracle, greedy, make_head, make_target, prompt_ids
from peagle.generation import cost as cost_mod
from peagle.generation import cost_cache
from peagle.generation import decoding as decoding_mod
from peagle.generation import policy as policy_mod
from peagle.generation.calibration import collect_rounds, expected_calibration_error, fit_from_rounds
from peagle.generation.cost import VerifyCostModel
from peagle.generation.policy import CostPolicy
from peagle.generation.rule import choose_num_drafts, expected_tokens


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


def _cost_head(target, mode="parallel", model=None, **kw):
    head = make_head(target, drafting_mode=mode, confidence_threshold=None, **kw)
    head.cost_model = model
    return head


# ---------------------------------------------------------------------------------------------- the rule
def test_rule_matches_brute_force():
    rng = random.Random(0)
    for case in range(600):
        k = rng.randint(1, 8)
        probs = [rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(k)]
        if case % 3 == 0:  # non-monotone curves, as this CPU's BLAS gives (4 tokens cheaper than 3)
            curve = [rng.uniform(0.5, 2.0) for _ in range(k + 1)]
        else:
            curve = [1.0 + rng.uniform(0, 0.3) * n for n in range(k + 1)]
        drafter = rng.choice([0.0, 0.05, 0.3])
        rates = [expected_tokens(probs, j) / (curve[j] + drafter) for j in range(k + 1)]
        best = max(rates)
        chosen = choose_num_drafts(probs, curve, drafter)
        assert rates[chosen] == pytest.approx(best, rel=1e-9)
        assert chosen == min(j for j, r in enumerate(rates) if r >= best * (1 - 1e-9))


def test_rule_extremes():
    assert choose_num_drafts([0.99] * 7, [1.0] * 8) == 7  # flat curve (a GPU): every draft
    assert choose_num_drafts([0.99] * 7, [1.0] + [10.0] * 7) == 0  # verifying is dear: none
    assert choose_num_drafts([0.0] * 3, [1.0, 1.0, 1.0, 1.0]) == 0  # worthless drafts: none (ties -> smaller)
    curve = [1.0, 1.5, 2.0, 1.6]  # 3 drafts cost less than 2
    assert choose_num_drafts([0.9, 0.9, 0.9], curve) == 3


# ---------------------------------------------------------------------------------------------- in generate()
def test_flat_curve_drafts_k_every_round(target):
    """On a flat cost curve (a GPU at batch 1) the rule verifies all K drafts in every round, and never skips the
    drafter while rounds realise more than a plain step's token."""
    head = _cost_head(target, model=VerifyCostModel.flat(max_tokens=8))
    ids = prompt_ids(3, 7)
    ref = greedy(target, ids, max_new_tokens=20)
    oracle = Oracle(head, ref, p=1.0)
    out = greedy(
        target, ids, max_new_tokens=20, assistant_model=head, num_assistant_tokens=4, draft_tree_size=0
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.draft_policy == "cost" and st.rounds > 0
    assert st.chosen_k_histogram[0] == 0 and st.skipped_drafter_rounds == 0 and st.truncated_rounds <= 3
    assert st.draft_tokens == sum(k * n for k, n in enumerate(st.chosen_k_histogram))  # all that were drafted
    assert head.cost_model.verify_seconds == [1.0] * 8  # a user's curve is not refined online


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_dear_verification_falls_back_to_plain_steps(target, mode):
    """When verifying extra tokens costs more than their chance of acceptance (the head's drafts are random), rounds
    verify no draft and the drafter itself is skipped more and more often; the output is plain greedy's."""
    curve = VerifyCostModel([1.0] + [3.0] * 7, drafter_seconds=0.2, drafter_step_seconds=0.2)
    head = _cost_head(target, mode, model=curve)
    ids = prompt_ids(4, 6)
    out = greedy(target, ids, max_new_tokens=40, assistant_model=head, num_assistant_tokens=4)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=40))
    st = head.last_generation_stats
    assert st.rounds == 0 and st.declined_rounds > 0 and st.skipped_drafter_rounds > st.declined_rounds
    assert st.plain_steps == 40 and st.drafter_forward_calls < 40


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
@pytest.mark.parametrize("rows", [1, 3])
def test_drafting_that_cannot_pay_even_at_best_never_runs_the_drafter(target, mode, rows):
    """Where verifying 2 tokens already costs 50 plain steps, even drafts that are always right (the oracle's)
    cannot pay: the call never runs the drafter, takes no probe, and every step is a plain one."""
    curve = VerifyCostModel([1.0] + [50.0] * 7, drafter_seconds=0.2, drafter_step_seconds=0.2)
    head = _cost_head(target, mode, model=curve)
    ids = torch.cat([prompt_ids(4 + b, 6) for b in range(rows)])
    ref = greedy(target, ids, max_new_tokens=30)
    oracle = Oracle(head, list(ref), p=1.0)
    try:
        out = greedy(target, ids, max_new_tokens=30, assistant_model=head, num_assistant_tokens=4)
    finally:
        oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert (
        st.drafter_forward_calls == 0 and st.rounds == 0 and st.declined_rounds == 0 and st.probe_steps == 0
    )
    # every step skipped the drafter but the prefill and the last (no room left for a draft)
    assert st.skipped_drafter_rounds == 28 and st.plain_steps == 30 * rows
    # where the best case pays (verifying 5 tokens costs 2 plain steps), the same drafts are verified
    head.cost_model = VerifyCostModel([1.0] + [2.0] * 7, drafter_seconds=0.2, drafter_step_seconds=0.2)
    oracle = Oracle(head, list(ref), p=1.0)
    try:
        out = greedy(target, ids, max_new_tokens=30, assistant_model=head, num_assistant_tokens=4)
    finally:
        oracle.handle.remove()
    assert torch.equal(out, ref) and head.last_generation_stats.rounds > 0


def test_autoregressive_unroll_stops_when_a_pass_does_not_pay(target):
    """An EAGLE-3 head under the cost rule stops unrolling once one more drafter pass costs more than it can
    return: with a dear drafter step and cheap verification it drafts one token per round."""
    cheap_verify = VerifyCostModel([1.0] * 8, drafter_seconds=0.01, drafter_step_seconds=5.0)
    head = _cost_head(target, "autoregressive", model=cheap_verify)
    ids = prompt_ids(5, 6)
    out = greedy(target, ids, max_new_tokens=12, assistant_model=head, num_assistant_tokens=4)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=12))
    st = head.last_generation_stats
    assert st.rounds > 0 and st.drafter_forward_calls == st.rounds + st.skipped_drafter_rounds * 0


@pytest.mark.parametrize("tree", [0, 12])
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lossless_under_any_k_and_skips(target, monkeypatch, mode, seed, tree):
    """Whatever k (chains) or tree size the rule picks and whenever it skips the drafter (its cache then catches
    up in one pass), greedy output is plain greedy's; oracle drafts make rounds accept 0..K tokens."""
    rng = random.Random(seed)
    calls = []

    def random_choice(self, plan, drafts, drafter):
        calls.append(1)
        width = min(len(t.values) for t in drafts.trees) if drafts.trees else len(drafts.confidences)
        k = 0 if len(calls) % 4 == 1 else rng.randint(1, width)
        histogram = self.stats.tree_size_histogram if drafts.trees else self.stats.chosen_k_histogram
        histogram[k] += 1
        if rng.random() < 0.3:
            self._skip_left = rng.randint(1, 3)
        return k

    monkeypatch.setattr(CostPolicy, "_choose", random_choice)
    head = _cost_head(target, mode, model=VerifyCostModel.flat(max_tokens=8))
    ids = prompt_ids(10 + seed, 8)
    ref = greedy(target, ids, max_new_tokens=48)
    oracle = Oracle(head, ref, p=0.8, seed=seed)
    out = greedy(
        target, ids, max_new_tokens=48, assistant_model=head, num_assistant_tokens=5, draft_tree_size=tree
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    chosen = st.tree_size_histogram if tree else st.chosen_k_histogram
    assert st.skipped_drafter_rounds > 0 and st.accepted_tokens > 0 and chosen[0] > 0
    assert st.tree_rounds == (st.rounds if tree else 0)
    assert st.generated_tokens == 48 == st.accepted_tokens + st.rounds + st.plain_steps


def test_explicit_cuts_keep_their_meaning(target):
    """A head whose default is the cost rule still drafts exactly K every round with an explicit 0.0, and applies
    transformers' confidence rule with an explicit threshold."""
    head = _cost_head(target, model=VerifyCostModel([1.0] + [50.0] * 7))
    ids = prompt_ids(6, 6)
    kw = dict(max_new_tokens=16, assistant_model=head, num_assistant_tokens=3)
    greedy(target, ids, assistant_confidence_threshold=0.0, **kw)
    st = head.last_generation_stats
    # K every round but the last ones, where the length limit leaves room for fewer
    assert st.draft_policy == "fixed" and st.truncated_rounds <= 2 and st.draft_tokens >= 3 * (st.rounds - 2)
    greedy(target, ids, assistant_confidence_threshold=1.0, **kw)
    st = head.last_generation_stats
    assert st.draft_policy == "threshold" and st.draft_tokens == st.rounds  # every draft is "unsure"
    greedy(target, ids, **kw)
    assert head.last_generation_stats.draft_policy == "cost"


# ---------------------------------------------------------------------------------------------- the cost model
def test_cost_model_key_and_cache(target, monkeypatch, tmp_path):
    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path))
    cost_mod.forget_cost_models()
    head = make_head(target)
    key = cost_mod.cost_model_key(target, head)
    assert {"target", "device", "dtype", "threads", "drafter"} <= set(key)
    assert cost_mod.cost_model_key(target.to(torch.bfloat16), head)["dtype"] == "bfloat16"
    target.to(torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other = cost_mod.cost_model_key(target, head)
    finally:
        torch.set_num_threads(threads)
    assert other != key and cost_mod.cost_cache_path(other) != cost_mod.cost_cache_path(key)

    model = cost_mod.cost_model_for(target, head, max_tokens=4)
    assert model.source == "calibrated" and len(model.verify_seconds) == 4 and model.drafter_seconds > 0
    path = cost_mod.cost_cache_path(key)
    assert path.parent == tmp_path and json.loads(path.read_text())["key"] == key
    assert cost_mod.cost_model_for(target, head, max_tokens=4) is model  # this process: the same object
    cost_mod.forget_cost_models()

    def no_measuring(*a, **k):
        raise AssertionError("the cached curve should have been used")

    monkeypatch.setattr(cost_mod, "measure_cost_model", no_measuring)
    again = cost_mod.cost_model_for(target, head, max_tokens=4)
    assert again.source == "cache" and again.verify_seconds == model.verify_seconds
    head.cost_model = VerifyCostModel.flat()  # a user's override wins
    assert cost_mod.cost_model_for(target, head) is head.cost_model
    cost_mod.forget_cost_models()


@pytest.mark.parametrize("where", ["file", "directory", "read-only"])
def test_unwritable_cost_cache_warns_once_and_generation_goes_on(target, monkeypatch, tmp_path, where):
    """A cache is an optimisation: a cache that cannot be written keeps the curve in memory, warns once naming
    the path, and never fails `generate()`."""
    head = _cost_head(target)
    root = tmp_path / "cache"
    if where == "file":  # PEAGLE_COST_CACHE names a file
        root.write_text("not a folder")
    else:
        root.mkdir()
        if where == "directory":  # a folder where the JSON should be
            monkeypatch.setenv("PEAGLE_COST_CACHE", str(root))
            cost_mod.cost_cache_path(cost_mod.cost_model_key(target, head)).mkdir()
        else:
            root.chmod(0o500)
    monkeypatch.setenv("PEAGLE_COST_CACHE", str(root))
    cost_mod.forget_cost_models()
    cost_cache._UNWRITABLE.clear()
    if where == "read-only":
        probe = root / "probe"
        try:
            probe.write_text("x")
        except OSError:
            pass
        else:  # root writes read-only folders: a folder nobody can create instead (/proc refuses new entries)
            probe.unlink()
            if not Path("/proc/self").is_dir():
                pytest.skip("no read-only folder to test with as this user")
            root.chmod(0o700)
            root = Path("/proc/self/peagle-cost-cache")
            monkeypatch.setenv("PEAGLE_COST_CACHE", str(root))
    path = cost_mod.cost_cache_path(cost_mod.cost_model_key(target, head))
    try:
        with pytest.warns(RuntimeWarning, match="could not write its verify-cost cache") as record:
            model = cost_mod.cost_model_for(target, head, max_tokens=3)
        assert str(path) in str(record[0].message) and model.source == "calibrated"
        cost_mod.forget_cost_models()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per path, not once per call
            cost_mod.cost_model_for(target, head, max_tokens=3)
        cost_mod.forget_cost_models()
        ids = prompt_ids(1, 12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = target.generate(ids, assistant_model=head, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, greedy(target, ids, max_new_tokens=6))
        assert where == "read-only" or not list(root.parent.rglob("*.tmp"))  # no temporary file left behind
    finally:
        if where == "read-only":
            (tmp_path / "cache").chmod(0o700)
        cost_mod.forget_cost_models()


def test_online_factors_correct_the_curve_and_fill_in_between():
    """The measured curve stays as timed; per n, an online factor (a running mean in log space at first)
    carries what the machine realises, and an n never observed takes its observed neighbours' factors."""
    model = VerifyCostModel([1.0, 1.5, 2.0], smoothing=0.5, source="calibrated", context=256)
    model.observe_verify(1, 2.0)  # this machine is twice as slow as calibrated: first sample, weight 1/2
    assert model.factor(1) == pytest.approx(2**0.5) and model.verify_seconds == [1.0, 1.5, 2.0]
    assert model.cost(2) == pytest.approx(1.5 * 2**0.5) and model.cost(3) == pytest.approx(2.0 * 2**0.5)
    model.observe_verify(3, 1.0)  # n = 3 starts from its neighbour's factor and moves half-way to 0.5
    assert model.factor(3) == pytest.approx(2**-0.25) and model.observations == [1, 0, 1]
    assert model.factor(2) == pytest.approx(2**0.125)  # log-interpolated between n = 1 and n = 3
    assert model.cost(5) > model.cost(3)  # extrapolated
    with pytest.raises(ValueError, match="positive seconds"):
        VerifyCostModel([0.0])
    assert VerifyCostModel.from_dict(model.to_dict()) == model
    model.reset_online()
    assert model.cost(3) == 2.0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"verify_seconds": [True, 1.0]}, "verify_seconds must be positive seconds"),
        ({"verify_seconds": ["1.0"]}, "verify_seconds must be positive seconds"),
        ({"verify_seconds": [1.0, float("inf")]}, "verify_seconds must be positive seconds"),
        ({"verify_seconds": []}, "verify_seconds must be positive seconds"),
        ({"verify_seconds": "1.0"}, "verify_seconds must be positive seconds"),
        ({"smoothing": 5}, r"smoothing must be a weight in \(0, 1\]"),
        ({"smoothing": 0}, "smoothing must be a weight"),
        ({"smoothing": -0.1}, "smoothing must be a weight"),
        ({"smoothing": True}, "smoothing must be a weight"),
        ({"drafter_seconds": -1.0}, "drafter_seconds must be seconds >= 0"),
        ({"drafter_seconds": True}, "drafter_seconds must be seconds >= 0"),
        ({"drafter_step_seconds": float("nan")}, "drafter_step_seconds must be seconds >= 0"),
        ({"observations": [1, -2, 0]}, "observations must be counts"),
        ({"observations": [1, True, 0]}, "observations must be counts"),
        ({"key": []}, "key must be a dict"),
    ],
)
def test_cost_model_refuses_values_a_cache_file_cannot_mean(change, words):
    """`true` as seconds or a smoothing of 5 were accepted and turned the curve negative."""
    data = {**VerifyCostModel([1.0, 1.5, 2.0], source="calibrated").to_dict(), **change}
    with pytest.raises(ValueError, match=words):
        VerifyCostModel.from_dict(data)


def test_a_smoothing_of_one_follows_the_last_measurement():
    model = VerifyCostModel([1.0, 2.0], smoothing=1, source="calibrated")
    model.observe_verify(1, 3.0)
    assert model.cost(1) == pytest.approx(3.0) and model.cost(2) > 0


# ---------------------------------------------------------------------------------------------- calibration
def test_calibration_lowers_heldout_error():
    """Confidences that overstate acceptance (true probability = confidence^3) are mapped close to the truth:
    the held-out ECE drops."""
    rng = random.Random(0)
    rounds = []
    for _ in range(3000):
        conf = [rng.random() for _ in range(3)]
        accepted = 0
        for c in conf:
            if rng.random() < c**3:
                accepted += 1
            else:
                break
        rounds.append((conf, accepted))
    result = fit_from_rounds(rounds)
    before, after = result["report"]["ece_before"], result["report"]["ece_after"]
    assert before[0] > 0.15 and after[0] < before[0] / 3 and after[1] < before[1]
    cal = result["calibration"]
    assert cal["method"] == "isotonic" and all(y == sorted(y) for y in cal["y"])
    assert expected_calibration_error([0.5], [1]) == 0.5


def test_collect_rounds_records_every_round(target):
    head = make_head(target)
    ids = prompt_ids(8, 6)
    ref = greedy(target, ids, max_new_tokens=30)
    oracle = Oracle(head, ref, p=0.7, seed=3)
    rounds = collect_rounds(head, target, [ids], num_speculative_tokens=4, max_new_tokens=30, progress=False)
    oracle.handle.remove()
    st = head.last_generation_stats
    assert len(rounds) == st.rounds and sum(a for _, a in rounds) == st.accepted_tokens
    assert all(len(c) <= 4 and all(0 <= x <= 1 for x in c) for c, _ in rounds)
    assert not hasattr(head, "round_recorder")  # the rounds come through the call's observer, not the head


def test_a_round_observer_sees_every_verified_chain_round(target):
    """`generate(..., round_observer=fn)` reports each row's verified chain round (the head's confidence in each
    draft, the drafts accepted) to the call's observer, the way `peagle calibrate` collects its rounds."""
    head = make_head(target)
    ids = prompt_ids(8, 6)
    ref = greedy(target, ids, max_new_tokens=30)
    oracle = Oracle(head, ref, p=0.7, seed=3)
    seen = []
    out = greedy(
        target,
        ids,
        max_new_tokens=30,
        assistant_model=head,
        num_assistant_tokens=4,
        assistant_confidence_threshold=0.0,
        round_observer=lambda confidences, accepted: seen.append((confidences, accepted)),
    )
    oracle.handle.remove()
    st = head.last_generation_stats
    assert torch.equal(out, ref)
    assert len(seen) == st.rounds > 0 and sum(a for _, a in seen) == st.accepted_tokens
    assert all(1 <= len(c) <= 4 and 0 <= a <= len(c) for c, a in seen)


@pytest.mark.parametrize(
    "threshold, policy",
    [(0.0, policy_mod.FixedPolicy), (0.3, policy_mod.ThresholdPolicy), (None, CostPolicy)],
)
def test_each_call_runs_the_policy_its_threshold_selects(target, threshold, policy, monkeypatch):
    """One policy object per call, by the threshold: 0.0 fixed, t > 0 the cut, none the cost rule."""
    made = []
    original = policy_mod.make_policy

    def spy(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("peagle.generation.drafting.make_policy", spy)
    head = _cost_head(target, model=VerifyCostModel.flat(max_tokens=8))
    head.config.confidence_threshold = threshold
    greedy(target, prompt_ids(8, 6), max_new_tokens=6, assistant_model=head, num_assistant_tokens=3)
    assert [type(p) for p in made] == [policy]
    assert head.last_generation_stats.draft_policy == made[0].settings.policy


def test_overconfident_calibration_is_corrected_by_the_rounds_verified():
    """A calibration that promises 0.9 at every depth for drafts that are never accepted (a random head): the
    rounds verified teach the rule otherwise, and it stops verifying drafts; with the promise taken at face value
    it would verify drafts in every round. The output stays plain greedy's."""
    target = make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)
    curve = VerifyCostModel([1.0 + 0.2 * n for n in range(8)], drafter_seconds=0.01)
    head = _cost_head(target, model=curve)
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.9, 0.9]]}
    ids = prompt_ids(6, 6)
    out = greedy(
        target, ids, max_new_tokens=80, assistant_model=head, num_assistant_tokens=4, draft_tree_size=0
    )
    assert torch.equal(out, greedy(target, ids, max_new_tokens=80))
    st = head.last_generation_stats
    assert st.accepted_tokens <= 2  # a random head: drafts (almost) never accepted
    # about ten rejections outweigh the promise; every round would verify drafts without the correction
    assert st.rounds < 30 and st.declined_rounds + st.skipped_drafter_rounds > 45
    assert choose_num_drafts([0.9] * 4, curve.curve(5), 0.01) == 4  # what the uncorrected promise would pick


def test_correction_learns_the_acceptance_the_rounds_show():
    """A calibration that promises 0.9 per depth for drafts accepted half the time (oracle, p = 0.5): under a flat
    cost curve every round verifies K drafts, and the corrected prediction must come to match what the rounds
    realise.  Fed its own corrected predictions, the correction would settle at the square root of the right
    factor (0.75 instead of 0.56 at each depth) and keep overpromising by about a third."""
    target = make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)
    head = _cost_head(target, model=VerifyCostModel.flat(16, drafter_seconds=0.0))
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.9, 0.9]]}
    ids = prompt_ids(3, 6)
    ref = greedy(target, ids, max_new_tokens=400)
    oracle = Oracle(head, ref, p=0.5, seed=0)
    out = greedy(
        target, ids, max_new_tokens=400, assistant_model=head, num_assistant_tokens=4, draft_tree_size=0
    )
    oracle.handle.remove()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.rounds > 150 and st.declined_rounds + st.skipped_drafter_rounds == 0
    assert st.predicted_tokens / st.realised_tokens < 1.12, (st.predicted_tokens, st.realised_tokens)


# ---------------------------------------------------------------------------------------------- context and batch
class FakeMachine:
    """A machine where a target pass over n tokens per row after L cached tokens, for B rows, costs
    `verify(n, L, B)` seconds and a drafter forward `drafter` seconds: forward hooks advance the clock the
    decoding loop times its passes with (`_Decoder.clock`), so the cost rule sees these costs whatever the CPU does."""

    def __init__(self, target, head, verify, drafter=0.01, on_pass=None):
        self.now, self.verify, self.drafter, self.on_pass = 0.0, verify, drafter, on_pass
        self.passes: list[int] = []  # tokens per row of every target pass
        self.handles = [
            target.register_forward_pre_hook(self._target, with_kwargs=True),
            head.register_forward_pre_hook(self._draft),
        ]

    def _target(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        context = cache.get_seq_length() if cache is not None else 0
        self.now += self.verify(ids.shape[1], context, ids.shape[0])
        self.passes.append(ids.shape[1])
        if self.on_pass is not None:
            self.on_pass(len(self.passes))

    def _draft(self, *_):
        self.now += self.drafter

    def clock(self) -> float:
        return self.now

    def close(self):
        for h in self.handles:
            h.remove()


def test_a_cost_that_grows_with_the_context_changes_the_choice(target):
    """Verifying 9 tokens costs little after a short prompt and far more after a long one (as on a CPU): the same
    always-right drafts are verified after a short prompt and not after a long one."""
    model = VerifyCostModel(
        [1.0] * 9,
        context=16,
        context_points=[{"context": 64, "n": [1, 2, 9], "seconds": [1.0, 6.0, 9.0], "drafter_seconds": 0.0}],
    )
    assert model.cost(9, 16) == 1.0 and model.cost(9, 40) == pytest.approx(5.0)
    assert model.cost(9, 112) == pytest.approx(17.0)  # beyond the last point: along its last segment
    assert model.cost(1, 112) == 1.0 and model.cost(5, 64) == pytest.approx(
        6.0 + 3.0 * 3 / 7
    )  # n interpolated at a point
    head = _cost_head(target, model=model)
    for length, drafts in [(8, True), (100, False)]:
        ids = prompt_ids(21, length)
        ref = greedy(target, ids, max_new_tokens=20)
        oracle = Oracle(head, ref, p=1.0)
        out = greedy(target, ids, max_new_tokens=20, assistant_model=head, num_assistant_tokens=8)
        oracle.handle.remove()
        assert torch.equal(out, ref)
        st = head.last_generation_stats
        assert (st.rounds > 0 and st.declined_rounds == 0) if drafts else st.rounds == 0, (length, st)


def test_a_cost_that_grows_with_the_batch_changes_the_choice(target, monkeypatch, tmp_path):
    """Each batch size has its own curve: where verifying drafts for 4 rows costs 20 plain steps, a batch of 4
    verifies none of the drafts a single row verifies."""
    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path))
    cost_mod.forget_cost_models()

    def truth(n, context, rows):
        return 1.0 if rows == 1 or n == 1 else 20.0

    def measured(target, head=None, max_tokens=11, batch_size=1, budget=None, **kw):
        curve = [truth(n, 256, batch_size) for n in range(1, max_tokens + 1)]
        return VerifyCostModel(
            curve, key=cost_mod.cost_model_key(target, head, batch_size), source="calibrated", context=256
        )

    monkeypatch.setattr(cost_mod, "measure_cost_model", measured)
    monkeypatch.setattr(cost_mod, "measure_quick_cost_model", measured)
    head = _cost_head(target)
    machine = FakeMachine(target, head, truth, drafter=0.0)
    monkeypatch.setattr(decoding_mod._Decoder, "clock", staticmethod(machine.clock))
    try:
        ids = torch.cat([prompt_ids(30 + b, 8) for b in range(4)])
        for rows, drafts in [(1, True), (4, False)]:
            ref = greedy(target, ids[:rows], max_new_tokens=16)
            oracle = Oracle(head, ref, p=1.0)
            out = greedy(target, ids[:rows], max_new_tokens=16, assistant_model=head, num_assistant_tokens=4)
            oracle.handle.remove()
            assert torch.equal(out, ref)
            st = head.last_generation_stats
            assert st.batch_size == rows and (st.rounds > 0 if drafts else st.rounds == 0), (rows, st)
            assert any(f"B={rows} " in k for k in st.seconds_by_context)
        assert len(list(tmp_path.glob("*.json"))) == 2  # one curve per batch size, online figures included
    finally:
        machine.close()
        cost_mod.forget_cost_models()


def test_a_curve_timed_under_load_is_corrected_within_one_call(target, monkeypatch):
    """The cached curve says a plain step costs as much as verifying 9 tokens (timed while another job ran); on
    this (fake, idle) machine verifying n tokens costs 1 + (n - 1) / 2 plain steps and half the drafts are right.
    Taken as cached, the curve makes the rule verify 9 tokens every round, at 2.5x the time of plain decoding;
    within one call the online factors learn the real costs, and the call is no slower than plain decoding."""
    truth = lambda n, context, rows: 1.0 + 0.5 * (n - 1)  # noqa: E731
    model = VerifyCostModel([3.0] * 9, drafter_seconds=0.2, source="cache", context=256)
    head = _cost_head(target, model=model)
    machine = FakeMachine(target, head, truth, drafter=0.2)
    monkeypatch.setattr(decoding_mod._Decoder, "clock", staticmethod(machine.clock))
    try:
        ids = prompt_ids(40, 8)
        start = machine.now
        ref = greedy(target, ids, max_new_tokens=200)
        plain_seconds, start = machine.now - start, machine.now
        oracle = Oracle(head, ref, p=0.5, seed=4)
        out = greedy(
            target, ids, max_new_tokens=200, assistant_model=head, num_assistant_tokens=8, draft_tree_size=0
        )
        head_seconds = machine.now - start
        oracle.handle.remove()
    finally:
        machine.close()
    assert torch.equal(out, ref)
    assert model.verify_seconds == [3.0] * 9  # the timed curve stays; the factors correct it
    seen = [n for n, count in enumerate(model.observations, 1) if count >= 3]
    assert 1 in seen and all(model.cost(n) == pytest.approx(truth(n, 0, 1), rel=0.15) for n in seen)
    assert head_seconds <= plain_seconds, (head_seconds, plain_seconds)


def test_plain_steps_are_probed_when_the_rule_always_drafts(target, monkeypatch):
    """Where every round drafts, a plain step is still measured now and then (its cost is what every round is
    compared with): within the first passes while the curve has few plain-step observations."""
    model = VerifyCostModel([1.0] * 9, source="cache", context=256)
    head = _cost_head(target, model=model)
    machine = FakeMachine(target, head, lambda n, context, rows: 1.0, drafter=0.0)
    monkeypatch.setattr(decoding_mod._Decoder, "clock", staticmethod(machine.clock))
    try:
        ids = prompt_ids(42, 8)
        ref = greedy(target, ids, max_new_tokens=40)
        oracle = Oracle(head, ref, p=1.0)
        out = greedy(target, ids, max_new_tokens=40, assistant_model=head, num_assistant_tokens=4)
        oracle.handle.remove()
    finally:
        machine.close()
    assert torch.equal(out, ref)
    st = head.last_generation_stats
    assert st.probe_steps >= 1 and model.observations[0] >= 1 and st.rounds > 0


def test_drafting_that_stops_paying_stops_and_comes_back(target, monkeypatch):
    """The calibration promises 0.9 per draft; for the first 60 passes no draft is accepted, then every one is.
    The rule goes by what rounds realise: it stops drafting within a few rounds and drafts again soon after the
    drafts come right."""
    truth = lambda n, context, rows: 1.0 + 0.1 * (n - 1)  # noqa: E731
    head = _cost_head(
        target, model=VerifyCostModel([truth(n, 0, 1) for n in range(1, 10)], drafter_seconds=0.1)
    )
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.9, 0.9]]}
    ids = prompt_ids(41, 8)
    ref = greedy(target, ids, max_new_tokens=160)
    oracle = Oracle(head, ref, p=0.0, seed=5)

    def switch(count):
        if count == 60:
            oracle.p = [1.0]

    machine = FakeMachine(target, head, truth, drafter=0.1, on_pass=switch)
    monkeypatch.setattr(decoding_mod._Decoder, "clock", staticmethod(machine.clock))
    try:
        out = greedy(
            target, ids, max_new_tokens=160, assistant_model=head, num_assistant_tokens=8, draft_tree_size=0
        )
    finally:
        machine.close()
        oracle.handle.remove()
    assert torch.equal(out, ref)
    early, late = machine.passes[1:60], machine.passes[60:]
    assert sum(n > 1 for n in early) <= 7, early  # wrong drafts: probes 1, 2, 4, 8, 16 steps apart
    assert late[16:] and sum(n > 1 for n in late[16:]) >= len(late[16:]) // 2, late  # right again: drafting
    st = head.last_generation_stats
    assert st.skipped_drafter_rounds > 0 and st.accepted_tokens > 0


def _rows_that_end(target):
    """Four prompts and an EOS token that ends their rows at different steps (one row never): `(ids, the rows'
    free-running tokens, eos, generate kwargs, plain batched greedy's output)`."""
    ids = torch.cat([prompt_ids(50 + b, 8) for b in range(4)])
    free = greedy(target, ids, max_new_tokens=30)[:, 8:]
    eos = next(
        t
        for t in range(3, 127)
        if len({row.tolist().index(t) for row in free if t in row.tolist()}) >= 2
        and sum(t in row.tolist()[:24] for row in free) in (2, 3)
    )
    kw = dict(max_new_tokens=30, eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones_like(ids))
    return ids, free, eos, kw, greedy(target, ids, **kw)


def _greedy_counting_rows(target, ids, head, kw):
    """peagle's greedy output and the rows of every target pass it ran."""
    shapes = []
    hook = target.register_forward_pre_hook(
        lambda m, a, k: shapes.append(k["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        return greedy(target, ids, assistant_model=head, num_assistant_tokens=4, **kw), shapes
    finally:
        hook.remove()


def test_ended_rows_stay_idle_where_a_pass_is_cheaper_with_them(target):
    """A CPU's matrix kernels can take longer for 3 rows than for 4: with measured plain steps of 1.0 s for 4 rows,
    2.0 s for 2 or 3 and 0.5 s for 1, rows that end at EOS stay in the batch (idle, their tokens never output)
    while 2 or 3 rows still decode, and leave once one does.  Every row is plain batched greedy's."""
    ids, free, eos, kw, ref = _rows_that_end(target)
    model = VerifyCostModel(
        [1.0] * 6, source="cache", context=256, row_seconds={"4": 1.0, "3": 2.0, "2": 2.0, "1": 0.5}
    )
    head = _cost_head(target, model=model)
    oracle = Oracle(head, [torch.cat([ids[b], free[b]]) for b in range(4)], p=0.6, seed=6)
    try:
        out, shapes = _greedy_counting_rows(target, ids, head, kw)
    finally:
        oracle.handle.remove()
    assert torch.equal(out, ref)
    assert (
        set(shapes) <= {4, 1} and 4 in shapes
    )  # never 2 or 3 rows: ended rows stayed idle until one was left
    st = head.last_generation_stats
    emitted = [row.tolist().index(eos) + 1 if eos in row.tolist() else 30 for row in ref[:, 8:]]
    assert 1 in shapes and st.generated_tokens == sum(emitted)  # idle rows' tokens count nowhere
    assert st.generated_tokens == st.accepted_tokens + st.rounds + st.plain_steps


def test_a_catch_up_that_cannot_pay_is_not_run(target, monkeypatch):
    """The drafter's first round catches up on the whole prompt.  Where drafting did not pay after this context in
    an earlier call, a call with few tokens left to win it back skips the drafter altogether; with many tokens
    left it drafts (and so would learn if drafting pays after all)."""
    # verifying n tokens costs (n + 1) / 2 plain steps: always-right drafts would pay, never-right ones do not
    model = VerifyCostModel([1.0 + n / 2 for n in range(9)], drafter_seconds=0.1, source="cache", context=256)
    head = _cost_head(target, model=model)
    machine = FakeMachine(target, head, lambda n, context, rows: 1.0 + (n - 1) / 2, drafter=0.0)
    slot_cost = head.register_forward_pre_hook(
        lambda m, a, k: setattr(machine, "now", machine.now + 0.01 * k["input_ids"].shape[1]),
        with_kwargs=True,
    )
    monkeypatch.setattr(decoding_mod._Decoder, "clock", staticmethod(machine.clock))
    ids = prompt_ids(60, 300)
    try:
        ref = greedy(target, ids, max_new_tokens=40)
        oracle = Oracle(head, ref, p=0.0)  # drafts never right: drafting does not pay here
        for new_tokens, drafts in [(40, True), (12, False), (120, True)]:
            out = greedy(target, ids, max_new_tokens=new_tokens, assistant_model=head, num_assistant_tokens=4)
            assert torch.equal(out, greedy(target, ids, max_new_tokens=new_tokens))
            st = head.last_generation_stats
            assert (st.drafter_forward_calls > 0) == drafts, (new_tokens, st)
        assert model.drafter_slot_seconds == pytest.approx(0.01, rel=0.2)
        assert model.remembered_pays(300) < 1.0 and model.remembered_pays(5000) == model.remembered_pays(300)
        # a drafter window catches up on its last W slots only: cheap enough to look again with few tokens left
        out = greedy(
            target, ids, max_new_tokens=12, assistant_model=head, num_assistant_tokens=4, drafter_window=16
        )
        assert torch.equal(out, greedy(target, ids, max_new_tokens=12))
        assert head.last_generation_stats.drafter_forward_calls > 0
    finally:
        slot_cost.remove()
        machine.close()
        oracle.handle.remove()


def test_a_longer_context_is_timed_once_when_a_call_first_reaches_it(target, monkeypatch, tmp_path):
    """A call whose context lies well beyond the timed ones first times a context point (on a lengthened copy
    of a short cache, no long prefill); the point is cached with the curve, and the next call reuses it."""
    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path))
    cost_mod.forget_cost_models()
    head = _cost_head(target)
    ids = prompt_ids(70, 420)
    try:
        for first in (True, False):
            out = greedy(target, ids, max_new_tokens=6, assistant_model=head, num_assistant_tokens=4)
            assert torch.equal(out, greedy(target, ids, max_new_tokens=6))
            st = head.last_generation_stats
            assert (st.cost_timing_seconds > 0) == first
        (path,) = tmp_path.glob("*.json")
        saved = VerifyCostModel.from_dict(json.loads(path.read_text()))
        limit = 512 - len(saved.verify_seconds)  # the tiny target's 512 positions less the tokens verified
        assert [p["context"] for p in saved.context_points] == [limit]
        assert saved.context_points[0]["n"] == cost_mod.context_point_tokens(len(saved.verify_seconds))
        assert sum(saved.observations) > 0  # the calls' online figures went to the file too
    finally:
        cost_mod.forget_cost_models()


@pytest.mark.parametrize("bad", ["curve", 5, {"verify_seconds": [1.0]}])
def test_set_cost_model_refuses_what_is_not_a_cost_model(target, bad):
    """`set_cost_model(head, "curve")` was accepted and failed with an AttributeError deep in candidates.py."""
    import peagle

    head = _cost_head(target)
    with pytest.raises(TypeError, match="VerifyCostModel"):
        peagle.set_cost_model(head, bad)
    head.cost_model = bad  # set directly: refused by name when generate() reads it
    with pytest.raises(TypeError, match="head.cost_model must be a VerifyCostModel"):
        greedy(target, prompt_ids(80, 6), max_new_tokens=4, assistant_model=head)


# ---------------------------------------------------------------------------------------------- no hidden cost
class PassCounter:
    """Wraps the cost timing's one target-pass timer and its drafter timers: counts the passes they run."""

    def __init__(self, monkeypatch):
        from peagle.generation import cost_timing

        self.target = self.drafter = 0
        time_pass, time_drafter, time_at = (
            cost_timing._time_pass,
            cost_timing._time_drafter,
            cost_timing._time_drafter_at,
        )

        def counted_pass(target, cache, ids, mask, repeats, *a, **k):
            warm = a[2] if len(a) > 2 else k.get("warm_up", True)
            self.target += repeats + 1 if warm else 1
            return time_pass(target, cache, ids, mask, repeats, *a, **k)

        def counted_drafter(head, target, k, repeats, rows=1, budget=None):
            self.drafter += repeats + 1 if budget is None else 1  # inside a call: one round
            return time_drafter(head, target, k, repeats, rows, budget)

        def counted_at(head, target, k, repeats, rows, context, budget=None):
            self.drafter += repeats + 1 if budget is None else 1
            return time_at(head, target, k, repeats, rows, context, budget)

        monkeypatch.setattr(cost_timing, "_time_pass", counted_pass)
        monkeypatch.setattr(cost_timing, "_time_drafter", counted_drafter)
        monkeypatch.setattr(cost_timing, "_time_drafter_at", counted_at)


def test_a_first_call_times_a_few_passes_counts_them_and_says_so_once(target, monkeypatch, tmp_path):
    """On a fresh cost cache, a call's first use of a batch size times a quick curve: at most 4 n per row count,
    one pass each, and one drafter round, and a context point the same way, all of it in
    `cost_timing_seconds` and in `total_seconds`; a warning says once per process what is timed and how to time
    it ahead; the same call again times nothing.  The output is plain greedy's."""
    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_mod, "_WARNED_TIMING", False)
    cost_mod.forget_cost_models()
    counter = PassCounter(monkeypatch)
    head = _cost_head(target)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for rows, length in [(1, 12), (2, 12), (1, 12), (1, 420)]:
                ids = torch.cat([prompt_ids(80 + b, length) for b in range(rows)])
                before = counter.target, counter.drafter
                out = greedy(target, ids, max_new_tokens=8, assistant_model=head, num_assistant_tokens=4)
                assert torch.equal(out, greedy(target, ids, max_new_tokens=8))
                st = head.last_generation_stats
                passes, drafter = counter.target - before[0], counter.drafter - before[1]
                fresh = (rows, length) != (1, 12) or before == (0, 0)  # a new curve or a new context point
                assert passes <= (4 if fresh else 0) and drafter <= (1 if fresh else 0), (
                    rows,
                    length,
                    passes,
                )
                assert (passes > 0) == fresh and (st.cost_timing_seconds > 0) == fresh
                assert st.cost_timing_seconds <= st.total_seconds
        said = [w for w in caught if "timing this machine's verify costs" in str(w.message)]
        assert len(said) == 1 and "peagle calibrate HEAD --costs" in str(said[0].message)
        models = [VerifyCostModel.from_dict(json.loads(p.read_text())) for p in tmp_path.glob("*.json")]
        assert len(models) == 2 and all(m.timing == "quick" for m in models)
        assert any(m.context_points for m in models)
    finally:
        cost_mod.forget_cost_models()


def test_a_quick_curve_stops_at_its_budget_and_fills_in_the_rest(target, monkeypatch):
    """With its budget spent, a quick curve times only the plain step and one more n (one pass each), and still
    covers every n up to the longest, never decreasing; the drafter is left to the call's first drafting round
    (with budget left it is timed); `peagle calibrate --costs` (no budget) times them all."""
    from peagle.generation import cost_timing

    counter = PassCounter(monkeypatch)
    head = _cost_head(target)
    budget = cost_timing.TimingBudget(seconds=0.0)
    model = cost_timing.measure_quick_cost_model(target, head, 17, 1, budget)
    assert counter.target == 2 and budget.passes == 2 and budget.spent > 0
    assert len(model.verify_seconds) == 17 and model.verify_seconds == sorted(model.verify_seconds)
    assert model.timing == "quick" and model.refined_online and model.drafter_seconds == 0.0
    assert budget.drafter_passes == 0
    model.observe_drafter(0.25)  # what the first drafting round measures becomes the drafter's seconds
    assert model.drafter_seconds == 0.25
    full = cost_timing.measure_cost_model(target, head, max_tokens=17, repeats=1)
    assert counter.target == 2 + 2 * len(cost_timing.measured_points(17)) and full.timing == "full"
    timed = cost_timing.measure_quick_cost_model(target, head, 17, 1, cost_timing.TimingBudget(seconds=60.0))
    assert timed.drafter_seconds > 0


def test_ended_rows_are_never_timed_in_a_call_and_each_count_is_learnt(target, monkeypatch):
    """Whether ended rows stay idle is decided from known plain-step seconds per row count; a call times none of
    them (each count was one more timing inside the user's call): with counts unknown the rows leave, and the
    plain steps the call runs teach the curve each count's seconds, at the reference context.  Every row is
    plain batched greedy's."""
    ids, free, eos, kw, ref = _rows_that_end(target)
    model = VerifyCostModel([1.0] * 6, source="cache", context=256)  # no row count's seconds known
    head = _cost_head(target, model=model)
    head.config.confidence_threshold = None
    counter = PassCounter(monkeypatch)
    out, shapes = _greedy_counting_rows(target, ids, head, kw)
    assert torch.equal(out, ref)
    assert counter.target == 0 and head.last_generation_stats.cost_timing_seconds == 0.0
    assert 4 in shapes and min(shapes) < 4  # ended rows left the batch
    learnt = {int(c) for c in model.row_seconds}
    assert learnt and learnt <= set(shapes) and all(v > 0 for v in model.row_seconds.values())


def _sliding_target(kind: str, implementation: str):
    """A tiny sliding-window target: Mistral (every layer slides: one mask) or Gemma 3 (sliding and full layers:
    a mask per layer kind), window 8."""
    import transformers

    common = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, sliding_window=8,
    )  # fmt: skip
    if kind == "mistral":
        config = transformers.MistralConfig(**common)
    else:
        config = transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        )  # fmt: skip
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_context_points_sliding_layers_hold_their_window_as_in_a_call(kind, implementation, rows):
    """The cache a long context is timed on is laid out as a decoding call's: sliding layers keep their window's
    slots (masked by position), not the whole context, and its passes take the masks a verify pass takes."""
    from peagle.generation import cost_timing

    target = _sliding_target(kind, implementation)
    stretched = cost_timing._stretched_cache(target, rows, 40, 128, torch.Generator().manual_seed(0), "cpu")
    kinds = getattr(target.config, "layer_types", None) or ["sliding_attention"] * 4
    for layer, layer_kind in zip(stretched.cache.layers, kinds, strict=True):
        assert layer.keys.shape[:3] == (rows, 2, 7 if layer_kind == "sliding_attention" else 40)
    mask = stretched.mask(3)
    masks = mask if isinstance(mask, dict) else {"sliding_attention": mask}
    for layer_kind, m in masks.items():
        assert m.shape == (rows, 1, 3, (7 if layer_kind == "sliding_attention" else 40) + 3)
    point = cost_timing.measure_context_point(target, None, 40, 5, repeats=1, batch_size=rows)
    assert point["context"] == 40 and all(s > 0 for s in point["seconds"])
    assert cost_timing.measure_plain_step(target, rows, 40, repeats=1) > 0
    quick = cost_timing.measure_quick_cost_model(
        target, None, 5, rows, cost_timing.TimingBudget(seconds=60.0)
    )
    assert len(quick.verify_seconds) == 5
