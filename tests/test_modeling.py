"""PEagleConfig and PEagleDrafter on tiny random configs: shapes, round trip, slot layout, errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

import peagle
from helpers import make_head, make_target, tiny_target_config
from peagle import PEagleConfig, PEagleDrafter

# invalid config values surface as transformers' strict-dataclass validation error wrapping our message
CONFIG_ERRORS = (ValueError, StrictDataclassError)


def _inputs(head, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (1, n), generator=g)
    feats = torch.randn(1, n, 3 * head.config.target_hidden_size, generator=g)
    return ids, feats


def test_for_target_defaults():
    cfg = PEagleConfig.for_target(tiny_target_config(num_hidden_layers=30))
    # the size rule (docs/families.md): two layers over 8 slots would cost 28% of this target's step (modeled)
    assert cfg.num_hidden_layers == 1 and cfg.embed_from_target
    assert PEagleConfig.for_target(tiny_target_config(num_hidden_layers=60)).num_hidden_layers == 2
    assert cfg.num_speculative_tokens == 7 and cfg.num_parallel_positions == 8
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.vocab_size == cfg.draft_vocab_size == 128
    assert cfg.target_hidden_size == 64 and cfg.target_num_hidden_layers == 30
    assert cfg.drafting_mode == "parallel"
    over = PEagleConfig.for_target(tiny_target_config(), num_hidden_layers=1, draft_vocab_size=32)
    assert over.num_hidden_layers == 1 and over.draft_vocab_size == 32


def test_shapes_and_parameters(tiny_head):
    ids, feats = _inputs(tiny_head)
    out = tiny_head(ids, feats)
    assert out.logits.shape == (1, 10, 128)
    assert out.last_hidden_state.shape == (1, 10, 64)
    assert tiny_head.mask_hidden.shape == (1, 1, 192)
    assert tiny_head.fc.weight.shape == (64, 192)
    assert tiny_head.layers[0].self_attn.q_proj.weight.shape == (64, 128)  # fused layer reads 2H
    assert tiny_head.layers[1].self_attn.q_proj.weight.shape == (64, 64)
    # no accidental weight sharing between layers
    assert (
        tiny_head.layers[0].mlp.gate_proj.weight.data_ptr()
        != tiny_head.layers[1].mlp.gate_proj.weight.data_ptr()
    )


def test_save_load_roundtrip_auto_classes(tiny_head, tmp_path):
    ids, feats = _inputs(tiny_head)
    ref = tiny_head(ids, feats).logits
    tiny_head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "peagle"
    assert cfg["auto_map"]["AutoModel"].endswith("modeling_peagle.PEagleDrafter")
    assert (tmp_path / "modeling_peagle.py").is_file() and (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "drafting_peagle.py").is_file()  # the model file's relative import travels with it
    assert isinstance(AutoConfig.from_pretrained(tmp_path), PEagleConfig)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, PEagleDrafter)
    assert torch.equal(loaded(ids, feats).logits, ref)


def test_eager_matches_sdpa(tiny_target):
    torch.manual_seed(3)
    cfg = PEagleConfig.for_target(tiny_target.config, num_hidden_layers=2, mask_token_id=127)
    eager = PEagleDrafter._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    sdpa = PEagleDrafter._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    ids, feats = _inputs(eager, n=12)
    torch.testing.assert_close(eager(ids, feats).logits, sdpa(ids, feats).logits, atol=1e-5, rtol=1e-5)
    # with a cache and a 4D boolean mask too
    mask = torch.tril(torch.ones(12, 12, dtype=torch.bool))[None, None]
    mask[..., 8:, 4:8] = False
    torch.testing.assert_close(
        eager(ids, feats, attention_mask=mask).logits,
        sdpa(ids, feats, attention_mask=mask).logits,
        atol=1e-5,
        rtol=1e-5,
    )


def test_cached_block_equals_full_forward(tiny_head):
    ids, feats = _inputs(tiny_head, n=12)
    full = tiny_head(ids, feats).logits
    first = tiny_head(ids[:, :7], feats[:, :7], use_cache=True)
    second = tiny_head(ids[:, 7:], feats[:, 7:], cache=first.cache)
    torch.testing.assert_close(second.logits, full[:, 7:], atol=1e-5, rtol=1e-5)


def test_the_cache_keeps_its_pre_5_24_name_as_an_alias(tiny_head):
    """transformers 5.24 renamed `past_key_values` to `cache`; the head takes and returns it under both names."""
    ids, feats = _inputs(tiny_head, n=12)
    first = tiny_head(ids[:, :7], feats[:, :7], use_cache=True)
    assert first.past_key_values is first.cache and first.cache.get_seq_length() == 7
    with pytest.warns(FutureWarning, match="past_key_values"):
        second = tiny_head(ids[:, 7:], feats[:, 7:], past_key_values=first.cache)
    assert second.cache is first.cache and first.cache.get_seq_length() == 12


def test_slot_layout_of_a_round(tiny_head):
    ids, pos, par = tiny_head.parallel_slots(
        torch.tensor([[5, 6, 7]]), start_position=9, num_speculative_tokens=4
    )
    assert ids.tolist() == [[5, 6, 7, 127, 127, 127]]
    assert pos.tolist() == [[9, 10, 11, 12, 13, 14]]
    assert par.tolist() == [[False, False, False, True, True, True]]


def test_mask_slots_get_mask_embedding_and_mask_hidden(tiny_head):
    """A parallel slot's input is (mask embedding, fc(mask_hidden)) whatever token/features it carries."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"], seen["hidden"] = args[0].clone(), args[1].clone()

    handle = tiny_head.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    ids, feats = _inputs(tiny_head, n=6)
    par = torch.tensor([[False, False, False, True, True, True]])
    tiny_head(ids, feats, parallel_mask=par)
    handle.remove()
    mask_vec = tiny_head.embed_tokens.weight[tiny_head.config.mask_token_id]
    mask_feat = tiny_head.fc(tiny_head.mask_hidden)[0, 0]
    for t in range(3, 6):
        torch.testing.assert_close(seen["embeds"][0, t], mask_vec)
        torch.testing.assert_close(seen["hidden"][0, t], mask_feat)
    for t in range(3):
        torch.testing.assert_close(seen["embeds"][0, t], tiny_head.embed_tokens.weight[ids[0, t]])
        torch.testing.assert_close(seen["hidden"][0, t], tiny_head.fc(feats[0, t]))
    # default parallel mask: slots holding mask_token_id
    ids2 = ids.clone()
    ids2[0, 3:] = tiny_head.config.mask_token_id
    torch.testing.assert_close(tiny_head(ids2, feats).logits, tiny_head(ids, feats, parallel_mask=par).logits)


