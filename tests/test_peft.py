"""LoRA adapters on P-EAGLE heads through peft: wrapping, training, adapter round trip, merging, generation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import peagle
from helpers import Oracle, make_head, make_target
from peagle import PEagleDrafter
from peagle.integrations.peft import (
    DEFAULT_LORA_TARGET_MODULES,
    apply_lora,
    head_vocab_coverage,
    load_adapted_head,
    load_adapter,
    lora_config,
    lora_target_module_names,
    merge_lora,
)
from peagle.training import PEagleTrainer, PEagleTrainingArguments


def random_lora(head, seed: int = 3, **kw):
    """LoRA with random (non-zero) A and B, so the adapter changes the outputs."""
    torch.manual_seed(seed)
    model = apply_lora(head, lora_config(r=4, init_lora_weights=False, **kw))
    with torch.no_grad():  # peft's non-default init is large; keep the update a perturbation
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    return model


def drafter_inputs(head, seed: int = 0, length: int = 9, k: int = 4) -> dict:
    """A P-EAGLE drafting block: real slots with features, then K-1 parallel slots, plus a padding mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (2, length), generator=g)
    ids, pos, par = head.parallel_slots(ids, 0, k)
    feats = torch.randn(2, ids.shape[1], 3 * head.config.target_hidden_size, generator=g)
    return {"input_ids": ids, "target_hidden_states": feats, "position_ids": pos, "parallel_mask": par}


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


