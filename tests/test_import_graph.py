"""No import circle among peagle's modules, nor among its packages, lazy imports inside functions included; the
configuration imports nothing from peagle (it ships as Hub remote code); nothing imports `peagle.cli`; data flows one
way: data -> generation -> training -> evaluation."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "peagle"

KNOWN_CIRCLES: set[frozenset[str]] = set()
"""Circles left to an issue that rebuilds their modules (none now)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The peagle modules `node` (in module `name`) imports, wherever it sits (top level or in a function)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = set()
    for target in targets:
        while target not in MODULES and "." in target:
            target = target.rpartition(".")[0]
        # importing an enclosing package is always safe: it is being initialised already
        if target in MODULES and target != name and not name.startswith(target + "."):
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        nodes = [
            n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)
        ]
        graph[name] = set().union(*(imported(name, n) for n in nodes)) if nodes else set()
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert "peagle.sizing" in graph["peagle.training.recipe"]  # imported inside build_head only
    assert "peagle.data.shards" in graph["peagle.data.packing"]


def test_no_import_circle():
    new = [sorted(c) for c in circles(import_graph()) if c not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"


def package_of(module: str) -> str:
    """The unit of the package graph: `peagle.<package>` for a module inside a sub-package, the module itself for
    peagle's top-level modules (`peagle.modeling_peagle`, ...); `peagle` itself for its `__init__`."""
    parts = module.split(".")
    name = ".".join(parts[:2])
    return name if (SRC / parts[1]).is_dir() or len(parts) > 2 else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module == "peagle":  # the package's own __init__ re-exports everything: not a layer
            continue
        source = package_of(module)
        packages.setdefault(source, set())
        packages[source] |= {package_of(d) for d in deps if d != "peagle" and package_of(d) != source}
    return packages


def test_no_package_circle():
    """Packages import each other one way only: generation, training and evaluation never import in a circle (they
    share `peagle.data` instead), and no package reaches back into one that imports it."""
    found = [sorted(c) for c in circles(package_graph(import_graph()))]
    assert not found, f"package circles: {found}"


def test_package_circles_are_found():
    graph = {
        "peagle.a.x": {"peagle.b.y"},
        "peagle.b.y": set(),
        "peagle.b.z": {"peagle.a.w"},
        "peagle.a.w": set(),
    }
    assert circles(package_graph(graph)) == [frozenset({"peagle.a", "peagle.b"})]


def test_data_flows_one_way():
    """data imports none of generation, training, evaluation; generation none of training and evaluation; training
    not evaluation."""
    graph = package_graph(import_graph())
    order = ["peagle.data", "peagle.generation", "peagle.training", "peagle.evaluation"]
    for i, package in enumerate(order):
        above = set(order[i + 1 :]) & graph[package]
        assert not above, f"{package} imports {sorted(above)}"


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_the_configuration_imports_nothing_from_peagle():
    assert import_graph()["peagle.configuration_peagle"] == set()


def test_nothing_imports_the_command_line():
    users = {m for m, deps in import_graph().items() if any(d.startswith("peagle.cli") for d in deps)}
    assert all(m.startswith("peagle.cli") for m in users), sorted(users)


def test_benchmarks_import_only_the_library():
    """A benchmark is one script run by one command: none reaches another through `sys.path`."""
    root = SRC.parents[1] / "benchmarks"
    scripts = sorted(root.glob("*.py"))
    assert scripts
    for script in scripts:
        text = script.read_text()
        assert "sys.path" not in text, f"{script.name} edits sys.path"
        siblings = {p.stem for p in scripts} - {script.stem}
        tree = ast.parse(text)
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & siblings, f"{script.name} imports {sorted(names & siblings)}"