def test_draft_is_one_forward_with_positions(tiny_head):
    calls = []
    handle = tiny_head.register_forward_hook(
        lambda m, a, k, o: calls.append(k.get("position_ids")), with_kwargs=True
    )
    ids, feats = _inputs(tiny_head, n=5)
    draft = tiny_head.draft(ids, feats, num_speculative_tokens=4)
    handle.remove()
    assert len(calls) == 1
    assert calls[0].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert draft.tokens.shape == (1, 4) and draft.logits.shape == (1, 4, 128)
    assert draft.cache.get_seq_length() == 8 and draft.past_key_values is draft.cache
    slot_ids, _, par = tiny_head.parallel_slots(ids, 0, 4)
    full = tiny_head(slot_ids, torch.cat([feats, torch.zeros(1, 3, 192)], 1), parallel_mask=par)
    assert torch.equal(draft.tokens, full.logits[:, -4:].argmax(-1))


def test_d2t_offsets(tiny_target):
    head = make_head(tiny_target, draft_vocab_size=16)
    keep = torch.tensor([3, 4, 10, 11, 12, 20, 40, 41, 50, 60, 70, 80, 90, 100, 110, 126])
    head.set_draft_vocab(keep)
    assert head.d2t.tolist() == (keep - torch.arange(16)).tolist()
    assert head.t2d.sum() == 16 and bool(head.t2d[keep].all())
    assert head.draft_to_target(torch.arange(16)).tolist() == keep.tolist()
    logits = torch.randn(2, 16)
    full = head.draft_logits_to_target(logits)
    assert full.shape == (2, 128)
    assert torch.equal(full[:, keep], logits)
    assert torch.isinf(full[:, ~head.t2d]).all()
    assert torch.equal(full.argmax(-1), head.draft_to_target(logits.argmax(-1)))
    with pytest.raises(ValueError, match="strictly increasing"):
        head.set_draft_vocab(keep.flip(0))