# ------------------------------------------------------------------------------------------------ wrapping
def test_default_targets_are_attention_mlp_and_fc_only():
    target = make_target()
    head = make_head(target)
    names = lora_target_module_names(head)
    suffixes = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    suffixes += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    expected = ["fc"] + [f"layers.{i}.{s}" for i in range(head.config.num_hidden_layers) for s in suffixes]
    assert sorted(names) == sorted(expected)
    assert set(DEFAULT_LORA_TARGET_MODULES) == {n.split(".")[-1] for n in names}

    model = apply_lora(head, lora_config(r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(expected)
    # the head's API stays reachable through the wrapper
    assert model.config is head.config and torch.equal(model.d2t, head.d2t)
    assert model.get_base_model() is head and callable(model.draft) and callable(model.attach_target)

    only_first = lora_target_module_names(head, lora_config(r=4, layers_to_transform=[1]))
    assert sorted(only_first) == sorted(f"layers.1.{s}" for s in suffixes)


def test_wrapping_refuses_what_lora_cannot_adapt():
    target = make_target()
    with pytest.raises(ValueError, match="lm_head"):
        apply_lora(make_head(target), lora_config(target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match="match no module"):
        apply_lora(make_head(target), lora_config(target_modules=["query_key_value"]))
    with pytest.raises(TypeError, match="PEagleDrafter"):
        apply_lora(target, lora_config())
    with pytest.raises(ValueError, match="rank"):
        lora_config(r=0)
    with pytest.raises(TypeError, match="PeftModel"):
        merge_lora(make_head(target))


def test_forward_keywords_pass_through_and_zero_init_is_the_head():
    target = make_target()
    head = make_head(target)
    inputs = drafter_inputs(head)
    mask = torch.ones(
        2, 1, inputs["input_ids"].shape[1], inputs["input_ids"].shape[1], dtype=torch.bool
    ).tril()
    inputs["attention_mask"] = mask
    ref = logits(head, inputs)
    model = apply_lora(head, lora_config(r=4))  # B = 0: the adapted head starts as the head
    assert torch.equal(logits(model, inputs), ref)
    out = model(**inputs, logits_to_keep=3)
    assert out.logits.shape == (2, 3, head.config.draft_vocab_size)
    assert torch.equal(out.logits, ref[:, -3:])

    adapted = random_lora(make_head(target))
    assert not torch.allclose(logits(adapted, inputs), ref, atol=1e-3)  # the adapter is live


# ------------------------------------------------------------------------------------------------ training
def test_trainer_updates_only_the_adapter(tmp_path):
    target = make_target()
    head = make_head(target).float()
    model = apply_lora(head, lora_config(r=4, lora_dropout=0.1))
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        ids = torch.randint(3, 120, (24,), generator=g).tolist()
        data.append({"input_ids": ids, "loss_mask": [0] * 6 + [1] * 18})
    args = PEagleTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        num_parallel_positions=3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = PEagleTrainer(model=model, target_model=target, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2
    after = dict(model.named_parameters())
    for n, p in base_before.items():
        assert torch.equal(after[n].detach(), p), f"base weight {n} changed"
        assert after[n].grad is None, f"base weight {n} received a gradient"
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers_before[n])
    changed = [n for n, p in lora_before.items() if not torch.equal(after[n].detach(), p)]
    # step 1 moves every B (A != 0); step 2 then moves every A (B != 0)
    assert sorted(changed) == sorted(lora_before)
    assert all(p.requires_grad is False for n, p in model.named_parameters() if "lora_" not in n)


# ------------------------------------------------------------------------------------------------ save, load, merge
def test_adapter_round_trip(tmp_path):
    target = make_target()
    head = make_head(target)
    head.save_pretrained(tmp_path / "head")
    model = random_lora(head)
    inputs = drafter_inputs(head, seed=1)
    ref = logits(model, inputs)
    model.save_pretrained(tmp_path / "adapter")

    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert not any(f.endswith((".bin", ".pt")) for f in files)
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", framework="pt") as fh:
        keys = list(fh.keys())
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)  # the head itself is not duplicated
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["task_type"] is None
    assert sorted(saved["target_modules"]) == sorted(DEFAULT_LORA_TARGET_MODULES)

    fresh = PEagleDrafter.from_pretrained(tmp_path / "head")
    assert torch.equal(logits(fresh, inputs), logits(make_head(target), inputs))
    loaded = load_adapter(fresh, tmp_path / "adapter")
    assert torch.allclose(logits(loaded, inputs), ref, atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in loaded.parameters())  # inference mode by default
    trainable = load_adapter(PEagleDrafter.from_pretrained(tmp_path / "head"), tmp_path / "adapter", True)
    assert any(p.requires_grad for p in trainable.parameters())

    merged = load_adapted_head(tmp_path / "head", tmp_path / "adapter", target_model=target)
    assert type(merged) is PEagleDrafter and not merged.training
    assert torch.allclose(logits(merged, inputs), ref, atol=1e-5, rtol=0)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(make_head(target), tmp_path / "head")


@pytest.mark.parametrize("embed_from_target", [False, True])
def test_merged_head_equals_adapted_head_and_exports(tmp_path, embed_from_target):
    target = make_target()
    head = make_head(target, embed_from_target=embed_from_target).attach_target(target)
    model = random_lora(head)
    inputs = drafter_inputs(head, seed=2)
    unmerged = logits(model, inputs)
    drafts = model.draft(inputs["input_ids"][:, :9], inputs["target_hidden_states"][:, :9], 4)

    merged = merge_lora(model)
    assert type(merged) is PEagleDrafter and merged is head
    assert not any("lora" in n for n, _ in merged.named_modules())
    assert all(type(m) is torch.nn.Linear for n, m in merged.named_modules() if n.endswith(("_proj", "fc")))
    assert torch.allclose(logits(merged, inputs), unmerged, atol=1e-5, rtol=0)
    again = merged.draft(inputs["input_ids"][:, :9], inputs["target_hidden_states"][:, :9], 4)
    assert torch.equal(again.tokens, drafts.tokens)
    assert merged.fc.weight.requires_grad and merged.lm_head.weight.requires_grad
    assert merged.embed_tokens.weight.requires_grad is (not embed_from_target)

    out = peagle.export(merged, tmp_path / "vllm", layout="vllm", target_model=target)
    reloaded = PEagleDrafter.from_pretrained(out, target_model=target)
    assert torch.allclose(logits(reloaded, inputs), unmerged, atol=1e-5, rtol=0)


def test_merged_head_generates_losslessly():
    target = make_target(seed=0, num_hidden_layers=4, eos_token_id=None)
    head = make_head(target, seed=5)
    model = random_lora(head, seed=6)
    ids = torch.randint(3, 127, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, do_sample=False, max_new_tokens=16)

    with pytest.raises(ValueError, match=r"merge_and_unload\(\)"):  # the PeftModel wrapper itself: named fix
        target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=model)
    unmerged = model.get_base_model()  # the head with live LoRA branches also drafts inside generate()
    out = target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=unmerged)
    assert torch.equal(out, ref)

    merged = merge_lora(model).eval()
    oracle = Oracle(merged, ref, p=0.8, seed=1)  # steer some drafts right so rounds accept tokens
    try:
        out = target.generate(
            ids, do_sample=False, max_new_tokens=16, assistant_model=merged, num_assistant_tokens=4
        )
    finally:
        oracle.handle.remove()
    assert torch.equal(out, ref)
    stats = merged.last_generation_stats
    assert stats.rounds > 0 and stats.accepted_tokens > 0
    assert stats.generated_tokens == 16 and stats.drafter_forward_calls == stats.rounds


