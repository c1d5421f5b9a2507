"""Every peagle module with docstring examples runs them (the examples in the docs must stay true)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import peagle

SKIP = ("peagle.model_card_templates",)


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(peagle.__path__, prefix="peagle."):
        if info.name.startswith(SKIP):
            continue
        spec = importlib.util.find_spec(info.name)
        origin = Path(spec.origin) if spec and spec.origin else None
        if origin and origin.suffix == ".py" and ">>>" in origin.read_text(encoding="utf-8"):
            names.append(info.name)
    return sorted(names)


MODULES = _modules_with_examples()


def test_modules_with_examples_are_found():
    assert "peagle.generation.rule" in MODULES and "peagle.configuration_peagle" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(
        importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0, f"{name} has '>>>' but no example ran"
    assert result.failed == 0
