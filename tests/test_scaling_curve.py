"""The evaluation scripts' rules: scaling_curve.py's pooling of several held-out sets, checkpoint budgets,
fit, the matching of reused points by weights and their relabelling; ablate_heads.py's collection of its
evaluations."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import scaling_curve  # noqa: E402
from ablate_heads import collect  # noqa: E402
from scaling_curve import (  # noqa: E402
    checkpoint_budget,
    fit_log_linear,
    head_budgets,
    merge_points,
    pooled,
    relabel_points,
    weights_fingerprint,
)


def set_result(anchors: int, every_anchor: float, depth: list[float], tokens: int, passes: int) -> dict:
    """One held-out set's result as teacher_forced() reports it, in the fields pooled() reads."""
    return {
        "anchors": anchors,
        "tokens_per_target_pass": every_anchor,
        "acceptance_by_depth": depth,
        "decoded_tokens": tokens,
        "decoded_target_passes": passes,
    }


def test_pooled_weights_by_anchors_and_walks_sum_tokens_over_passes():
    easy = set_result(10, 2.0, [0.5, 0.2], tokens=30, passes=10)
    hard = set_result(30, 1.0, [0.1, 0.0], tokens=20, passes=20)
    got = pooled([easy, hard])
    assert got["anchors"] == 40
    assert got["every_anchor_tokens_per_target_pass"] == pytest.approx(1.25)
    assert got["acceptance_by_depth"] == pytest.approx([0.2, 0.05])
    # 50 tokens in 30 passes, not the mean of the two sets' 3.0 and 1.0
    assert got["decoded_tokens_per_target_pass"] == pytest.approx(50 / 30)


def test_head_budgets_reads_summaries_and_marks_stated_budgets_as_estimates(tmp_path):
    staged = tmp_path / "staged"
    staged.mkdir()
    summary = {"response_tokens_trained": 500, "previous_stage": {"response_tokens_trained": 200}}
    (staged / "train_summary.json").write_text(json.dumps(summary))
    checkpoint = str(tmp_path / "checkpoint-100")  # no train_summary.json: its budget is stated
    budgets, estimated = head_budgets([str(staged), checkpoint], [f"{checkpoint}=1.5e3"])
    assert budgets == {str(staged): 700, checkpoint: 1500}
    assert estimated == {checkpoint}
    with pytest.raises(ValueError, match="not one of --heads"):
        head_budgets([str(staged)], [f"{checkpoint}=1000"])
    with pytest.raises(ValueError, match="expected HEAD=TOKEN_PASSES"):
        head_budgets([str(staged)], [str(staged)])


def test_checkpoint_budget_adds_the_earlier_stages():
    final = {
        "optimizer_steps": 100,
        "response_tokens_trained": 5000,
        "previous_stage": {
            "response_tokens_trained": 700,
            "previous_stage": {"response_tokens_trained": 300},
        },
    }
    assert checkpoint_budget(40, final) == 1000 + 2000
    assert checkpoint_budget(40, {"optimizer_steps": 100, "response_tokens_trained": 5000}) == 2000


def test_fit_log_linear_recovers_a_line_and_predicts_budgets():
    points = [
        {"token_passes": x, "tokens_per_target_pass": -1.0 + 0.5 * math.log10(x)} for x in (1e5, 1e6, 1e7)
    ]
    points.append({"token_passes": 0, "tokens_per_target_pass": 9.0})  # no budget: left out of the fit
    fit, predictions = fit_log_linear(points, [2.0, 3.0])
    assert fit["a"] == pytest.approx(-1.0) and fit["b"] == pytest.approx(0.5)
    assert predictions["2.0"] == pytest.approx(1e6) and predictions["3.0"] == pytest.approx(1e8)
    falling = [
        {"token_passes": 1e5, "tokens_per_target_pass": 2.0},
        {"token_passes": 1e6, "tokens_per_target_pass": 1.5},
    ]
    assert fit_log_linear(falling, [2.5])[1] == {"2.5": None}
    flat = [  # a fit that barely rises: the budget for 3.0 is beyond any float
        {"token_passes": 1e6, "tokens_per_target_pass": 2.0},
        {"token_passes": 1e7, "tokens_per_target_pass": 2.0001},
    ]
    assert fit_log_linear(flat, [3.0])[1] == {"3.0": None}
    assert fit_log_linear(points[:1], [2.0]) == (None, {})


def test_ablations_record_the_decoding_walk(tmp_path):
    def result(walk):
        return {"acceptance_by_depth": [0.5, 0.3, 0.2, 0.1, 0.1, 0.05, 0.05], "anchors": 100,
                "decoded_tokens_per_target_pass": walk}  # fmt: skip

    head = str(tmp_path / "base" / "head")
    evaluated = {
        str(tmp_path / "base" / "run" / "checkpoints" / "checkpoint-50"): result(1.2),
        head: result(1.4),
    }
    evaluated[head]["train_summary"] = {"response_tokens_trained": 1000, "seconds": 60.0}
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "eval.json").write_text(json.dumps({"results": evaluated}))
    collect(["base"], tmp_path, argparse.Namespace(out=str(tmp_path / "ablations.json")))
    got = json.loads((tmp_path / "ablations.json").read_text())["results"]["base"]
    assert got["decoded_tokens_per_target_pass"] == 1.4 and got["decoded_k"] == 7
    assert [c["decoded_tokens_per_target_pass"] for c in got["curve"]] == [1.2, 1.4]
    assert got["tokens_per_target_pass_k7"] == pytest.approx(2.3)


