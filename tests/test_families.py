"""Every target family of the matrix (`peagle.sizing.FAMILIES`), on tiny random configs built from transformers'
config classes: a head from `for_target`, lossless drafting in `generate()` (greedy token for token, sampling within
the target's distribution), one partitioned training step, save/load, and the vLLM export where vLLM serves the
family.  Plus the size rule on a Gemma-3-270M-shaped config and the families that cannot work."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers import Oracle, check_tree_logits, make_args, make_target, random_examples
from peagle import PEagleConfig, PEagleDrafter, export, sizing
from peagle.sizing import (
    FAMILIES,
    HEAD_BUDGET,
    ROUND_BUDGET,
    SLOT_COST,
    VOCAB_CAP,
    head_parameters,
    plan_head,
    round_cost,
    target_step_cost,
)
from peagle.training import HeadArguments, PEagleTrainer, build_head

WINDOW = 8  # sliding window of the tiny targets that have one: generation runs past it, so rollbacks cross it
COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "gemma2": (
        transformers.Gemma2Config,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },  # fmt: skip
    ),
    "phi3": (transformers.Phi3Config, {}),
    "olmo2": (transformers.Olmo2Config, {}),
    "gpt_oss": (
        transformers.GptOssConfig,
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    "gpt2": (
        transformers.GPT2Config,
        {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 256, "bos_token_id": 1, "eos_token_id": 2},
    ),
}
MATRIX = sorted(CONFIGS)


def test_matrix_is_the_family_table():
    assert set(CONFIGS) == set(FAMILIES)
    assert {m for m in FAMILIES if FAMILIES[m].vllm_eagle3} == set(FAMILIES) & sizing.VLLM_EAGLE3_MODEL_TYPES


def target_config(family: str):
    cls, extra = CONFIGS[family]
    values = {} if family == "gpt2" else dict(COMMON)
    values.update(extra)
    if family == "gpt2":
        values["vocab_size"] = COMMON["vocab_size"]
    return cls(**values)


@functools.cache
def _target(family: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(target_config(family)).eval()
    assert model.config.model_type == family
    return model


@pytest.fixture(params=MATRIX)
def family(request) -> str:
    return request.param


@pytest.fixture
def target(family):
    return _target(family)


def new_head(target, **overrides) -> PEagleDrafter:
    torch.manual_seed(1)
    values = dict(num_hidden_layers=1, mask_token_id=127, confidence_threshold=0.0)
    values.update(overrides)
    return PEagleDrafter(PEagleConfig.for_target(target, **values)).eval()


def prompt(seed: int, length: int = 10) -> torch.LongTensor:
    return torch.randint(3, 127, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- for_target
def test_for_target_maps_fields(family, target):
    cfg = PEagleConfig.for_target(target)
    tc = target.config
    assert cfg.target_model_type == family and cfg.vocab_size == 128
    assert cfg.hidden_size == cfg.target_hidden_size == 64 and cfg.num_attention_heads == 4
    assert cfg.head_dim == (getattr(tc, "head_dim", None) or 16)
    assert cfg.num_key_value_heads == (getattr(tc, "num_key_value_heads", None) or 4)
    assert cfg.hidden_act == "silu" and not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.embed_from_target and cfg.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert cfg.num_speculative_tokens <= cfg.num_parallel_positions
    assert "partial_rotary_factor" not in cfg.rope_parameters
    expected_theta = {"gemma3_text": 1_000_000.0, "gpt_oss": 150_000.0}.get(family, 10_000.0)
    assert cfg.rope_parameters["rope_theta"] == expected_theta
    # K follows a smaller K_train; explicit fields win
    assert PEagleConfig.for_target(target, num_parallel_positions=4).num_speculative_tokens == 4
    assert PEagleConfig.for_target(target, num_hidden_layers=3).num_hidden_layers == 3


def test_plan_notes_name_the_drafters_own_fields():
    gemma = plan_head(target_config("gemma3_text"))
    text = gemma.describe()
    assert "gelu_pytorch_tanh" in text and "'full_attention' layers'" in text and "sliding_window" in text
    assert "sqrt(hidden_size)" in text and "tie_word_embeddings" in text
    assert "the target has no RoPE" in plan_head(target_config("gpt2")).describe()


# ---------------------------------------------------------------------------------------------- generate()
def test_greedy_lossless_past_the_sliding_window(family, target):
    """Oracle drafts are accepted often, so the target's cache is rolled back many times, across the window."""
    head = new_head(target)
    accepted = 0
    for seed in range(2):
        ids = prompt(seed)
        ref = target.generate(ids, do_sample=False, max_new_tokens=3 * WINDOW, min_new_tokens=3 * WINDOW)
        oracle = Oracle(head, ref, p=0.8, seed=seed)
        out = target.generate(
            ids, do_sample=False, max_new_tokens=3 * WINDOW, min_new_tokens=3 * WINDOW, assistant_model=head
        )
        oracle.handle.remove()
        assert torch.equal(out, ref), f"{family}: speculative greedy output differs from plain greedy"
        stats = head.last_generation_stats
        assert stats.drafter_forward_calls == stats.rounds
        accepted += stats.accepted_tokens
    assert accepted > 10


