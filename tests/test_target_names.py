"""Exports that work where they land: a head names its target by Hub id when one is known and never by a folder of
the machine it was made on (`peagle.sizing.recorded_target_name`), in its config, its export, its upload and its
card; `peagle export --layout vllm` prints a serve command with the real target and an absolute path."""

from __future__ import annotations

import json
import re

import pytest

from helpers import make_head, make_target, tiny_tokenizer
from peagle import PEagleDrafter
from peagle.cli import main
from peagle.integrations.hub import prepare_upload_folder
from peagle.sizing import recorded_target_name, target_fields
from peagle.training import train_head, training_arguments


def _folder(path, **files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name.replace("_", ".")).write_text(text)
    return path


def test_recorded_target_name_is_a_hub_id_or_nothing(tmp_path):
    assert (
        recorded_target_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert recorded_target_name(None) is None and recorded_target_name("") is None
    assert recorded_target_name(str(_folder(tmp_path / "plain"))) is None
    assert recorded_target_name("/no/such/folder") is None and recorded_target_name("./runs/target") is None
    cache = _folder(tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123")
    assert recorded_target_name(str(cache)) == "org/tiny"
    configured = _folder(
        tmp_path / "configured", config_json=json.dumps({"_name_or_path": "org/from-config"})
    )
    assert recorded_target_name(str(configured)) == "org/from-config"
    carded = _folder(
        tmp_path / "carded", README_md="---\nlicense: mit\nbase_model: org/from-card\n---\n# x\n"
    )
    assert recorded_target_name(str(carded)) == "org/from-card"
    own_path = _folder(tmp_path / "own", config_json=json.dumps({"_name_or_path": str(tmp_path / "own")}))
    assert recorded_target_name(str(own_path)) is None


def test_a_head_sized_for_a_local_target_records_no_folder(tmp_path):
    target = make_target()
    target.config._name_or_path = str(tmp_path)
    assert target_fields(target)[0]["target_model_name"] is None
    target.config._name_or_path = "org/tiny"
    assert target_fields(target)[0]["target_model_name"] == "org/tiny"


def test_train_head_records_no_folder_of_this_machine(tmp_path):
    target, tok = make_target(), tiny_tokenizer()
    tok.save_pretrained(tmp_path / "target")
    tok = type(tok).from_pretrained(tmp_path / "target")
    target.config._name_or_path = str(tmp_path / "target")
    assert tok.name_or_path == str(tmp_path / "target")
    examples = [{"input_ids": tok("write code please the bot", add_special_tokens=False)["input_ids"],
                 "loss_mask": [0, 0, 1, 1, 1]}] * 2  # fmt: skip
    args = training_arguments(
        tmp_path / "ckpt", num_parallel_positions=3, max_steps=1, gradient_accumulation_steps=1, use_cpu=True,
        save_strategy="no", progress=False,
    )  # fmt: skip
    train_head(target, tok, output_dir=tmp_path / "head", examples=examples, training_args=args)
    config = (tmp_path / "head" / "config.json").read_text()
    assert json.loads(config).get("target_model_name") is None and str(tmp_path) not in config


@pytest.fixture
def local_head(tmp_path):
    """A tiny head whose config records its target's local folder (as heads trained before this fix do)."""

    def make(target_folder):
        target = make_target()
        target.save_pretrained(target_folder)
        head = make_head(target)
        head.config.target_model_name = str(target_folder)
        head.save_pretrained(tmp_path / "head")
        return tmp_path / "head"

    return make


def _serve_line(printed: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith("serve with: "))


def test_export_names_the_targets_hub_id_and_an_absolute_path(tmp_path, capsys, monkeypatch, local_head):
    target = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    head = local_head(target)
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(head), "--layout", "vllm", "--out", "exported", "--target", str(target)]) == 0
    line = _serve_line(capsys.readouterr().out)
    assert line.startswith("serve with: vllm serve org/tiny --speculative-config '")
    spec = json.loads(re.search(r"'(.+)'", line).group(1))
    assert spec["model"] == str((tmp_path / "exported").resolve())
    config = (tmp_path / "exported" / "config.json").read_text()
    assert '"target_model_name": "org/tiny"' in config and str(tmp_path) not in config
    assert PEagleDrafter.from_pretrained(tmp_path / "exported").config.target_model_name == "org/tiny"


def test_export_of_a_target_without_hub_id_says_so_and_records_no_folder(tmp_path, capsys, local_head):
    target = tmp_path / "my-target"
    head = local_head(target)
    out = tmp_path / "exported"
    assert main(["export", str(head), "--layout", "vllm", "--out", str(out), "--target", str(target)]) == 0
    printed = capsys.readouterr().out
    assert _serve_line(printed).startswith("serve with: vllm serve <target> ")
    assert "(no Hub id is known for the target: put its Hub id or folder in place of <target>)" in printed
    assert str(tmp_path) not in (out / "config.json").read_text()
    assert PEagleDrafter.from_pretrained(out).config.target_model_name is None


def test_an_upload_carries_no_local_path(tmp_path, local_head):
    head = PEagleDrafter.from_pretrained(local_head(tmp_path / "my-target"))
    assert head.config.target_model_name == str(tmp_path / "my-target")
    folder = prepare_upload_folder(head, tmp_path / "upload", repo_id="you/tiny-peagle", license="mit")
    for name in ("config.json", "README.md"):
        assert str(tmp_path) not in (folder / name).read_text(), name
    assert json.loads((folder / "config.json").read_text()).get("target_model_name") is None
    assert head.config.target_model_name == str(tmp_path / "my-target")  # the head itself is left as it was
