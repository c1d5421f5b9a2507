"""Self-distillation and Magpie prompts: batched generation, seeding, chat-template paths, the evaluation guard."""

from __future__ import annotations

import pytest
import torch

from helpers import SYSTEM, make_target, tiny_tokenizer
from peagle.data import evalsets
from peagle.training import chat_prompt_ids, self_distill, synthesize_prompts, user_turn_template
from test_data_prompts import real_eval_prompts


def test_self_distill_batched_equals_one_by_one_and_masks_the_prompt():
    target = make_target()
    prompts = [[1, 5, 9], [1, 7, 8, 20, 33, 4], [1, 40], [1, 11, 12, 13]]
    batched = self_distill(target, prompts, max_new_tokens=6, batch_size=3, progress=False)
    single = self_distill(target, prompts, max_new_tokens=6, batch_size=1, progress=False)
    assert batched == single
    for p, ex in zip(prompts, batched):
        assert ex["input_ids"][: len(p)] == p
        assert ex["loss_mask"] == [0] * len(p) + [1] * (len(ex["input_ids"]) - len(p))
        resp = ex["input_ids"][len(p) :]
        assert 1 <= len(resp) <= 6
        assert 2 not in resp[:-1], "responses stop at the first EOS"
    # greedy: the response is the target's own argmax continuation
    ex = batched[0]
    logits = target(torch.tensor([ex["input_ids"]])).logits[0]
    assert logits[len(prompts[0]) - 1 : -1].argmax(-1).tolist() == ex["input_ids"][len(prompts[0]) :]


def test_sampled_self_distill_is_seeded():
    target = make_target()
    prompts = [[1, 5, 9], [1, 7, 8]]
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.5, progress=False)
    a = self_distill(target, prompts, seed=1, **kw)
    b = self_distill(target, prompts, seed=1, **kw)
    c = self_distill(target, prompts, seed=2, **kw)
    assert a == b and a != c


def test_magpie_prompts_from_explicit_template_pieces():
    target = make_target()
    prefix, suffix = [1, 3, 5, 6], [2, 3, 7]
    prompts = synthesize_prompts(
        target, 5, prefix_ids=prefix, suffix_ids=suffix, max_new_tokens=6, min_new_tokens=1, progress=False
    )
    assert 1 <= len(prompts) <= 5
    assert len({tuple(p) for p in prompts}) == len(prompts)
    for p in prompts:
        assert p[:4] == prefix and p[-3:] == suffix
        assert 2 not in p[4:-3], "the end-of-turn token ends the user turn"


def test_chat_template_paths_include_the_default_system_prompt():
    tok = tiny_tokenizer()
    prefix, suffix = user_turn_template(tok)
    system_ids = tok(SYSTEM, add_special_tokens=False)["input_ids"]
    text = tok.decode(prefix)
    assert SYSTEM in text and text.rstrip().endswith("user")
    assert all(i in prefix for i in system_ids)
    assert tok.decode(suffix).split() == ["<|im_end|>", "<|im_start|>", "assistant"]
    ids = chat_prompt_ids(tok, "hello world")
    assert ids == prefix + tok("hello world", add_special_tokens=False)["input_ids"] + suffix
    assert chat_prompt_ids(tok, [5, 6]) == [5, 6]
    target = make_target()
    examples = self_distill(
        target,
        ["hello world", [{"role": "user", "content": "write code"}]],
        tokenizer=tok,
        max_new_tokens=4,
        progress=False,
    )
    assert len(examples) == 2 and examples[0]["input_ids"][: len(ids)] == ids
    prompts = synthesize_prompts(target, 3, tokenizer=tok, max_new_tokens=5, min_new_tokens=1, progress=False)
    assert prompts and all(p[: len(prefix)] == prefix and p[-len(suffix) :] == suffix for p in prompts)
    with pytest.raises(ValueError, match="tokenizer"):
        self_distill(target, ["hello"], progress=False)


def test_a_tokenizer_without_a_chat_template_needs_plain_prompts():
    """No silent fallback: without a chat template, text prompts are refused (saying how to go on) unless
    `plain_prompts`, which encodes them as plain text; Magpie prompts are refused either way."""
    tok = tiny_tokenizer()
    tok.chat_template = None
    target = make_target()
    with pytest.raises(ValueError, match=r"has no chat template.*--chat_template FILE.*--plain_prompts"):
        self_distill(target, ["hello world"], tokenizer=tok, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match=r"Magpie prompts need a chat template.*has none"):
        synthesize_prompts(target, 2, tokenizer=tok, progress=False)
    examples = self_distill(
        target, ["hello world"], tokenizer=tok, max_new_tokens=3, progress=False, plain_prompts=True
    )
    assert (
        examples[0]["input_ids"][:2]
        == tok("hello world")["input_ids"]
        == chat_prompt_ids(tok, "hello world", plain=True)
    )


# ---------------------------------------------------------------------------------------------------- guard
def test_self_distill_refuses_evaluation_prompts():
    target = make_target()
    for prompt in real_eval_prompts():
        with pytest.raises(
            ValueError, match="self_distill: prompt 1 is an MT-Bench/HumanEval evaluation prompt"
        ):
            self_distill(target, ["hello world", prompt], tokenizer=tiny_tokenizer(), progress=False)


