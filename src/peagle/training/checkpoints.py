"""Resuming: whether a Trainer checkpoint holds the head being trained, checked before transformers loads it.

transformers' `Trainer` loads a checkpoint into whatever model it is given: a head of another shape (another draft
vocabulary, layer count or width) or another set of trainable parameters (`--trainable_parameters`,
`--lr-scale`, LoRA) fails deep inside `load_state_dict` or the optimizer with a size or parameter-group mismatch.
[`check_checkpoint_fits`] reads the checkpoint's weight shapes (safetensors headers, no tensor is loaded) and its
optimizer's parameter groups first, and says what differs.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

OPTIMIZER_FILE = "optimizer.pt"


def _checkpoint_shapes(folder: str) -> dict[str, list[int]]:
    """Name -> shape of every tensor in the checkpoint's safetensors weights ({} when it has none)."""
    from safetensors import safe_open

    files = []
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    shapes: dict[str, list[int]] = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                shapes[key] = list(fh.get_slice(key).get_shape())
    return shapes


def _optimizer_param_counts(folder: str) -> list[int] | None:
    """Parameters per group of the checkpoint's optimizer (None when it has no readable optimizer state)."""
    path = os.path.join(folder, OPTIMIZER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return [len(group["params"]) for group in state["param_groups"]]
    except Exception:  # another optimizer format: transformers reports its own problems
        return None


def check_checkpoint_fits(model: Any, folder: str | os.PathLike, trainable: int | None = None) -> None:
    """Raise `ValueError` naming the checkpoint when `model` is not the head it holds.

    Args:
        model: the head about to be trained (its `state_dict` keys and shapes are compared).
        folder: the checkpoint folder (`checkpoint-N`).
        trainable: the number of parameter tensors the optimizer will train (default: those with
            `requires_grad`); compared with the checkpoint optimizer's total.
    """
    folder = os.fspath(folder)
    saved = _checkpoint_shapes(folder)
    if saved:
        ours = {k: list(v.shape) for k, v in model.state_dict().items()}
        differ = [
            f"{k} is {saved[k]} there, {ours[k]} here" for k in ours if k in saved and saved[k] != ours[k]
        ]
        extra = sorted(set(saved) - set(ours))
        if differ or extra:
            detail = "; ".join(
                differ[:3]
                + ([f"it holds {len(extra)} weights this head lacks, e.g. {extra[0]}"] if extra else [])
            )
            raise ValueError(
                f"cannot resume from {folder}: it holds a head of another shape ({detail}). Resume with the options "
                "that checkpoint was trained with (--draft_vocab_size, --num_hidden_layers, --drafting_mode, the same target), or "
                "train into a new --output."
            )
    counts = _optimizer_param_counts(folder)
    if trainable is None:
        trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if counts is not None and sum(counts) != trainable:
        raise ValueError(
            f"cannot resume from {folder}: its optimizer trained {sum(counts)} parameter tensors "
            f"(groups of {counts}), this head has {trainable} trainable. Resume with the same "
            "--trainable_parameters, --lr_scales and --lora options, or train into a new --output_dir."
        )


__all__ = ["check_checkpoint_fits"]
