"""Benchmark harness on a tiny random target (behaviour only: nothing here is timed or compared by speed)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import make_head, make_target
from peagle.data.evalsets import is_evaluation_prompt, load_humaneval, load_mtbench
from peagle.evaluation.bench import format_table, run_benchmark, summarize, write_results
from peagle.evaluation.timing import timed_generate


def test_timed_generate_counts_rounds():
    target = make_target()
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = timed_generate(target, ids, 6)
    assert plain.new_tokens == 6 and plain.target_calls == 6  # one forward per token
    assert plain.drafter_calls == 0 and plain.seconds >= plain.target_seconds > 0


def test_run_benchmark_rows_summary_and_files(tmp_path):
    target = make_target()
    head = make_head(target)
    prompts = {"toy": [torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]]), torch.tensor([[9, 10, 11, 12]])]}
    res = run_benchmark(
        target, prompts, {"peagle": head}, ks=(2, 3), max_new_tokens=8, repeats=2, progress=False
    )
    rows = res["runs"]
    assert len(rows) == 2 * (1 + 2 * 2)  # per prompt: greedy + (peagle, pld) x 2 Ks
    assert {r["method"] for r in rows} == {"greedy", "peagle", "pld"}
    assert all(r["lossless"] for r in rows)
    peagle_rows = [r for r in rows if r["method"] == "peagle"]
    # one drafter pass per drafting round; target passes without a draft (at the length cap) add none
    assert all(0 < r["drafter_calls"] <= r["target_passes"] for r in peagle_rows)
    summary = {(s["dataset"], s["method"], s["k"]): s for s in res["summary"]}
    assert summary[("toy", "greedy", 0)]["tokens_per_target_pass"] == 1.0
    assert summary[("toy", "greedy", 0)]["speedup"] == 1.0
    assert all(s["tokens_per_target_pass"] >= 1.0 for s in res["summary"])
    js, png = write_results(res, tmp_path)
    assert json.loads(js.read_text())["summary"] and png.stat().st_size > 1000
    assert "| toy | peagle | 3 |" in format_table(res["summary"])


def test_run_benchmark_passes_the_confidence_threshold():
    target = make_target()
    head = make_head(target)
    prompts = {"toy": [torch.tensor([[5, 6, 7, 8]])]}
    res = run_benchmark(
        target, prompts, {"peagle": head}, ks=(4,), max_new_tokens=8, repeats=1, progress=False,
        methods=("greedy", "peagle"), confidence_threshold=1.0,
    )  # fmt: skip
    assert res["config"]["confidence_threshold"] == {"peagle": 1.0} and all(
        r["lossless"] for r in res["runs"]
    )
    stats = head.last_generation_stats
    assert stats.confidence_threshold == 1.0 and stats.draft_tokens == stats.rounds  # one draft per round
    # None: each head's own default; an explicit 0.0 overrides it
    head.config.confidence_threshold = 1.0
    for given, used in ((None, 1.0), (0.0, 0.0)):
        res = run_benchmark(
            target, prompts, {"peagle": head}, ks=(4,), max_new_tokens=8, repeats=1, progress=False,
            methods=("greedy", "peagle"), confidence_threshold=given,
        )  # fmt: skip
        assert res["config"]["confidence_threshold"] == {"peagle": used}
        assert head.last_generation_stats.confidence_threshold == used


def test_summarize_flags_a_mismatch():
    rows = [
        dict(dataset="d", prompt=0, method="greedy", k=0, new_tokens=10, seconds=1.0, target_passes=10,
             target_seconds=0.9, drafter_seconds=0.0, drafter_calls=0, lossless=True),
        dict(dataset="d", prompt=0, method="peagle", k=3, new_tokens=10, seconds=0.5, target_passes=4,
             target_seconds=0.3, drafter_seconds=0.1, drafter_calls=4, lossless=False),
    ]  # fmt: skip
    s = {x["method"]: x for x in summarize(rows)}
    assert (
        s["peagle"]["speedup"] == 2.0
        and s["peagle"]["tokens_per_target_pass"] == 2.5
        and s["peagle"]["lossless"] is False
    )
    assert "NO" in format_table(summarize(rows))


def test_evaluation_sets_and_guard():
    mt, he = load_mtbench(), load_humaneval()
    assert len(mt) == 80 and len(he) == 164
    assert load_mtbench(5) == mt[:5]
    assert is_evaluation_prompt(mt[10]) and is_evaluation_prompt("  " + he[3].upper())
    assert not is_evaluation_prompt("Explain the water cycle to a beginner in a few paragraphs.")


def test_demo_command_passes_its_options(monkeypatch):
    import peagle.demo
    from peagle.cli import build_parser

    seen = {}
    monkeypatch.setattr(peagle.demo, "run_demo", lambda **kw: seen.update(kw) or True)
    args = build_parser().parse_args(
        ["demo", "--dtype", "bfloat16", "--confidence_threshold", "0.3", "--num_speculative_tokens", "5"]
    )
    assert args.func(args) == 0
    assert seen == {
        "max_new_tokens": 128,
        "num_speculative_tokens": 5,
        "confidence_threshold": 0.3,
        "dtype": "bfloat16",
        "head_dtype": "auto",
        "target": None,
        "head": None,
    }
    args = build_parser().parse_args(["demo", "--head_dtype", "float32", "--target", "t/x", "--head", "h/y"])
    assert args.func(args) == 0
    assert seen["dtype"] == "float32" and seen["head_dtype"] == "float32"
    assert (seen["target"], seen["head"]) == ("t/x", "h/y")
    assert build_parser().parse_args(["bench"]).head_dtype == "auto"
    assert build_parser().parse_args(["bench", "--head_dtype", "float32"]).head_dtype == "float32"


def test_run_benchmark_default_rule_rows():
    """With `default_rule`, each head also runs with its own default (cost-aware drafting for a head without a
    cut) as method "<head>-auto", next to the fixed-K rows; outputs stay greedy's."""
    target = make_target()
    head = make_head(target, confidence_threshold=None, num_speculative_tokens=3)
    prompts = {"toy": [torch.tensor([[5, 6, 7, 8]])]}
    res = run_benchmark(
        target, prompts, {"peagle": head}, ks=(2,), max_new_tokens=8, repeats=1, progress=False,
        methods=("greedy", "peagle"), confidence_threshold=0.0, default_rule=True,
    )  # fmt: skip
    methods = [(r["method"], r["k"]) for r in res["runs"]]
    assert methods == [("greedy", 0), ("peagle", 2), ("peagle-auto", 3)]
    auto = res["runs"][-1]
    assert auto["lossless"] and auto["stats"]["draft_policy"] == "cost"
    assert res["runs"][1]["stats"]["draft_policy"] == "fixed"
    assert "| toy | peagle-auto | 3 |" in format_table(res["summary"])


