"""The code's shape, as docs/DESIGN.md section 9 states it: no module over 700 lines in `src/` or `benchmarks/`, no
function over 80 lines in `generation/` or `training/` (the run-time core), no public function with more than 10
parameters (settings travel in dataclasses)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "peagle").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
MAX_MODULE_LINES = 700
MAX_CORE_FUNCTION_LINES = 80
CORE = ("generation", "training")
MAX_PUBLIC_PARAMETERS = 10


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters, without `self` / `cls` and without `*args` / `**kwargs`."""
    args = node.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return len([a for a in named if a not in ("self", "cls")])


def test_no_module_over_700_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_long_function_in_the_core():
    core = [p for p in SOURCES if p.parent.name in CORE]
    assert core
    long = {
        f"{p.relative_to(ROOT)}:{f.name}": size
        for p in core
        for f in functions(p)
        if (size := f.end_lineno - f.lineno + 1) > MAX_CORE_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_CORE_FUNCTION_LINES} lines in {CORE}: {long}"


def test_no_public_function_with_more_than_ten_parameters():
    wide = {
        f"{p.relative_to(ROOT)}:{f.name}": n
        for p in SOURCES
        for f in functions(p)
        if not f.name.startswith("_") and (n := parameters(f)) > MAX_PUBLIC_PARAMETERS
    }
    assert not wide, f"public functions with more than {MAX_PUBLIC_PARAMETERS} parameters: {wide}"


def test_the_rules_see_what_they_measure(tmp_path):
    path = tmp_path / "wide.py"
    path.write_text("def f(self, a, b, *args, c, **kw):\n    pass\n\n\ndef g(\n    a,\n):\n    return a\n")
    found = {f.name: (parameters(f), f.end_lineno - f.lineno + 1) for f in functions(path)}
    assert found == {"f": (3, 2), "g": (1, 4)}


def test_design_states_the_limits_these_tests_check():
    """docs/DESIGN.md section 9 cites the same numbers as this module (the docstring above points readers there)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    section = " ".join(text.split("## 9. Package layout", 1)[1].split("\n## ", 1)[0].split())
    for limit in (
        f"no module over {MAX_MODULE_LINES} lines in `src/` or `benchmarks/`",
        f"no function over {MAX_CORE_FUNCTION_LINES} lines in `{CORE[0]}/` or `{CORE[1]}/`",
        f"no public function with more than {MAX_PUBLIC_PARAMETERS} parameters",
    ):
        assert limit in section, f"docs/DESIGN.md section 9 does not state the limit {limit!r}"
