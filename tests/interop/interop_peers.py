"""Settings and helpers shared by the interop suite's fixtures and tests."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

PYTHON_ENV = "PEAGLE_VLLM_PYTHON"
K = 3
"""Draft tokens per round in every vLLM / peagle comparison."""
PROMPTS = 8
"""MT-Bench prompts (the first ones, chat-formatted by the target's tokenizer)."""
MAX_NEW_TOKENS = 64


def run_peer(args: list[str], timeout: float = 900.0) -> dict:
    """Run a script in the peers' interpreter, offline; its `RESULT <json>` line, or an error with its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [os.environ[PYTHON_ENV], *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"peer script {args[0]} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def speculative(folder: Path, parallel: bool) -> dict:
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}
    if parallel:
        spec["parallel_drafting"] = True
    return spec
