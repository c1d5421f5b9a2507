"""How much memory one partitioned training step needs, and the partition count S that fits a byte budget.

The model counts what a step holds at its peak, for one micro-batch of `B` rows (the examples of the batch):

- **per step**, whatever S: the target features (``4 * H_t`` values per token), the prefix keys and values of
  every drafter layer with their float32 gradients (``4 * L * kv_width`` values per anchor), and, when the
  features are computed online, the frozen target's forward pass (no gradients: a few activations of one layer
  at a time);
- **per segment pass**, for the largest: the activations kept for backward, per element ``L * (10 * H + 3.5 * I)``
  values for the decoder layers, ``3 * V_draft`` for the logits and their loss, ``3 * H_t`` for the features it
  reads; the attention mask and what attention keeps of it, ``8.5 * L`` bytes per query-key pair (the keys are the
  prefix and the segment's own elements); the target's distribution over the segment's window of positions
  (``3 * V_draft`` values per position); 64 MiB of workspace.

The constants come from segment passes measured on the CPU (fp32, SDPA; peak RSS) for the shipped head's shape at
several query and key counts; the model errs on the large side (docs/training.md, section 8, has the figures).  Weights, gradients of the weights and optimiser state
are not counted: they do not depend on the sequence.  `docs/training.md` (long context) compares the model with
measured peaks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from .partition import partition_plan

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
CANDIDATE_PARTITIONS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def parse_bytes(value: str | int | float) -> int:
    """Bytes from `4GB` (10^9), `4GiB` (2^30), `512MiB`, `3.5 GB` or a plain number.

    >>> parse_bytes("4GB"), parse_bytes("1.5GiB"), parse_bytes(1024)
    (4000000000, 1610612736, 1024)
    """
    if isinstance(value, (int, float)):
        amount, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{value!r} is not a size; write e.g. 4GB, 3.5GiB, 512MiB or a number of bytes.")
        amount, unit = float(match.group(1)), match.group(2).lower()
    size = int(amount * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{value!r} is not a positive size.")
    return size


AUTO_BUDGET_CPU_CAP = 4 * 2**30
"""`partition_memory_budget="auto"` on a CPU: a quarter of the machine's memory, at most 4 GiB."""
AUTO_BUDGET_GPU_SHARE = 0.5
"""... on a GPU: this share of the device memory free when the trainer is built (the head and the target on it; the
optimiser state, a few bytes per head parameter, comes later)."""


