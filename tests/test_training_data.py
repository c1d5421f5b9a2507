"""Training data: collation, self-distillation, Magpie prompts, prompt files, draft vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_target
from peagle.training import (
    PEagleDataCollator,
    chat_prompt_ids,
    load_examples,
    load_prompts,
    save_examples,
    select_draft_vocab,
    self_distill,
    stdlib_code_prompts,
    synthesize_prompts,
    user_turn_template,
)

SYSTEM = "you are a helpful bot"


def tiny_tokenizer():
    """A word-level tokenizer (ids < 128) whose chat template inserts a default system prompt, like SmolLM2's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, "<|im_start|>": 3, "<unk>": 4}
    for w in [
        "system",
        "user",
        "assistant",
        "you",
        "are",
        "a",
        "helpful",
        "bot",
        "hello",
        "world",
        "write",
        "code",
        "please",
        "the",
        "of",
        "and",
        "to",
    ]:
        vocab[w] = len(vocab)
    for i in range(len(vocab), 100):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<s>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = (
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|> system "
        + SYSTEM
        + " <|im_end|> {% endif %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return fast


# ---------------------------------------------------------------------------------------------------- collation
def test_collator_pads_right_and_truncates():
    feats = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "target_hidden_states": torch.ones(3, 4)},
        {
            "input_ids": [8, 9, 10, 11, 12],
            "loss_mask": [0, 0, 1, 1, 1],
            "target_hidden_states": torch.ones(5, 4),
        },
    ]
    batch = PEagleDataCollator(pad_token_id=0, max_length=4)(feats)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]
    assert (
        batch["target_hidden_states"].shape == (2, 4, 4)
        and batch["target_hidden_states"][0, 3].abs().sum() == 0
    )
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        PEagleDataCollator()([{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    with pytest.raises(KeyError, match="loss_mask"):
        PEagleDataCollator()([{"input_ids": [1, 2, 3]}])


# ---------------------------------------------------------------------------------------------------- generation
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


# ---------------------------------------------------------------------------------------------------- sources
def test_load_prompts_formats(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    rows = [
        {"prompt": "a"},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]},
        {"other": 1},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "p.json").write_text(json.dumps(["x", "y", "z"]))
    assert load_prompts(tmp_path / "p.txt") == ["first prompt", "second prompt"]
    got = load_prompts(tmp_path / "p.jsonl")
    assert got[0] == "a"
    assert got[1] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert got[2] == [{"role": "user", "content": "h"}]
    assert len(got) == 3
    assert load_prompts(tmp_path / "p.json", limit=2) == ["x", "y"]
    with pytest.raises(ValueError, match="expected a .txt"):
        load_prompts(tmp_path / "p.csv")


def test_stdlib_code_prompts_are_deterministic():
    a = stdlib_code_prompts(20, seed=0)
    assert len(a) == 20 and a == stdlib_code_prompts(20, seed=0) and a != stdlib_code_prompts(20, seed=1)
    assert all(p.startswith("Write a Python function `") for p in a)


def test_examples_round_trip_and_draft_vocab(tmp_path):
    examples = [
        {"input_ids": [1, 5, 6, 6, 9, 2], "loss_mask": [0, 0, 1, 1, 1, 1]},
        {"input_ids": torch.tensor([1, 7, 6, 9]), "loss_mask": torch.tensor([0, 0, 1, 1])},
    ]
    save_examples(examples, tmp_path / "ex.jsonl")
    loaded = load_examples(tmp_path / "ex.jsonl")
    assert loaded[1] == {"input_ids": [1, 7, 6, 9], "loss_mask": [0, 0, 1, 1]}
    # response counts: 6 x3, 9 x2, 2 x1; then prompt-only tokens by total count (1 x2), ties by id
    assert select_draft_vocab(loaded, 3, 16).tolist() == [2, 6, 9]
    assert select_draft_vocab(loaded, 4, 16).tolist() == [1, 2, 6, 9]
    assert select_draft_vocab(loaded, 3, 16, extra_ids=[15]).tolist() == [6, 9, 15]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(loaded, 17, 16)


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
