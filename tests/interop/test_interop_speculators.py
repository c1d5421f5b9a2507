"""speculators 0.9 and peagle read each other's heads, tensor for tensor, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from interop_peers import run_peer
from safetensors.torch import load_file

import peagle

HERE = Path(__file__).parent
CLASSES = {"peagle": "PEagleDraftModel", "eagle3": "Eagle3DraftModel"}


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_speculators_loads_peagle_exports(kind, exports, target_dir, tmp_path):
    """`SpeculatorModel.from_pretrained` on the CLI's speculators export (`--target default`): its own class, every
    file tensor identical, the verifier found offline in the local target folder.  speculators' re-save of it
    keeps peagle's metadata block: K, K_train and the drafting settings come back in peagle."""
    folder = exports[f"{kind}-speculators"]
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    resaved = tmp_path / "resaved"
    got = run_peer([str(HERE / "peer_speculators.py"), "load", str(folder), str(resaved)])
    assert got["class"] == CLASSES[kind]
    assert got["mismatched"] == [] and got["file_tensors"] == len(file_tensors(folder))
    assert set(got["not_in_file"]) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
    head = peagle.load_head(peagle.targets.default_drafter_path(kind))
    assert got["speculative_tokens"] == head.config.num_speculative_tokens
    assert got["aux_layer_ids"] == list(head.config.eagle_aux_hidden_state_layer_ids)
    if kind == "peagle":
        assert got["mask_token_id"] == head.config.mask_token_id

    back = peagle.load_head(resaved)
    for key in (
        "num_speculative_tokens",
        "num_parallel_positions",
        "confidence_threshold",
        "draft_calibration",
        "drafting_mode",
        "target_num_hidden_layers",
    ):
        assert getattr(back.config, key) == getattr(head.config, key), key
    ours, theirs = file_tensors(folder), file_tensors(resaved)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_speculators_heads_load_in_peagle(kind, target, target_dir, prompts, tmp_path):
    """A head speculators creates (random, SmolLM2 sizes, draft vocabulary of 8192) and saves: peagle loads it with
    identical tensors (written back in the speculators layout, file for file) and drafts losslessly with it."""
    made = tmp_path / "made"
    got = run_peer([str(HERE / "peer_speculators.py"), "make", kind, str(made), str(target_dir)])
    assert got["class"] == CLASSES[kind]
    head = peagle.load_head(made, target=target[0])
    assert head.config.drafting_mode == ("parallel" if kind == "peagle" else "autoregressive")
    assert head.config.draft_vocab_size == 8192 and head.config.num_speculative_tokens == 3

    again = peagle.export(head, tmp_path / "again", layout="speculators")
    theirs, ours = file_tensors(made), file_tensors(again)
    assert theirs.keys() == ours.keys()
    different = [k for k in theirs if theirs[k].dtype != ours[k].dtype or not torch.equal(theirs[k], ours[k])]
    assert different == []

    model = target[0]
    for ids in prompts[:2]:
        with torch.inference_mode():
            plain = model.generate(ids, do_sample=False, max_new_tokens=24)
            spec = model.generate(
                ids,
                do_sample=False,
                max_new_tokens=24,
                assistant_model=head,
                num_assistant_tokens=3,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
            )
        assert torch.equal(plain, spec)
        assert head.last_generation_stats.rounds > 0