def test_bench_command_validates_before_loading(monkeypatch):
    import peagle.targets
    from peagle.cli import main

    def no_loading(*a, **k):
        raise AssertionError("nothing should load for invalid arguments")

    monkeypatch.setattr(peagle.targets, "load_target", no_loading)
    for argv, message in (
        (["bench", "--limit", "0"], "--limit must be >= 1"),
        (["bench", "--ks", "0,3"], "integers >= 1"),
        (["bench", "--methods", "greedy,nope"], "unknown methods"),
        (["bench", "--datasets", "nope"], "unknown datasets"),
        (["bench", "--tree_sizes", "8,-1"], "integers >= 0"),
        (["bench", "--tree_sizes", "8", "--datasets", ""], "needs prompts"),
        (["bench", "--skip", "-3"], "--skip must be >= 0"),
        (["bench", "--contexts", "0,-1", "--examples", "x"], "integers >= 0"),
        (["bench", "--contexts", "0,2048"], "needs held-out prompts: --examples"),
    ):
        with pytest.raises(SystemExit, match=message):
            main(argv)


def test_batch_benchmark_rows_summary_and_files(tmp_path):
    """`peagle bench --batch_sizes`: every method at every B on the same prompts, each row checked against plain
    batched greedy and against batch 1; a table and a plot (behaviour only, nothing compared by speed)."""
    from peagle.evaluation.bench_batch import format_batch_table, run_batch_benchmark, write_batch_results

    target = make_target(eos_token_id=None)
    head = make_head(target, confidence_threshold=None)
    from peagle.generation.cost import VerifyCostModel

    head.cost_model = VerifyCostModel.flat(max_tokens=8)  # no timing in tests: a fixed curve
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 127, (1, n), generator=gen) for n in (4, 9, 6, 3, 12)]
    res = run_batch_benchmark(
        target, prompts, {"peagle": head}, batch_sizes=(1, 2, 4), max_new_tokens=6, progress=False
    )
    assert res["config"]["prompts"] == 4  # the largest multiple of every batch size
    assert res["config"]["methods"] == ["greedy", "peagle-auto", "peagle"]  # no EAGLE-3 head given
    runs = res["runs"]
    assert len(runs) == (4 + 2 + 1) * 3 and all(r["lossless"] for r in runs)
    summary = {(s["batch_size"], s["method"]): s for s in res["summary"]}
    assert (
        summary[(2, "greedy")]["speedup"] == 1.0 and summary[(4, "peagle")]["rows_equal_to_batch1"] == "4/4"
    )
    assert summary[(4, "peagle-auto")]["new_tokens"] == 4 * 6
    js, png = write_batch_results(res, tmp_path)
    assert json.loads(js.read_text())["summary"] and png.stat().st_size > 1000
    assert "| 4 | peagle-auto |" in format_batch_table(res["summary"])
    with pytest.raises(ValueError, match="cannot fill whole batches"):
        run_batch_benchmark(target, prompts[:2], {}, batch_sizes=(4,), progress=False)


