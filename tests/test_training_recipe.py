"""The recipe's building blocks: training arguments, head construction, and train_head's evaluation guard."""

from __future__ import annotations

import pytest
import torch

from helpers import make_head, make_target, tiny_tokenizer
from peagle import PEagleConfig
from peagle.data import evalsets
from peagle.training import (
    DataArguments,
    HeadArguments,
    PEagleTrainingArguments,
    build_head,
    train_head,
    training_arguments,
)
from peagle.training.head_surgery import init_layers_from_target
from peagle.training.recipe import format_summary


def one_step_args(tmp_path):
    """The recipe's arguments for one optimizer step of one example, K_train 3, on the CPU, saving nothing."""
    return training_arguments(
        tmp_path / "ckpt", num_parallel_positions=3, max_steps=1, gradient_accumulation_steps=1, use_cpu=True,
        save_strategy="no", progress=False,
    )  # fmt: skip


def test_training_arguments_recipe_defaults_and_overrides(tmp_path):
    args = training_arguments(tmp_path / "ckpt", use_cpu=True)
    assert isinstance(args, PEagleTrainingArguments)
    assert args.output_dir == str(tmp_path / "ckpt")
    # K_train left to the head's config (default 8): one definition, in PEagleConfig
    assert args.num_parallel_positions is None and PEagleConfig().num_parallel_positions == 8
    assert args.cod_ratio == 0.7 and args.cod_min_ratio == 0.2
    assert args.learning_rate == 3e-4 and args.gradient_accumulation_steps == 8 and args.seed == 42
    assert args.loss_type == "kl" and args.report_to == [] or args.report_to == "none"
    args = training_arguments(
        tmp_path, num_parallel_positions=4, save_strategy="no", save_total_limit=2, optim="sgd", use_cpu=True
    )
    assert args.num_parallel_positions == 4 and args.save_total_limit == 2 and args.optim == "sgd"
    with pytest.raises(ValueError, match="loss_type"):
        training_arguments(tmp_path, loss_type="mse", use_cpu=True)


def test_build_head_config_and_draft_vocabulary():
    target = make_target()
    examples = [{"input_ids": [1, 5, 6, 6, 9, 2], "loss_mask": [0, 0, 1, 1, 1, 1]}] * 3
    head = build_head(
        target,
        examples,
        HeadArguments(
            drafting_mode="autoregressive",
            num_hidden_layers=1,
            draft_vocab_size=16,
            embed_from_target=True,
            mask_token_id=100,
        ),
        num_parallel_positions=5,
        num_speculative_tokens=3,
        target_model_name="tiny",
    )
    cfg = head.config
    assert (cfg.drafting_mode, cfg.num_hidden_layers, cfg.draft_vocab_size) == ("autoregressive", 1, 16)
    assert (cfg.num_parallel_positions, cfg.num_speculative_tokens, cfg.mask_token_id) == (5, 3, 100)
    assert cfg.embed_from_target and cfg.target_model_name == "tiny"
    assert next(head.parameters()).dtype == torch.float32
    vocab = head.t2d.nonzero().flatten().tolist()
    assert {2, 5, 6, 9} <= set(vocab) and len(vocab) == 16  # response tokens and EOS (id 2) are kept
    full = build_head(target, attn_implementation="eager")
    assert full.config.draft_vocab_size == 128 and full.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="examples"):
        build_head(target, head_args=HeadArguments(draft_vocab_size=16))
    with pytest.raises(TypeError, match=r"\['draft_vocab_size'\] in head_args"):
        build_head(target, draft_vocab_size=16)


