"""peagle.evaluation.acceptance (`peagle evaluate`)'s rules: held-out set specs, and decoding results pooled exactly over example sets
and over runs (`--pool`), refusing what would not be the same measure."""

from __future__ import annotations

import argparse

import pytest
import torch

from helpers import make_args, make_head
from peagle.evaluation import acceptance as eval_acceptance
from peagle.evaluation.acceptance import heldout_spec, pool_results, pooled_summary, summarise
from peagle.evaluation.teacher_forced import evaluate_acceptance
from peagle.generation import PEagleGenerationStats
from peagle.training import save_examples


def test_heldout_spec_reads_skip_and_limit_or_keeps_the_defaults():
    assert heldout_spec("data/heldout:48:24", 0, 10) == ("data/heldout", 48, 24)
    assert heldout_spec("data/heldout", 3, 5) == ("data/heldout", 3, 5)
    assert heldout_spec("c:/data/heldout", 3, 5) == ("c:/data/heldout", 3, 5)  # a colon that is not a range


def one_set(
    folder: str, skip: int, prompts: int, rounds: int, accepted: int, plain: int, lossless=True
) -> dict:
    """A set's entry as decode() writes it: where the prompts came from and the summed stats of their decoding."""
    stats = PEagleGenerationStats(
        num_speculative_tokens=7,
        rounds=rounds,
        draft_tokens=7 * rounds,
        accepted_tokens=accepted,
        plain_steps=plain,
        generated_tokens=accepted + rounds + plain,
        accepted_per_depth=[accepted, 0, 0, 0, 0, 0, 0],
        drafted_per_depth=[rounds] * 7,
        calls=prompts,
    )
    return {"examples": folder, "skip": skip, "limit": prompts, **summarise(stats, prompts, lossless)}


def run(sets: dict[str, dict], k: int = 7, head: str = "heads/h") -> dict:
    """A decoding run's --out JSON over `sets` for one head."""
    settings = {
        "num_speculative_tokens": k,
        "max_new_tokens": 128,
        "head_dtype": "bfloat16",
        "examples": list(sets),
    }
    return {"settings": settings, "results": {head: pooled_summary(sets)}}


def test_pooling_sums_the_counts_before_it_divides():
    a = one_set("heldout", 48, 16, rounds=900, accepted=800, plain=16)  # 1716 tokens / 916 passes
    b = one_set("heldout-set2", 0, 40, rounds=2000, accepted=2400, plain=40)  # 4440 / 2040
    c = one_set("heldout-set2", 40, 80, rounds=4000, accepted=4100, plain=80, lossless=False)
    pooled = pool_results([run({"heldout:48:16": a, "heldout-set2:0:40": b}), run({"heldout-set2:40:80": c})])
    r = pooled["results"]["heads/h"]
    tokens = 1716 + 4440 + (4100 + 4000 + 80)
    passes = 916 + 2040 + 4080
    assert (r["new_tokens"], r["target_passes"], r["prompts"]) == (tokens, passes, 136)
    assert r["tokens_per_target_pass"] == pytest.approx(tokens / passes)
    # not the mean of the sets' ratios, which would weigh a small set like a large one
    ratios = [s["tokens_per_target_pass"] for s in r["per_set"].values()]
    assert r["tokens_per_target_pass"] != pytest.approx(sum(ratios) / 3)
    assert r["acceptance_length"] == pytest.approx((800 + 2400 + 4100 + 6900) / 6900)
    assert r["lossless"] is False  # one set whose output differed from plain greedy taints the pool
    assert list(r["per_set"]) == ["heldout:48:16", "heldout-set2:0:40", "heldout-set2:40:80"]
    assert pooled["settings"]["examples"] == list(r["per_set"])
    # pooling is the same whether the sets came in one run or in several
    once = run({"heldout:48:16": a, "heldout-set2:0:40": b, "heldout-set2:40:80": c})["results"]["heads/h"]
    assert {k: v for k, v in once.items() if k != "stats"} == {k: v for k, v in r.items() if k != "stats"}


def test_pooling_refuses_what_is_not_the_same_measure():
    a = one_set("heldout", 48, 16, rounds=900, accepted=800, plain=16)
    overlapping = one_set("heldout", 60, 10, rounds=500, accepted=400, plain=10)
    with pytest.raises(ValueError, match="overlap"):
        pool_results([run({"heldout:48:16": a}), run({"heldout:60:10": overlapping})])
    adjacent = one_set("heldout", 64, 10, rounds=500, accepted=400, plain=10)
    pool_results([run({"heldout:48:16": a}), run({"heldout:64:10": adjacent})])  # 48-63 and 64-73: fine
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        pool_results([run({"heldout:48:16": a}), run({"heldout:64:10": adjacent}, k=5)])
    with pytest.raises(ValueError, match="different heads"):
        pool_results([run({"heldout:48:16": a}), run({"heldout:64:10": adjacent}, head="heads/other")])
    old = run({"heldout:48:16": a})
    old["results"]["heads/h"] = {k: v for k, v in old["results"]["heads/h"].items() if k != "per_set"}
    with pytest.raises(ValueError, match="generation stats"):
        pool_results([old, run({"heldout:64:10": adjacent})])
    forced = run({"heldout:64:10": adjacent})
    forced["settings"]["teacher_forced"] = True
    with pytest.raises(ValueError, match="teacher-forced"):
        pool_results([run({"heldout:48:16": a}), forced])