@pytest.mark.parametrize("k", ["0", "-1", "65", "3e7", "x"])
def test_demo_refuses_k_out_of_range_before_loading(monkeypatch, capsys, k):
    """`-k 0` ran the demo with the head's K = 7."""
    import peagle.demo
    import peagle.targets
    from peagle.cli import main

    def no_loading(*a, **kw):
        raise AssertionError("nothing should load for an invalid K")

    monkeypatch.setattr(peagle.targets, "load_target", no_loading)
    monkeypatch.setattr(peagle.targets, "load_default_target", no_loading)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--num_speculative_tokens", k])
    assert exit_.value.code != 0 and "expected an integer in [1, 64]" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"num_speculative_tokens is 0; expected an integer in \[1, 64\]"):
        peagle.demo.run_demo(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="confidence_threshold is 1.5"):
        peagle.demo.run_demo(confidence_threshold=1.5)


def test_tree_benchmark_rows_summary_and_files(tmp_path):
    """`peagle bench --tree_sizes`: chains and trees of each budget for each head, with and without the lookup
    branch, prompt lookup alone and the default-rule rows, each checked against greedy; a table and a plot."""
    from peagle.evaluation.bench_tree import format_tree_table, run_tree_benchmark, write_tree_results
    from peagle.generation.cost import VerifyCostModel

    target = make_target(eos_token_id=None)
    heads = {"peagle": make_head(target, confidence_threshold=None)}
    heads["eagle3"] = make_head(target, confidence_threshold=None, drafting_mode="autoregressive")
    for head in heads.values():
        head.cost_model = VerifyCostModel.flat(max_tokens=40)  # no timing in tests: a fixed curve
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(3, 127, (1, 6), generator=gen)
    prompts = {"repeats": [torch.cat([base, base, base[:, :3]], dim=1)], "random": [base]}
    res = run_tree_benchmark(
        target, prompts, heads, tree_sizes=(0, 4, 8), num_speculative_tokens=3, lookups=(0, 4),
        max_new_tokens=8, progress=False,
    )  # fmt: skip
    labels = [s["label"] for s in res["summary"] if s["dataset"] == "random"]
    assert labels == [
        "greedy", "peagle chain", "peagle tree 4", "peagle tree 4 +lookup 4", "peagle tree 8",
        "peagle tree 8 +lookup 4", "eagle3 chain", "eagle3 tree 4", "eagle3 tree 4 +lookup 4", "eagle3 tree 8",
        "eagle3 tree 8 +lookup 4", "pld 4", "peagle default", "peagle default chains", "eagle3 default",
        "eagle3 default chains",
    ]  # fmt: skip
    assert all(s["lossless"] for s in res["summary"]) and len(res["runs"]) == 2 * len(labels)
    by = {(s["dataset"], s["label"]): s for s in res["summary"]}
    assert by[("random", "greedy")]["tokens_per_target_pass"] == 1.0
    tree_runs = [r for r in res["runs"] if r["label"] == "peagle tree 8"]
    assert all(r["stats"]["tree_rounds"] == r["stats"]["rounds"] for r in tree_runs)
    chain_runs = [r for r in res["runs"] if r["label"] == "peagle default chains"]
    assert all(r["stats"]["tree_rounds"] == 0 for r in chain_runs)
    # the prompt repeats itself: the lookup branch is accepted where the head's own drafts are not
    assert (
        by[("repeats", "peagle tree 8 +lookup 4")]["tokens_per_target_pass"]
        > by[("repeats", "peagle tree 8")]["tokens_per_target_pass"]
    )
    js, png = write_tree_results(res, tmp_path)
    assert json.loads(js.read_text())["config"]["tree_sizes"] == [0, 4, 8] and png.stat().st_size > 1000
    table = format_tree_table(res["summary"])
    assert "| random | peagle tree 8 +lookup 4 |" in table


