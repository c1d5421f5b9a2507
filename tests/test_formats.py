"""Heads in the wild: every published layout loads with the expected logits; export -> load round trips.

The fixtures are written from the documented names and shapes (each layout module of peagle.formats
lists its sources); the expected logits come from `_reference_logits`, a plain-torch forward over the raw
tensors that shares no code with `PEagleDrafter`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

import peagle
from helpers import make_head, make_target
from peagle import PEagleDrafter
from peagle.formats import VLLM_EAGLE3_ARCHITECTURES, detect_layout

V, H, HEADS, KV, INTER, DRAFT_V = 128, 64, 4, 2, 128, 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# ------------------------------------------------------------------------------------------ fixtures
def _draft_ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(V, generator=g)[:DRAFT_V].sort().values


def _layer(g, prefix, *, fused, head_dim, bias):
    def w(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    in_dim = 2 * H if fused else H
    t = {
        f"{prefix}self_attn.q_proj.weight": w(HEADS * head_dim, in_dim),
        f"{prefix}self_attn.k_proj.weight": w(KV * head_dim, in_dim),
        f"{prefix}self_attn.v_proj.weight": w(KV * head_dim, in_dim),
        f"{prefix}self_attn.o_proj.weight": w(H, HEADS * head_dim),
        f"{prefix}mlp.gate_proj.weight": w(INTER, H),
        f"{prefix}mlp.up_proj.weight": w(INTER, H),
        f"{prefix}mlp.down_proj.weight": w(H, INTER),
        f"{prefix}input_layernorm.weight": 1 + w(H, scale=0.1),
        f"{prefix}post_attention_layernorm.weight": 1 + w(H, scale=0.1),
    }
    if fused:
        t[f"{prefix}hidden_norm.weight"] = 1 + w(H, scale=0.1)
    if bias:
        for name, n in (("q", HEADS), ("k", KV), ("v", KV)):
            t[f"{prefix}self_attn.{name}_proj.bias"] = w(n * head_dim)
        t[f"{prefix}self_attn.o_proj.bias"] = w(H)
    return t


def _raw_tensors(*, layer0, head_dim, bias, embed=True, lm_head=True, mask_hidden=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = _draft_ids(seed)
    t = {
        "fc.weight": torch.randn(H, 3 * H, generator=g) * 0.05,
        "norm.weight": 1 + torch.randn(H, generator=g) * 0.1,
        "d2t": ids - torch.arange(DRAFT_V),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if embed:
        t["embed_tokens.weight"] = torch.randn(V, H, generator=g)
    if lm_head:
        t["lm_head.weight"] = torch.randn(DRAFT_V, H, generator=g) * 0.1
    if mask_hidden:
        t["mask_hidden"] = torch.randn(1, 1, 3 * H, generator=g)
    t.update(_layer(g, layer0, fused=True, head_dim=head_dim, bias=bias))
    t.update(_layer(g, "layers.1.", fused=False, head_dim=head_dim, bias=bias))
    return t


def _llama_fields(head_dim, **extra):
    fields = dict(
        model_type="llama",
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        vocab_size=V,
        tie_word_embeddings=False,
    )
    fields.update(extra)
    return fields


def _write(folder, config, tensors, pickle=False):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if pickle:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, folder / "model.safetensors")
    return folder


def write_aws(folder, **overrides):
    """AWS P-EAGLE head as vLLM's EAGLE-3 Llama drafter loads it: midlayer.*, ptd_token_id, mask_hidden."""
    tensors = _raw_tensors(layer0="midlayer.", head_dim=32, bias=True)
    config = _llama_fields(
        32,
        architectures=["LlamaForCausalLMEagle3"],
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        attention_bias=True,
        draft_vocab_size=DRAFT_V,
        ptd_token_id=127,
        target_hidden_size=H,
        eagle_aux_hidden_state_layer_ids=[1, 4, 7],
        norm_before_residual=False,
    )
    config.update(overrides)
    return _write(folder, config, tensors), config, tensors


def write_speculators_peagle(folder):
    tensors = _raw_tensors(layer0="layers.0.", head_dim=16, bias=False)
    config = {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": _llama_fields(
            16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        ),
        "draft_vocab_size": DRAFT_V,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "norm_before_residual": True,
        "mask_token_id": 126,
    }
    return _write(folder, config, tensors), config, tensors


def write_speculators_eagle3(folder):
    """An eagle3 speculator without embed_tokens and without norm_before_residual (vLLM: default True)."""
    tensors = _raw_tensors(layer0="layers.0.", head_dim=16, bias=False, embed=False, mask_hidden=False)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        },
        "transformer_layer_config": _llama_fields(16, rope_theta=10000.0),
        "draft_vocab_size": DRAFT_V,
    }
    return _write(folder, config, tensors), config, tensors