def test_default_settings_past_the_sliding_window(family, target, tmp_path, monkeypatch):
    """Default settings (the cost rule) on a context longer than the window: the rule measures this target's
    verify cost first (a fresh cost cache), which rolls a cache back past the window; then rounds verify drafts
    and roll the target's cache back across it.  Output identical to plain greedy."""
    from peagle.generation.cost import forget_cost_models

    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path))
    forget_cost_models()
    head = new_head(target, confidence_threshold=None)
    assert head.config.confidence_threshold is None  # the default: cost-aware drafting
    ids = prompt(5, length=12)  # longer than the window
    ref = target.generate(ids, do_sample=False, max_new_tokens=3 * WINDOW, min_new_tokens=3 * WINDOW)
    oracle = Oracle(head, ref, p=0.9, seed=5)
    try:
        out = target.generate(
            ids, do_sample=False, max_new_tokens=3 * WINDOW, min_new_tokens=3 * WINDOW, assistant_model=head
        )
    finally:
        oracle.handle.remove()
        forget_cost_models()
    assert torch.equal(out, ref), f"{family}: default-settings output differs from plain greedy"
    stats = head.last_generation_stats
    assert stats.draft_policy == "cost" and list(tmp_path.glob("*.json")), "the verify cost was not measured"
    assert stats.accepted_tokens > 0, "no draft was verified: the rollback path did not run"


