"""docs/DESIGN.md's layout section (section 9) names every module of the package, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "peagle"


def layout_names() -> set[str]:
    """The paths the first column of section 9's table names: `dir/a.py`, `b.py` names dir/a.py and dir/b.py; a
    name ending in `/` is a folder."""
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    section = text.split("## 9. Package layout", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in re.findall(r"^\| (.+?) \|", section, flags=re.M):
        folder = ""
        for name in re.findall(r"`([^`]+)`", row):
            if "/" in name.rstrip("/"):
                folder = name.rsplit("/", 1)[0] + "/"
                names.add(name)
            else:
                names.add(name if name.endswith("/") else folder + name)
    return names


def modules() -> set[str]:
    return {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}


def test_every_module_is_in_the_layout_section():
    names = layout_names()
    folders = {n for n in names if n.endswith("/")}
    missing = sorted(m for m in modules() if m not in names and not any(m.startswith(f) for f in folders))
    assert not missing, f"docs/DESIGN.md section 9 does not name {missing}"


def test_the_layout_section_names_no_module_that_is_gone():
    names = layout_names()
    gone = sorted(n for n in names if not n.endswith("/") and n not in modules())
    assert not gone, f"docs/DESIGN.md section 9 names modules that do not exist: {gone}"
    assert all((SRC / n).is_dir() for n in names if n.endswith("/"))


def test_the_reader_splits_shared_rows():
    assert {"formats/vllm.py", "integrations/vllm/runner.py", "cli/grow_data.py"} <= layout_names()