def write_eagle3_research(folder, pickle=False, **drop):
    """SafeAILab EAGLE-3 head: midlayer.*, no bias, no mask token; embeddings come from the target."""
    tensors = _raw_tensors(
        layer0="midlayer.", head_dim=16, bias=False, embed=False, mask_hidden=False, **drop
    )
    config = _llama_fields(
        16, architectures=["LlamaForCausalLMEagle3"], rope_theta=10000.0, draft_vocab_size=DRAFT_V
    )
    return _write(folder, config, tensors, pickle=pickle), config, tensors


# ------------------------------------------------------------------------------------------ reference
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _inv_freq(head_dim, theta, scaling):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling and scaling.get("rope_type") == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > orig / lo, inv / factor, inv)
        middle = (wavelen <= orig / lo) & (wavelen >= orig / hi)
        inv = torch.where(middle, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def _rotate(x, positions, inv):
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _attention(x, t, p, head_dim, positions, inv):
    def proj(name):
        out = x @ t[f"{p}self_attn.{name}.weight"].T
        bias = t.get(f"{p}self_attn.{name}.bias")
        return out if bias is None else out + bias

    n = x.shape[0]
    q = proj("q_proj").view(n, HEADS, head_dim).transpose(0, 1)
    k = proj("k_proj").view(n, KV, head_dim).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    v = proj("v_proj").view(n, KV, head_dim).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    q, k = _rotate(q, positions, inv), _rotate(k, positions, inv)
    scores = q @ k.transpose(1, 2) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HEADS * head_dim) @ t[
        f"{p}self_attn.o_proj.weight"
    ].T
    bias = t.get(f"{p}self_attn.o_proj.bias")
    return out if bias is None else out + bias


def _mlp(x, t, p):
    gate, up = x @ t[f"{p}mlp.gate_proj.weight"].T, x @ t[f"{p}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{p}mlp.down_proj.weight"].T


def _reference_logits(
    t, *, layer0, head_dim, ids, feats, parallel, mask_id, norm_before_residual, rope, eps=1e-5
):
    """Plain-torch drafter forward over raw tensors: fused layer + one Llama layer, causal, positions 0..T-1."""
    theta = rope.get("rope_theta", 10000.0)
    inv = _inv_freq(head_dim, theta, rope)
    positions = torch.arange(ids.shape[0])
    emb = t["embed_tokens.weight"][ids].clone()
    hidden = feats @ t["fc.weight"].T
    if parallel.any():
        emb[parallel] = t["embed_tokens.weight"][mask_id]
        hidden[parallel] = t["fc.weight"] @ t["mask_hidden"].flatten()
    normed = _rms(hidden, t[f"{layer0}hidden_norm.weight"], eps)
    fused = torch.cat([_rms(emb, t[f"{layer0}input_layernorm.weight"], eps), normed], -1)
    h = (normed if norm_before_residual else hidden) + _attention(fused, t, layer0, head_dim, positions, inv)
    h = h + _mlp(_rms(h, t[f"{layer0}post_attention_layernorm.weight"], eps), t, layer0)
    p = "layers.1."
    h = h + _attention(_rms(h, t[f"{p}input_layernorm.weight"], eps), t, p, head_dim, positions, inv)
    h = h + _mlp(_rms(h, t[f"{p}post_attention_layernorm.weight"], eps), t, p)
    return _rms(h, t["norm.weight"], eps) @ t["lm_head.weight"].T


def _slots(n=9, parallel_tail=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (n,), generator=g)
    feats = torch.randn(n, 3 * H, generator=g)
    parallel = torch.zeros(n, dtype=torch.bool)
    if parallel_tail:
        parallel[-parallel_tail:] = True
    return ids, feats, parallel


def _head_logits(head, ids, feats, parallel):
    with torch.no_grad():
        return head(ids[None], feats[None], parallel_mask=parallel[None]).logits[0]