def resolve_memory_budget(
    value: str | int | float | None, device: Any = "cpu", gradient_checkpointing: bool = False
) -> int | None:
    """Bytes `partition_memory_budget` allows one step's activations: a size, `"auto"` (chosen from the device's
    memory: a quarter of a CPU machine's RAM up to 4 GiB; half a GPU's free memory; none under
    `gradient_checkpointing`, which partitioning cannot run with), or None / `"none"` (no budget:
    `sequence_partitions` alone decides).

    >>> resolve_memory_budget("2GiB"), resolve_memory_budget("none")
    (2147483648, None)
    >>> 0 < resolve_memory_budget("auto") <= 4 * 2**30
    True
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    if not (isinstance(value, str) and value.strip().lower() == "auto"):
        return parse_bytes(value)
    if gradient_checkpointing:
        return None
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(AUTO_BUDGET_GPU_SHARE * free), 1)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): assume the cap fits
        ram = 4 * AUTO_BUDGET_CPU_CAP
    return min(AUTO_BUDGET_CPU_CAP, max(ram // 4, 1))


class StepMemoryModel:
    """Bytes one training step holds, from the head's shape (see the module docstring).

    Args:
        head_config: the drafter's `PEagleConfig`.
        target_config: the target's (text) config, for its forward pass when `online` (else unused).
        online: the target's features are computed in the step (no feature cache).
        bytes_per_value: 4 for float32 training; bf16 autocast keeps most activations in 2 bytes, but the
            model stays at 4 so the estimate errs on the large side.
    """

    ELEMENT_LAYER_VALUES = (10.0, 3.5)  # per element and decoder layer: x hidden size, x intermediate size
    PAIR_BYTES_PER_LAYER = 8.5
    WORKSPACE = 64 * 2**20  # per segment pass: allocator slack, masks being built, index tensors

    def __init__(self, head_config, target_config=None, online: bool = True, bytes_per_value: int = 4):
        self.h = int(head_config.hidden_size)
        self.i = int(head_config.intermediate_size)
        self.layers = int(head_config.num_hidden_layers)
        self.kv_width = int(head_config.num_key_value_heads) * int(
            getattr(head_config, "head_dim", None) or self.h // head_config.num_attention_heads
        )
        self.v_draft = int(head_config.draft_vocab_size)
        self.h_t = int(head_config.target_hidden_size or self.h)
        self.online = online and target_config is not None
        self.target_i = int(getattr(target_config, "intermediate_size", 4 * self.h_t)) if self.online else 0
        self.w = int(bytes_per_value)

    def per_token(self) -> float:
        """Bytes per token of the example held through the whole step (features, prefix keys/values + grads)."""
        return self.w * 4 * self.h_t + (2 * self.w + 8) * self.layers * self.kv_width

    def target_forward(self, tokens: int) -> float:
        """Bytes of the frozen target's forward pass over `tokens` (0 with cached features)."""
        return self.w * tokens * (8 * self.h_t + 3 * self.target_i) if self.online else 0.0

    def per_element(self) -> float:
        a, b = self.ELEMENT_LAYER_VALUES
        return self.w * (self.layers * (a * self.h + b * self.i) + 3 * self.v_draft + 3 * self.h_t)

    def segment(self, elements: int, keys: int, window: int) -> float:
        """Bytes of one segment pass: `elements` queries (rows x width), `keys` keys each, `window` positions of
        target distribution."""
        return (
            self.WORKSPACE
            + elements * self.per_element()
            + elements * keys * self.PAIR_BYTES_PER_LAYER * self.layers
            + window * 3 * self.v_draft * 4
        )

    def step(self, plans: Sequence) -> float:
        """Peak bytes of a step over the [`ExamplePlan`]s of one micro-batch with their current segments."""
        rows = len(plans)
        tokens = max(p.length for p in plans)
        k = max(1, int(plans[0].depth.max()) + 1) if plans[0].depth.numel() else 1
        peak_segment = 0.0
        for s in range(len(plans[0].segments)):
            width = max(len(p.segments[s]) for p in plans)
            if width == 0:
                continue
            past = max(p.segments[s].start for p in plans)
            span = max(p.segments[s].end for p in plans) - min(p.segments[s].start for p in plans)
            peak_segment = max(peak_segment, rows * self.segment(width, past + width, span + k))
        held = rows * tokens * self.per_token()
        return held + max(peak_segment, rows * self.target_forward(tokens))


def choose_num_segments(
    plans: Sequence,
    model: StepMemoryModel,
    budget: int,
    minimum: int = 1,
    balance: bool = True,
) -> tuple[int, float]:
    """The smallest S (at least `minimum`, from `CANDIDATE_PARTITIONS` and up) whose step fits `budget` bytes.

    The plans' segments are replaced by the chosen partition.  Returns `(S, estimated bytes)`.  Raises
    `ValueError` when no S fits: what every step holds (features, prefix) is then over the budget by itself.
    """
    longest = max(p.num_anchors for p in plans)
    candidates = [s for s in CANDIDATE_PARTITIONS if s >= minimum] or [minimum]
    if minimum not in candidates:
        candidates.insert(0, minimum)
    best = None
    for s in candidates:
        for p in plans:
            p.segments = partition_plan(p.anchor, p.depth, p.num_anchors, s, balance=balance)
        need = model.step(plans)
        best = (s, need)
        if need <= budget or s >= max(longest, 1):
            break
    s, need = best
    if need > budget:
        held = len(plans) * max(p.length for p in plans) * model.per_token()
        raise ValueError(
            f"no sequence partition fits partition_memory_budget {budget / 2**30:.2f} GiB for a micro-batch of "
            f"{len(plans)} x {max(p.length for p in plans)} tokens: even S = {s} needs about {need / 2**30:.2f} GiB "
            f"({held / 2**30:.2f} GiB of features and prefix keys/values whatever S). Raise the budget, lower "
            "max_length or per_device_train_batch_size, or cache the features (--feature_cache)."
        )
    return s, need


__all__ = [
    "StepMemoryModel",
    "choose_num_segments",
    "parse_bytes",
    "resolve_memory_budget",
    "CANDIDATE_PARTITIONS",
]
