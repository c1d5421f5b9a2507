"""peagle's wheel holds code only; the shipped heads come from the companion distribution peagle-heads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from peagle import targets

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_is_code_only(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
    ]
    subprocess.run([*cmd, str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("peagle-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.stat().st_size < 1_000_000, f"{wheel.name} is {wheel.stat().st_size} bytes"
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".gguf", ".pt"))]
    assert "peagle/modeling_peagle.py" in names and "peagle/model_card_templates/peagle_head.md" in names


def test_heads_come_from_the_companion_package():
    path = targets.default_drafter_path("peagle")
    assert path.parent.name == targets.HEADS_PACKAGE
    assert (path / "model.safetensors").is_file() and (
        targets.default_drafter_path("eagle3") / "config.json"
    ).is_file()


def test_missing_heads_say_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == targets.HEADS_PACKAGE else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps -e \./heads"):
        targets.default_drafter_path("peagle")


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="'medusa'"):
        targets.default_drafter_path("medusa")
