"""Reading checkpoints: every load error names the file (bad JSON, a missing folder, a truncated weights file)."""

from __future__ import annotations

import pytest
import torch

import peagle
from helpers import make_head, make_target
from peagle import PEagleDrafter


@pytest.fixture
def saved(tmp_path):
    make_head(make_target()).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


@pytest.mark.parametrize("load", [PEagleDrafter.from_pretrained, peagle.load_head])
def test_config_that_is_not_json_names_the_file(saved, load):
    (saved / "config.json").write_text('{"model_type": "peagle", oops}')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON: .* line 1, column"):
        load(saved)


def test_load_head_takes_target_model_as_from_pretrained_does(tmp_path):
    target = make_target()
    make_head(target, embed_from_target=True).save_pretrained(tmp_path / "head")
    a = peagle.load_head(tmp_path / "head", target_model=target)
    b = PEagleDrafter.from_pretrained(tmp_path / "head", target_model=target)
    weight = target.get_input_embeddings().weight
    assert a.embed_tokens.weight is b.embed_tokens.weight is weight  # attached: the target's own table
    assert peagle.load_head(tmp_path / "head", target=target).embed_tokens.weight is weight
    with pytest.raises(ValueError, match="two different targets"):
        peagle.load_head(tmp_path / "head", target=target, target_model=make_target())


@pytest.mark.parametrize("spec", ["/no/such/head/folder", "./no-such-head", "~/no-such-head-9f2", "a/b/c"])
def test_a_missing_path_fails_at_once_naming_it(spec):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        peagle.load_head(spec)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        PEagleDrafter.from_pretrained(spec)


def test_a_truncated_weights_file_names_the_file(saved):
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors"):
        peagle.load_head(saved)


def test_export_refuses_a_target_the_head_was_not_built_for(tmp_path):
    head = make_head(make_target())
    other = make_target(num_hidden_layers=6)
    with pytest.raises(ValueError, match="head was built for a target with 8 layers, target has 6"):
        peagle.export(head, tmp_path / "out", layout="vllm", target_model=other)
    wide = make_target(hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="target hidden size 64, target has 32"):
        peagle.export(head, tmp_path / "out", layout="speculators", target_model=wide)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
@pytest.mark.parametrize("cut", [None, 0.0, 0.6])
def test_drafting_settings_survive_an_export_round_trip(tmp_path, layout, cut):
    target = make_target()
    head = make_head(target, confidence_threshold=cut)
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.1, 0.9]], "y": [[0.05, 0.7]]}
    peagle.export(head, tmp_path / layout, layout=layout, target_model=target)
    back = PEagleDrafter.from_pretrained(tmp_path / layout)
    assert back.config.confidence_threshold == cut
    assert back.config.draft_calibration == head.config.draft_calibration


@pytest.mark.parametrize("layout", ["peagle", "vllm"])
def test_a_tensor_of_the_wrong_kind_is_refused_not_cast(tmp_path, layout):
    """An integer tensor where floats belong (here `fc.weight`) is an error naming file and tensor."""
    from safetensors.torch import load_file, save_file

    target = make_target()
    peagle.export(make_head(target), tmp_path / layout, layout=layout, target_model=target)
    weights = tmp_path / layout / "model.safetensors"
    tensors = load_file(weights)
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.int32)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'fc\.weight' holds int values; .* float"
    ):
        peagle.load_head(tmp_path / layout)


def test_the_command_line_is_told_about_target(tmp_path, capsys):
    """`peagle export` of a head that shares its target's embeddings, without a target: the error names the
    `--target` option a command-line user has, not only the Python argument."""
    from peagle.cli import main

    make_head(make_target(), embed_from_target=True).save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit, match="--target on the command line"):
        main(["export", str(tmp_path / "head"), "--out", str(tmp_path / "out"), "--layout", "vllm"])