def decode_args(heads: list[str], examples: list[str], **extra) -> argparse.Namespace:
    """eval_acceptance's arguments for decoding `examples` with `heads` on the tiny target: K=3, 12 new tokens."""
    return argparse.Namespace(
        heads=heads,
        examples=examples,
        skip=0,
        limit=10,
        head_dtype="float32",
        max_new_tokens=12,
        num_speculative_tokens=3,
        **extra,
    )


def test_decoding_several_heads_runs_plain_greedy_once_per_prompt(tiny_target, tmp_path, monkeypatch):
    examples = [
        {"input_ids": [5 + i, 17, 30 + i, 9, 40, 41], "loss_mask": [0, 0, 0, 0, 1, 1]} for i in range(3)
    ]
    save_examples(examples, tmp_path / "heldout.jsonl")
    heads = []
    for seed in (1, 2):
        make_head(tiny_target, seed=seed).save_pretrained(tmp_path / f"head{seed}")
        heads.append(str(tmp_path / f"head{seed}"))
    plain_calls = []

    def counting(target, ids, max_new_tokens, assistant=None, **kwargs):
        if assistant is None:
            plain_calls.append(ids[0].tolist())
        return real(target, ids, max_new_tokens, assistant=assistant, **kwargs)

    real = eval_acceptance.timed_generate
    monkeypatch.setattr(eval_acceptance, "timed_generate", counting)
    args = decode_args(heads, [f"{tmp_path / 'heldout.jsonl'}:1:2", f"{tmp_path / 'heldout.jsonl'}:0:1"])
    with torch.no_grad():
        results = eval_acceptance.decode(tiny_target, args)
    # plain greedy ran once for each prompt, not once per head
    assert sorted(plain_calls) == sorted(ex["input_ids"][:4] for ex in examples)
    for head in heads:  # both heads checked against the shared plain outputs, per set and pooled
        assert results[head]["lossless"] is True
        assert results[head]["prompts"] == 3
        assert [s["limit"] for s in results[head]["per_set"].values()] == [2, 1]


def test_greedy_references_are_what_decoding_reads(tiny_target, tmp_path):
    """`--write_greedy` writes plain greedy's continuation of each prompt (prompt unsupervised, new tokens
    supervised, one shard per set), and the decoding walk over those references counts the new tokens and target
    passes that decoding with a head reports on the same prompts; the stored responses, which are longer and
    differ from the target's greedy continuation, count otherwise."""
    from peagle.data.shards import read_manifest, read_shards
    from peagle.training.trainer import PEagleTrainer

    torch.manual_seed(3)
    examples = [
        {"input_ids": torch.randint(3, 120, (5 + i + 30,)).tolist(), "loss_mask": [0] * (5 + i) + [1] * 30}
        for i in range(4)
    ]
    save_examples(examples, tmp_path / "heldout.jsonl")
    head_dir = tmp_path / "head"
    args = decode_args(
        [str(head_dir)],
        [f"{tmp_path / 'heldout.jsonl'}:0:3", f"{tmp_path / 'heldout.jsonl'}:3:1"],
        write_greedy=str(tmp_path / "refs"),
    )
    with torch.no_grad():
        eval_acceptance.write_greedy(tiny_target, args)
    refs = read_shards(tmp_path / "refs")
    head = make_head(tiny_target, seed=2)  # trained on the references, so that its rounds accept drafts
    trainer = PEagleTrainer(
        model=head,
        target_model=tiny_target,
        args=make_args(tmp_path, max_steps=25, per_device_train_batch_size=4, learning_rate=0.5),
        train_dataset=refs,
    )
    trainer.train()
    head.save_pretrained(head_dir)
    with torch.no_grad():
        decoded = eval_acceptance.decode(tiny_target, args)[str(head_dir)]
    assert decoded["lossless"] and decoded["stats"]["accepted_tokens"] > 0
    manifest = read_manifest(tmp_path / "refs")
    assert [s["examples"] for s in manifest["shards"]] == [3, 1]
    assert (
        manifest["shards"][0]["prompts_of"]["skip"] == 0 and manifest["shards"][1]["prompts_of"]["skip"] == 3
    )
    for ex, ref in zip(examples, refs):
        prompt = ex["input_ids"][: ex["loss_mask"].index(1)]
        with torch.no_grad():
            plain = tiny_target.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt)),
            )
        assert ref["input_ids"] == plain[0].tolist()
        assert ref["loss_mask"] == [0] * len(prompt) + [1] * (plain.shape[1] - len(prompt))

    walk = evaluate_acceptance(trainer, refs, num_speculative_tokens=3, progress=False, max_new_tokens=12)
    assert (walk["decoded_tokens"], walk["decoded_target_passes"]) == (
        decoded["new_tokens"],
        decoded["target_passes"],
    )
    stored = evaluate_acceptance(
        trainer, examples, num_speculative_tokens=3, progress=False, max_new_tokens=12
    )
    assert stored["decoded_tokens_per_target_pass"] != walk["decoded_tokens_per_target_pass"]
