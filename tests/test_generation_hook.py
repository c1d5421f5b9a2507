"""The generate() hook: options a speculative round cannot honour exactly are refused by name; explicit K and
confidence values count as given even when they equal transformers' defaults."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from helpers import LAYERS, greedy, make_head, make_target, prompt_ids


@pytest.fixture(scope="module")
def target():
    return make_target(seed=0, num_hidden_layers=LAYERS, eos_token_id=None)


class StopAfter(StoppingCriteria):
    """Stops every row after 3 new tokens (prompts of 5)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 8, dtype=torch.bool)


def test_stop_strings_without_a_tokenizer_are_refused_as_plain_generate_refuses_them(target):
    head = make_head(target)
    with pytest.raises(ValueError, match="stop_strings=\\['x'\\] need the model's tokenizer"):
        target.generate(prompt_ids(1, 5), max_new_tokens=4, assistant_model=head, stop_strings=["x"])


def test_custom_stopping_criteria_run_without_an_eos_criterion(target):
    """Without EOS, plain decoding lets a stopped row go on until every row stops; a call with one row ends."""
    head = make_head(target)
    ids = prompt_ids(2, 5)
    crit = StoppingCriteriaList([StopAfter()])
    ref = target.generate(ids, max_new_tokens=9, stopping_criteria=crit, do_sample=False)
    assert ref.shape[1] == 5 + 3
    out = target.generate(
        ids, max_new_tokens=9, assistant_model=head, stopping_criteria=crit, do_sample=False
    )
    assert torch.equal(out, ref)


def test_max_time_is_accepted(target):
    head = make_head(target)
    ids = prompt_ids(3, 5)
    out = greedy(target, ids, max_new_tokens=6, assistant_model=head, max_time=60.0)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=6))


def test_explicit_values_equal_to_transformers_defaults_count(target):
    """`num_assistant_tokens=20` means K=20 and `assistant_confidence_threshold=0.4` a 0.4 cut, although both equal
    the values transformers fills in when nothing is given."""
    head = make_head(target, num_speculative_tokens=3, num_parallel_positions=20)
    ids = prompt_ids(5, 6)
    greedy(target, ids, max_new_tokens=30, assistant_model=head)
    assert head.last_generation_stats.num_speculative_tokens == 3  # not given: the head's K
    greedy(target, ids, max_new_tokens=30, assistant_model=head, num_assistant_tokens=20)
    assert head.last_generation_stats.num_speculative_tokens == 20
    greedy(target, ids, max_new_tokens=8, assistant_model=head, assistant_confidence_threshold=0.4)
    st = head.last_generation_stats
    assert st.draft_policy == "threshold" and st.confidence_threshold == 0.4


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(guidance_scale=1.5), "guidance_scale=1.5"),
        (dict(use_cache=False), "use_cache=False"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions=True"),
    ],
)
def test_unsupported_options_are_refused_by_name_before_any_work(target, options, named):
    head = make_head(target)
    calls = []
    handle = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=named):
            target.generate(prompt_ids(5, 6), max_new_tokens=4, assistant_model=head, **options)
    finally:
        handle.remove()
    assert calls == []  # refused before the prefill


def test_bad_prompts_and_heads_are_refused(target):
    head = make_head(target)
    ids = prompt_ids(6, 6)
    with pytest.raises(ValueError, match="empty prompt"):
        target.generate(ids[:, :0], max_new_tokens=4, assistant_model=head)
    embeds = target.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        target.generate(inputs_embeds=embeds, max_new_tokens=4, assistant_model=head)
    with torch.device("meta"):
        meta = make_head(target)
    with pytest.raises(ValueError, match="meta device"):
        target.generate(ids, max_new_tokens=4, assistant_model=meta)
    with pytest.raises(ValueError, match="custom_generate cannot be combined"):
        target.generate(ids, max_new_tokens=4, assistant_model=head, custom_generate=lambda *a, **k: None)
