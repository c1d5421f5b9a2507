"""What a training run says about itself: before it starts, how much it will train (examples per optimizer step,
the optimizer steps it will make and, for a run too small to learn, what to change); after it, its summary
([`format_summary`], with a loss for every run that made a step).

A first `peagle train` run scaled down from the README's command (8 + 8 prompts, one epoch) made *one* optimizer
step: the recipe's effective batch is 64 examples (8 per device x 8 accumulation steps), and the run had 16.
[`run_size`] counts the steps the way `transformers.Trainer` will; [`too_small_warning`] says what to change.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MIN_OPTIMIZER_STEPS = 10
"""Fewer optimizer steps than this learn next to nothing: the warning's threshold."""


@dataclass(frozen=True)
class RunSize:
    """The optimizer steps a run will make.

    Attributes:
        examples: training examples.
        per_device: `per_device_train_batch_size`.
        accumulation: `gradient_accumulation_steps`.
        processes: data-parallel processes (`world_size`).
        epochs: `num_train_epochs` (ignored when `max_steps` is set).
        max_steps: `max_steps` when positive, else None.
        steps: optimizer steps the run will make.
    """

    examples: int
    per_device: int
    accumulation: int
    processes: int
    epochs: float
    max_steps: int | None
    steps: int

    @property
    def examples_per_step(self) -> int:
        return self.per_device * self.accumulation * self.processes


def _steps(examples: int, per_device: int, accumulation: int, processes: int, epochs: float) -> int:
    """`transformers.Trainer`'s count: batches per process, then updates per epoch (a partial one counts)."""
    batches = math.ceil(examples / (per_device * processes))
    per_epoch = max(math.ceil(batches / accumulation), 1)
    return math.ceil(epochs * per_epoch)


def run_size(num_examples: int, args: Any) -> RunSize:
    """The steps a run over `num_examples` examples will make with training arguments `args`."""
    per_device = int(args.per_device_train_batch_size)
    accumulation = int(args.gradient_accumulation_steps)
    processes = int(getattr(args, "world_size", 1) or 1)
    epochs = float(args.num_train_epochs)
    max_steps = int(args.max_steps) if args.max_steps and args.max_steps > 0 else None
    steps = max_steps or _steps(num_examples, per_device, accumulation, processes, epochs)
    return RunSize(num_examples, per_device, accumulation, processes, epochs, max_steps, steps)


def too_small_warning(size: RunSize, minimum: int = MIN_OPTIMIZER_STEPS) -> str | None:
    """What to say about a run of fewer than `minimum` optimizer steps (None for a larger run, or one whose
    `max_steps` the user set): its size and each change that would reach `minimum` steps."""
    if size.steps >= minimum or size.max_steps is not None or size.examples == 0:
        return None
    per_epoch = _steps(size.examples, size.per_device, size.accumulation, size.processes, 1.0)
    fixes = []
    accumulation = next(
        (
            a
            for a in range(size.accumulation - 1, 0, -1)
            if _steps(size.examples, size.per_device, a, size.processes, size.epochs) >= minimum
        ),
        None,
    )
    if accumulation is not None:
        fixes.append(f"--gradient_accumulation_steps {accumulation}")
    else:
        per_device = next(
            (
                b
                for b in range(size.per_device - 1, 0, -1)
                if _steps(size.examples, b, 1, size.processes, size.epochs) >= minimum
            ),
            None,
        )
        if per_device is not None:
            fixes.append(f"--gradient_accumulation_steps 1 --per_device_train_batch_size {per_device}")
    fixes.append(f"--num_train_epochs {math.ceil(minimum / per_epoch)}")
    needed = math.ceil(minimum * size.examples_per_step / max(size.epochs, 1e-9))
    fixes.append(
        f"about {needed} examples (more prompts: --num_magpie_prompts, --num_code_prompts, --prompts)"
    )
    return (
        f"This run will make {size.steps} optimizer step{'s' if size.steps != 1 else ''}: {size.examples} examples, "
        f"{size.examples_per_step} per optimizer step (per_device_train_batch_size {size.per_device} x "
        f"gradient_accumulation_steps {size.accumulation} x {size.processes} process"
        f"{'es' if size.processes != 1 else ''}), {size.epochs:g} epoch{'s' if size.epochs != 1 else ''}. A head "
        f"learns next to nothing in fewer than {minimum} steps. For {minimum} or more: "
        + "; or ".join(fixes)
        + "."
    )


def warn_if_too_small(num_examples: int, args: Any) -> RunSize:
    """Log the run's size (and, for a run too small to learn, a warning saying what to change); return it."""
    size = run_size(num_examples, args)
    warning = too_small_warning(size)
    if warning:
        logger.warning(warning)
    else:
        logger.info(
            "training: %d examples, %d per optimizer step, %d optimizer steps",
            size.examples,
            size.examples_per_step,
            size.steps,
        )
    return size


def _loss_row(summary: dict[str, Any]) -> tuple[str, str]:
    """The summary's loss: the first logged one and the run's mean, for every run that made a step."""
    first, mean = summary.get("first_loss"), summary.get("train_loss")
    if not summary["optimizer_steps"] or mean is None:
        return ("loss", "- (no optimizer step)")
    if first is None:  # logging_first_step off and fewer steps than logging_steps
        return ("loss (run mean)", f"{mean:.4f}")
    return ("loss first log -> run mean", f"{first:.4f} -> {mean:.4f}")


def format_summary(summary: dict[str, Any]) -> str:
    """A small human-readable table of a [`train_head`] summary."""
    rows = [
        ("head", summary["output_dir"]),
        (
            "mode / layers / K_train",
            f"{summary['drafting_mode']} / {summary['num_hidden_layers']} / {summary['num_parallel_positions']}",
        ),
        ("draft vocab", summary["draft_vocab_size"]),
    ]
    if summary.get("head_parameters") and summary.get("target_parameters"):
        own, tgt = summary["head_parameters"], summary["target_parameters"]
        rows.append(
            ("head / target parameters", f"{own / 1e6:.2f}M / {tgt / 1e6:.1f}M ({100 * own / tgt:.1f}%)")
        )
    rows += [
        (
            "examples / tokens / response tokens",
            f"{summary['examples']} / {summary['tokens']} / {summary['response_tokens']}",
        ),
        ("optimizer steps", summary["optimizer_steps"]),
        _loss_row(summary),
        (
            "top-1 by depth (last log)",
            " ".join(f"{v:.2f}" for v in summary["last_logged_accuracy"].values()) or "-",
        ),
    ]
    if summary.get("feature_cache"):
        cache = summary["feature_cache"]
        rows.append(("feature cache", f"{cache['path']} ({cache['bytes'] / 2**20:.1f} MiB)"))
    rows.append(("time", f"{summary['seconds']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


__all__ = [
    "MIN_OPTIMIZER_STEPS",
    "RunSize",
    "format_summary",
    "run_size",
    "too_small_warning",
    "warn_if_too_small",
]
