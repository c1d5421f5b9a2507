"""peagle.evaluation.results_page (behind benchmarks/results_page.py): docs/results.md and the README's results
table are what the committed benchmark JSONs give, so neither can go stale."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest

from peagle.evaluation.results_page import SOURCES, anchor, readme_table, render

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
SCRIPT = ROOT / "benchmarks" / "results_page.py"


def test_the_committed_page_is_what_the_committed_jsons_give():
    committed = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert committed == render(RESULTS), "docs/results.md is stale: run python benchmarks/results_page.py"


def test_the_readme_table_is_the_generated_one():
    table = readme_table(RESULTS)
    assert table in (ROOT / "README.md").read_text(encoding="utf-8"), (
        "README.md's results table is not what `python benchmarks/results_page.py --readme` prints"
    )
    assert 3 <= len(table.splitlines()) - 2 <= 8


def test_the_page_says_machine_date_and_head_of_every_run():
    page = render(RESULTS)
    for source in SOURCES.values():
        assert f"date: {source.date}" in page and source.head in page and source.command in page
    assert (
        page.count("- machine: AMD EPYC, AVX-512 BF16, 2 threads, no GPU") == len(SOURCES) - 2
    )  # one shared
    assert page.count("- machine: AMD EPYC, AVX-512 BF16, 1 thread, no GPU") == 1  # the first-call benchmark


def test_the_figures_come_from_the_jsons(tmp_path):
    """A changed JSON changes the page and the README table: nothing is copied by hand."""
    shutil.copytree(RESULTS, tmp_path / "results", ignore=shutil.ignore_patterns("*.png"))
    path = tmp_path / "results" / SOURCES["speed"].path
    data = json.loads(path.read_text())
    row = next(r for r in data["summary"] if r["dataset"] == "heldout" and r["label"] == "peagle default")
    row["speedup"], row["lossless"] = 9.87, False
    data["machine"]["cuda"] = "NVIDIA H100"
    path.write_text(json.dumps(data))
    page, table = render(tmp_path / "results"), readme_table(tmp_path / "results")
    assert "| held-out | P-EAGLE, default (trees) | 2.36 | 12.9 | 18.1 | 9.87x | 1.19x | **no** |" in page
    assert "9.87x | **no** |" in table and "GPU NVIDIA H100" in page
    assert page != render(RESULTS)


def test_the_command_writes_and_checks_the_page(tmp_path, capsys):
    out = tmp_path / "results.md"
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main(["--check", "--out", str(out)]) == 1
    assert main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render(RESULTS)
    assert main(["--check", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["--readme"]) == 0 and capsys.readouterr().out == readme_table(RESULTS)


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("10. The batched decoding loop", "10-the-batched-decoding-loop"),
        (
            "8.8 Long-context heads: the drafter window and documents",
            "88-long-context-heads-the-drafter-window-and-documents",
        ),
        ("19. A real target: Gemma-3-270M (#69)", "19-a-real-target-gemma-3-270m-69"),
    ],
)
def test_anchor_is_githubs(heading, expected):
    assert anchor(heading) == expected