def test_embed_from_target(tiny_target, tmp_path):
    head = make_head(tiny_target, embed_from_target=True).attach_target(tiny_target)
    assert head.embed_tokens.weight is tiny_target.get_input_embeddings().weight
    assert head.mask_embedding.shape == (1, 64)
    torch.testing.assert_close(head.mask_vector, head.mask_embedding[0])
    ids, feats = _inputs(head)
    ref = head(ids, feats).logits
    head.save_pretrained(tmp_path)
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = PEagleDrafter.from_pretrained(tmp_path).attach_target(tiny_target).eval()
    assert torch.equal(loaded(ids, feats).logits, ref)


def test_error_aux_layers_outside_target():
    with pytest.raises(CONFIG_ERRORS, match=r"\[2, 4, 9\].*\[9\].*\[0, 7\]"):
        PEagleConfig.for_target(tiny_target_config(), eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    head = make_head(make_target(), eagle_aux_hidden_state_layer_ids=[1, 2, 6], target_num_hidden_layers=None)
    with pytest.raises(ValueError, match=r"\[6\].*\[0, 3\]"):
        head.check_target(tiny_target_config(num_hidden_layers=4))


def test_error_hidden_and_vocab_mismatch(tiny_head):
    with pytest.raises(ValueError, match="hidden size 64, target has 96"):
        tiny_head.check_target(tiny_target_config(hidden_size=96))
    with pytest.raises(ValueError, match="vocab size 128, target has 256"):
        tiny_head.check_target(tiny_target_config(vocab_size=256))
    with pytest.raises(ValueError, match="width 64; expected 192"):
        tiny_head(torch.tensor([[3, 4]]), torch.zeros(1, 2, 64))


def test_error_bad_config_values():
    with pytest.raises(CONFIG_ERRORS, match="drafting_mode"):
        PEagleConfig.for_target(tiny_target_config(), drafting_mode="tree")
    with pytest.raises(CONFIG_ERRORS, match="draft_vocab_size is 300"):
        PEagleConfig.for_target(tiny_target_config(), draft_vocab_size=300)
    with pytest.raises(CONFIG_ERRORS, match="mask_token_id is 128"):
        PEagleConfig.for_target(tiny_target_config(), mask_token_id=128)
    with pytest.raises(CONFIG_ERRORS, match="confidence_threshold is 2.0"):
        PEagleConfig.for_target(tiny_target_config(), confidence_threshold=2.0)


def test_error_misshaped_tensor_in_checkpoint(tiny_head, tmp_path):
    tiny_head.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["fc.weight"] = torch.zeros(64, 100)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"fc\.weight"):
        PEagleDrafter.from_pretrained(tmp_path)


def test_error_missing_tensor_in_checkpoint(tiny_head, tmp_path):
    tiny_head.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["mask_hidden"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="mask_hidden"):
        PEagleDrafter.from_pretrained(tmp_path)


def test_refuses_pickle_checkpoint(tiny_head, tmp_path):
    tiny_head.config.save_pretrained(tmp_path)
    torch.save(tiny_head.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match=r"pytorch_model\.bin"):
        PEagleDrafter.from_pretrained(tmp_path)


def test_import_registers_auto_classes():
    assert AutoConfig.for_model("peagle").__class__ is PEagleConfig
    assert peagle.PEagleDrafter is PEagleDrafter


# ------------------------------------------------------------------ values read from config.json (#57)
def _saved_config(tiny_head, tmp_path, **changes):
    tiny_head.save_pretrained(tmp_path)
    file = tmp_path / "config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg))
    return file


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_speculative_tokens", "7", "num_speculative_tokens is '7' (str); expected an integer"),
        ("num_speculative_tokens", 2.5, "num_speculative_tokens is 2.5 (float); expected an integer"),
        ("num_speculative_tokens", True, "num_speculative_tokens is True (bool)"),
        ("mask_token_id", "127", "mask_token_id is '127' (str); expected an integer"),
        ("eagle_aux_hidden_state_layer_ids", "1,2,3", "eagle_aux_hidden_state_layer_ids is '1,2,3'"),
        ("eagle_aux_hidden_state_layer_ids", [1, 2.0, 3], "eagle_aux_hidden_state_layer_ids is"),
        ("num_parallel_positions", "8", "num_parallel_positions is '8'"),
        ("confidence_threshold", True, "confidence_threshold is True"),
        ("confidence_threshold", "0.5", "confidence_threshold is '0.5'"),
        ("embed_from_target", "false", "embed_from_target is 'false'"),
        ("drafting_mode", 1, "drafting_mode is 1"),
        ("hidden_size", "64", "'hidden_size' expected int, got str"),
        ("num_hidden_layers", 0, "num_hidden_layers is 0; expected an integer >= 1"),
    ],
)
def test_config_json_type_errors_name_the_field_and_the_file(tiny_head, tmp_path, field, value, words):
    file = _saved_config(tiny_head, tmp_path, **{field: value})
    for load in (peagle.load_head, AutoModel.from_pretrained, PEagleConfig.from_pretrained):
        with pytest.raises(ValueError) as err:
            load(tmp_path)
        assert str(file) in str(err.value) and words in str(err.value), (load, str(err.value))


