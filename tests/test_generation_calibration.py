"""`peagle calibrate`: fits the head's draft calibration on held-out examples and stores it in config.json."""

from __future__ import annotations

import json

import torch

from helpers import make_head, make_target
from peagle import PEagleDrafter
from peagle.generation.calibration import prompts_of_examples


def test_prompts_of_examples_cut_at_the_response():
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [1, 2], "loss_mask": [1, 1]},
    ]
    prompts = prompts_of_examples(rows)
    assert len(prompts) == 1 and prompts[0].tolist() == [[5, 6]]


def test_calibrate_command_writes_the_config(tmp_path, capsys):
    from peagle.cli import main

    target = make_target(eos_token_id=None)
    target.save_pretrained(tmp_path / "target")
    make_head(target, num_speculative_tokens=3).save_pretrained(tmp_path / "head")
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "heldout.jsonl", "w") as fh:
        for _ in range(8):
            ids = torch.randint(3, 120, (12,), generator=g).tolist()
            fh.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 6 + [1] * 6}) + "\n")
    argv = ["calibrate", str(tmp_path / "head"), "--examples", str(tmp_path / "heldout.jsonl")]
    argv += [
        "--target",
        str(tmp_path / "target"),
        "--max-new-tokens",
        "24",
        "--report",
        str(tmp_path / "r.json"),
    ]
    assert main(argv) == 0
    assert "ECE before" in capsys.readouterr().out
    cal = json.loads((tmp_path / "head" / "config.json").read_text())["draft_calibration"]
    assert cal["method"] == "isotonic" and cal["data"]["limit"] == 32 and len(cal["x"]) >= 1
    assert cal["report"]["samples"][0] > 0
    head = PEagleDrafter.from_pretrained(tmp_path / "head")  # the stored calibration loads with the head
    assert head.config.draft_calibration["x"] == cal["x"]
    assert json.loads((tmp_path / "r.json").read_text())["calibration"]["y"] == cal["y"]
