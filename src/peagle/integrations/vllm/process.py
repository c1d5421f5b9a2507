"""Where peagle finds vLLM: the interpreter of a vLLM environment and the script it runs there.

vLLM pins other transformers versions than peagle, so it lives in an environment of its own
(`tests/interop/peer_env.sh` builds one); peagle runs `runner.py` (beside this module) in that interpreter as a child process.
The benchmark's vLLM rows (`peagle.evaluation.bench.run_vllm`) and the vLLM engine of self-distillation
(`peagle.data.vllm_engine`) both start it from here.
"""

from __future__ import annotations

import os
from pathlib import Path

VLLM_PYTHON_ENV = "PEAGLE_VLLM_PYTHON"
"""The environment variable naming the Python interpreter of a vLLM environment."""
VLLM_RUNNER = Path(__file__).with_name("runner.py")
"""The script run in that interpreter (it imports nothing from peagle)."""


def vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The vLLM interpreter: `explicit`, else `$PEAGLE_VLLM_PYTHON`; a clear error when neither names a file."""
    python = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        raise ValueError(
            f"no vLLM environment: pass its Python interpreter or set {VLLM_PYTHON_ENV} "
            "(tests/interop/peer_env.sh builds one)."
        )
    if not Path(python).is_file():
        raise ValueError(f"{python} is not a file; expected the Python interpreter of a vLLM environment.")
    return Path(python)


def vllm_environ(kv_cache_gib: int = 1) -> dict[str, str]:
    """The child's environment: this one, offline, with a CPU KV-cache size unless the user set one (GiB; the
    CPU backend's default reserves far more than these small targets need)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env