def test_train_head_with_argument_object_and_evaluation_guard(tmp_path, monkeypatch):
    target, tok = make_target(), tiny_tokenizer()
    examples = [
        {"input_ids": tok("write code please the bot of the", add_special_tokens=False)["input_ids"],
         "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
    ] * 2  # fmt: skip
    args = one_step_args(tmp_path)
    head, summary = train_head(
        target, tok, output_dir=tmp_path / "head", examples=examples, training_args=args
    )
    assert summary["optimizer_steps"] == 1 and summary["num_parallel_positions"] == 3
    assert "optimizer steps" in format_summary(summary)
    monkeypatch.setattr(evalsets, "_evaluation_fingerprints", lambda: frozenset({"write code please"}))
    with pytest.raises(ValueError, match="train_head examples: prompt 0 .*write code please"):
        train_head(target, tok, output_dir=tmp_path / "head2", examples=examples, training_args=args)
    with pytest.raises(ValueError, match="needs prompts"):
        train_head(target, tok, output_dir=tmp_path / "head3", training_args=args)
    with pytest.raises(ValueError, match=r"generation_batch_size is 0; expected an integer"):
        train_head(
            target,
            tok,
            output_dir=tmp_path / "h4",
            prompts=["hi"],
            data_args=DataArguments(generation_batch_size=0),
            training_args=args,
        )


def test_sizing_log_says_given_only_for_what_the_caller_gave(caplog):
    target = make_target()
    examples = [{"input_ids": [1, 5, 6, 6, 9, 2], "loss_mask": [0, 0, 1, 1, 1, 1]}] * 3
    with caplog.at_level("INFO", logger="peagle.sizing"):
        build_head(target, examples)
    assert "draft_vocab_size: 128 (the size rule's)" in caplog.text and "(given)" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="peagle.sizing"):
        build_head(target, examples, HeadArguments(draft_vocab_size=16, num_hidden_layers=1))
    assert "draft_vocab_size: 16 (given)" in caplog.text and "num_hidden_layers: 1 (given)" in caplog.text
    caplog.clear()
    wide = make_target(vocab_size=9216)  # above the 8,192 floor: the size comes from the data
    with caplog.at_level("INFO", logger="peagle.sizing"):
        build_head(wide, examples)
    assert (
        "draft_vocab_size: 8192 (chosen from the training data" in caplog.text
        and "(given)" not in caplog.text
    )


def test_train_head_fits_the_draft_calibration_on_held_out_examples(tmp_path):
    """With calibration_examples=N, the last N examples are not trained on; after training, the head's per-depth
    draft calibration (cost-aware drafting) is fitted on their prompts, stored in its saved config with the
    held-out calibration error, and reported in the summary."""
    from peagle import PEagleDrafter

    target = make_target(eos_token_id=None)
    g = torch.Generator().manual_seed(0)
    examples = [
        {"input_ids": torch.randint(3, 120, (30,), generator=g).tolist(), "loss_mask": [0] * 6 + [1] * 24}
        for _ in range(12)
    ]
    args = one_step_args(tmp_path)
    head, summary = train_head(
        target, output_dir=tmp_path / "head", examples=examples, training_args=args,
        data_args=DataArguments(calibration_examples=4), head_args=HeadArguments(draft_vocab_size=64),
    )  # fmt: skip
    assert summary["examples"] == 8  # 4 held out
    saved = PEagleDrafter.from_pretrained(tmp_path / "head").config.draft_calibration
    assert saved["method"] == "isotonic" and saved["data"]["examples"] == 4
    assert len(saved["x"]) >= 1 and summary["calibration"] == saved["report"]
    with pytest.raises(ValueError, match="leaves nothing to train on"):
        train_head(
            target,
            output_dir=tmp_path / "h2",
            examples=examples,
            training_args=args,
            data_args=DataArguments(calibration_examples=12),
        )


def test_train_head_drops_a_continued_heads_stale_calibration(tmp_path, caplog):
    """A head continued from a calibrated one leaves training without the old map (fitted to other weights)."""
    from peagle import PEagleDrafter

    target = make_target(eos_token_id=None)
    g = torch.Generator().manual_seed(0)
    examples = [
        {"input_ids": torch.randint(3, 120, (30,), generator=g).tolist(), "loss_mask": [0] * 6 + [1] * 24}
        for _ in range(4)
    ]
    head = build_head(
        target, examples, HeadArguments(num_hidden_layers=1, draft_vocab_size=64), num_parallel_positions=3
    )
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.0, 1.0]]}
    args = one_step_args(tmp_path)
    with caplog.at_level("WARNING", logger="peagle.training"):
        trained, _ = train_head(
            target,
            output_dir=tmp_path / "head",
            examples=examples,
            head=head,
            training_args=args,
        )
    assert trained.config.draft_calibration is None and "peagle calibrate" in caplog.text
    assert PEagleDrafter.from_pretrained(tmp_path / "head").config.draft_calibration is None


