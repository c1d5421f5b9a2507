"""scripts/write_default_cards.py: the card's held-out decoding line from an eval_acceptance.py record, and the
layer count of a stage that grew the head."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from write_default_cards import _heldout_files, _heldout_line, _layers  # noqa: E402


def record(tmp_path, results: dict) -> str:
    settings = {
        "num_speculative_tokens": 7,
        "max_new_tokens": 128,
        "head_dtype": "float32",
        "examples": ["data/heldout:48:16", "data/heldout:64:56", "data/heldout-set2:0:120"],
    }
    path = tmp_path / "decoded.json"
    path.write_text(json.dumps({"settings": settings, "results": results}))
    return str(path)


def result(lossless: bool) -> dict:
    return {"tokens_per_target_pass": 2.0034, "new_tokens": 21345, "target_passes": 10654, "prompts": 192,
            "lossless": lossless}  # fmt: skip


def test_heldout_line_states_the_decoding_and_whether_it_was_lossless(tmp_path):
    line = _heldout_line(record(tmp_path, {"runs/head": result(True)}))
    assert line.startswith("2.003 new tokens per target pass at K=7")
    assert (
        "21,345 tokens in 10,654 target passes over 192 held-out examples of data/heldout, data/heldout-set2"
        in line
    )
    assert "float32 head" in line and line.endswith("every output identical to plain greedy")
    assert "NOT identical" in _heldout_line(record(tmp_path, {"runs/head": result(False)}))


def test_heldout_line_refuses_a_record_of_several_heads(tmp_path):
    with pytest.raises(SystemExit, match="one head, found 2"):
        _heldout_line(record(tmp_path, {"a": result(True), "b": result(True)}))


def test_layers_of_a_stage_and_of_a_weight_average_of_arms():
    assert _layers({"num_hidden_layers": 4}) == 4
    assert _layers({"arms": [{"num_hidden_layers": 2}, {"num_hidden_layers": 2}]}) == 2
    assert _layers({}) is None


def test_heldout_option_takes_kind_equals_file_and_refuses_anything_else():
    assert _heldout_files(["peagle=a.json", "eagle3=b=c.json"]) == {"peagle": "a.json", "eagle3": "b=c.json"}
    with pytest.raises(SystemExit, match="expected KIND=JSON"):
        _heldout_files(["a.json"])
    with pytest.raises(SystemExit, match="unknown head kind 'medusa'"):
        _heldout_files(["medusa=a.json"])