def test_sampling_stays_in_the_targets_distribution(family, target):
    """Sampling with top-k 3: every token is in the target's own top 3 given its prefix, and the second token's
    frequencies match the target's exact marginal (drafts are accepted or resampled, never passed through)."""
    head = new_head(target)
    ids = prompt(7, length=6)
    n0 = ids.shape[1]
    greedy_ref = target.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    oracle = Oracle(head, greedy_ref, p=0.7, seed=3)
    torch.manual_seed(0)
    runs = 60
    outs = [
        target.generate(
            ids, do_sample=True, top_k=3, max_new_tokens=3, min_new_tokens=3, assistant_model=head,
            num_assistant_tokens=3,
        )[0, n0:].tolist()
        for _ in range(runs)
    ]  # fmt: skip
    oracle.handle.remove()
    with torch.no_grad():
        first = target(ids).logits[0, -1].float()
        first[2] = float("-inf")  # min_new_tokens keeps EOS out
        top1 = first.topk(3)
        p1 = top1.values.softmax(-1)
        marginal = torch.zeros(128)
        allowed: dict[tuple, set] = {(): set(top1.indices.tolist())}
        for t1, q in zip(top1.indices.tolist(), p1.tolist()):
            nxt = target(torch.cat([ids, torch.tensor([[t1]])], 1)).logits[0, -1].float()
            nxt[2] = float("-inf")
            nxt = nxt.topk(3)
            marginal[nxt.indices] += q * nxt.values.softmax(-1)
            allowed[(t1,)] = set(nxt.indices.tolist())
    for out in outs:
        assert out[0] in allowed[()], f"{family}: first token outside the target's top 3"
        assert out[1] in allowed[(out[0],)], f"{family}: second token outside the target's top 3"
    empirical = torch.bincount(torch.tensor([o[1] for o in outs]), minlength=128).float() / runs
    assert 0.5 * float((empirical - marginal).abs().sum()) < 0.3
    assert head.last_generation_stats.rounds > 0


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_batches_with_trees_and_lookup_equal_plain_batched_greedy(family, target, mode):
    """B = 4 left-padded prompts of different lengths, 8-node trees with prompt-lookup branches, an oracle drafter
    right about half the time (drafts accepted and rejected, rows keeping different numbers), generation three
    windows long on the sliding-window families: every row equals plain batched greedy."""
    head = new_head(target, drafting_mode=mode)
    rows = [prompt(40 + i, length=n)[0] for i, n in enumerate([12, 5, 9, 3])]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    kw = dict(do_sample=False, max_new_tokens=3 * WINDOW, min_new_tokens=3 * WINDOW, pad_token_id=0)
    ref = target.generate(ids, attention_mask=mask, **kw)
    singles = [target.generate(r[None], **kw)[0] for r in rows]
    oracle = Oracle(head, singles, p=0.5, seed=11, second=True)
    try:
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=head,
            draft_tree_size=8,
            prompt_lookup_num_tokens=2,
            **kw,
        )
    finally:
        oracle.handle.remove()
    assert torch.equal(out, ref), (
        f"{family} ({mode}): batched tree drafting differs from plain batched greedy"
    )
    stats = head.last_generation_stats
    assert stats.batch_size == 4 and stats.tree_rounds > 0 and stats.accepted_tokens > 0


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_draft_trees_reach_the_attention_intact(family, attn):
    """A draft tree's mask reaches this family's attention as built (every slot gets its own path's logits), and
    generate() with trees is identical to plain greedy on every family, sliding-window ones included (their
    window is masked by position)."""
    from peagle.generation.tree import grow_tree

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(target_config(family), attn_implementation=attn).eval()
    except ValueError as err:  # e.g. GPT-OSS has no SDPA path in transformers
        pytest.skip(f"transformers itself refuses {attn} attention for {family}: {str(err)[:80]}")
    assert model.config._attn_implementation == attn
    tree = grow_tree([[(5, 0.6), (6, 0.3)], [(7, 0.5), (8, 0.4)], [(9, 0.5)]], budget=9)
    check_tree_logits(model, tree)

    head = new_head(model)
    ids = prompt(9)
    ref = model.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    oracle = Oracle(head, ref, p=0.5, seed=3, second=True)
    out = model.generate(
        ids, do_sample=False, max_new_tokens=16, min_new_tokens=16, assistant_model=head, draft_tree_size=8
    )
    oracle.handle.remove()
    assert torch.equal(out, ref), f"{family} ({attn}): tree drafting output differs from plain greedy"
    stats = head.last_generation_stats
    assert stats.tree_rounds == stats.rounds > 0 and stats.accepted_tokens > 0


