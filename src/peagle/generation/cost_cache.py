"""The on-disk cost cache: what a curve depends on ([`cost_model_key`]), the JSON file that keeps it
([`cost_cache_path`]) and writing it there ([`save_cost_model`], [`persist_cost_model`])."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .cost_model import VerifyCostModel

CACHE_SUBDIR = "cost"
COST_MODEL_VERSION = 3
"""Part of the cache key: curves of an earlier model (2: verify passes copied the cache per query head; 1: no
context points, factors kept in memory only) are timed again."""


def cost_model_key(target: Any, head: Any = None, batch_size: int = 1) -> dict[str, Any]:
    """What a cost curve depends on: the target (name and shape), its device and dtype, torch's thread count,
    the drafter's shape (its pass is part of the round's cost) and the batch size (rows verified together;
    recorded from 2 rows on, so batch-1 curves keep their key)."""
    cfg = target.config
    param = next(target.parameters())
    key = {
        "target": str(getattr(cfg, "_name_or_path", "") or type(target).__name__),
        "target_shape": [
            getattr(cfg, "hidden_size", None),
            getattr(cfg, "num_hidden_layers", None),
            getattr(cfg, "vocab_size", None),
        ],
        "device": str(param.device),
        "dtype": str(param.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
    }
    if head is not None:
        hc = head.config
        key["drafter"] = [
            hc.drafting_mode,
            hc.num_hidden_layers,
            hc.hidden_size,
            hc.draft_vocab_size,
            str(next(head.parameters()).dtype).replace("torch.", ""),
        ]
    if batch_size > 1:
        key["batch_size"] = int(batch_size)
    key["cost_model"] = COST_MODEL_VERSION
    return key


def cost_cache_path(key: dict[str, Any]) -> Path:
    """The JSON file caching the curve of `key`: under `$PEAGLE_COST_CACHE` when set, else the peagle cache
    folder's `cost/` (`$PEAGLE_CACHE/cost/`, default `~/.cache/peagle/cost/`)."""
    from ..targets import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("PEAGLE_COST_CACHE")
    return (Path(root) if root else cache_dir() / CACHE_SUBDIR) / f"{digest}.json"


def save_cost_model(model: VerifyCostModel, path: str | os.PathLike | None = None) -> Path:
    """Write the curve as JSON (default: its cache file)."""
    path = Path(path) if path is not None else cost_cache_path(model.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(model.to_dict(), indent=2))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def persist_cost_model(model: VerifyCostModel) -> None:
    """Write a measured curve, with its context points and online factors, to its cache file (when caching is
    on for it); a failed write warns once and the curve stays in memory."""
    if not model.refined_online or not getattr(model, "persist", False) or not model.key:
        return
    path = cost_cache_path(model.key)
    try:
        save_cost_model(model, path)
    except OSError as e:  # a cache is an optimisation: keep the curve in memory and go on
        _warn_unwritable_once(path, e)


_UNWRITABLE: set[str] = set()
"""Cache paths already warned about in this process (one warning each)."""


def _warn_unwritable_once(path: Path, error: OSError) -> None:
    if str(path) in _UNWRITABLE:
        return
    _UNWRITABLE.add(str(path))
    warnings.warn(
        f"peagle could not write its verify-cost cache {path} ({error.strerror or error}); the measured curve "
        "is kept in memory for this process only. Set PEAGLE_COST_CACHE to a writable folder to keep it.",
        RuntimeWarning,
        stacklevel=3,
    )


__all__ = [
    "CACHE_SUBDIR",
    "COST_MODEL_VERSION",
    "cost_cache_path",
    "cost_model_key",
    "persist_cost_model",
    "save_cost_model",
]
