"""scripts/chain_averages.py: a stage's chain averages collected from walk results split over the cores, with
their members read from the averages' train summaries and every point checked against the weights it measured."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import chain_averages  # noqa: E402
from chain_averages import chain_record  # noqa: E402
from scaling_curve import weights_fingerprint  # noqa: E402

SETTINGS = {"heldout": ["a:0:8", "b:0:8"], "num_speculative_tokens": 7, "max_new_tokens": 128}
SETTINGS.update(head_dtype="bfloat16", measure="decoded", out="x.json")


def head(folder, weights: bytes, summary: dict):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "train_summary.json").write_text(json.dumps(summary))
    return str(folder)


def point(folder: str, walk: float, sha: str | None = "same") -> dict:
    return {
        "head": folder,
        "token_passes": 1000,
        "decoded_tokens_per_target_pass": walk,
        "per_set": {"a:0:8": {"decoded_tokens_per_target_pass": walk - 0.1}},
        "weights_sha256": weights_fingerprint(folder) if sha == "same" else sha,
    }


def write(path, points, **settings):
    path.write_text(json.dumps({"settings": {**SETTINGS, **settings}, "points": points}))
    return str(path)


@pytest.fixture
def stage(tmp_path):
    arms = head(tmp_path / "avg", b"m", {"merged_from": ["runs/A", "runs/B"]})
    old, start = str(tmp_path / "old"), head(tmp_path / "start", b"s", {})
    chain2 = head(tmp_path / "chain2", b"c2", {"chain_average": {"from": [start, arms]}})
    chain3 = head(
        tmp_path / "chain3", b"c3", {"chain_average": {"from": [old, start, arms], "weights": [1, 2, 1]}}
    )
    core0 = write(tmp_path / "core0.json", [point(start, 2.0), point(arms, 1.98), point(chain2, 2.01)])
    core1 = write(tmp_path / "core1.json", [point(start, 2.0), point(chain3, 2.02)])
    return tmp_path, start, arms, old, chain2, chain3, core0, core1


def test_record_joins_walks_from_both_cores_with_the_members_each_average_recorded(stage):
    tmp_path, start, arms, old, chain2, chain3, core0, core1 = stage
    got = chain_record([core0, core1], [chain2, chain3], [start, arms], [f"{old}=git:abc:old"], [], "none")
    assert got["settings"]["heldout"] == SETTINGS["heldout"] and "out" not in got["settings"]
    assert got["compare"] == {start: 2.0, arms: 1.98}
    two, three = got["points"]
    assert two["chain_of"] == [start, f"{arms} (average of runs/A, runs/B)"] and "weights" not in two
    assert three["chain_of"] == ["git:abc:old", start, f"{arms} (average of runs/A, runs/B)"]
    assert three["weights"] == [1, 2, 1]
    assert (two["walk"], three["walk"]) == (2.01, 2.02)
    assert three["per_set"] == {"a:0:8": pytest.approx(1.92)}
    assert three["weights_sha256"] == weights_fingerprint(chain3)
    kept = chain_record(
        [core0, core1], [chain2], [start], [f"{start}=git:def:start"], [f"{chain2}=heads/s27"], ""
    )
    assert [p["head"] for p in kept["points"]] == ["heads/s27"]
    assert kept["points"][0]["chain_of"][0] == "git:def:start" and kept["compare"] == {"git:def:start": 2.0}


def test_record_refuses_mismatched_walks_stale_points_and_plain_heads(stage):
    tmp_path, start, arms, old, chain2, chain3, core0, core1 = stage
    other_k = write(tmp_path / "k5.json", [point(chain3, 2.02)], num_speculative_tokens=5)
    with pytest.raises(ValueError, match="other settings.*num_speculative_tokens"):
        chain_record([core0, other_k], [chain2], [], [], [], "none")
    stale = write(tmp_path / "stale.json", [point(chain2, 2.01, sha="0" * 64)])
    with pytest.raises(ValueError, match="holds other weights"):
        chain_record([stale], [chain2], [], [], [], "none")
    with pytest.raises(ValueError, match="no walk"):
        chain_record([core0], [chain3], [], [], [], "none")
    with pytest.raises(ValueError, match="records no chain average"):
        chain_record([core0], [arms], [], [], [], "none")
    twice = write(tmp_path / "twice.json", [point(start, 1.9)])
    with pytest.raises(ValueError, match="two different walks"):
        chain_record([core0, twice], [chain2], [], [], [], "none")
    every_anchor = write(tmp_path / "ea.json", [point(chain2, 2.01)], measure="every-anchor")
    with pytest.raises(ValueError, match="not a decoding walk"):
        chain_record([every_anchor], [chain2], [], [], [], "none")
    with pytest.raises(ValueError, match="no walk results"):
        chain_record([], [chain2], [], [], [], "none")


def test_command_writes_the_record(stage, monkeypatch, capsys):
    tmp_path, start, arms, old, chain2, chain3, core0, core1 = stage
    out = tmp_path / "docs" / "chain_averages.json"
    argv = ["chain_averages.py", "--walks", core0, core1, "--averages", chain2, "--compare", start]
    monkeypatch.setattr(sys, "argv", argv + ["--kept", "none", "--out", str(out)])
    chain_averages.main()
    assert json.loads(out.read_text())["points"][0]["walk"] == 2.01
    assert "walk 2.0100" in capsys.readouterr().out
    # a wrong spec is a usage error naming it, and nothing is written
    out.unlink()
    monkeypatch.setattr(sys, "argv", argv + ["--relabel", "runs/gone=x", "--kept", "none", "--out", str(out)])
    with pytest.raises(SystemExit):
        chain_averages.main()
    assert "no point is labelled runs/gone" in capsys.readouterr().err and not out.exists()