def test_bench_contexts_runs_the_long_context_benchmark(tmp_path, monkeypatch, capsys):
    """`peagle bench --contexts 0,N --examples F [--context_source DIR]`: the head's default rule against plain
    greedy after each context, every output checked; long_context.json and .png."""
    import peagle.targets
    from helpers import tiny_tokenizer
    from peagle.cli import main
    from peagle.data.shards import save_examples

    target = make_target(eos_token_id=None)
    make_head(target).save_pretrained(tmp_path / "head")
    monkeypatch.setattr(peagle.targets, "load_target", lambda *a, **k: (target, tiny_tokenizer()))
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(5, 120, (30,), generator=gen).tolist() for _ in range(6)]
    save_examples([{"input_ids": r, "loss_mask": [0] * 8 + [1] * 22} for r in rows], tmp_path / "ex.jsonl")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(" ".join(["hello", "world", "code"] * 40))
    common = ["bench", "--target", "tiny", "--head", str(tmp_path / "head"), "--methods", "greedy,peagle"]
    common += [
        "--examples",
        str(tmp_path / "ex.jsonl"),
        "--skip",
        "4",
        "--limit",
        "2",
        "--max_new_tokens",
        "6",
    ]
    for source in ("conversations", str(docs)):
        out = tmp_path / source.replace("/", "_")
        assert main([*common, "--contexts", "0,64", "--context_source", source, "--out", str(out)]) == 0
        res = json.loads((out / "long_context.json").read_text())
        assert [s["context"] for s in res["summary"]] == [0, 64]
        assert (
            all(s["identical"] for s in res["summary"]) and (out / "long_context.png").stat().st_size > 1000
        )
        assert res["config"]["context_source"] == source and res["command"].startswith("peagle bench")
    assert "wrote" in capsys.readouterr().out