@pytest.mark.parametrize("k", [30_000_000, 100_000_000, 65, 0, -1])
def test_num_speculative_tokens_is_bounded_where_it_is_read(tiny_head, tmp_path, k):
    file = _saved_config(tiny_head, tmp_path, num_speculative_tokens=k)
    with pytest.raises(
        ValueError, match=rf"{file}: num_speculative_tokens is {k}; expected an integer in \[1, 64\]"
    ):
        peagle.load_head(tmp_path)
    with pytest.raises(ValueError, match=r"num_parallel_positions is 1000; expected an integer in \[1, 64\]"):
        PEagleConfig.for_target(tiny_target_config(), num_parallel_positions=1000)
    assert (
        PEagleConfig.for_target(tiny_target_config(), num_speculative_tokens=64).num_speculative_tokens == 64
    )


def test_config_json_that_is_not_utf8_names_the_file(tiny_head, tmp_path):
    file = _saved_config(tiny_head, tmp_path)
    file.write_bytes(file.read_bytes().replace(b'"peagle"', b'"p\xe9agle"', 1))
    with pytest.raises(ValueError, match=rf"{file} is not UTF-8 text: byte 0xe9"):
        peagle.load_head(tmp_path)


_CALIBRATION = {
    "method": "isotonic",
    "x": [[0.1, 0.5, 0.9]],
    "y": [[0.05, 0.4, 0.8]],
    "report": {"samples": [9]},
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"x": [[0.9, 0.5, 0.1]]}, r"draft_calibration.x\[0\] is \[0.9, 0.5, 0.1\]; expected non-decreasing"),
        (
            {"y": [[-0.5, 0.4, 0.8]]},
            r"draft_calibration.y\[0\] is \[-0.5, 0.4, 0.8\]; expected probabilities",
        ),
        ({"y": [[0.05, 0.4, 1.5]]}, r"draft_calibration.y\[0\].*expected probabilities in \[0, 1\]"),
        ({"y": [[0.05, 0.4]]}, r"draft_calibration.x\[0\] has 3 knots and y\[0\] 2"),
        ({"y": [[0.05, 0.4, 0.8], [0.1]]}, "1 maps in x and 2 in y"),
        ({"x": None}, "draft_calibration.x is None"),
        ({"x": [["0.1", 0.5, 0.9]]}, "expected finite numbers"),
        ({"x": [[0.1, float("nan"), 0.9]]}, "expected finite numbers"),
        ({"y": [[]]}, "draft_calibration.y is"),
        ({"method": "platt"}, "draft_calibration.method is 'platt'; expected one of"),
        ({"method": None}, "draft_calibration.method is None"),
    ],
)
def test_malformed_draft_calibration_is_refused_at_load(tiny_head, tmp_path, change, words):
    file = _saved_config(tiny_head, tmp_path, draft_calibration={**_CALIBRATION, **change})
    with pytest.raises(ValueError, match=rf"{file}: .*{words}"):
        peagle.load_head(tmp_path)


def test_a_well_formed_draft_calibration_loads(tiny_head, tmp_path):
    _saved_config(tiny_head, tmp_path, draft_calibration=_CALIBRATION)
    assert peagle.load_head(tmp_path).config.draft_calibration == _CALIBRATION
    with pytest.raises(ValueError, match="draft_calibration is 'isotonic'"):
        PEagleConfig.for_target(tiny_target_config(), draft_calibration="isotonic")