def test_one_partitioned_training_step(family, target, tmp_path):
    examples = random_examples(4, seed=1)
    head = build_head(target, examples, HeadArguments(num_hidden_layers=1, mask_token_id=127))
    assert head.config.embed_from_target and head.config.draft_vocab_size == 128
    emb = target.get_input_embeddings().weight.detach().clone()
    rows = target.get_output_embeddings().weight.detach()
    scaled = rows * (head.config.initializer_range / rows.std())
    torch.testing.assert_close(head.lm_head.weight, scaled, msg="the LM head starts from the target's rows")
    before = {k: v.detach().clone() for k, v in head.named_parameters() if v.requires_grad}
    args = make_args(tmp_path, sequence_partitions=2, num_parallel_positions=3)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=examples)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [k for k, v in head.named_parameters() if k in before and not torch.equal(v, before[k])]
    assert "fc.weight" in changed and "mask_hidden" in changed and "mask_embedding" in changed
    assert not head.embed_tokens.weight.requires_grad
    assert torch.equal(target.get_input_embeddings().weight, emb), "the shared embeddings stay frozen"
    assert head.config.num_speculative_tokens == 3  # K follows the K_train it was trained with


# ---------------------------------------------------------------------------------------------- save / export
def test_save_load_and_vllm_export(family, target, tmp_path):
    head = new_head(target, num_hidden_layers=2)
    head.attach_target(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (1, 6), generator=g)
    feats = torch.randn(1, 6, 3 * 64, generator=g)
    ref = head(ids, feats).logits
    head.save_pretrained(tmp_path / "peagle")
    with safe_open(tmp_path / "peagle" / "model.safetensors", framework="pt") as fh:
        assert "embed_tokens.weight" not in set(fh.keys())  # the shared table is not stored
    loaded = PEagleDrafter.from_pretrained(tmp_path / "peagle", target_model=target)
    assert loaded.config.target_model_type == family
    torch.testing.assert_close(loaded(ids, feats).logits, ref)
    if FAMILIES[family].vllm_eagle3:
        out = export(head, tmp_path / "vllm", layout="vllm", target_model=target)
        back = PEagleDrafter.from_pretrained(out, target_model=target)
        torch.testing.assert_close(back(ids, feats).logits, ref)
    else:
        for layout in ("vllm", "speculators"):  # both go through vLLM's EAGLE-3 path
            with pytest.raises(
                ValueError, match=rf"{layout} layout.*{re.escape(FAMILIES[family].name)}.*EAGLE3"
            ):
                export(head, tmp_path / layout, layout=layout, target_model=target)
            assert not (tmp_path / layout).exists(), "a refused export creates no folder"
            with pytest.raises(ValueError, match="EAGLE3 interface"):  # the family recorded by for_target
                export(head, tmp_path / layout, layout=layout)
            assert not (tmp_path / layout).exists()
        assert export(head, tmp_path / "own", layout="peagle").is_dir()  # transformers serves every family


def test_head_refuses_a_target_of_another_family(tmp_path):
    """A Llama head fits a same-shaped Qwen3 target in every width, but not in family."""
    llama, qwen3 = _target("llama"), _target("qwen3")
    head = new_head(llama)
    with pytest.raises(ValueError, match=r"model_type 'llama'.*model_type is 'qwen3'"):
        head.attach_target(qwen3)
    with pytest.raises(ValueError, match="'qwen3'"):
        export(head, tmp_path / "out", layout="peagle", target_model=qwen3)
    assert not (tmp_path / "out").exists()
    head.attach_target(llama)  # its own family passes
    head.config.target_model_type = None  # heads of older peagle versions record none: the check is skipped
    head.save_pretrained(tmp_path / "old")
    assert (
        PEagleDrafter.from_pretrained(tmp_path / "old", target_model=llama).config.target_model_type is None
    )


# ---------------------------------------------------------------------------------------------- the size rule
def gemma3_270m_config():
    """Gemma-3-270M's shape (262,144-token vocabulary, 18 layers, width 640), random weights, no download."""
    return transformers.Gemma3TextConfig(
        vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32_768, sliding_window=512,
        query_pre_attn_scalar=256, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )  # fmt: skip