def test_head_vocab_coverage():
    target = make_target()
    head = make_head(target, draft_vocab_size=64)
    head.set_draft_vocab(torch.arange(64) * 2)  # even ids only
    ex = [{"input_ids": [1, 3, 4, 6, 7, 8], "loss_mask": [0, 0, 1, 1, 1, 1]}]
    assert head_vocab_coverage(head, ex) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="no response tokens"):
        head_vocab_coverage(head, [{"input_ids": [1, 2], "loss_mask": [0, 0]}])


# ------------------------------------------------------------------------------------------------ command line
def test_peagle_train_lora_command(tmp_path, capsys):
    from helpers import tiny_tokenizer
    from peagle.cli import main

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    make_head(target).save_pretrained(tmp_path / "base")
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "examples.jsonl", "w") as fh:
        for _ in range(3):
            ids = torch.randint(3, 100, (20,), generator=g).tolist()
            fh.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 5 + [1] * 15}) + "\n")
    out = tmp_path / "adapted"
    argv = [
        "train",
        "--target",
        str(tmp_path / "target"),
        "--use_cpu",
        "--examples",
        str(tmp_path / "examples.jsonl"),
    ]
    argv += [
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--num_parallel_positions",
        "3",
        "--learning_rate",
        "0.05",
    ]
    argv += ["--lora", "--lora_r", "4", "--lora_alpha", "8", "--base_head", str(tmp_path / "base")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "merged head" in printed and "optimizer steps" in printed
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 8

    base = PEagleDrafter.from_pretrained(tmp_path / "base")
    inputs = drafter_inputs(base, seed=3)
    merged = PEagleDrafter.from_pretrained(out / "merged")
    adapted = load_adapter(PEagleDrafter.from_pretrained(tmp_path / "base"), out)
    assert torch.allclose(logits(merged, inputs), logits(adapted, inputs), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(merged, inputs), logits(base, inputs), atol=1e-6)  # it trained
    assert torch.equal(logits(base, inputs), logits(make_head(target), inputs))  # the base head is untouched

    with pytest.raises(SystemExit, match="--base_head"):
        main(argv[:-2])


def test_casting_an_adapted_head_leaves_its_target_untouched():
    """`.to()` on the peft wrapper reaches the head's own `_apply`: the target's shared table stays float32."""
    target = make_target(tie_word_embeddings=True)
    head = make_head(target, embed_from_target=True).attach_target(target)
    model = apply_lora(head, lora_config(r=4))
    model.to(torch.bfloat16)
    assert target.get_input_embeddings().weight.dtype == torch.float32
    assert target.get_output_embeddings().weight.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 22]])
    assert target.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)
