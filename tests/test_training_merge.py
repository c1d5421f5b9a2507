"""Weight averaging of heads trained side by side: tensors, guards, and the budget of the result."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_head
from peagle.training.merge import average_heads, average_state_dicts, chain_summary, merged_summary
from peagle.training.recipe import training_budget


def _arm(head, path, shift: float, summary: dict | None = None):
    """A copy of `head` whose floating-point weights moved by `shift`, saved at `path`."""
    with torch.no_grad():
        for p in head.parameters():
            p.add_(shift)
    head.save_pretrained(path)
    with torch.no_grad():
        for p in head.parameters():
            p.sub_(shift)
    if summary is not None:
        (path / "train_summary.json").write_text(json.dumps(summary))
    return load_file(path / "model.safetensors")


def test_average_heads_takes_the_mean_and_adds_the_arms_budgets(tiny_target, tmp_path):
    head = make_head(tiny_target).float()
    start = {"response_tokens_trained": 1000, "optimizer_steps": 10, "seconds": 100.0, "threads": 1}
    arm = {"optimizer_steps": 5, "seconds": 60.0, "threads": 1, "previous_stage": start}
    a = _arm(head, tmp_path / "a", 0.5, {**arm, "response_tokens_trained": 300})
    b = _arm(head, tmp_path / "b", -0.1, {**arm, "response_tokens_trained": 200})
    out = average_heads([tmp_path / "a", tmp_path / "b"], tmp_path / "soup")
    soup = load_file(out / "model.safetensors")
    for name, tensor in head.state_dict().items():
        if tensor.is_floating_point():
            assert torch.allclose(soup[name], tensor + 0.2, atol=1e-6), name
            assert soup[name].dtype == a[name].dtype
        else:
            assert torch.equal(soup[name], b[name])
    summary = json.loads((out / "train_summary.json").read_text())
    budget = training_budget(summary)
    # both arms' token-passes, steps and CPU time count once each, on top of the common starting head's
    assert budget["response_tokens_trained"] == 1500
    assert budget["optimizer_steps"] == 20
    assert budget["cpu_hours"] == round(220 / 3600, 2)
    assert summary["cumulative"] == budget and len(summary["arms"]) == 2
    assert summary["wall_seconds"] == 60.0
    # the average loads like any head, with the remote code its config names
    code = sorted(x.name for x in (tmp_path / "a").glob("*.py"))
    assert code and sorted(x.name for x in out.glob("*.py")) == code
    loaded = type(head).from_pretrained(out)
    assert torch.allclose(loaded.fc.weight, head.fc.weight + 0.2, atol=1e-6)


def test_average_heads_drops_the_first_heads_calibration(tiny_target, tmp_path):
    head = make_head(tiny_target).float()
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.0, 1.0]]}
    _arm(head, tmp_path / "a", 0.1)
    _arm(head, tmp_path / "b", -0.1)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["draft_calibration"]
    out = average_heads([tmp_path / "a", tmp_path / "b"], tmp_path / "soup")
    assert json.loads((out / "config.json").read_text())["draft_calibration"] is None
    assert type(head).from_pretrained(out).config.draft_calibration is None


def test_weighted_average_and_guards():
    x = {"w": torch.tensor([0.0, 4.0], dtype=torch.bfloat16), "ids": torch.tensor([1, 2])}
    y = {"w": torch.tensor([4.0, 0.0], dtype=torch.bfloat16), "ids": torch.tensor([1, 2])}
    got = average_state_dicts([x, y], weights=[3, 1])
    assert got["w"].dtype == torch.bfloat16 and got["w"].tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="one starting head"):
        average_state_dicts([x, {**y, "ids": torch.tensor([2, 1])}])
    with pytest.raises(ValueError, match="shapes differ"):
        average_state_dicts([x, {**y, "w": torch.zeros(3)}])
    with pytest.raises(ValueError, match="other tensors"):
        average_state_dicts([x, {"w": y["w"]}])
    with pytest.raises(ValueError, match="weight"):
        average_state_dicts([x, y], weights=[1])


def test_arms_from_different_starts_keep_no_common_stage():
    one = {"response_tokens_trained": 5, "previous_stage": {"response_tokens_trained": 1}}
    two = {"response_tokens_trained": 5, "previous_stage": {"response_tokens_trained": 2}}
    merged = merged_summary([one, two])
    assert "previous_stage" not in merged and merged["response_tokens_trained"] == 10


def test_arms_that_share_an_older_stage_count_their_own_stages_since_it():
    start = {"response_tokens_trained": 1000, "optimizer_steps": 10}
    # run R: 10 steps finalised as a stage, then resumed from its checkpoint to 17 steps (counting all 17)
    r_early = {
        "output_dir": "runs/R",
        "response_tokens_trained": 100,
        "optimizer_steps": 10,
        "previous_stage": start,
    }
    r_late = {
        "output_dir": "runs/R",
        "response_tokens_trained": 170,
        "optimizer_steps": 17,
        "previous_stage": start,
    }
    from_early = {
        "output_dir": "runs/C",
        "response_tokens_trained": 70,
        "optimizer_steps": 7,
        "previous_stage": r_early,
    }
    merged = merged_summary([r_late, from_early])
    assert merged["previous_stage"] == start
    assert training_budget(merged)["response_tokens_trained"] == 1000 + 170 + 70
    assert training_budget(merged)["optimizer_steps"] == 10 + 17 + 7
    assert "after_common_stage" not in merged["arms"][1]
    # a stage of another run between the common stage and an arm counts, and is kept in the arm's record
    other = {
        "output_dir": "runs/O",
        "response_tokens_trained": 100,
        "optimizer_steps": 10,
        "previous_stage": start,
    }
    merged = merged_summary([r_late, {**from_early, "previous_stage": other}])
    assert training_budget(merged)["response_tokens_trained"] == 1000 + 170 + 70 + 100
    assert merged["arms"][1]["after_common_stage"] == [
        {k: v for k, v in other.items() if k != "previous_stage"}
    ]


def test_average_heads_refuses_heads_of_other_shapes(tiny_target, tmp_path):
    make_head(tiny_target).save_pretrained(tmp_path / "two")
    make_head(tiny_target, num_hidden_layers=1).save_pretrained(tmp_path / "one")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        average_heads([tmp_path / "two", tmp_path / "one"], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        average_heads([tmp_path / "two", tmp_path / "missing"], tmp_path / "out")


def test_chain_average_keeps_the_newest_stages_budget(tiny_target, tmp_path):
    head = make_head(tiny_target).float()
    first = {"response_tokens_trained": 1000, "optimizer_steps": 10, "seconds": 100.0, "threads": 1}
    second = {"response_tokens_trained": 400, "optimizer_steps": 4, "seconds": 40.0, "previous_stage": first}
    third = {"response_tokens_trained": 300, "optimizer_steps": 3, "seconds": 30.0, "previous_stage": second}
    _arm(head, tmp_path / "s1", 0.3, first)
    _arm(head, tmp_path / "s2", 0.0, second)
    head.config.confidence_threshold = 0.25  # a setting the newest stage changed
    _arm(head, tmp_path / "s3", -0.6, third)
    out = average_heads([tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"], tmp_path / "chain", chain=True)
    avg = load_file(out / "model.safetensors")
    assert torch.allclose(avg["fc.weight"], head.state_dict()["fc.weight"] - 0.1, atol=1e-6)
    summary = json.loads((out / "train_summary.json").read_text())
    # averaging trains nothing: the budget is the newest stage's, not the sum an arm average would give
    assert training_budget(summary)["response_tokens_trained"] == 1700
    assert summary["cumulative"] == training_budget(summary)
    assert summary["previous_stage"] == second
    assert summary["chain_average"]["token_passes"] == [1000, 1400, 1700]
    assert summary["chain_average"]["from"] == [str(tmp_path / s) for s in ("s1", "s2", "s3")]
    # the config is the newest stage's (without its calibration), not the oldest's
    config = json.loads((out / "config.json").read_text())
    assert config["confidence_threshold"] == 0.25 and config["draft_calibration"] is None
    # the next stage trained from it chains on as from any head
    assert (
        training_budget({"response_tokens_trained": 50, "previous_stage": summary})["response_tokens_trained"]
        == 1750
    )


def test_chain_average_refuses_what_is_not_one_chain(tiny_target, tmp_path):
    first = {"response_tokens_trained": 1000}
    second = {"response_tokens_trained": 400, "previous_stage": first}
    other = {"response_tokens_trained": 400, "previous_stage": {"response_tokens_trained": 999}}
    with pytest.raises(ValueError, match="not an earlier stage"):
        chain_summary([first, other])
    with pytest.raises(ValueError, match="not an earlier stage"):
        chain_summary([second, first])  # newest first
    head = make_head(tiny_target)
    _arm(head, tmp_path / "a", 0.1, first)
    _arm(head, tmp_path / "b", 0.1)
    with pytest.raises(FileNotFoundError, match="train_summary.json"):
        average_heads([tmp_path / "a", tmp_path / "b"], tmp_path / "out", chain=True)
