"""PEagleTrainer: exact partitioned gradients, agreement with inference, accumulation, resume, caching, learning."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from helpers import greedy, make_args, make_head, make_target, random_examples, rel_diff, tiny_target_config
from peagle.evaluation.teacher_forced import evaluate_acceptance
from peagle.training import (
    FeatureCache,
    PEagleDataCollator,
    PEagleTrainer,
    self_distill,
)
from peagle.training.callbacks import COUNTS_FILE


def update_after_one_step(target, data, tmp_path, head_kwargs=None, **arg_overrides):
    head = make_head(target, **(head_kwargs or {})).float()
    before = {k: p.detach().clone() for k, p in head.named_parameters()}
    trainer = PEagleTrainer(
        model=head, target_model=target, args=make_args(tmp_path, **arg_overrides), train_dataset=data
    )
    trainer.train()
    return {k: p.detach() - before[k] for k, p in head.named_parameters()}, trainer


# ---------------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_partitioned_step_equals_unpartitioned(tmp_path, mode):
    target = make_target()
    data = random_examples(2)
    ref, _ = update_after_one_step(target, data, tmp_path, {"drafting_mode": mode}, sequence_partitions=1)
    for parts in (2, 4, 7):
        upd, _ = update_after_one_step(
            target, data, tmp_path, {"drafting_mode": mode}, sequence_partitions=parts
        )
        assert rel_diff(upd, ref) < 1e-5, parts
    # the unbalanced (equal-length) segments give the same gradient too
    upd, _ = update_after_one_step(
        target, data, tmp_path, {"drafting_mode": mode}, sequence_partitions=3, balance_partitions=False
    )
    assert rel_diff(upd, ref) < 1e-5


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    target = make_target()
    data = random_examples(4, seed=1)
    big, _ = update_after_one_step(target, data, tmp_path, per_device_train_batch_size=4)
    acc, _ = update_after_one_step(
        target,
        data,
        tmp_path,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        sequence_partitions=3,
    )
    assert rel_diff(acc, big) < 1e-5


def naive_loss(head, target, batch, k: int, autoregressive: bool) -> tuple[float, int]:
    """Sum of KL(target || drafter) over every supervised element, each computed the way inference drafts it."""
    t2d = head.t2d
    draft_rows = torch.arange(head.config.draft_vocab_size) + head.d2t
    total, count = 0.0, 0
    ids_all = batch["input_ids"]
    for b in range(ids_all.shape[0]):
        length = int(batch["attention_mask"][b].sum())
        ids = ids_all[b : b + 1, :length]
        out = target(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.config.eagle_aux_hidden_state_layer_ids], -1)
        tlogits = out.logits[0][:, draft_rows]
        for a in range(length - 2):
            depths = [d for d in range(k) if a + d + 2 < length]
            if autoregressive:
                cache = DynamicCache(config=head.config)
                step = head(ids[:, 1 : a + 2], aux[:, : a + 1], cache=cache, use_cache=True)
                logits, hidden = [step.logits[0, -1]], step.last_hidden_state[:, -1:]
                for d in depths[1:]:
                    step = head(
                        ids[:, a + d + 1 : a + d + 2],
                        projected_hidden_states=hidden,
                        position_ids=torch.tensor([[a + d]]),
                        parallel_mask=torch.zeros(1, 1, dtype=torch.bool),
                        cache=cache,
                        use_cache=True,
                    )
                    logits.append(step.logits[0, -1])
                    hidden = step.last_hidden_state
            else:
                logits = head.draft(
                    ids[:, 1 : a + 2], aux[:, : a + 1], num_speculative_tokens=len(depths)
                ).logits[0]
            for d in depths:
                p = a + d + 2
                if batch["loss_mask"][b, p] and t2d[ids[0, p]]:
                    lp = tlogits[p - 1].float().log_softmax(-1)
                    lq = logits[d].float().log_softmax(-1)
                    w = 0.8**d if autoregressive else 1.0
                    total += w * float((lp.exp() * (lp - lq)).sum())
                    count += 1
    return total, count


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_training_loss_equals_inference_time_drafting(tmp_path, mode):
    """Element (a, d) sees exactly what a drafting round from context x_0..x_{a+1} shows its slot d."""
    target = make_target()
    head = make_head(target, drafting_mode=mode, draft_vocab_size=64).float()
    head.set_draft_vocab(torch.arange(0, 128, 2))  # even ids only: odd labels are not supervised
    data = random_examples(2, seed=3, lo=9, hi=14)
    args = make_args(tmp_path, cod_ratio=1.0, cod_min_ratio=1.0, sequence_partitions=2)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=data)
    batch = PEagleDataCollator()(data)
    with torch.no_grad():
        loss = trainer.compute_loss(head.eval(), dict(batch))
        expected, count = naive_loss(head, target, batch, 4, mode == "autoregressive")
    plans = trainer.plan_batch(batch)
    assert sum(p.num_supervised for p in plans) == count > 0
    assert abs(float(loss) - expected / count) < 1e-5 * max(1.0, expected / count)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no backward on the CPU")
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_flex_attention_block_mask_gives_the_sdpa_update(tmp_path, mode):
    target = make_target()
    data = random_examples(2)
    kw = dict(use_cpu=False, sequence_partitions=2, flex_block_size=16)
    ref, _ = update_after_one_step(target, data, tmp_path, {"drafting_mode": mode}, **kw)
    flex, _ = update_after_one_step(
        target, data, tmp_path, {"drafting_mode": mode, "attn_implementation": "flex_attention"}, **kw
    )
    assert rel_diff({k: v.cpu() for k, v in flex.items()}, {k: v.cpu() for k, v in ref.items()}) < 1e-4


def test_flex_attention_head_is_refused_on_the_cpu(tmp_path):
    target = make_target()
    head = make_head(target, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="flex_attention"):
        PEagleTrainer(
            model=head, target_model=target, args=make_args(tmp_path), train_dataset=random_examples(1)
        )


# ---------------------------------------------------------------------------------------------------- behaviour
def test_nan_loss_stops_with_a_clear_error(tmp_path):
    target = make_target()
    head = make_head(target).float()
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    trainer = PEagleTrainer(
        model=head, target_model=target, args=make_args(tmp_path), train_dataset=random_examples(2)
    )
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        trainer.train()


@pytest.mark.parametrize("loss_type", ["ce", "kl"])
def test_nan_target_logits_stop_training(tmp_path, loss_type):
    """A target whose logits are NaN must not teach the head "always token 0" (argmax of NaN) under CE."""
    target = make_target()
    with torch.no_grad():
        target.lm_head.weight[3, 0] = float("nan")
    head = make_head(target).float()
    trainer = PEagleTrainer(
        model=head,
        target_model=target,
        args=make_args(tmp_path, loss_type=loss_type),
        train_dataset=random_examples(2),
    )
    with pytest.raises(FloatingPointError, match="target's logits are not finite"):
        trainer.train()


def test_training_data_is_checked_before_the_first_step(tmp_path, caplog):
    target = make_target()
    head = make_head(target).float()

    def build(data):
        return PEagleTrainer(model=head, target_model=target, args=make_args(tmp_path), train_dataset=data)

    with pytest.raises(ValueError, match="the training dataset is empty"):
        build([])
    no_labels = [dict(ex, loss_mask=[0] * len(ex["loss_mask"])) for ex in random_examples(3)]
    with pytest.raises(ValueError, match="none of the 3 examples has a supervised token"):
        build(no_labels)
    with pytest.raises(
        ValueError,
        match=r"example 1 \(0-based row\): token id 500 is outside the target's vocabulary \[0, 128\)",
    ):
        build([random_examples(1)[0], {"input_ids": [5, 500, 7], "loss_mask": [0, 1, 1]}])
    with caplog.at_level("WARNING"):
        build(random_examples(2) + no_labels[:1])
    assert "1 of 3 examples have no supervised token" in caplog.text


def test_target_stays_frozen_and_embeddings_come_from_it(tmp_path):
    target = make_target()
    target_before = {k: p.clone() for k, p in target.state_dict().items()}
    head = make_head(target, embed_from_target=True).float()
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=random_examples(4))
    mask_before = head.mask_embedding.detach().clone()
    trainer.train()
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    for k, v in target.state_dict().items():
        assert torch.equal(v, target_before[k]), k
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not torch.equal(head.mask_embedding, mask_before), "the mask embedding is learned"
    ckpt = os.path.join(args.output_dir, "checkpoint-2", "model.safetensors")
    with safe_open(ckpt, framework="pt") as fh:
        keys = set(fh.keys())
    assert "mask_embedding" in keys and "embed_tokens.weight" not in keys
    assert trainer.model is head and not isinstance(
        trainer.target_model, torch.nn.parallel.DistributedDataParallel
    )


def test_trainable_parameters_train_only_the_matching_weights(tmp_path):
    target = make_target()
    head = make_head(target).float()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    args = make_args(tmp_path, trainable_parameters=r"^lm_head\.")
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=random_examples(2))
    trainer.train()
    after = head.state_dict()
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    changed = [k for k in before if k != "lm_head.weight" and not torch.equal(after[k], before[k])]
    assert changed == [], changed
    assert [n for n, p in head.named_parameters() if p.requires_grad] == ["lm_head.weight"]
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        PEagleTrainer(
            model=make_head(target),
            target_model=target,
            args=make_args(tmp_path, trainable_parameters="no_such_weight"),
            train_dataset=random_examples(1),
        )
    with pytest.raises(ValueError, match="not a regex"):
        make_args(tmp_path, trainable_parameters="lm_head(")


def test_lr_scales_set_each_parameter_group_rate(tmp_path):
    # one SGD step from the same weights on the same batch: a parameter scaled by s moves s times as far
    target = make_target()
    data = random_examples(2)
    plain = make_head(target).float()
    scaled = make_head(target).float()
    scaled.load_state_dict(plain.state_dict())
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    PEagleTrainer(
        model=plain, target_model=target, args=make_args(tmp_path / "a"), train_dataset=data
    ).train()
    args = make_args(tmp_path / "b", lr_scales=["lm_head=0.5", r"^fc\.=0"])
    trainer = PEagleTrainer(model=scaled, target_model=target, args=args, train_dataset=data)
    trainer.train()
    floats = [k for k, v in before.items() if v.is_floating_point()]
    step = {k: plain.state_dict()[k] - before[k] for k in floats}
    moved = {k: scaled.state_dict()[k] - before[k] for k in floats}
    assert step["lm_head.weight"].abs().max() > 0 and step["fc.weight"].abs().max() > 0
    torch.testing.assert_close(moved["lm_head.weight"], 0.5 * step["lm_head.weight"])
    assert torch.equal(moved["fc.weight"], torch.zeros_like(step["fc.weight"]))
    torch.testing.assert_close(moved["layers.0.mlp.up_proj.weight"], step["layers.0.mlp.up_proj.weight"])
    rates = sorted(g["lr"] for g in trainer.optimizer.param_groups if g["params"])
    assert rates[0] == 0.0 and 0.5 in rates and rates[-1] == 1.0
    # an optimizer passed in keeps its own groups
    own = make_head(target).float()
    opt = torch.optim.SGD([p for p in own.parameters() if p.requires_grad], lr=1.0)
    PEagleTrainer(
        model=own, target_model=target, args=args, train_dataset=data, optimizers=(opt, None)
    ).train()
    assert len(opt.param_groups) == 1 and "lr_scale" not in opt.param_groups[0]
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        PEagleTrainer(
            model=make_head(target),
            target_model=target,
            args=make_args(tmp_path, lr_scales=["no_such_weight=0.1"]),
        )
    for bad in ("lm_head", "lm_head=x", "lm_head=-1", "lm_head(=0.1"):
        with pytest.raises(ValueError, match="lr_scales entry"):
            make_args(tmp_path, lr_scales=[bad])


# with scales, the optimizer's extra parameter groups resume too
@pytest.mark.parametrize("lr_scales", [[], ["lm_head=0.1"]])
def test_resume_from_checkpoint_continues_identically(tmp_path, lr_scales):
    target = make_target()
    data = random_examples(8, seed=5)
    common = dict(
        optim="adamw_torch",
        learning_rate=1e-2,
        per_device_train_batch_size=2,
        max_steps=4,
        lr_scales=lr_scales,
    )

    head_a = make_head(target).float()
    args_a = make_args(tmp_path / "a", **common)
    PEagleTrainer(model=head_a, target_model=target, args=args_a, train_dataset=data).train()

    args_b = make_args(tmp_path / "b", save_strategy="steps", save_steps=2, **common)
    head_b = make_head(target).float()
    trainer_b = PEagleTrainer(model=head_b, target_model=target, args=args_b, train_dataset=data)
    trainer_b.train()
    # the training time resumes too: checkpoint-2 says the run had trained 1,000 s (written as a long run's would be)
    record = os.path.join(args_b.output_dir, "checkpoint-2", COUNTS_FILE.format(0))
    with open(record) as fh:
        saved = json.load(fh)
    assert 0 < saved["training_seconds"] < 1000
    with open(record, "w") as fh:
        json.dump(saved | {"training_seconds": 1000.0}, fh)
    head_c = make_head(target, seed=7).float()  # different init: everything must come from the checkpoint
    trainer_c = PEagleTrainer(model=head_c, target_model=target, args=args_b, train_dataset=data)
    trainer_c.train(resume_from_checkpoint=os.path.join(args_b.output_dir, "checkpoint-2"))
    assert trainer_c.resumed_seconds == 1000.0 and 1000.0 < trainer_c.training_seconds() < 1000.0 + 600
    with open(os.path.join(args_b.output_dir, "checkpoint-4", COUNTS_FILE.format(0))) as fh:
        assert json.load(fh)["training_seconds"] > 1000.0
    for (k, a), (_, c) in zip(head_a.named_parameters(), head_c.named_parameters()):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6, msg=k)
    # the token-pass count resumes too: the resumed run counts every token-pass of the whole run, exactly
    assert trainer_c.response_tokens_trained() == trainer_b.response_tokens_trained() > 0
    assert not trainer_c.count_estimated


def test_resume_from_a_checkpoint_without_a_count_record_estimates_it(tmp_path):
    target = make_target()
    data = random_examples(8, seed=5)
    args = make_args(
        tmp_path, save_strategy="steps", save_steps=2, per_device_train_batch_size=2, max_steps=4
    )
    trainer = PEagleTrainer(
        model=make_head(target).float(), target_model=target, args=args, train_dataset=data
    )
    trainer.train()
    record = os.path.join(args.output_dir, "checkpoint-2", COUNTS_FILE.format(0))
    with open(record) as fh:
        first_half = json.load(fh)["response_tokens_trained"]
    os.remove(record)  # as older peagle wrote it
    resumed = PEagleTrainer(
        model=make_head(target).float(), target_model=target, args=args, train_dataset=data
    )
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    # checkpoint 2 is half an epoch (8 examples, 2 per step): half the data's response tokens, then counted exactly
    per_epoch = sum(sum(e["loss_mask"]) for e in data)
    assert resumed.count_estimated
    assert (
        resumed.response_tokens_trained()
        == round(0.5 * per_epoch) + trainer.response_tokens_trained() - first_half
    )


def test_resuming_into_a_head_of_another_shape_says_so(tmp_path):
    """A checkpoint of another head (draft vocabulary, layers) or another set of trainable parameters is refused
    naming the checkpoint and what differs, before transformers' size or parameter-group mismatch."""
    target = make_target()
    data = random_examples(4, seed=5)
    args = make_args(tmp_path, save_strategy="steps", save_steps=1, optim="adamw_torch", max_steps=1)
    PEagleTrainer(model=make_head(target).float(), target_model=target, args=args, train_dataset=data).train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-1")

    def resume(head):
        PEagleTrainer(model=head.float(), target_model=target, args=args, train_dataset=data).train(
            resume_from_checkpoint=checkpoint
        )

    with pytest.raises(ValueError, match=r"cannot resume from .*checkpoint-1: it holds a head of another shape "
                       r"\(.*lm_head.weight is \[128, 64\] there, \[64, 64\] here"):  # fmt: skip
        resume(make_head(target, draft_vocab_size=64))
    with pytest.raises(ValueError, match=r"it holds .* weights this head lacks, e.g. layers.1"):
        resume(make_head(target, num_hidden_layers=1))
    frozen = make_head(target)
    for name, p in frozen.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))
    with pytest.raises(
        ValueError, match=r"its optimizer trained \d+ parameter tensors .*, this head has 1 trainable"
    ):
        resume(frozen)
    resume(make_head(target))  # the same head resumes


