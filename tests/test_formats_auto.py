"""`AutoModel.from_pretrained` on the vLLM and speculators exports, the vLLM config forms, the recorded verifier."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModel

import peagle
from helpers import make_head, make_target
from peagle.cli.export import resolve_verifier, target_locations


def _head():
    target = make_target()
    # explicit sizes: the head stores its own embeddings (the exports carry the full table anyway)
    head = make_head(target, embed_from_target=False, num_hidden_layers=2, draft_vocab_size=128)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head, target


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_automodel_returns_the_head(tmp_path, layout):
    head, _ = _head()
    out = peagle.export(head, tmp_path / layout, layout=layout)
    model = AutoModel.from_pretrained(out)
    assert isinstance(model, peagle.PEagleDrafter)
    ref = head.state_dict()
    assert model.state_dict().keys() == ref.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())


@pytest.mark.parametrize(("layout", "model_type"), [("vllm", "eagle"), ("speculators", "speculators")])
def test_transformers_alone_refuses_the_exports(tmp_path, layout, model_type):
    """Without peagle imported, transformers stops at the model type instead of building a half-random LlamaModel."""
    head, _ = _head()
    out = peagle.export(head, tmp_path / layout, layout=layout)
    code = (
        "import sys\nfrom transformers import AutoModel\n"
        f"try:\n    m = AutoModel.from_pretrained({str(out)!r})\n"
        "except ValueError as err:\n    print('REFUSED', err)\n    sys.exit(0)\n"
        "print('LOADED', type(m).__name__)\nsys.exit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model type `{model_type}`" in proc.stdout


def test_vllm_flat_and_eagle_config_forms_load_alike(tmp_path):
    """peagle writes vLLM's EAGLE config (Llama fields under `model`); the AWS heads' flat form reads the same."""
    head, _ = _head()
    out = peagle.export(head, tmp_path / "nested", layout="vllm")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "eagle" and "hidden_size" not in raw and raw["model"]["hidden_size"] == 64
    flat = {**raw["model"], **{k: v for k, v in raw.items() if k not in ("model", "model_type", "method")}}
    flat_dir = tmp_path / "flat"
    flat_dir.mkdir()
    (flat_dir / "config.json").write_text(json.dumps(flat))
    (flat_dir / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    a, b = peagle.load_head(out), peagle.load_head(flat_dir)
    assert a.config.to_diff_dict() | {"_name_or_path": None} == b.config.to_diff_dict() | {
        "_name_or_path": None
    }
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_speculators_export_records_the_verifier(tmp_path):
    head, target = _head()
    head.config.target_model_name = "org/tiny-target"
    out = peagle.export(head, tmp_path / "hub", layout="speculators")
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"
    ] == ("org/tiny-target")
    local = tmp_path / "target"
    out = peagle.export(head, tmp_path / "local", layout="speculators", verifier=local)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(local)
    assert cfg["model_type"] == "speculators"
    # the metadata block keeps the target's name: reading the export back does not take the folder for it
    assert peagle.load_head(out).config.target_model_name == "org/tiny-target"


def test_cli_verifier_choices(tmp_path):
    folder = tmp_path / "my-target"
    folder.mkdir()
    assert target_locations(str(folder)) == (None, str(folder.resolve()))
    assert resolve_verifier(None, str(folder)) == str(folder.resolve())  # local is the default with --target
    assert resolve_verifier("local", str(folder)) == str(folder.resolve())
    assert resolve_verifier("org/explicit", str(folder)) == "org/explicit"
    assert resolve_verifier(None, None) is None
    with pytest.raises(SystemExit, match="no Hub id known"):
        resolve_verifier("hub", str(folder))
    with pytest.raises(SystemExit, match="needs --target"):
        resolve_verifier("local", None)
    # a Hub id that is not in the (offline) cache: its id is known, its folder is not
    assert target_locations("org/not-cached-anywhere")[0] == "org/not-cached-anywhere"
    with pytest.raises(SystemExit, match="no local folder known"):
        resolve_verifier("local", "org/not-cached-anywhere")
    assert resolve_verifier("hub", "org/not-cached-anywhere") == "org/not-cached-anywhere"
