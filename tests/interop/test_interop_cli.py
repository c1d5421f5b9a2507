"""The command line against the peers: `peagle bench` vLLM rows, `--target default` in push, AutoModel on exports."""

from __future__ import annotations

import json

import torch
from transformers import AutoModel

import peagle
from peagle.cli import main


def test_bench_vllm_rows(tmp_path, capsys):
    """`peagle bench --methods ...,vllm,vllm-peagle`: vLLM plain and with the exported head on the same prompt and
    length, next to the transformers rows (wiring only: one prompt, 16 tokens; no timing is asserted)."""
    out = tmp_path / "bench"
    args = ["bench", "--methods", "greedy,peagle,vllm,vllm-peagle", "--datasets", "mtbench", "--limit", "1"]
    args += ["--ks", "3", "--max_new_tokens", "16", "--repeats", "1", "--no_default_rule", "--out", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    results = json.loads((out / "bench.json").read_text())
    rows = {(s["method"], s["k"]): s for s in results["summary"]}
    assert {("greedy", 0), ("peagle", 3), ("vllm", 0), ("vllm-peagle", 3)} <= rows.keys()
    plain, spec = rows[("vllm", 0)], rows[("vllm-peagle", 3)]
    assert plain["tokens_per_target_pass"] == 1.0 and plain["acceptance_length"] is None
    assert spec["acceptance_length"] is not None and spec["tokens_per_target_pass"] >= 1.0
    assert plain["lossless"] and spec["lossless"] and plain["tokens_per_s"] > 0
    assert plain["ms_per_round_target"] is None  # vLLM's time is not split
    runs = [r for r in results["runs"] if r["method"].startswith("vllm")]
    assert all(r["new_tokens"] == 16 for r in runs)
    assert "| mtbench | vllm-peagle | 3 |" in table


def test_push_prepare_only_with_default_target(tmp_path):
    shipped = peagle.targets.default_drafter_path("peagle")
    out = tmp_path / "upload"
    assert (
        main(["push", str(shipped), "me/smollm2-peagle", "--target", "default", "--prepare_only", str(out)])
        == 0
    )
    back, ref = peagle.load_head(out), peagle.load_head(shipped)
    assert back.config.num_speculative_tokens == ref.config.num_speculative_tokens
    assert back.config.embed_from_target  # the target's embeddings are not stored: compare everything else
    theirs, ours = back.state_dict(), ref.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], v) for k, v in ours.items() if k != "embed_tokens.weight")
    assert (out / "README.md").is_file()


def test_automodel_loads_the_exports_the_peers_read(exports):
    """The exports vLLM and speculators read above: `AutoModel.from_pretrained` returns the head, not a
    half-random LlamaModel."""
    for name, folder in exports.items():
        model = AutoModel.from_pretrained(folder)
        assert isinstance(model, peagle.PEagleDrafter), name
        ref = peagle.load_head(folder).state_dict()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items()), name