def test_default_head_for_a_262k_vocabulary_target_is_small():
    plan = plan_head(gemma3_270m_config())
    assert 260e6 < plan.target_parameters < 280e6
    assert plan.head_parameters <= 0.15 * plan.target_parameters
    assert plan.head_parameters <= HEAD_BUDGET * plan.target_parameters
    cfg = PEagleConfig.for_target(gemma3_270m_config())
    assert cfg.embed_from_target and cfg.draft_vocab_size <= VOCAB_CAP and cfg.num_hidden_layers == 1
    with torch.device("meta"):  # the head's real parameter count, without allocating 262k embedding rows
        head = PEagleDrafter(cfg)
    own = sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens.weight")
    assert own == plan.head_parameters == head_parameters(cfg.to_dict())
    # and a drafting round costs at most 20% of a target step (modeled)
    assert plan.round_fraction <= ROUND_BUDGET
    # a drafting pass reads the head's weights once and a target step the target's: a small fraction
    assert own / plan.target_parameters < 0.15


def smollm2_135m_config():
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
    )  # fmt: skip


def test_round_and_step_costs():
    cfg = PEagleConfig.for_target(target_config("llama"), num_hidden_layers=2, draft_vocab_size=100)
    values = cfg.to_dict()
    k, h = cfg.num_speculative_tokens, cfg.hidden_size
    lm = 100 * h
    layers = head_parameters(values) - lm - h  # fc, mask_hidden, layers, norms (not the mask embedding)
    expected = layers * (1 + SLOT_COST * (2 + k - 2)) + lm * (1 + SLOT_COST * (k - 1))
    assert round_cost(values) == pytest.approx(expected)
    auto = {**values, "drafting_mode": "autoregressive"}
    assert round_cost(auto) == pytest.approx(layers * (1 + SLOT_COST + k - 1) + lm * k)
    # a target step multiplies every weight once: not the untied input table, the tied one as its LM head
    untied = _target("llama")
    emb = untied.get_input_embeddings().weight.numel()
    assert target_step_cost(untied, untied) == sum(p.numel() for p in untied.parameters()) - emb
    tied = AutoModelForCausalLM.from_config(target_config("gemma3_text"))
    assert target_step_cost(tied, tied) == sum(p.numel() for p in tied.parameters())
    moe = _target("qwen3_moe")  # 2 of 4 experts active: half the expert weights
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in moe.parameters()) - moe.get_input_embeddings().weight.numel()
    assert target_step_cost(moe, moe) == pytest.approx(dense - experts / 2)


