"""The docs' cross-references point at something that exists: every "DESIGN.md section N" or "docs/X.md section
N" named in the README, the docs, the code, the tests, the benchmarks and the examples is a numbered heading of
that file, and every markdown link into docs/ (or from one doc to another) names a file that exists and, with an
anchor, a heading it has.  Section numbers are cited from code, so a doc keeps its numbers and adds new sections at
the end; DESIGN.md's index table lists every section."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SECTION_REF = re.compile(
    r"\b(?:docs/)?(?P<doc>[A-Za-z0-9_]+)\.md,? sections? "
    r"(?P<numbers>\d+(?:\.\d+)*(?:(?:,? and |, | or )\d+(?:\.\d+)*)*)"
)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
NUMBERED = re.compile(r"^#{1,6} (\d+(?:\.\d+)*)\.?\s")


def sources() -> list[Path]:
    """The files whose references are checked."""
    found = [ROOT / "README.md", *DOCS.glob("*.md")]
    for folder in ("src", "tests", "benchmarks", "examples"):
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md") and p.is_file()]
    return sorted(
        p for p in found if p != Path(__file__).resolve()
    )  # this file's own examples are broken on purpose


def headings(text: str) -> list[str]:
    """Markdown headings outside code fences, without their `#`s."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)):
            out.append(m.group(1))
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path.read_text(encoding="utf-8")):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


@cache
def section_numbers(path: Path) -> set[str]:
    return {m.group(1) for h in headings(path.read_text(encoding="utf-8")) if (m := NUMBERED.match("# " + h))}


def section_problems(path: Path, text: str) -> list[str]:
    problems = []
    for m in SECTION_REF.finditer(re.sub(r"\s+", " ", text)):
        doc = DOCS / f"{m.group('doc')}.md"
        if not doc.is_file():
            problems.append(f"{path.relative_to(ROOT)}: {m.group(0)!r} names no file in docs/")
            continue
        for number in re.findall(r"\d+(?:\.\d+)*", m.group("numbers")):
            if number not in section_numbers(doc):
                problems.append(
                    f"{path.relative_to(ROOT)}: {m.group(0)!r}: {doc.name} has no section {number}"
                )
    return problems


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for m in LINK.finditer(text):
        target = m.group("target").strip("<>")
        if re.match(r"[a-z]+:", target):
            continue
        file, _, fragment = target.partition("#")
        if path.suffix == ".py":  # code names docs from the repository root
            if not file.startswith("docs/"):
                continue
            resolved = ROOT / file
        else:
            resolved = (path.parent / file).resolve() if file else path
            if DOCS not in resolved.parents and path.parent != DOCS and not fragment:
                continue
        where = f"{path.relative_to(ROOT)}: ({target})"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{where}: {resolved.name} has no heading with that anchor")
    return problems


def test_every_section_reference_names_a_section_that_exists():
    problems = [p for path in sources() for p in section_problems(path, path.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_every_link_into_the_docs_names_a_heading_that_exists():
    problems = [p for path in sources() for p in link_problems(path, path.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_numbered_sections_come_in_order():
    """A reader finds section 8.7 before 8.8: each doc's numbered headings ascend."""
    for doc in sorted(DOCS.glob("*.md")):
        numbers = [
            tuple(int(n) for n in m.group(1).split("."))
            for h in headings(doc.read_text(encoding="utf-8"))
            if (m := NUMBERED.match("# " + h))
        ]
        assert numbers == sorted(numbers), f"{doc.name}: sections out of order: {numbers}"


def test_the_design_index_lists_every_section():
    text = (DOCS / "DESIGN.md").read_text(encoding="utf-8")
    top = sorted(int(n) for n in section_numbers(DOCS / "DESIGN.md") if "." not in n)
    index = [int(n) for n in re.findall(r"^\| (\d+) \|", text.split("\n## ", 1)[0], flags=re.M)]
    assert index == top, f"DESIGN.md's index lists sections {index}; its headings are {top}"


def test_the_checks_see_broken_references(tmp_path):
    """The rules find what they are for (so a passing run means something)."""
    here = ROOT / "tests" / "example.py"
    bad = "docs/DESIGN.md section 99, DESIGN.md sections 3.2 and 10.9, docs/nothing.md section 1"
    assert len(section_problems(here, bad)) == 3
    assert not section_problems(
        here, "docs/DESIGN.md sections 3.2, 3.3, 7 and\n    11; training.md, section 8"
    )
    readme = ROOT / "README.md"
    links = "[a](docs/DESIGN.md#10-the-batched-decoding-loop) [b](docs/DESIGN.md#10-no) [c](docs/gone.md)"
    assert [p.split(": ", 1)[1] for p in link_problems(readme, links)] == [
        "(docs/DESIGN.md#10-no): DESIGN.md has no heading with that anchor",
        "(docs/gone.md): no such file",
    ]
    assert (
        anchor("8.8 Long-context heads: the `drafter` window") == "88-long-context-heads-the-drafter-window"
    )
    assert headings("# a\n```\n# not a heading\n```\n## b ##") == ["a", "b"]


def test_the_readme_fits_two_screens():
    """The front door: about 120 lines, one results table of at most 8 rows; the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 125, f"README.md has {len(lines)} lines; move details to docs/usage.md"
    separators = [i for i, line in enumerate(lines) if re.fullmatch(r"\|(---\|)+", line)]
    assert len(separators) == 1, "README.md should hold one table, the results"
    rows = 0
    for line in lines[separators[0] + 1 :]:
        if not line.startswith("|"):
            break
        rows += 1
    assert 1 <= rows <= 8
