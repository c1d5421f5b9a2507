"""Self-distillation with the vLLM engine (`peagle.training.VLLMEngine`) against transformers, on the real target."""

from __future__ import annotations

import pytest

from peagle.data import evalsets
from peagle.training import VLLMEngine, self_distill, synthesize_prompts, user_turn_template

PROMPTS = [
    "Write a Python function that reverses a list.",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a hash map is in two sentences.",
]


@pytest.fixture(scope="module")
def engine(target_dir):
    with VLLMEngine(target_dir, dtype="float32", chunk_size=3) as engine:
        yield engine


def test_engine_responses_equal_transformers_greedy(engine, target):
    model, tokenizer = target
    # chunk_size 3: two requests to the process, answers put back in input order
    ours = self_distill(engine, PROMPTS, tokenizer=tokenizer, max_new_tokens=48, progress=False)
    theirs = self_distill(
        model, PROMPTS, tokenizer=tokenizer, max_new_tokens=48, batch_size=4, progress=False
    )
    assert ours == theirs
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    stopped = [ex for ex in ours if ex["input_ids"][-1] in eos]
    assert stopped, "a short answer ends at and includes its end-of-turn token, as with transformers"


def test_engine_magpie_turns_are_seeded_and_framed_by_the_template(engine, target):
    _, tokenizer = target
    kw = dict(tokenizer=tokenizer, temperature=1.0, top_p=0.95, max_new_tokens=40, progress=False)
    a = synthesize_prompts(engine, 6, seed=3, **kw)
    assert a == synthesize_prompts(engine, 6, seed=3, **kw)
    assert a != synthesize_prompts(engine, 6, seed=4, **kw)
    assert len({tuple(p) for p in a}) == 6, (
        "each prompt gets its own seed: the same prefix gives distinct turns"
    )
    prefix, suffix = user_turn_template(tokenizer)
    for p in a:
        assert (
            p[: len(prefix)] == prefix and p[-len(suffix) :] == suffix and len(p) > len(prefix) + len(suffix)
        )
        assert not evalsets.is_evaluation_prompt(tokenizer.decode(p[len(prefix) : -len(suffix)]))


def test_engine_refuses_a_prompt_longer_than_its_window(engine):
    assert engine.max_model_len == 8192, "the target's window (max_position_embeddings), capped at 8192"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * (engine.max_model_len - 10)], max_new_tokens=100, progress=False)
    # checked before anything is generated: the long prompt is named even behind a full chunk of good ones
    batch = [[1, 2, 3]] * engine.chunk_size + [[1] * engine.max_model_len]
    with pytest.raises(ValueError, match=f"prompt {engine.chunk_size} "):
        engine.generate(batch, max_new_tokens=8, progress=False)