def gemma3_shape(layers: int):
    """The Gemma-3-270M shape with another depth (every sixth layer global)."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6 + 1)
    return transformers.Gemma3TextConfig(
        **{**gemma3_270m_config().to_dict(), "num_hidden_layers": layers, "layer_types": types[:layers]}
    )


def test_round_budget_keeps_the_vocabulary_then_the_layers(caplog):
    gemma = plan_head(
        gemma3_270m_config()
    )  # 2 layers at 8 slots leave < 8k ids: a layer goes, not the vocabulary
    assert gemma.values["num_hidden_layers"] == 1 and gemma.round_fraction <= ROUND_BUDGET
    assert gemma.vocab_range[0] == 8192 <= gemma.values["draft_vocab_size"] < 20480
    assert any("a layer is dropped before the vocabulary" in n for n in gemma.notes) and not gemma.over_budget
    old = plan_head(
        gemma3_270m_config(), {"num_hidden_layers": 2, "draft_vocab_size": 20480}
    )  # before this rule
    assert old.round_fraction > ROUND_BUDGET and any("over the round budget" in n for n in old.notes)
    deep = plan_head(gemma3_shape(36))  # a deeper target's step affords two layers and more than the floor
    assert deep.values["num_hidden_layers"] == 2 and deep.vocab_range[1] > 8192 and not deep.over_budget
    wants = plan_head(gemma3_shape(36), needed_vocab=20000)  # data needing 20k ids: a layer goes first
    assert wants.values["num_hidden_layers"] == 1 and wants.vocab_range[1] >= 20000 and not wants.over_budget
    given = PEagleConfig.for_target(gemma3_shape(36), draft_vocab_size=20480)  # build_head's second call
    assert given.num_hidden_layers == 1
    smol = plan_head(smollm2_135m_config())  # narrow: one layer and the 8k floor already cost 22% (modeled)
    assert smol.values["num_hidden_layers"] == 1 and smol.vocab_range == (8192, 8192)
    assert smol.head_parameters <= smol.budget and ROUND_BUDGET < smol.round_fraction < 0.25
    assert any("the vocabulary floor is kept" in n for n in smol.notes)
    with caplog.at_level("INFO", logger="peagle.sizing"):
        PEagleConfig.for_target(smollm2_135m_config())
    assert [r.levelname for r in caplog.records] == ["INFO"]  # a deliberate rule, not a warning
    shipped = plan_head(smollm2_135m_config(), {"num_hidden_layers": 2, "draft_vocab_size": 8192})
    assert shipped.values["num_hidden_layers"] == 2 and shipped.over_budget  # kept as given, said so


def test_budget_shrinks_vocabulary_then_layers():
    small = plan_head(target_config("llama"))  # a tiny target: even one layer exceeds 10%
    assert small.values["num_hidden_layers"] == 1 and small.head_parameters > small.budget  # floors: said so
    assert any("over budget" in n for n in small.notes)
    wide = transformers.LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip
    plan = plan_head(wide)  # Llama-3.2-1B's shape: two layers exceed 10%, one fits with a 20k vocabulary
    assert plan.values["num_hidden_layers"] == 1 and plan.head_parameters <= plan.budget
    assert (
        8192 <= plan.values["draft_vocab_size"] <= VOCAB_CAP and plan.values["draft_vocab_size"] % 1024 == 0
    )


def test_draft_vocabulary_size_comes_from_the_data():
    target = _target("llama")
    big = transformers.LlamaConfig(**{**COMMON, "vocab_size": 40_000, "num_hidden_layers": 4})
    plan = plan_head(big)
    assert plan.vocab_range[0] <= plan.values["draft_vocab_size"] <= plan.vocab_range[1]
    from peagle.training import choose_draft_vocab_size

    ex = [{"input_ids": list(range(3000)) * 3, "loss_mask": [1] * 9000}]
    assert choose_draft_vocab_size(ex, 40_000, 1024, 32_768) == 3072  # 3000 ids needed, next multiple of 1024
    assert choose_draft_vocab_size(ex, 40_000, 8192, 32_768) == 8192  # never below the floor
    assert choose_draft_vocab_size(ex, 40_000, 1024, 2048) == 2048  # never above the cap
    with pytest.raises(ValueError, match="chosen from training examples"):
        build_head(target, head_args=HeadArguments(draft_vocab_size=64))


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "config, match",
    [
        (
            lambda: transformers.T5Config(vocab_size=128, d_model=64, num_layers=2, num_heads=4),
            "encoder-decoder",
        ),
        (
            lambda: transformers.MambaConfig(
                vocab_size=128, hidden_size=64, num_hidden_layers=4, state_size=8
            ),
            "stateful",
        ),
        (
            lambda: transformers.RecurrentGemmaConfig(
                vocab_size=128,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                lru_width=64,
                attention_window_size=16,
                block_types=["recurrent", "attention"],
            ),
            "'recurrent_gemma'.*stateful",
        ),  # fmt: skip
    ],
)
def test_families_that_cannot_work_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        PEagleConfig.for_target(config())


# ---------------------------------------------------------------------------------------------- the commands
@pytest.mark.parametrize("kind", ["gemma3_text", "gpt2", "gpt_oss"])
def test_peagle_train_and_export_commands(kind, tmp_path, capsys):
    """`peagle train` with its defaults on a non-Llama target saved to disk, then `peagle export --layout vllm`."""
    import json

    from helpers import tiny_tokenizer
    from peagle.cli import main
    from peagle.training import save_examples

    target_dir, examples = tmp_path / "target", tmp_path / "examples.jsonl"
    _target(kind).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    save_examples(random_examples(3, seed=2), examples)
    out = tmp_path / "head"
    args = [
        "train",
        "--target",
        str(target_dir),
        "--examples",
        str(examples),
        "--output_dir",
        str(out),
        "--use_cpu",
    ]
    assert (
        main(
            [*args, "--max_steps", "1", "--gradient_accumulation_steps", "1", "--num_parallel_positions", "3"]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert "head / target parameters" in printed.out
    assert f"head for {FAMILIES[kind].name} target" in printed.err  # the size rule's decisions are shown
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["optimizer_steps"] == 1 and 0 < summary["head_parameters"] < summary["target_parameters"]
    head = PEagleDrafter.from_pretrained(out)
    assert head.config.target_model_type == kind and head.config.embed_from_target
    assert head.config.num_speculative_tokens == 3
    export_args = ["export", str(out), "--out", str(tmp_path / "vllm"), "--target", str(target_dir)]
    if FAMILIES[kind].vllm_eagle3:
        assert main(export_args) == 0 and (tmp_path / "vllm" / "config.json").exists()
    else:
        with pytest.raises(SystemExit, match="EAGLE3 interface"):
            main(export_args)


def test_bench_and_demo_need_a_head_for_another_target(tmp_path):
    from helpers import tiny_tokenizer
    from peagle.cli import main
    from peagle.demo import run_demo

    target_dir = tmp_path / "target"
    _target("qwen3").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    with pytest.raises(SystemExit, match="needs --head"):
        main(["bench", "--target", str(target_dir), "--limit", "1"])
    with pytest.raises(ValueError, match="needs a head trained for it"):
        run_demo(target=str(target_dir))
    other = tmp_path / "other-head"
    new_head(make_target()).save_pretrained(other)  # a head for an 8-layer target: refused, with the reason
    with pytest.raises(SystemExit, match="does not fit the target"):
        main(["bench", "--target", str(target_dir), "--head", str(other), "--methods", "greedy,peagle"])


def test_sizing_notes_say_what_they_mean_and_what_to_do(caplog):
    """The notes a first run prints: each says what it means for the user and what, if anything, to do."""
    smol = plan_head(smollm2_135m_config())  # the embedded target: the floor's round costs 22% (modeled)
    ids = next(n for n in smol.notes if n.startswith("draft ids:"))
    assert "drafts 8192 of the target's 49152 tokens" in ids and "placeholders" in ids
    assert "peagle train" in ids and "set_draft_vocab" in ids
    over = next(n for n in smol.notes if n.startswith("over the round budget"))
    assert "generate() times both on your machine and drafts only where a round pays" in over
    assert "nothing to do" in over
    deep = plan_head(smollm2_135m_config(), {"num_hidden_layers": 3})  # a size the user gave: shrink it
    advice = [n for n in deep.notes if n.startswith("over")]
    assert advice and all("give fewer num_hidden_layers or a smaller draft_vocab_size" in n for n in advice)
    # build_head chooses the draft ids from its examples: it says so, and does not call its choice "given"
    target = make_target(vocab_size=20000)
    examples = [{"input_ids": list(range(3, 40)), "loss_mask": [0] * 5 + [1] * 32}] * 2
    with caplog.at_level("INFO", logger="peagle.sizing"):
        build_head(target, examples)
    logged = caplog.text
    assert "draft ids: the training examples' 8192 most frequent response tokens and the EOS ids" in logged
    assert "placeholders" not in logged and "(given" not in logged and "given [" not in logged
    assert "(even the smallest default head does not fit)" in logged and "nothing to do" in logged