# ------------------------------------------------------------------------------------------ loading
def test_detect_layout():
    names = ["midlayer.self_attn.q_proj.weight", "fc.weight"]
    assert detect_layout({"model_type": "peagle"}, []) == "peagle"
    assert detect_layout({"speculators_model_type": "peagle"}, []) == "speculators"
    assert detect_layout({"speculators_model_type": "eagle3"}, []) == "speculators"
    assert detect_layout({"model_type": "llama", "ptd_token_id": 5}, names) == "vllm"
    assert detect_layout({"model_type": "llama", "pard_token": 5}, names) == "vllm"
    assert detect_layout({"model_type": "llama"}, [*names, "mask_hidden"]) == "vllm"
    assert detect_layout({"model_type": "llama"}, names) == "eagle3"
    assert (
        detect_layout({"model_type": "llama"}, ["model.layers.0.mlp.up_proj.weight", "model.fc.weight"])
        == "eagle3"
    )
    with pytest.raises(ValueError, match="'medusa'"):
        detect_layout({"speculators_model_type": "medusa"}, [])
    with pytest.raises(ValueError, match="cannot tell the layout"):
        detect_layout({"model_type": "llama"}, ["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("model_type", [None, "llama", "eagle"])
def test_peagle_head_with_a_dropped_or_changed_model_type_is_refused(tmp_path, model_type):
    """Read as the vLLM layout, such a head lost its K (5 -> 7) and confidence setting (0.0 -> none) silently."""
    target = make_target()
    for embed in (False, True):
        folder = tmp_path / f"head-{embed}"
        head_ = make_head(target, num_speculative_tokens=5, embed_from_target=embed)
        head_.save_pretrained(folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("model_type")
        if model_type is not None:
            cfg["model_type"] = model_type
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(
            ValueError, match=rf"{folder / 'config.json'}: model_type is {model_type!r}.*peagle's own"
        ):
            peagle.load_head(folder, target=target)
        with pytest.raises(ValueError, match='Set "model_type": "peagle"'):
            PEagleDrafter.from_pretrained(folder)
        cfg["model_type"] = "peagle"  # the fix the message names
        (folder / "config.json").write_text(json.dumps(cfg))
        loaded = peagle.load_head(folder, target=target)
        assert loaded.config.num_speculative_tokens == 5 and loaded.config.confidence_threshold == 0.0


def test_aws_vllm_layout_gives_reference_logits(tmp_path):
    folder, config, raw = write_aws(tmp_path / "aws")
    head = PEagleDrafter.from_pretrained(folder)
    c = head.config
    assert (c.drafting_mode, c.mask_token_id, c.num_hidden_layers, c.head_dim) == ("parallel", 127, 2, 32)
    assert (
        c.attention_bias
        and c.rope_parameters["rope_type"] == "llama3"
        and c.rope_parameters["rope_theta"] == 5e5
    )
    assert (c.draft_vocab_size, c.eagle_aux_hidden_state_layer_ids) == (DRAFT_V, [1, 4, 7])
    assert torch.equal(head.draft_to_target(torch.arange(DRAFT_V)), _draft_ids())
    ids, feats, parallel = _slots(n=12, parallel_tail=4)
    ids[parallel] = 127
    expected = _reference_logits(
        raw, layer0="midlayer.", head_dim=32, ids=ids, feats=feats, parallel=parallel, mask_id=127,
        norm_before_residual=False, rope=dict(LLAMA3_ROPE, rope_theta=5e5),
    )  # fmt: skip
    torch.testing.assert_close(_head_logits(head, ids, feats, parallel), expected, rtol=1e-4, atol=1e-4)
    # positions beyond original_max_position_embeddings exercise all three llama3 frequency bands
    assert _inv_freq(32, 5e5, LLAMA3_ROPE).ne(_inv_freq(32, 5e5, None)).any()


def test_speculators_peagle_layout_gives_reference_logits(tmp_path):
    folder, config, raw = write_speculators_peagle(tmp_path / "spec")
    head = PEagleDrafter.from_pretrained(folder)
    c = head.config
    assert (c.drafting_mode, c.mask_token_id, c.norm_before_residual) == ("parallel", 126, True)
    assert (c.num_speculative_tokens, c.target_model_name) == (5, "org/tiny-target")
    ids, feats, parallel = _slots()
    expected = _reference_logits(
        raw, layer0="layers.0.", head_dim=16, ids=ids, feats=feats, parallel=parallel, mask_id=126,
        norm_before_residual=True, rope={"rope_theta": 10000.0},
    )  # fmt: skip
    torch.testing.assert_close(_head_logits(head, ids, feats, parallel), expected, rtol=1e-4, atol=1e-4)


def test_speculators_eagle3_takes_embeddings_from_target(tmp_path):
    folder, config, raw = write_speculators_eagle3(tmp_path / "spec3")
    with pytest.raises(ValueError, match=r"model\.safetensors.*'embed_tokens\.weight'.*target_model="):
        PEagleDrafter.from_pretrained(folder)
    target = make_target()
    head = PEagleDrafter.from_pretrained(folder, target_model=target)
    assert head.config.drafting_mode == "autoregressive" and head.config.norm_before_residual
    assert head.config.embed_from_target and head.embed_tokens.weight is target.get_input_embeddings().weight
    assert head.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # default for the 8-layer target
    ids, feats, parallel = _slots(parallel_tail=0)
    raw = dict(raw, **{"embed_tokens.weight": target.get_input_embeddings().weight.detach()})
    expected = _reference_logits(
        raw, layer0="layers.0.", head_dim=16, ids=ids, feats=feats, parallel=parallel, mask_id=None,
        norm_before_residual=True, rope={"rope_theta": 10000.0},
    )  # fmt: skip
    torch.testing.assert_close(_head_logits(head, ids, feats, parallel), expected, rtol=1e-4, atol=1e-4)


def test_eagle3_research_head_pickle_refused_then_autoregressive(tmp_path):
    folder, config, raw = write_eagle3_research(tmp_path / "eagle3", pickle=True)
    target = make_target()
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*allow_pickle=True"):
        PEagleDrafter.from_pretrained(folder, target_model=target)
    head = PEagleDrafter.from_pretrained(folder, target_model=target, allow_pickle=True)
    assert head.config.drafting_mode == "autoregressive" and not head.config.norm_before_residual
    ids, feats, parallel = _slots(parallel_tail=0)
    raw = dict(raw, **{"embed_tokens.weight": target.get_input_embeddings().weight.detach()})
    expected = _reference_logits(
        raw, layer0="midlayer.", head_dim=16, ids=ids, feats=feats, parallel=parallel, mask_id=None,
        norm_before_residual=False, rope={"rope_theta": 10000.0},
    )  # fmt: skip
    torch.testing.assert_close(_head_logits(head, ids, feats, parallel), expected, rtol=1e-4, atol=1e-4)


def test_missing_lm_head_takes_draft_rows_of_target_lm_head(tmp_path):
    raw = _raw_tensors(layer0="midlayer.", head_dim=16, bias=False, lm_head=False, mask_hidden=False)
    config = _llama_fields(16, rope_theta=10000.0, draft_vocab_size=DRAFT_V)
    folder = _write(tmp_path / "nohead", config, raw)
    with pytest.raises(ValueError, match=r"'lm_head\.weight'"):
        PEagleDrafter.from_pretrained(folder, target_model=None)
    target = make_target()
    head = PEagleDrafter.from_pretrained(folder, target_model=target)
    rows = target.get_output_embeddings().weight[_draft_ids()]
    assert torch.equal(head.lm_head.weight, rows)


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    folder, config, raw = write_aws(tmp_path / "bad")
    raw["midlayer.self_attn.q_proj.weight"] = torch.zeros(4 * 32, H)  # fused layer must read 2H
    save_file(raw, folder / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'midlayer\.self_attn\.q_proj\.weight' has shape \(128, 64\).*\(128, 128\)",
    ):
        PEagleDrafter.from_pretrained(folder)


def test_missing_tensors_are_named(tmp_path):
    folder, config, raw = write_aws(tmp_path / "missing")
    del raw["layers.1.mlp.up_proj.weight"]
    save_file(raw, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.1\.mlp\.up_proj\.weight'\]"):
        PEagleDrafter.from_pretrained(folder)
    del raw["mask_hidden"]
    save_file(raw, folder / "model.safetensors")
    with pytest.raises(ValueError, match="mask_hidden not found.*mask token 127"):
        PEagleDrafter.from_pretrained(folder)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_layers=4.*2 decoder layers"):
        PEagleDrafter.from_pretrained(write_aws(tmp_path / "a", num_hidden_layers=4)[0])
    with pytest.raises(ValueError, match="norm_before_fc=true"):
        PEagleDrafter.from_pretrained(write_aws(tmp_path / "b", norm_before_fc=True)[0])
    with pytest.raises(ValueError, match="different mask tokens"):
        PEagleDrafter.from_pretrained(write_aws(tmp_path / "c", pard_token=3)[0])
    folder, config, raw = write_aws(tmp_path / "d")
    raw["d2t"] = _draft_ids()  # absolute ids instead of offsets
    save_file(raw, folder / "model.safetensors")
    with pytest.raises(ValueError, match="absolute target ids"):
        PEagleDrafter.from_pretrained(folder)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"eagle_aux_hidden_state_layer_ids": "1,4,7"}, "eagle_aux_hidden_state_layer_ids is '1,4,7'"),
        ({"eagle_aux_hidden_state_layer_ids": [1, "4", 7]}, "eagle_aux_hidden_state_layer_ids is"),
        ({"ptd_token_id": "127"}, r"ptd_token_id is '127' \(str\); expected an integer"),
        ({"hidden_size": 64.0}, r"hidden_size is 64.0 \(float\); expected an integer"),
        ({"draft_vocab_size": "48"}, "draft_vocab_size is '48'"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers is '2'"),
        ({"attention_bias": "true"}, r"attention_bias is 'true' \(str\); expected true or false"),
        ({"rope_theta": "500000"}, "rope_theta is '500000'; expected a positive number"),
        ({"rope_scaling": "llama3"}, "rope_scaling is 'llama3'; expected an object or null"),
        ({"hidden_act": 1}, r"hidden_act is 1 \(int\); expected a string"),
        ({"peagle": {"num_speculative_tokens": "7"}}, r"num_speculative_tokens is '7' \(str\)"),
        (
            {"peagle": {"num_speculative_tokens": 100000000}},
            r"num_speculative_tokens is 100000000; .*\[1, 64\]",
        ),
        ({"peagle": {"num_speculative_tokens": 2.5}}, "num_speculative_tokens is 2.5"),
        ({"peagle": {"draft_calibration": {"method": "isotonic", "x": [[0.1]], "y": [[0.1, 0.2]]}}}, "knots"),
    ],
)
def test_foreign_config_values_are_checked_not_coerced(tmp_path, change, words):
    folder, _, _ = write_aws(tmp_path / "aws", **change)
    with pytest.raises(ValueError, match=rf"{folder / 'config.json'}.*{words}"):
        peagle.load_head(folder)


# ------------------------------------------------------------------------------------------ export
def _tiny_head(seed=1, **overrides):
    target = make_target()
    head = make_head(target, seed=seed, **overrides)
    with torch.no_grad():
        for p in head.parameters():  # non-trivial norms and mask vectors
            p.add_(torch.randn_like(p) * 0.05)
    head.set_draft_vocab(_draft_ids()) if head.config.draft_vocab_size == DRAFT_V else None
    return head, target


@pytest.mark.parametrize("layout", ["vllm", "speculators", "peagle"])
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_export_roundtrip_identical_logits(tmp_path, layout, mode):
    head, _ = _tiny_head(draft_vocab_size=DRAFT_V, drafting_mode=mode, attention_bias=True)
    ids, feats, parallel = _slots(parallel_tail=3 if mode == "parallel" else 0)
    ref = _head_logits(head, ids, feats, parallel)
    out = peagle.export(head, tmp_path / layout, layout=layout)
    loaded = PEagleDrafter.from_pretrained(out)
    assert loaded.config.drafting_mode == mode
    for key in (
        "mask_token_id",
        "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids",
        "num_speculative_tokens",
    ):
        assert getattr(loaded.config, key) == getattr(head.config, key), key
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    # same tensors and the same computation; only float32 summation order may differ (kernel paths)
    torch.testing.assert_close(_head_logits(loaded, ids, feats, parallel), ref, rtol=1e-5, atol=1e-5)


def test_export_embed_from_target_head(tmp_path):
    head, target = _tiny_head(embed_from_target=True)
    with pytest.raises(ValueError, match="not attached.*target_model="):
        peagle.export(head, tmp_path / "x", layout="vllm")
    out = peagle.export(head, tmp_path / "vllm", layout="vllm", target_model=target)
    emb = load_file(out / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(emb[127], head.mask_embedding[0])
    others = torch.arange(V) != 127
    assert torch.equal(emb[others], target.get_input_embeddings().weight[others])
    ids, feats, parallel = _slots()
    loaded = PEagleDrafter.from_pretrained(out)
    assert not loaded.config.embed_from_target
    torch.testing.assert_close(
        _head_logits(loaded, ids, feats, parallel),
        _head_logits(head, ids, feats, parallel),
        rtol=1e-5,
        atol=1e-5,
    )


def _vllm_param_names(config):
    """The parameters `Eagle3LlamaForCausalLM` owns (qkv / gate_up fused) for a config, with their shapes."""
    h, hd, nh, nkv = (
        config["hidden_size"],
        config["head_dim"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    inter = config["intermediate_size"]
    bias = config.get("attention_bias", False)
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.fc.weight": (h, 3 * config.get("target_hidden_size", h)),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["draft_vocab_size"], h),
        "draft_id_to_target_id": (config["draft_vocab_size"],),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv_in = 2 * h if i == 0 else h
        shapes[p + "self_attn.qkv_proj.weight"] = ((nh + 2 * nkv) * hd, qkv_in)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if bias:
            shapes[p + "self_attn.qkv_proj.bias"] = ((nh + 2 * nkv) * hd,)
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if i == 0:
            shapes[p + "hidden_norm.weight"] = (h,)
    return shapes


def _vllm_load(tensors):
    """Replay of `Eagle3LlamaForCausalLM.load_weights` (vLLM llama_eagle3.py): names -> fused param shapes."""
    stacked = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
               (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]  # fmt: skip
    params, mask_hidden = {}, None
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "mask_hidden" in name:
            mask_hidden = t.view(1, -1)
            continue
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for fused, part in stacked:
            if part in name:
                name = name.replace(part, fused)
                break
        rows, rest = t.shape[0], tuple(t.shape[1:])
        old = params.get(name)
        params[name] = (old[0] + rows, *rest) if old else (rows, *rest)
    return params, mask_hidden


def test_vllm_export_matches_vllm_loader(tmp_path):
    head, target = _tiny_head(draft_vocab_size=DRAFT_V, head_dim=32, attention_bias=True,
                              rope_parameters=dict(LLAMA3_ROPE, rope_theta=5e5))  # fmt: skip
    out = peagle.export(head, tmp_path / "vllm", layout="vllm", num_speculative_tokens=7)
    raw = json.loads((out / "config.json").read_text())
    # vLLM's EAGLE config: the Llama fields under `model`, the drafter's at the top level (transformers has no
    # "eagle" model type, so AutoModel cannot build a half-random LlamaModel from it)
    assert raw["model_type"] == "eagle" and raw["method"] == "eagle3"
    assert raw["model"]["model_type"] == "llama" and raw["model"]["architectures"] == raw["architectures"]
    config = {**raw["model"], **{k: v for k, v in raw.items() if k != "model"}}
    assert config["architectures"][0] in VLLM_EAGLE3_ARCHITECTURES
    assert config["ptd_token_id"] == config["pard_token"] == 127
    assert config["draft_vocab_size"] == DRAFT_V and config["target_hidden_size"] == H
    assert (
        config["eagle_aux_hidden_state_layer_ids"]
        == [2, 4, 5]
        == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    assert config["num_hidden_layers"] == 2 and config["head_dim"] == 32 and config["attention_bias"] is True
    assert config["rope_theta"] == 5e5 and config["rope_scaling"]["rope_type"] == "llama3"
    # vLLM's EAGLEConfig builds the nested dict with transformers' AutoConfig.for_model (a LlamaConfig)
    llama = LlamaConfig(**{k: v for k, v in raw["model"].items() if k != "model_type"})
    assert llama.head_dim == 32 and llama.num_hidden_layers == 2
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0
    tensors = load_file(out / "model.safetensors")
    assert any(n.startswith("midlayer.") for n in tensors) and not any(
        n.startswith("model.") for n in tensors
    )
    params, mask_hidden = _vllm_load(tensors)
    assert params == _vllm_param_names(config)
    assert mask_hidden is not None and mask_hidden.numel() == 3 * config["hidden_size"]
    assert torch.equal(tensors["embed_tokens.weight"][127], head.mask_vector)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], head.d2t)


def test_speculators_export_matches_config_classes(tmp_path):
    head, target = _tiny_head(draft_vocab_size=DRAFT_V, target_model_name="org/tiny-target")
    out = peagle.export(
        head, tmp_path / "spec", layout="speculators", target_model=target, num_speculative_tokens=6
    )
    config = json.loads((out / "config.json").read_text())
    # the fields vLLM's SpeculatorsConfig.validate_speculators_config / update_peagle read
    spec = config["speculators_config"]
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert (
        spec["proposal_methods"][0]["speculative_tokens"] == 6 and spec["default_proposal_method"] == "greedy"
    )
    assert spec["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
    assert config["mask_token_id"] == 127 and config["draft_vocab_size"] == DRAFT_V
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == V
    LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})  # speculators builds this class
    tensors = load_file(out / "model.safetensors")
    assert "layers.0.hidden_norm.weight" in tensors and not any(n.startswith("midlayer.") for n in tensors)
    assert tensors["mask_hidden"].shape == (1, 1, 3 * H) and tensors[
        "layers.0.self_attn.q_proj.weight"
    ].shape == (64, 128)


def test_vllm_export_refuses_unequal_widths(tmp_path):
    head, _ = _tiny_head(target_hidden_size=32)
    with pytest.raises(ValueError, match="3 x hidden_size = 192.*3 x target_hidden_size = 96"):
        peagle.export(head, tmp_path / "x", layout="vllm")


def test_cli_export(tmp_path, capsys):
    from peagle.cli import main

    folder, _, _ = write_aws(tmp_path / "aws")
    assert main(["export", str(folder), "--out", str(tmp_path / "spec"), "--layout", "speculators"]) == 0
    assert "speculators layout" in capsys.readouterr().out
    a, b = PEagleDrafter.from_pretrained(folder), PEagleDrafter.from_pretrained(tmp_path / "spec")
    ids, feats, parallel = _slots()
    torch.testing.assert_close(_head_logits(a, ids, feats, parallel), _head_logits(b, ids, feats, parallel))


def test_sharded_export_loads(tmp_path):
    head, _ = _tiny_head(draft_vocab_size=DRAFT_V)
    out = peagle.export(head, tmp_path / "sharded", layout="vllm", max_shard_size="40KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    ids, feats, parallel = _slots()
    loaded = PEagleDrafter.from_pretrained(out)
    torch.testing.assert_close(
        _head_logits(loaded, ids, feats, parallel), _head_logits(head, ids, feats, parallel)
    )


# ------------------------------------------------------------------------------------------ registry
def test_layout_registry_and_load_head(tmp_path):
    from peagle import formats

    assert list(formats.LAYOUTS) == ["peagle", "speculators", "vllm", "eagle3"]
    assert set(formats.EXPORT_LAYOUTS) == {"peagle", "speculators", "vllm"}
    assert peagle.load_head.__module__ == "peagle"  # formats.load_head, also taking target_model= (#57)
    assert PEagleDrafter._checkpoint_loader is formats.load_head  # registered by importing peagle.formats
    assert PEagleDrafter._folder_writer is formats.head_folder  # save_pretrained swaps its folder in
    folder, _, raw = write_aws(tmp_path / "aws")
    head = peagle.load_head(folder)
    assert head.config.drafting_mode == "parallel" and not head.training
    ids, feats, parallel = _slots()
    torch.testing.assert_close(
        _head_logits(head, ids, feats, parallel),
        _head_logits(PEagleDrafter.from_pretrained(folder), ids, feats, parallel),
    )


def test_from_pretrained_without_a_registered_loader(tmp_path, monkeypatch):
    """As remote code nothing is registered: peagle's own layout loads through plain transformers."""
    head, target = _tiny_head()
    head.save_pretrained(tmp_path / "head")
    monkeypatch.setattr(PEagleDrafter, "_checkpoint_loader", None)
    loaded = PEagleDrafter.from_pretrained(tmp_path / "head", target_model=target)
    ids, feats, parallel = _slots()
    torch.testing.assert_close(
        _head_logits(loaded, ids, feats, parallel), _head_logits(head, ids, feats, parallel)
    )


# ------------------------------------------------------------------------------------------ writing folders (#57)
def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _writers():
    def export_peagle(head, folder, **kw):
        peagle.export(head, folder, layout="peagle", **kw)

    def export_vllm(head, folder, **kw):
        peagle.export(head, folder, layout="vllm", **kw)

    def save(head, folder, **kw):
        head.save_pretrained(folder, **kw)

    return {"export-peagle": export_peagle, "export-vllm": export_vllm, "save_pretrained": save}


@pytest.mark.parametrize("writer", ["export-peagle", "export-vllm", "save_pretrained"])
@pytest.mark.parametrize(
    "first_sharded", [False, True], ids=["unsharded-then-sharded", "sharded-then-unsharded"]
)
def test_writing_a_head_over_another_leaves_only_the_new_one(tmp_path, writer, first_sharded):
    from transformers import AutoModel

    write = _writers()[writer]
    a, _ = _tiny_head(seed=1)
    b, _ = _tiny_head(seed=2)
    assert not _same_weights(a, b)
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")  # not a head file: kept
    sharded, unsharded = {"max_shard_size": "100KB"}, {}
    write(a, folder, **(sharded if first_sharded else unsharded))
    assert len(list(folder.glob("*.safetensors"))) == (
        1 if not first_sharded else len(list(folder.glob("model-*")))
    )
    write(b, folder, **(unsharded if first_sharded else sharded))
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if first_sharded:  # the new head is one file: no shard and no index of the old one is left
        assert weights == ["model.safetensors"] and not index.exists()
    else:
        listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        assert len(listed) > 1 and weights == listed
    assert (folder / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    for load in (peagle.load_head, AutoModel.from_pretrained):
        loaded = load(folder)
        assert _same_weights(loaded, b) and not _same_weights(loaded, a), load


def test_a_failed_export_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    a, _ = _tiny_head(seed=1)
    b, _ = _tiny_head(seed=2)
    folder = peagle.export(a, tmp_path / "head", layout="peagle")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(PEagleDrafter, "save_pretrained", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        peagle.export(b, folder, layout="peagle")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_written_folder_keeps_the_usual_permissions(tmp_path):
    import os
    import stat

    head, _ = _tiny_head()
    umask = os.umask(0)
    os.umask(umask)
    head.save_pretrained(tmp_path / "new")
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o777 & ~umask
    (tmp_path / "old").mkdir()
    os.chmod(tmp_path / "old", 0o750)
    head.save_pretrained(tmp_path / "old")
    assert stat.S_IMODE((tmp_path / "old").stat().st_mode) == 0o750


# ------------------------------------------------------------------------------------------ K on export (#57)
@pytest.mark.parametrize("layout", ["peagle", "vllm", "speculators"])
def test_export_records_the_k_it_is_given(tmp_path, layout):
    head, _ = _tiny_head(num_speculative_tokens=5)
    out = peagle.export(head, tmp_path / layout, layout=layout, num_speculative_tokens=3)
    assert peagle.load_head(out).config.num_speculative_tokens == 3
    assert head.config.num_speculative_tokens == 5  # the head itself is unchanged
    assert (
        peagle.load_head(peagle.export(head, tmp_path / "own", layout=layout)).config.num_speculative_tokens
        == 5
    )


@pytest.mark.parametrize("k", [0, -5, 65, 2.5, "3", True])
@pytest.mark.parametrize("layout", ["peagle", "vllm", "speculators"])
def test_export_refuses_a_k_it_cannot_record(tmp_path, layout, k):
    head, _ = _tiny_head()
    with pytest.raises(
        ValueError, match=rf"num_speculative_tokens is {k!r}; expected an integer in \[1, 64\]"
    ):
        peagle.export(head, tmp_path / "out", layout=layout, num_speculative_tokens=k)
    assert not (tmp_path / "out").exists()


def test_export_fails_when_what_it_wrote_does_not_reload_with_its_values(tmp_path, monkeypatch):
    from peagle.formats import vllm

    head, _ = _tiny_head(num_speculative_tokens=5)
    real = vllm.peagle_metadata
    monkeypatch.setattr(vllm, "peagle_metadata", lambda c, k: {**real(c, k), "num_speculative_tokens": 7})
    with pytest.raises(
        ValueError, match="reloads with num_speculative_tokens 7 instead of 5; nothing was written"
    ):
        peagle.export(head, tmp_path / "out", layout="vllm")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--layout", "speculators", "--num_speculative_tokens", "-5"],
        ["--layout", "peagle", "--num_speculative_tokens", "0"],
        ["--layout", "vllm", "--num_speculative_tokens", "3e7"],
        ["--max_shard_size=-5GB"],
        ["--max_shard_size", "lots"],
    ],
)
def test_cli_export_refuses_k_out_of_range(tmp_path, capsys, flags):
    from peagle.cli import main

    folder, _, _ = write_aws(tmp_path / "aws")
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(folder), "--out", str(tmp_path / "out"), *flags])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "expected an integer in [1, 64]" in err or "expected a positive size such as 500MB" in err, err
    assert not (tmp_path / "out").exists()


def test_cli_export_peagle_layout_reloads_with_the_given_k(tmp_path, capsys):
    from peagle.cli import main

    folder, _, _ = write_aws(tmp_path / "aws")
    out = tmp_path / "out"
    assert (
        main(
            ["export", str(folder), "--out", str(out), "--layout", "peagle", "--num_speculative_tokens", "3"]
        )
        == 0
    )
    assert peagle.load_head(out).config.num_speculative_tokens == 3


def test_saving_into_the_working_folder_replaces_the_head_files_in_place(tmp_path, monkeypatch):
    a, _ = _tiny_head(seed=1)
    b, _ = _tiny_head(seed=2)
    folder = tmp_path / "head"
    a.save_pretrained(folder, max_shard_size="100KB")
    (folder / "notes.txt").write_text("mine")
    monkeypatch.chdir(folder)
    b.save_pretrained(".")
    assert folder.samefile(".") and (folder / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    assert not (folder / "model.safetensors.index.json").exists()
    assert _same_weights(peagle.load_head(folder), b)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_without_a_registered_folder_writer_save_pretrained_writes_in_place(tmp_path, monkeypatch):
    """As remote code without peagle nothing is registered: transformers' own save_pretrained."""
    head, _ = _tiny_head()
    monkeypatch.setattr(PEagleDrafter, "_folder_writer", None)
    head.save_pretrained(tmp_path / "head")
    assert _same_weights(peagle.load_head(tmp_path / "head"), head)