def test_self_distill_checks_token_id_prompts_with_a_tokenizer(monkeypatch):
    target, tok = make_target(), tiny_tokenizer()
    ids = chat_prompt_ids(tok, "write code please")
    assert len(self_distill(target, [ids], tokenizer=tok, max_new_tokens=2, progress=False)) == 1
    monkeypatch.setattr(evalsets, "_evaluation_fingerprints", lambda: frozenset({"write code please"}))
    with pytest.raises(ValueError, match="write code please"):
        self_distill(target, [ids], tokenizer=tok, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="write code please"):
        self_distill(
            target, [[{"role": "user", "content": "write code please"}]], tokenizer=tok, progress=False
        )


def test_magpie_drops_evaluation_turns_and_logs_the_count(monkeypatch, caplog):
    target, tok = make_target(), tiny_tokenizer()
    kw = dict(tokenizer=tok, max_new_tokens=5, min_new_tokens=1, max_rounds=2, progress=False)
    kept = synthesize_prompts(target, 3, **kw)
    assert kept
    monkeypatch.setattr(evalsets, "is_evaluation_prompt", lambda text: True)
    with caplog.at_level("WARNING"):
        assert synthesize_prompts(target, 3, **kw) == []
    assert "synthesize_prompts: dropped" in caplog.text


def test_magpie_with_a_system_prompt():
    target, tok = make_target(), tiny_tokenizer()
    prefix, suffix = user_turn_template(tok, system="the bot")
    assert SYSTEM not in tok.decode(prefix) and "the bot" in tok.decode(prefix)
    prompts = synthesize_prompts(
        target, 2, tokenizer=tok, system="the bot", max_new_tokens=4, min_new_tokens=1, progress=False
    )
    assert prompts and all(p[: len(prefix)] == prefix and p[-len(suffix) :] == suffix for p in prompts)


@pytest.mark.slow
def test_real_smollm2_magpie_prefix_and_self_distillation():
    from peagle.targets import load_default_target

    target, tok = load_default_target()
    prefix, suffix = user_turn_template(tok)
    text = tok.decode(prefix)
    assert "<|im_start|>system" in text and "SmolLM" in text, (
        "SmolLM2's default system prompt is part of the prefix"
    )
    assert text.rstrip().endswith("<|im_start|>user")
    prompts = synthesize_prompts(target, 2, tokenizer=tok, max_new_tokens=24, temperature=0.8, progress=False)
    assert len(prompts) == 2 and all(
        p[: len(prefix)] == prefix and p[-len(suffix) :] == suffix for p in prompts
    )
    examples = self_distill(
        target, ["What is 2 + 2?", prompts[0]], tokenizer=tok, max_new_tokens=8, progress=False
    )
    assert len(examples) == 2
    for ex in examples:
        resp = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
        assert 1 <= len(resp) <= 8 and tok.decode(ex["input_ids"]).count("<|im_start|>assistant") == 1


def test_vllm_engine_needs_an_environment_and_a_model_folder(tmp_path, monkeypatch):
    from peagle.integrations.vllm.process import VLLM_PYTHON_ENV, vllm_python
    from peagle.training import VLLMEngine

    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(ValueError, match=VLLM_PYTHON_ENV):
        vllm_python()
    with pytest.raises(ValueError, match="not a file"):
        vllm_python(tmp_path / "missing-python")
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "missing-python"))
    with pytest.raises(ValueError, match="not a file"):
        vllm_python()
    with pytest.raises(ValueError, match="config.json"):
        VLLMEngine(tmp_path)


def test_generation_settings_objects_and_keywords_are_one_set_of_settings():
    """`self_distill(target, prompts, settings)` equals the same fields given as keywords; keywords replace the
    settings' fields (transformers' `generate(generation_config, **kwargs)`); an unknown one is refused; the
    recipe's data settings default to the generation settings' own values."""
    from peagle.training import DataArguments, GenerationSettings, MagpieSettings

    target = make_target()
    prompts = [[1, 5, 9], [1, 7, 8]]
    settings = GenerationSettings(max_new_tokens=5, do_sample=True, seed=3, progress=False)
    by_object = self_distill(target, prompts, settings)
    assert by_object == self_distill(
        target, prompts, max_new_tokens=5, do_sample=True, seed=3, progress=False
    )
    assert self_distill(target, prompts, settings, seed=4) != by_object and settings.seed == 3
    with pytest.raises(TypeError, match="max_tokens"):
        self_distill(target, prompts, max_tokens=5)
    prefix, suffix = [1, 3, 5, 6], [2, 3, 7]
    magpie = MagpieSettings(max_new_tokens=6, min_new_tokens=1, seed=2, progress=False)
    kw = dict(prefix_ids=prefix, suffix_ids=suffix)
    assert synthesize_prompts(target, 3, magpie, **kw) == synthesize_prompts(
        target, 3, **kw, max_new_tokens=6, min_new_tokens=1, seed=2, progress=False
    )
    data = DataArguments()
    assert (data.max_new_tokens, data.generation_batch_size, data.do_sample, data.temperature) == (
        GenerationSettings.max_new_tokens,
        GenerationSettings.batch_size,
        GenerationSettings.do_sample,
        GenerationSettings.temperature,
    )
