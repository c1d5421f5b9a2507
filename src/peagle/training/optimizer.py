"""The optimiser side of training a head: which parameters train ([`freeze_except`], `trainable_parameters`) and
at which learning rate ([`split_lr_groups`], `lr_scales`, parsed by `arguments.parse_lr_scales`)."""

from __future__ import annotations

import re

import torch
from transformers.utils import logging

from .arguments import parse_lr_scales

logger = logging.get_logger(__name__)


def freeze_except(model: torch.nn.Module, pattern: str) -> list[str]:
    """Freeze every parameter of `model` whose name `pattern` does not match (`re.search`); return the names left
    trainable.  Parameters already frozen (the target's shared embeddings) stay frozen."""
    regex = re.compile(pattern)
    kept = []
    for name, param in model.named_parameters():
        if param.requires_grad and regex.search(name):
            kept.append(name)
        else:
            param.requires_grad_(False)
    if not kept:
        names = ", ".join(n for n, _ in model.named_parameters())
        raise ValueError(
            f"trainable_parameters {pattern!r} matches no trainable parameter of the head ({names})."
        )
    logger.info("training %d of the head's parameter tensors: %s", len(kept), ", ".join(kept))
    return kept


def split_lr_groups(
    optimizer: torch.optim.Optimizer, named_parameters, entries: list[str] | tuple[str, ...]
) -> dict[str, float]:
    """Move the parameters that `entries` (see [`parse_lr_scales`]) scale out of the freshly built `optimizer`'s
    groups into groups of their own, with the same hyper-parameters (weight decay, betas) and `lr` times the scale,
    before the learning-rate scheduler records the groups' initial rates.  Returns `{parameter name: scale}` of
    the parameters moved."""
    scales = parse_lr_scales(entries)
    if not scales:
        return {}
    names = {id(p): n for n, p in named_parameters}
    moved: dict[str, float] = {}
    new_groups = []
    for group in optimizer.param_groups:
        kept, by_scale = [], {}
        for param in group["params"]:
            name = names.get(id(param), "")
            hit = next((i for i, (regex, _) in enumerate(scales) if regex.search(name)), None)
            if hit is None:
                kept.append(param)
                continue
            scale = scales[hit][1]
            moved[name] = scale
            by_scale.setdefault(scale, []).append(param)
        group["params"] = kept
        for scale, params in by_scale.items():
            hyper = {k: v for k, v in group.items() if k != "params"}
            new_groups.append({**hyper, "params": params, "lr": group["lr"] * scale, "lr_scale": scale})
    for group in new_groups:
        optimizer.add_param_group(group)
    logger.info("per-parameter learning-rate scales: %s", moved)
    return moved


__all__ = ["freeze_except", "split_lr_groups"]
