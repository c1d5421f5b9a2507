"""PEagleGenerationStats: the named metrics, merging, and the Hub recipe reporting under the same names."""

from __future__ import annotations

import importlib.util
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import peagle
from helpers import make_head, make_target
from peagle.generation import PEagleGenerationStats

RECIPE = Path(peagle.__file__).parent / "model_card_templates" / "custom_generate.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("peagle_recipe_for_stats", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_named_metrics():
    st = PEagleGenerationStats(rounds=4, accepted_tokens=6, plain_steps=2, generated_tokens=12)
    assert st.target_passes == 6
    assert st.tokens_per_target_pass == 2.0  # 12 new tokens over 6 target passes (prefill included)
    assert st.acceptance_length == 2.5  # (6 accepted + 4 bonus) / 4 rounds
    assert PEagleGenerationStats().tokens_per_target_pass == 0.0
    assert PEagleGenerationStats().acceptance_length == 0.0


def test_merge_sums_counts_and_recomputes_ratios():
    a = PEagleGenerationStats(rounds=2, accepted_tokens=2, plain_steps=1, generated_tokens=5,
                              accepted_per_depth=[2], drafted_per_depth=[2], num_speculative_tokens=1)  # fmt: skip
    b = PEagleGenerationStats(rounds=1, accepted_tokens=3, plain_steps=1, generated_tokens=5,
                              accepted_per_depth=[1, 1, 1], drafted_per_depth=[1, 1, 1], num_speculative_tokens=3)  # fmt: skip
    total = a + b
    assert (total.rounds, total.accepted_tokens, total.generated_tokens, total.calls) == (3, 5, 10, 2)
    assert total.accepted_per_depth == [3, 1, 1] and total.num_speculative_tokens == 3
    assert total.tokens_per_target_pass == 10 / 5
    assert total.acceptance_length == (5 + 3) / 3
    assert PEagleGenerationStats.merge([a, b]) == total
    assert PEagleGenerationStats.merge([]).calls == 0
    assert (a + PEagleGenerationStats(drafting_mode="autoregressive")).drafting_mode == "mixed"


def test_to_dict_round_trip():
    st = PEagleGenerationStats(rounds=3, accepted_tokens=4, generated_tokens=8, plain_steps=1)
    d = st.to_dict()
    assert d["tokens_per_target_pass"] == 2.0 and d["acceptance_length"] == pytest.approx(7 / 3)
    assert PEagleGenerationStats.from_dict(d) == st
    with pytest.raises(ValueError, match="unknown generation-stats fields"):
        PEagleGenerationStats.from_dict({"tau": 2.0})


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_hub_recipe_drafts_like_generate(mode, monkeypatch):
    """The standalone recipe drafts through the head's own `draft_round`, the function generate() calls: on the
    same prompt (greedy, K drafts every round) both make the same rounds, with the same real slots and drafts,
    until generate() shortens its last rounds at the length limit (the recipe drafts K and trims afterwards)."""
    target = make_target()
    head = make_head(target, drafting_mode=mode)
    calls: list[tuple[list[int], list[int], int]] = []
    original = type(head).draft_round

    def spy(self, input_ids, target_hidden_states, k, *args, **kwargs):
        out = original(self, input_ids, target_hidden_states, k, *args, **kwargs)
        calls.append((input_ids[0].tolist(), out.tokens[0].tolist(), k))
        return out

    monkeypatch.setattr(type(head), "draft_round", spy)
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = target.generate(
        ids, assistant_model=head, do_sample=False, max_new_tokens=24, num_assistant_tokens=4,
        assistant_confidence_threshold=0.0,
    )  # fmt: skip
    ref, calls = calls, []
    got = _recipe().generate(
        target,
        ids,
        peagle_head=head,
        max_new_tokens=24,
        num_speculative_tokens=4,
        assistant_confidence_threshold=0.0,
    )
    assert torch.equal(got, expected)
    full = [c for c in ref if c[2] == 4]  # generate()'s rounds before the length limit shortened K
    assert len(full) >= 3 and calls[: len(full)] == full
    st = head.last_generation_stats
    assert isinstance(st, PEagleGenerationStats)  # peagle is installed: the very same class
    assert st.rounds == len(calls) and st.generated_tokens == 24


def test_hub_recipe_fallback_stats_use_the_same_names(monkeypatch):
    """Without peagle installed the recipe's own stats object has PEagleGenerationStats' counters and metrics."""
    recipe = _recipe()
    monkeypatch.setitem(__import__("sys").modules, "peagle.generation", None)  # import fails as if absent
    head = make_head(make_target())
    st = recipe._new_stats(head, 3, 0.0)
    assert not isinstance(st, PEagleGenerationStats)
    tracked = (
        "rounds",
        "draft_tokens",
        "accepted_tokens",
        "plain_steps",
        "generated_tokens",
        "drafter_forward_calls",
    )
    names = {f.name for f in fields(PEagleGenerationStats)}
    for name in (*tracked, "drafting_mode", "num_speculative_tokens", "confidence_threshold"):
        assert name in names and hasattr(st, name), name
    st.rounds, st.accepted_tokens, st.plain_steps, st.generated_tokens = 2, 2, 1, 5
    ref = PEagleGenerationStats(rounds=2, accepted_tokens=2, plain_steps=1, generated_tokens=5)
    assert st.tokens_per_target_pass == ref.tokens_per_target_pass
    assert st.acceptance_length == ref.acceptance_length