def test_build_head_layers_from_the_targets_last_layers():
    target = make_target()
    head = build_head(target, head_args=HeadArguments(num_hidden_layers=2, layers_init="target"))
    source = target.model.layers[-2:]
    hidden = head.config.hidden_size
    fused, plain = head.layers
    for name in ("q_proj", "k_proj", "v_proj"):  # the hidden-state columns of the fused projections
        ours = getattr(fused.self_attn, name).weight
        assert torch.equal(ours[:, hidden:], getattr(source[0].self_attn, name).weight)
        assert not torch.equal(ours[:, :hidden], getattr(source[0].self_attn, name).weight)
    assert torch.equal(fused.self_attn.o_proj.weight, source[0].self_attn.o_proj.weight)
    assert torch.equal(fused.mlp.down_proj.weight, source[0].mlp.down_proj.weight)
    assert torch.equal(fused.hidden_norm.weight, source[0].input_layernorm.weight)
    for (name, ours), theirs in zip(plain.state_dict().items(), source[1].state_dict().values()):
        assert torch.equal(ours, theirs), name
    random = build_head(target, head_args=HeadArguments(num_hidden_layers=2))
    assert not torch.equal(random.layers[1].mlp.up_proj.weight, source[1].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="decoder layers"):
        build_head(
            make_target(num_hidden_layers=1),
            head_args=HeadArguments(num_hidden_layers=2, layers_init="target"),
        )
    with pytest.raises(ValueError, match="layers_init"):
        build_head(target, head_args=HeadArguments(layers_init="copy"))
    target.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(8))  # another layer family
    with pytest.raises(ValueError, match="shares no weight"):
        init_layers_from_target(random, target)


def test_resize_draft_vocab_keeps_trained_rows_and_maps_the_targets_rows_for_new_ids(tmp_path):
    """Kept ids keep their trained LM-head rows, every other weight is copied, and new ids' rows are the target's
    output rows through the linear map fitted on the kept ones (a single scale when too few are kept)."""
    from peagle import PEagleDrafter
    from peagle.training import resize_draft_vocab

    target = make_target(hidden_size=16, intermediate_size=32)
    rows_of = target.get_output_embeddings().weight.detach()
    examples = [{"input_ids": list(range(3, 120)), "loss_mask": [1] * 117}]
    head = build_head(
        target, examples, HeadArguments(num_hidden_layers=1, draft_vocab_size=40), num_parallel_positions=3
    )
    own = head.draft_vocab_ids
    mapping = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        head.lm_head.weight.copy_(rows_of[own] @ mapping)
    ids = torch.cat([own, torch.tensor([120, 121, 125])]).sort().values
    new = resize_draft_vocab(head, target, ids)
    assert new.config.draft_vocab_size == 43 and new.draft_vocab_ids.tolist() == ids.tolist()
    assert new.t2d.nonzero().flatten().tolist() == ids.tolist() and head.config.draft_vocab_size == 40
    rows = dict(zip(ids.tolist(), new.lm_head.weight.detach()))
    for i, t in enumerate(own.tolist()):
        assert torch.equal(rows[t], head.lm_head.weight[i].detach())
    for t in (120, 121, 125):
        torch.testing.assert_close(rows[t], rows_of[t] @ mapping, atol=1e-4, rtol=1e-4)
    old = head.state_dict()
    for name, value in new.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(value, old[name]), name
    new.save_pretrained(tmp_path / "grown")
    assert PEagleDrafter.from_pretrained(tmp_path / "grown").config.draft_vocab_size == 43

    few = build_head(
        target, examples, HeadArguments(num_hidden_layers=1, draft_vocab_size=8), num_parallel_positions=3
    )
    few_ids = few.draft_vocab_ids
    with torch.no_grad():
        few.lm_head.weight.copy_(3 * rows_of[few_ids])
    grown = resize_draft_vocab(few, target, torch.cat([few_ids, torch.tensor([126])]))
    torch.testing.assert_close(grown.lm_head.weight[-1].detach(), 3 * rows_of[126])