# ------------------------------------------------------------------ moving or casting a head (#57)
@pytest.mark.parametrize(
    "convert",
    [
        lambda h: h.to(torch.bfloat16),
        lambda h: h.half(),
        lambda h: h.to("cpu", torch.float64),
        lambda h: h.bfloat16().float(),
    ],
    ids=["to-bf16", "half", "to-cpu-f64", "bf16-then-float"],
)
def test_casting_a_head_leaves_its_target_untouched(convert):
    target = make_target(tie_word_embeddings=True)  # input table and output layer: one parameter
    head = make_head(target, embed_from_target=True).attach_target(target)
    table = target.get_input_embeddings().weight
    assert head.embed_tokens.weight is table  # shared, as attach_target does
    before = table.detach().clone()
    ids = torch.tensor([[1, 5, 9, 22, 7, 40]])
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    convert(head)
    assert target.get_input_embeddings().weight is table and table.dtype == torch.float32
    assert target.get_output_embeddings().weight.dtype == torch.float32
    assert torch.equal(table, before)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False), ref)
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=head)
    assert torch.equal(out, ref)
    assert target.get_input_embeddings().weight.dtype == torch.float32


def test_moving_a_head_to_its_own_dtype_still_shares_the_table_memory():
    target = make_target()
    head = make_head(target, embed_from_target=True).attach_target(target)
    head.to("cpu")
    weight = target.get_input_embeddings().weight
    assert head.embed_tokens.weight.data_ptr() == weight.data_ptr()  # no copy of the table
    assert not head.embed_tokens.weight.requires_grad


# ------------------------------------------------------------------ the draft-vocabulary map of a saved head (#57)
_KEEP = torch.tensor([3, 4, 10, 11, 12, 20, 40, 41, 50, 60, 70, 80, 90, 100, 110, 126])


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.__setitem__(15, 200), r"maps draft id 15 to target id 215 .*outside \[0, 128\)"),
        (
            lambda d: d.__setitem__(1, -5),
            r"maps draft id 1 to target id -4 \(d2t\[1\] = -5\), outside",
        ),  # wraps
        (lambda d: d.__setitem__(2, d[1] - 1), r"maps draft ids \[1, 2\] all to target id 4"),
        (lambda d: d.copy_(_KEEP), "maps draft id 15 .* It looks like absolute target ids"),
    ],
    ids=["past-the-vocabulary", "negative-wraps", "duplicate", "absolute-ids"],
)
def test_a_native_d2t_that_cannot_map_is_refused_at_load(tiny_target, tmp_path, edit, words):
    """Such a map raised a torch IndexError mid-generation, or wrapped round silently when negative."""
    head = make_head(tiny_target, draft_vocab_size=16)
    head.set_draft_vocab(_KEEP)
    head.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    edit(state["d2t"])
    state["t2d"] = torch.zeros(128, dtype=torch.bool)  # t2d is checked after d2t
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for load in (peagle.load_head, PEagleDrafter.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(ValueError, match=rf"{tmp_path / 'model.safetensors'}: tensor 'd2t' {words}"):
            load(tmp_path)


def test_a_native_t2d_that_disagrees_with_d2t_is_refused(tiny_target, tmp_path):
    head = make_head(tiny_target, draft_vocab_size=16)
    head.set_draft_vocab(_KEEP)
    head.save_pretrained(tmp_path)
    assert torch.equal(peagle.load_head(tmp_path).d2t, head.d2t)
    state = load_file(tmp_path / "model.safetensors")
    state["t2d"][5] = True
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor 't2d' disagrees with 'd2t'"):
        peagle.load_head(tmp_path)


def test_every_bad_field_of_a_config_json_is_named_in_one_error(tiny_head, tmp_path):
    file = _saved_config(
        tiny_head, tmp_path, num_speculative_tokens="7", mask_token_id="127", embed_from_target=1
    )
    with pytest.raises(ValueError) as err:
        peagle.load_head(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{file}: ")
    for words in ("mask_token_id is '127'", "num_speculative_tokens is '7'", "embed_from_target is 1"):
        assert words in message, message


def test_numpy_integers_are_kept_as_plain_ints():
    import numpy as np

    cfg = PEagleConfig.for_target(
        tiny_target_config(), num_speculative_tokens=np.int64(5), mask_token_id=np.int32(9)
    )
    assert type(cfg.num_speculative_tokens) is int and type(cfg.mask_token_id) is int
    assert json.loads(cfg.to_json_string())["num_speculative_tokens"] == 5
