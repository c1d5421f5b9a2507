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
        "--max_new_tokens",
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


def test_calibrate_command_refuses_counts_it_cannot_use(tmp_path, capsys):
    """`--skip -5` took the last five examples (a negative slice); `--limit 0` fitted nothing."""
    import pytest

    from peagle.cli import main

    for flags, words in (
        (["--skip", "-5"], "expected an integer >= 0, got '-5'"),
        (["--limit", "0"], "expected an integer >= 1, got '0'"),
        (["--max_new_tokens", "0"], "expected an integer >= 1, got '0'"),
        (["--num_speculative_tokens", "0"], "expected an integer in [1, 64], got '0'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["calibrate", str(tmp_path / "head"), "--examples", str(tmp_path / "x.jsonl"), *flags])
        assert exit_.value.code != 0 and words in capsys.readouterr().err


def test_calibrate_refuses_to_store_a_calibration_the_head_could_not_read(tmp_path, monkeypatch):
    import pytest

    from peagle.generation import calibration

    target = make_target(eos_token_id=None)
    target.save_pretrained(tmp_path / "target")
    make_head(target).save_pretrained(tmp_path / "head")
    before = (tmp_path / "head" / "config.json").read_text()
    (tmp_path / "heldout.jsonl").write_text(
        json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}) + "\n"
    )
    bad = {"calibration": {"method": "isotonic", "x": [[0.5, 0.1]], "y": [[0.2, 0.4]]}, "report": {}}
    monkeypatch.setattr(calibration, "fit_draft_calibration", lambda *a, **k: bad)
    with pytest.raises(ValueError, match="non-decreasing"):
        calibration.calibrate_head_folder(
            str(tmp_path / "head"), str(tmp_path / "heldout.jsonl"), target=str(tmp_path / "target")
        )
    assert (tmp_path / "head" / "config.json").read_text() == before


def test_calibrate_costs_retimes_the_curves_and_resets_their_factors(tmp_path, capsys, monkeypatch):
    """`peagle calibrate HEAD --costs` times the cost curve of each batch size anew, with its context points, and
    replaces the cached one (online factors start over)."""
    from peagle.cli import main
    from peagle.generation import cost as cost_mod

    monkeypatch.setenv("PEAGLE_COST_CACHE", str(tmp_path / "cost"))
    cost_mod.forget_cost_models()
    target = make_target(eos_token_id=None)
    target.save_pretrained(tmp_path / "target")
    make_head(target, num_speculative_tokens=3).save_pretrained(tmp_path / "head")
    argv = ["calibrate", str(tmp_path / "head"), "--costs", "--target", str(tmp_path / "target")]
    try:
        assert main([*argv, "--batch_sizes", "1,2", "--contexts", "300,100000"]) == 0
        out = capsys.readouterr().out
        assert (
            "B=1 L=256" in out and "B=2 L=300" in out and "L=100000" not in out
        )  # beyond the range: skipped
        files = sorted((tmp_path / "cost").glob("*.json"))
        assert len(files) == 2
        batch1 = next(f for f in files if "batch_size" not in json.loads(f.read_text())["key"])
        data = json.loads(batch1.read_text())
        assert [p["context"] for p in data["context_points"]] == [300]
        data["factors"] = [3.0] * len(data["factors"])  # as if corrected online
        data["observations"] = [5] * len(data["observations"])
        batch1.write_text(json.dumps(data))
        assert main([*argv, "--contexts", "300"]) == 0
        again = json.loads(batch1.read_text())
        assert set(again["factors"]) == {1.0} and set(again["observations"]) == {0}
    finally:
        cost_mod.forget_cost_models()