def test_logs_per_depth_accuracy_and_evaluates(tmp_path):
    target = make_target()
    head = make_head(target).float()
    args = make_args(tmp_path, max_steps=2, per_device_eval_batch_size=2)
    trainer = PEagleTrainer(
        model=head,
        target_model=target,
        args=args,
        train_dataset=random_examples(4),
        eval_dataset=random_examples(2, 9),
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert {"acc_d0", "acc_d3", "supervised_elements"} <= set(logged[0])
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and 0.0 <= metrics["eval_acc_d0"] <= 1.0


def test_feature_cache_gives_the_online_gradient_and_is_reused(tmp_path):
    target = make_target()
    data = random_examples(2, seed=11)
    online, _ = update_after_one_step(target, data, tmp_path)
    head = make_head(target)
    cache = FeatureCache.build(
        target,
        data,
        tmp_path / "cache",
        head.config.eagle_aux_hidden_state_layer_ids,
        dtype=torch.float32,
        progress=False,
    )
    assert len(cache) == 2 and cache.size_bytes > 0 and "MiB" in repr(cache)
    shard = os.path.join(cache.directory, cache.index["locations"][0])
    stamp = os.path.getmtime(shard)
    again = FeatureCache.build(
        target,
        data,
        tmp_path / "cache",
        head.config.eagle_aux_hidden_state_layer_ids,
        dtype=torch.float32,
        progress=False,
    )
    assert os.path.getmtime(shard) == stamp and again.index == cache.index
    cached, _ = update_after_one_step(target, cache, tmp_path)
    assert rel_diff(cached, online) < 1e-5


def test_feature_cache_picks_a_dtype_the_targets_activations_fit(tmp_path, caplog):
    """Activations beyond float16's range (Gemma 3's reach 55,040 and more) are stored in bfloat16 by default; an
    explicit float16 is refused naming the cache; a cache that holds non-finite features is rebuilt, and training
    on one names it."""
    from safetensors.torch import load_file, save_file

    big = make_target()
    with torch.no_grad():
        big.get_input_embeddings().weight.mul_(1e7)  # the residual stream carries ~1e5
    data = random_examples(2, seed=11)
    ids = make_head(big).config.eagle_aux_hidden_state_layer_ids
    with caplog.at_level("WARNING", logger="peagle.data.features"):
        cache = FeatureCache.build(big, data, tmp_path / "big", ids, progress=False)
    assert cache.index["dtype"] == "torch.bfloat16" and cache.index["max_abs"] > 65504
    assert "beyond float16's range; storing them in bfloat16" in caplog.text
    assert all(bool(torch.isfinite(cache[i]["target_hidden_states"]).all()) for i in range(len(cache)))
    with pytest.raises(
        ValueError, match=r"feature cache .*fp16: the target's features reach .* float16's range"
    ):
        FeatureCache.build(big, data, tmp_path / "fp16", ids, dtype=torch.float16, progress=False)

    # a float16 cache that holds inf (as an older peagle built it): training names it, building again replaces it
    target = make_target()
    cache = FeatureCache.build(target, data, tmp_path / "old", ids, progress=False)
    assert cache.index["dtype"] == "torch.float16"
    shard = os.path.join(cache.directory, cache.index["locations"][0])
    tensors = load_file(shard)
    for key in tensors:
        tensors[key][0, 0] = float("inf")
    save_file(tensors, shard)
    index = dict(cache.index)
    del index["max_abs"]
    with open(os.path.join(cache.directory, FeatureCache.INDEX), "w") as fh:
        json.dump(index, fh)
    broken = FeatureCache(cache.directory)
    trainer = PEagleTrainer(
        model=make_head(target).float(), target_model=target, args=make_args(tmp_path), train_dataset=broken
    )
    with pytest.raises(FloatingPointError, match=r"the feature cache .*old holds non-finite target features"):
        trainer.train()
    caplog.clear()
    with caplog.at_level("WARNING", logger="peagle.data.features"):
        rebuilt = FeatureCache.build(target, data, tmp_path / "old", ids, progress=False)
    assert "holds non-finite features" in caplog.text and math.isfinite(rebuilt.index["max_abs"])


def test_rejects_wrong_arguments(tmp_path):
    target = make_target()
    head = make_head(target)
    with pytest.raises(ValueError, match="target_model"):
        PEagleTrainer(model=head, args=make_args(tmp_path), train_dataset=random_examples(1))
    with pytest.raises(ValueError, match="loss_type"):
        make_args(tmp_path, loss_type="mse")
    other = make_target(hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden size"):
        PEagleTrainer(
            model=head, target_model=other, args=make_args(tmp_path), train_dataset=random_examples(1)
        )


# ---------------------------------------------------------------------------------------------------- learning
def cycle_target(vocab: int = 32, seed: int = 0):
    """A real Llama target whose greedy next token is a fixed cycle over ids 3..vocab-2: identity decoder
    layers (zero output projections), orthonormal embeddings, lm_head rows pointing at each id's successor."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_target_config(vocab_size=vocab, num_hidden_layers=4)).eval()
    inner = torch.arange(3, vocab - 1)
    order = inner[torch.randperm(inner.numel())]
    succ = torch.arange(vocab)
    succ[order] = order.roll(-1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        q, _ = torch.linalg.qr(torch.randn(model.config.hidden_size, vocab))
        emb = q.T.contiguous()
        pred = torch.empty_like(succ)
        pred[succ] = torch.arange(vocab)
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb[pred] * 40.0)
    return model, succ


def acceptance(head, target, prompts, k: int) -> float:
    """Mean number of accepted drafts per round (greedy), drafting K tokens with one `draft()` call."""
    accepted = []
    for ids in prompts:
        out = target(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.config.eagle_aux_hidden_state_layer_ids], -1)
        cont = target.generate(ids, max_new_tokens=k + 1, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
        # the target's bonus token is cont[0]; drafts must match cont[1:]
        drafts = head.draft(torch.cat([ids[:, 1:], cont[None, :1]], 1), aux, num_speculative_tokens=k).tokens[
            0
        ]
        n = 0
        while n < k and int(drafts[n]) == int(cont[n + 1]):
            n += 1
        accepted.append(n)
    return sum(accepted) / len(accepted)


def test_a_few_hundred_steps_learn_a_deterministic_target(tmp_path):
    target, succ = cycle_target()
    g = torch.Generator().manual_seed(0)
    prompts = [[1, int(torch.randint(3, 31, (1,), generator=g))] for _ in range(48)]
    data = self_distill(target, prompts, max_new_tokens=30, batch_size=24, progress=False, eos_token_id=2)
    assert all(ex["input_ids"][i + 1] == int(succ[ex["input_ids"][i]]) for ex in data for i in range(2, 20))
    head = make_head(target, mask_token_id=31, num_parallel_positions=4).float()
    held_out = [torch.tensor([[1, 3 + i, int(succ[3 + i])]]) for i in range(0, 28, 3)]
    random_acc = acceptance(head, target, held_out, 4)
    args = make_args(
        tmp_path,
        optim="adamw_torch",
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        max_steps=200,
        logging_steps=50,
        cod_ratio=0.8,
    )
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < 0.3 * logs[0]["loss"]
    assert logs[-1]["acc_d3"] > 0.8
    trained_acc = acceptance(head.eval(), target, held_out, 4)
    assert random_acc < 0.5 and trained_acc > 3.0, (random_acc, trained_acc)


@pytest.mark.parametrize("flush", [True, False])
def test_denormals_are_flushed_while_training_only(tmp_path, flush):
    """CPU arithmetic on denormal floats (softmaxes over the draft vocabulary make many) is 10-20x slower: the
    trainer flushes them to zero for the duration of train() when asked (the default), and restores it."""
    from transformers import TrainerCallback

    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(float(torch.tensor([1e-40]) * 1.0))

    target = make_target()
    head = make_head(target)
    trainer = PEagleTrainer(
        model=head,
        target_model=target,
        args=make_args(tmp_path, flush_denormal=flush),
        train_dataset=random_examples(2),
        callbacks=[Probe()],
    )
    trainer.train()
    assert seen and all((v == 0.0) == flush for v in seen)
    assert float(torch.tensor([1e-40]) * 1.0) != 0.0


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_teacher_forced_acceptance_equals_drafting_rounds(tmp_path, mode):
    """evaluate_acceptance() measures, in one pass, the drafts that greedy verification accepts in a round started
    at every anchor: the same numbers as drafting each round with `head.draft` from the prefix."""
    from peagle.data.features import capture_features

    target = make_target()
    torch.manual_seed(0)
    examples = []
    for _ in range(3):
        prompt = torch.randint(3, 120, (1, 5))
        ids = greedy(target, prompt, max_new_tokens=20, min_new_tokens=20)
        examples.append({"input_ids": ids[0].tolist(), "loss_mask": [0] * 5 + [1] * (ids.shape[1] - 5)})
    head = make_head(target, drafting_mode=mode)
    args = make_args(tmp_path, max_steps=25, per_device_train_batch_size=3, learning_rate=0.5)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=examples)
    trainer.train()
    k = 3
    measured = evaluate_acceptance(trainer, examples, num_speculative_tokens=k, progress=False)

    head.eval()
    runs = []
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex["input_ids"]])
            aux, _ = capture_features(target, ids, None, head.config.eagle_aux_hidden_state_layer_ids)
            reference = target(ids).logits.argmax(-1)[0]  # position p predicts token p + 1
            length = ids.shape[1]
            for a in range(length):
                labels = [a + d + 2 for d in range(k)]
                if labels[-1] >= length or not all(ex["loss_mask"][p] for p in labels):
                    continue
                drafts = head.draft(ids[:, 1 : a + 2], aux[:, : a + 1], num_speculative_tokens=k).tokens[0]
                run = 0
                while run < k and int(drafts[run]) == int(reference[a + 1 + run]):
                    run += 1
                runs.append(run)
    runs = torch.tensor(runs, dtype=torch.float)
    assert measured["anchors"] == len(runs)
    assert (
        measured["acceptance_by_depth"][0] > 0
    )  # the trained head gets some drafts right: a real comparison
    assert measured["tokens_per_target_pass"] == pytest.approx(1 + float(runs.mean()))
    assert measured["acceptance_by_depth"] == pytest.approx(
        [float((runs > d).float().mean()) for d in range(k)]
    )


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_decoding_walk_equals_generate(tmp_path, mode):
    """The teacher-forced decoding walk gives the new tokens and target passes that `generate()` reports when it
    drafts K every round on the examples' prompts (their responses are the target's greedy continuations)."""
    target = make_target()
    torch.manual_seed(1)
    examples, prompts = [], []
    for _ in range(4):
        prompt = torch.randint(3, 120, (1, 5))
        ids = greedy(target, prompt, max_new_tokens=24, min_new_tokens=24)
        examples.append({"input_ids": ids[0].tolist(), "loss_mask": [0] * 5 + [1] * 24})
        prompts.append(prompt)
    head = make_head(target, drafting_mode=mode)
    args = make_args(tmp_path, max_steps=25, per_device_train_batch_size=4, learning_rate=0.5)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=examples)
    trainer.train()
    k, cap = 3, 18
    measured = evaluate_acceptance(
        trainer, examples, num_speculative_tokens=k, progress=False, max_new_tokens=cap
    )

    head.eval()
    tokens = passes = accepted = 0
    for prompt, ex in zip(prompts, examples):
        out = greedy(
            target,
            prompt,
            max_new_tokens=cap,
            min_new_tokens=cap,
            assistant_model=head,
            num_assistant_tokens=k,
            assistant_confidence_threshold=0.0,
        )
        assert out[0].tolist() == ex["input_ids"][: 5 + cap]
        stats = head.last_generation_stats
        tokens, passes = tokens + stats.generated_tokens, passes + stats.target_passes
        accepted += stats.accepted_tokens
    assert accepted > 0  # some rounds accept drafts: the walk's jumps are exercised
    assert (measured["decoded_tokens"], measured["decoded_target_passes"]) == (tokens, passes)
    assert measured["decoded_tokens_per_target_pass"] == pytest.approx(tokens / passes)
    # decoding crosses easy stretches in few rounds: it reads below the average over every anchor
    assert measured["decoded_tokens_per_target_pass"] <= measured["tokens_per_target_pass"] + 1e-9


def test_decoding_walk_jumps_cuts_and_restarts_at_each_response():
    """`decoding_walk` on a hand-made grid: a round moves past its accepted drafts and the bonus token, a round
    is cut at the response's end and at max_new_tokens, and a second response starts with its own prefill."""
    from peagle.evaluation.walk import decoding_walk

    k = 3
    correct = torch.zeros(20, k, dtype=torch.bool)
    correct[2] = True  # the round after anchor 2 would accept all three
    correct[6, 0] = True  # the round after anchor 6 accepts one
    mask = torch.tensor([0, 0, 0] + [1] * 9 + [0, 0] + [1] * 6)  # responses at 3..11 and 14..19
    # response 1: prefill -> token 3; anchor 2: 1 + 3 (tokens 4-7); anchor 6: 1 + 1 (8-9); anchors 8, 9: 1 each
    # (10, 11). Response 2: prefill -> 14; anchors 14..18 (none correct): 1 each. 9 + 6 tokens, 5 + 6 passes.
    assert decoding_walk(correct, mask) == (15, 11)
    # max_new_tokens=5: prefill (3), anchor 2 cut to 1 + 3 (4-7); response 2: prefill + 4 rounds
    assert decoding_walk(correct, mask, max_new_tokens=5) == (10, 7)
    # a run cut by the response's end: only the drafts whose tokens are left count
    correct[8] = True
    assert decoding_walk(correct, mask) == (15, 10)


@pytest.mark.parametrize("seed", [0, 7])
def test_epoch_order_is_the_trainers_own_visit_order(tmp_path, seed):
    """`epoch_order` names the examples a stopped run saw; it must match the sampler the trainer really uses."""
    from peagle.training.trainer import epoch_order

    target = make_target()
    data = random_examples(23)
    args = make_args(tmp_path, per_device_train_batch_size=1, seed=seed)
    trainer = PEagleTrainer(model=make_head(target), target_model=target, args=args, train_dataset=data)
    loader = trainer.get_train_dataloader()
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        visited = [i for batch in loader.batch_sampler for i in batch]
        assert visited == epoch_order(len(data), seed, epoch)
    assert epoch_order(len(data), seed) != epoch_order(len(data), seed + 1)
