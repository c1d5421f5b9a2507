""".ci/check_file_sizes.py: CI refuses tracked files over 1 MiB outside heads/ (a temporary git repository holds
the cases), and this repository passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "check_file_sizes.py"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=120
    )


def repo_with(tmp_path: Path, files: dict[str, int]) -> Path:
    """A git repository whose index tracks `files` (path -> size in bytes)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for name, size in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return tmp_path


def test_a_large_file_outside_heads_fails(tmp_path):
    repo = repo_with(
        tmp_path, {"README.md": 10, "data/big.bin": 2 << 20, "heads/h/model.safetensors": 3 << 20}
    )
    done = check(repo)
    assert done.returncode == 1
    assert "data/big.bin" in done.stdout and "heads/" in done.stdout  # named, with the exempt folder
    assert "model.safetensors" not in done.stdout


def test_small_files_and_the_heads_folder_pass(tmp_path):
    repo = repo_with(
        tmp_path, {"a.txt": 1 << 20, "heads/h/model.safetensors": 3 << 20}
    )  # 1 MiB: at the limit
    done = check(repo)
    assert done.returncode == 0 and done.stdout == ""


def test_an_untracked_large_file_is_not_checked(tmp_path):
    repo = repo_with(tmp_path, {"a.txt": 10})
    (repo / "local.bin").write_bytes(b"x" * (2 << 20))
    assert check(repo).returncode == 0


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_this_repository_passes():
    done = check(ROOT)
    assert done.returncode == 0, done.stdout
