"""docs/DESIGN.md names what exists: its layout section (section 9) names every module of the package, and only
modules that exist; and the code names it gives are names of the code.

The rule for code names (what is checked, chosen so that prose never raises a false alarm):

- **Dotted references anywhere in DESIGN.md**: a backticked `a.b` (or `a.b.c`) whose first part is the file stem of
  a peagle module (`cost.monotone`, `ragged.keep_tail`, `modeling_peagle.PEagleDrafter`) must name a top-level name
  of that module (a `def`, `class`, assignment or import: re-exports count); when several modules share the stem
  (`rule`: `sizing/rule.py` and `generation/rule.py`) one of them must define it.  A stem that is also a
  variable's name in prose (`head.last_generation_stats`: `fp8/head.py`'s stem) passes when peagle's code
  assigns that attribute on some object (`x.last_generation_stats = ...` or `setattr`).  One whose first part is a
  class defined at the top level of a peagle module (`PEagleDrafter.forward`, `_Decoder.tree_round`) must name an
  attribute of that class: found on the imported class (inherited ones included) or assigned as `self.<name>` in
  its body.  One starting `peagle.` must import or resolve as an attribute (`peagle.formats`,
  `peagle.quantize_head`).  Anything else (`head.last_generation_stats`, `config.json`, `transformers.Trainer`)
  is not a peagle name and is not checked.
- **The layout table's concept column**: every backticked plain identifier (`VerifyCostModel`,
  `cost_model_for`, `partition_memory_budget`) must occur in the code of the row's modules (any of them, for a
  shared row): as a name bound there (`def`, `class`, assignment, import, parameter) or used there (a name, an
  attribute, a keyword argument, or a string constant such as a registered name).  A dotted one follows the rule
  above.  Backticked text that is not an identifier (`"auto"`, `peagle calibrate`, `--documents`) is prose.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

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


# ------------------------------------------------------------------------------------------------- code names
DESIGN = ROOT / "docs" / "DESIGN.md"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
NOT_PYTHON = {"py", "json", "toml", "md", "txt", "jsonl", "yaml", "sh", "png"}
"""Last parts that make a dotted name a file name (`config.json`, `modeling_peagle.py`)."""


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse((SRC / module).read_text(encoding="utf-8"))


def top_level_names(module: str) -> set[str]:
    """What `module` (a path under src/peagle) binds at its top level: defs, classes, assignments, imports."""
    names = set()
    for node in _tree(module).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def code_names(module: str) -> set[str]:
    """Every name `module`'s code binds or uses (see the module docstring), string constants included."""
    names = set(top_level_names(module))
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and IDENTIFIER.fullmatch(node.value)
        ):
            names.add(node.value)
    return names


@cache
def assigned_attributes() -> frozenset[str]:
    """Attributes peagle's code assigns on objects (`head.last_generation_stats = ...`, `setattr(x, "name", ...)`)."""
    found = set()
    for module in modules():
        for node in ast.walk(_tree(module)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            found |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
            ):
                found.add(node.args[1].value)
    return frozenset(found)


def _module_name(module: str) -> str:
    return "peagle." + module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def classes() -> dict[str, list[str]]:
    """Class name -> the modules defining it at their top level."""
    found: dict[str, list[str]] = {}
    for module in sorted(modules()):
        for node in _tree(module).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def _class_has(module: str, name: str, attr: str) -> bool:
    cls = getattr(importlib.import_module(_module_name(module)), name)
    if hasattr(cls, attr):
        return True
    node = next(n for n in _tree(module).body if isinstance(n, ast.ClassDef) and n.name == name)
    return any(
        isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Name)
        and t.value.id == "self"
        and t.attr == attr
        for n in ast.walk(node)
        if isinstance(n, ast.Assign | ast.AnnAssign)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
    )


def _peagle_resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def dotted_problem(dotted: str) -> str | None:
    """Why `dotted` (a backticked `a.b...`) names nothing of peagle's, or None (fine, or not a peagle name)."""
    first, *rest = dotted.split(".")
    if rest[-1] in NOT_PYTHON:
        return None
    if first == "peagle":
        return None if _peagle_resolves(dotted) else "does not resolve"
    stems = sorted(m for m in modules() if Path(m).stem == first and not m.endswith("__init__.py"))
    if stems:
        if any(rest[0] in top_level_names(m) for m in stems) or rest[0] in assigned_attributes():
            return None
        return f"{' / '.join(stems)} defines no {rest[0]!r} at its top level"
    owners = classes().get(first)
    if owners:
        if any(_class_has(m, first, rest[0]) for m in owners):
            return None
        return f"class {first} ({' / '.join(owners)}) has no attribute {rest[0]!r}"
    return None


def backticked_dotted_names() -> list[str]:
    text = DESIGN.read_text(encoding="utf-8")
    return sorted({n for n in re.findall(r"`([^`\s]+)`", text) if DOTTED.fullmatch(n)})


def layout_rows() -> list[tuple[list[str], str]]:
    """`(modules, concept)` of each row of section 9's table (folder rows have no modules)."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## 9. Package layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for first, concept in re.findall(r"^\| (.+?) \| (.+) \|$", section, flags=re.M):
        folder, mods = "", []
        for name in re.findall(r"`([^`]+)`", first):
            if "/" in name.rstrip("/"):
                folder = name.rsplit("/", 1)[0] + "/"
                mods.append(name)
            else:
                mods.append(name if name.endswith("/") else folder + name)
        mods = [m for m in mods if not m.endswith("/")]
        if mods:
            rows.append((mods, concept))
    return rows


def test_every_dotted_code_name_in_design_exists():
    problems = {n: p for n in backticked_dotted_names() if (p := dotted_problem(n))}
    assert not problems, f"docs/DESIGN.md names code that does not exist: {problems}"


def test_every_code_name_of_the_layout_table_exists_in_its_modules():
    problems = []
    for mods, concept in layout_rows():
        known = set().union(*(code_names(m) for m in mods if (SRC / m).is_file()))
        for name in re.findall(r"`([^`]+)`", concept):
            if IDENTIFIER.fullmatch(name) and name not in known:
                problems.append(f"{', '.join(mods)}: {name}")
            elif DOTTED.fullmatch(name) and (why := dotted_problem(name)):
                problems.append(f"{', '.join(mods)}: {name} ({why})")
    assert not problems, f"docs/DESIGN.md section 9 names code its modules do not have: {problems}"


@pytest.mark.parametrize(
    ("name", "fine"),
    [
        ("cost.monotone", True),
        ("cost.no_such_name", False),
        ("rule.choose_batch_tree_size", True),  # generation/rule.py, not sizing/rule.py
        ("PEagleDrafter.forward", True),
        ("PEagleDrafter.from_pretrained", True),  # inherited
        ("PEagleDrafter.no_such_method", False),
        ("peagle.formats", True),
        ("peagle.no_such_name", False),
        ("config.json", True),
        ("head.last_generation_stats", True),  # not a peagle name: not checked
    ],
)
def test_the_dotted_rule(name, fine):
    assert (dotted_problem(name) is None) is fine


def test_the_table_rule_sees_bound_and_used_names():
    names = code_names("generation/cost.py")
    assert {"cost_model_for", "VerifyCostModel", "measured_points"} <= names  # defined and re-exported
    assert "no_such_name" not in names
    rows = dict((tuple(m), c) for m, c in layout_rows())
    assert "VerifyCostModel" in rows[("generation/cost_model.py",)]