def test_train_head_grows_a_continued_heads_draft_vocabulary(tmp_path, caplog):
    """train_head(head=..., head_args=HeadArguments(draft_vocab_size=larger)) keeps every id the head had, adds the examples' most frequent
    others, logs the coverage before and after, and trains the grown head."""
    target = make_target(eos_token_id=2)
    first = [{"input_ids": list(range(3, 40)), "loss_mask": [1] * 37}]
    head = build_head(
        target, first, HeadArguments(num_hidden_layers=1, draft_vocab_size=32), num_parallel_positions=3
    )
    own = set(head.draft_vocab_ids.tolist())
    later = [{"input_ids": [5] * 4 + list(range(60, 100)) * 2, "loss_mask": [0] * 4 + [1] * 80}] * 2
    args = one_step_args(tmp_path)
    with caplog.at_level("INFO", logger="peagle.training"):
        trained, summary = train_head(
            target, output_dir=tmp_path / "head", examples=later, head=head, training_args=args,
            head_args=HeadArguments(draft_vocab_size=48),
        )  # fmt: skip
    ids = set(trained.t2d.nonzero().flatten().tolist())
    assert summary["draft_vocab_size"] == 48 and own <= ids and len(ids & set(range(60, 100))) == 16
    assert "32 -> 48 ids" in caplog.text and "0.0% -> 40.0%" in caplog.text


@pytest.mark.parametrize("have", [1, 2])
def test_grow_layers_appends_layers_that_add_nothing_until_trained(tmp_path, have):
    """The grown head keeps every weight, its new layers copy the last plain layer (fresh ones after a fused-only
    head) with zeroed output projections, so it drafts exactly as before; training then moves the new layers."""
    from peagle import PEagleDrafter
    from peagle.training import grow_layers

    target = make_target()
    head = make_head(target, num_hidden_layers=have)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (1, 9), generator=g)
    feats = torch.randn(1, 9, 3 * head.config.target_hidden_size, generator=g)
    grown = grow_layers(head, have + 2)
    assert grown.config.num_hidden_layers == have + 2 and len(grown.layers) == have + 2
    torch.testing.assert_close(grown(ids, feats).logits, head(ids, feats).logits, atol=0, rtol=0)
    old = head.state_dict()
    for name, value in grown.state_dict().items():
        if name in old:
            assert torch.equal(value, old[name]), name
    for layer in grown.layers[have:]:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        if have > 1:  # a copy of the last plain layer, but for the zeroed projections
            assert torch.equal(layer.self_attn.q_proj.weight, head.layers[-1].self_attn.q_proj.weight)
        else:
            assert layer.self_attn.q_proj.weight.abs().sum() > 0
    grown.save_pretrained(tmp_path / "grown")
    assert PEagleDrafter.from_pretrained(tmp_path / "grown").config.num_hidden_layers == have + 2
    with pytest.raises(ValueError, match="does not shrink"):
        grow_layers(head, have)
    with pytest.raises(TypeError, match="PEagleDrafter"):
        grow_layers(torch.nn.Linear(2, 2), 3)


def test_train_head_grows_a_continued_heads_layers(tmp_path):
    """train_head(head=..., head_args=HeadArguments(num_hidden_layers=more)) appends layers and trains them: their zeroed output
    projections move, and the summary records the new depth."""
    target = make_target(eos_token_id=2)
    examples = [{"input_ids": list(range(3, 40)), "loss_mask": [0] * 5 + [1] * 32}]
    head = build_head(
        target, examples, HeadArguments(num_hidden_layers=1, draft_vocab_size=32), num_parallel_positions=3
    )
    args = training_arguments(
        tmp_path / "ckpt", num_parallel_positions=3, max_steps=1, gradient_accumulation_steps=1, use_cpu=True,
        save_strategy="no", progress=False, warmup_steps=0, learning_rate=1e-2,
    )  # fmt: skip
    trained, summary = train_head(
        target, output_dir=tmp_path / "head", examples=examples, head=head, training_args=args,
        head_args=HeadArguments(num_hidden_layers=2),
    )  # fmt: skip
    assert summary["num_hidden_layers"] == 2 and trained.config.num_hidden_layers == 2
    assert trained.layers[1].mlp.down_proj.weight.abs().sum() > 0


def test_train_head_checks_examples_it_is_given(tmp_path):
    target = make_target()
    good = {"input_ids": [1, 5, 6, 6, 9, 2], "loss_mask": [0, 0, 1, 1, 1, 1]}
    args = one_step_args(tmp_path)
    for bad, message in (
        ({"input_ids": [1, 5, 6], "loss_mask": [0, 2, 1]}, r"row 1: loss_mask holds 2"),
        ({"input_ids": [1, 5, 6]}, r"row 1: no 'loss_mask' field"),
        ({"input_ids": torch.tensor([1, 5]), "loss_mask": (0, 1, 1)}, r"row 1: loss_mask has 3 entries"),
    ):
        with pytest.raises(ValueError, match=rf"train_head examples, {message}"):
            train_head(target, output_dir=tmp_path / "h", examples=[good, bad], training_args=args)