def test_reused_points_are_matched_by_weights_not_by_folder(tmp_path):
    def head(name: str, weights: bytes) -> str:
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "model.safetensors").write_bytes(weights)
        return str(folder)

    same, changed, gone = head("same", b"a"), head("changed", b"b"), str(tmp_path / "gone")
    old_same = {"head": same, "tokens_per_target_pass": 1.5, "weights_sha256": weights_fingerprint(same)}
    old_changed = {
        "head": changed,
        "tokens_per_target_pass": 1.6,
        "weights_sha256": weights_fingerprint(changed),
    }
    old_gone = {"head": gone, "tokens_per_target_pass": 1.4, "weights_sha256": "0" * 64}
    assert weights_fingerprint(gone) is None
    head("changed", b"c")  # the folder now holds other weights
    new = [
        {"head": same, "tokens_per_target_pass": 1.5, "weights_sha256": weights_fingerprint(same)},
        {"head": changed, "tokens_per_target_pass": 1.9, "weights_sha256": weights_fingerprint(changed)},
    ]
    merged, notes = merge_points(new, [old_same, old_changed, old_gone])
    by_head = {p["head"]: p["tokens_per_target_pass"] for p in merged}
    stale = f"{changed}@sha256:{old_changed['weights_sha256'][:12]}"
    # the same weights measured again replace their point; other weights in a folder keep the old number apart
    assert by_head == {same: 1.5, changed: 1.9, stale: 1.6, gone: 1.4}
    assert len(notes) == 1 and stale in notes[0]
    # a stale folder is relabelled even when it is not measured again
    merged, _ = merge_points([], [old_changed])
    assert [p["head"] for p in merged] == [stale]
    # a point without a fingerprint cannot be matched: measuring its folder again is refused
    with pytest.raises(ValueError, match="no weights fingerprint"):
        merge_points(new, [{"head": same, "tokens_per_target_pass": 1.2}])
    assert merge_points([], [{"head": same, "tokens_per_target_pass": 1.2}])[0][0]["head"] == same


def test_relabel_points_renames_a_stage_that_left_the_tree_and_a_kept_candidate():
    points = [
        {"head": "heads/stage24", "tokens_per_target_pass": 2.027},
        {"head": "runs/stage25-chain2", "tokens_per_target_pass": 2.03},
        {"head": "runs/stage25A", "tokens_per_target_pass": 2.01},
    ]
    got = relabel_points(
        points, ["heads/stage24=git:abc1234:heads/stage24", "runs/stage25-chain2=heads/stage25"]
    )
    assert [p["head"] for p in got] == ["git:abc1234:heads/stage24", "heads/stage25", "runs/stage25A"]
    assert [p["tokens_per_target_pass"] for p in got] == [2.027, 2.03, 2.01]
    assert points[0]["head"] == "heads/stage24"  # the input is not changed
    assert relabel_points(points, []) == points
    with pytest.raises(ValueError, match="no point is labelled runs/gone"):
        relabel_points(points, ["runs/gone=heads/x"])
    with pytest.raises(ValueError, match="two points would be labelled runs/stage25A"):
        relabel_points(points, ["runs/stage25-chain2=runs/stage25A"])
    with pytest.raises(ValueError, match="expected OLD=NEW"):
        relabel_points(points, ["heads/stage24"])
    with pytest.raises(ValueError, match="runs/stage25A is relabelled twice"):
        relabel_points(points, ["runs/stage25A=heads/a", "runs/stage25A=heads/b"])


def test_reuse_with_relabel_alone_rewrites_the_result_without_evaluating(tmp_path, monkeypatch):
    settings = {"heldout": ["held"], "skip": 48, "limit": 48, "num_speculative_tokens": 7}
    settings.update(head_dtype="float32", measure="decoded", max_new_tokens=128)
    points = [
        {
            "head": f"heads/stage{n}",
            "token_passes": budget,
            "tokens_per_target_pass": walk,
            "weights_sha256": None,
        }
        for n, budget, walk in ((1, 10**6, 1.5), (2, 10**7, 1.9))
    ]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"settings": settings, "points": points}))
    out = tmp_path / "relabelled.json"

    def no_target():
        raise AssertionError("nothing to evaluate: the target must not be loaded")

    monkeypatch.setattr(scaling_curve, "load_default_target", no_target)
    argv = ["scaling_curve.py", "--heldout", "held", "--measure", "decoded", "--head-dtype", "float32"]
    argv += ["--reuse", str(earlier), "--relabel", "heads/stage1=git:abc1234:heads/stage1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    scaling_curve.main()
    got = json.loads(out.read_text())
    assert [p["head"] for p in got["points"]] == ["git:abc1234:heads/stage1", "heads/stage2"]
    assert got["fit"]["b"] == pytest.approx(0.4)
    assert out.with_suffix(".png").is_file()
    # an OLD that labels no point is refused before anything is evaluated or written
    monkeypatch.setattr(
        sys, "argv", argv[:-4] + ["--relabel", "heads/stage9=x", "--out", str(tmp_path / "no.json")]
    )
    with pytest.raises(SystemExit):
        scaling_curve.main()
    assert not (tmp_path / "no.json").exists()