def test_train_head_over_a_folder_holding_a_sharded_head_leaves_only_the_new_head(tmp_path):
    """`peagle train --output d` over a sharded head left d unloadable (the old index beside the new file)."""
    import json

    from peagle import PEagleDrafter, load_head

    target = make_target(eos_token_id=None)
    out = tmp_path / "head"
    old = make_head(target, seed=5)
    old.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    (out / "examples.jsonl").write_text("{}\n")  # what a training run keeps in its folder stays
    g = torch.Generator().manual_seed(0)
    examples = [
        {"input_ids": torch.randint(3, 120, (30,), generator=g).tolist(), "loss_mask": [0] * 6 + [1] * 24}
        for _ in range(4)
    ]
    head, _ = train_head(
        target, output_dir=out, examples=examples, training_args=one_step_args(tmp_path),
        head_args=HeadArguments(draft_vocab_size=64),
    )  # fmt: skip
    assert not (out / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert (out / "examples.jsonl").read_text() == "{}\n" and (out / "train_summary.json").is_file()
    loaded = load_head(out)
    assert loaded.config.draft_vocab_size == 64 and isinstance(loaded, PEagleDrafter)
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)
    assert json.loads((out / "train_summary.json").read_text())["draft_vocab_size"] == 64


def test_check_saved_head_refuses_a_folder_that_does_not_reload_with_the_head(tmp_path):
    from peagle.training.recipe import check_saved_head

    target = make_target()
    head = make_head(target, num_speculative_tokens=5)
    head.save_pretrained(tmp_path / "h")
    check_saved_head(tmp_path / "h", head)
    head.config.num_speculative_tokens = 3
    with pytest.raises(ValueError, match="reloads with num_speculative_tokens 5 instead of 3"):
        check_saved_head(tmp_path / "h", head)


@pytest.mark.parametrize("layers", [0, -1])
def test_build_head_refuses_a_head_without_layers(layers):
    """A config saying 0 layers described a head that had 1 (the fused layer): its vLLM export did not reload."""
    with pytest.raises(ValueError, match=f"num_hidden_layers is {layers}; expected an integer >= 1"):
        build_head(make_target(), head_args=HeadArguments(num_hidden_layers=layers))


def test_public_functions_of_the_training_api_take_at_most_ten_parameters():
    """Settings travel in dataclasses (`PEagleTrainingArguments`, `DataArguments`, `HeadArguments`,
    `GenerationSettings`, ...) or keywords forwarded to the function that reads them, never in long signatures."""
    import importlib
    import inspect

    from peagle.cli import COMMANDS

    modules = [
        "peagle.training.recipe",
        "peagle.training.arguments",
        "peagle.data.distill",
        "peagle.integrations.hub",
    ]
    modules += ["peagle.cli", "peagle.cli._common"] + [f"peagle.cli.{c.replace('-', '_')}" for c in COMMANDS]
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.startswith("_") or not inspect.isfunction(value) or value.__module__ != name:
                continue
            assert len(inspect.signature(value).parameters) <= 10, f"{name}.{attr}"


def test_same_seed_trains_bit_identical_heads(tmp_path):
    """`training_args.seed` fixes the new head's initial weights and the run: two runs with seed 7 give the same
    head bit for bit, whatever torch's global generator held before (and seed 8 gives another)."""
    target, tok = make_target(), tiny_tokenizer()
    examples = [
        {"input_ids": tok("write code please the bot of the and to", add_special_tokens=False)["input_ids"],
         "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1, 1]},
    ] * 2  # fmt: skip
    heads = []
    for run, (seed, noise) in enumerate([(7, 0), (7, 123), (8, 0)]):
        torch.manual_seed(noise)  # what the process did before must not matter
        args = one_step_args(tmp_path / str(run))
        args.seed = seed
        head, _ = train_head(
            target, tok, output_dir=tmp_path / f"head{run}", examples=examples, training_args=args
        )
        heads.append({k: v.clone() for k, v in head.state_dict().items()})
    assert heads[0].keys() == heads[1].keys()
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
    assert any(not torch.equal(heads[0][k], heads[2][k]) for k in heads[0])
