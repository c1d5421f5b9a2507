"""Timing utilities: one greedy `generate()` call timed, with the forward calls of the target and the drafter
counted and their time summed by hooks ([`timed_generate`]), and the machine a measurement ran on."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..generation.stats import PEagleGenerationStats
from .host_syncs import count_host_syncs


@dataclass
class RunResult:
    """One generate() call: tokens, wall time and where the time went."""

    new_tokens: int
    seconds: float
    target_calls: int
    target_seconds: float
    drafter_calls: int
    drafter_seconds: float
    output: list[int] = field(repr=False, default_factory=list)
    stats: PEagleGenerationStats | None = None
    """The head's statistics of this call (None for methods without a P-EAGLE head)."""
    prefill_seconds: float = 0.0
    """The target's first forward call (the prompt's prefill): what no drafting rule changes."""
    host_syncs: int | None = None
    """Host reads of tensors during the call ([`host_syncs.count_host_syncs`]), when counted."""
    target_spans: list[tuple[float, float, int, int]] = field(repr=False, default_factory=list)
    """Per target forward: `(start, end, host reads before, host reads after)` (reads 0 when not counted)."""
    drafter_spans: list[tuple[float, float, int, int]] = field(repr=False, default_factory=list)
    """The same per drafter forward."""
    sequences: torch.Tensor | None = field(repr=False, default=None)
    """What `generate()` returned: every row, prompt included (`output` holds row 0's new tokens)."""

    def rounds(self) -> list[RoundFigures]:
        """Per target pass after the first one that follows the prefill, what the loop spent in its round
        ([`RoundFigures`]).  The first round is left out: it also finishes the prefill (reads its tokens, hands the
        prompt's slots on) and catches the drafter up on the prompt."""
        out = []
        spans, drafter = self.target_spans[1:], self.drafter_spans
        for prev, cur in zip(spans, spans[1:]):
            inside = [d for d in drafter if prev[1] <= d[0] < cur[0]]
            drafter_seconds = sum(d[1] - d[0] for d in inside)
            out.append(
                RoundFigures(
                    drafted=bool(inside),
                    outside_seconds=max(0.0, cur[0] - prev[1] - drafter_seconds),
                    host_syncs=cur[2] - prev[3],
                )
            )
        return out

    @property
    def tokens_per_target_pass(self) -> float:
        """New tokens per target forward pass (prefill included), counted by forward hooks."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def overhead_seconds(self) -> float:
        return max(0.0, self.seconds - self.target_seconds - self.drafter_seconds)


@dataclass(frozen=True)
class RoundFigures:
    """One round of a decoding loop (from the end of one target pass to the end of the next): whether the drafter
    ran in it, the seconds outside the target's and the drafter's forwards, and the host reads of tensors made
    outside the target's forward (the drafter's own included)."""

    drafted: bool
    outside_seconds: float
    host_syncs: int


class _ForwardTimer:
    """Counts forward calls of a module and sums their wall time (hooks; no change to the module)."""

    def __init__(self, module: torch.nn.Module | None, syncs: Any = None):
        self.calls, self.seconds, self._t0, self._handles = 0, 0.0, 0.0, []
        self.first_seconds = 0.0  # the first call's
        self.syncs = syncs  # the running host-read count, when counted
        self.spans: list[tuple[float, float, int, int]] = []
        self._reads = 0
        if module is not None:
            self._handles = [
                module.register_forward_pre_hook(self._pre),
                module.register_forward_hook(self._post),
            ]

    def _pre(self, *_):
        self._reads = self.syncs.count if self.syncs is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, *_):
        end = time.perf_counter()
        took = end - self._t0
        self.spans.append((self._t0, end, self._reads, self.syncs.count if self.syncs is not None else 0))
        if self.calls == 0:
            self.first_seconds = took
        self.calls += 1
        self.seconds += took

    def close(self):
        for h in self._handles:
            h.remove()


def timed_generate(
    target, input_ids: torch.Tensor, max_new_tokens: int, assistant=None, count_syncs: bool = False, **kwargs
) -> RunResult:
    """Greedy `target.generate` with timing and call counts of the target and of `assistant`; with `count_syncs`,
    its host reads of tensors too (a wrapper of about a microsecond per read)."""
    gen_kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids)
    )
    if assistant is not None:
        gen_kwargs["assistant_model"] = assistant
    gen_kwargs.update(kwargs)
    target_timer = drafter_timer = None
    try:
        with count_host_syncs() if count_syncs else contextlib.nullcontext() as syncs:
            target_timer = _ForwardTimer(target, syncs)
            drafter_timer = _ForwardTimer(
                assistant if isinstance(assistant, torch.nn.Module) else None, syncs
            )
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(input_ids, **gen_kwargs)
            seconds = time.perf_counter() - t0
    finally:
        for timer in (target_timer, drafter_timer):
            if timer is not None:
                timer.close()
    new = out[0, input_ids.shape[1] :].tolist()
    stats = getattr(assistant, "last_generation_stats", None) if assistant is not None else None
    return RunResult(
        new_tokens=len(new),
        seconds=seconds,
        target_calls=target_timer.calls,
        target_seconds=target_timer.seconds,
        drafter_calls=drafter_timer.calls,
        drafter_seconds=drafter_timer.seconds,
        output=new,
        stats=stats if isinstance(stats, PEagleGenerationStats) else None,
        prefill_seconds=target_timer.first_seconds,
        host_syncs=syncs.count if syncs is not None else None,
        target_spans=target_timer.spans,
        drafter_spans=drafter_timer.spans,
        sequences=out,
    )


def cpu_model() -> tuple[str, str]:
    """The CPU's model name and its widest vector extension ("amx", "avx512_bf16", "avx512", "avx2" or ""), from
    /proc/cpuinfo; `platform`'s processor and "" where that file is missing."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                if flags and not name.startswith(platform.machine()):
                    break
    except OSError:
        pass
    isa = (
        next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "")
        .replace("amx_bf16", "amx")
        .replace("avx512f", "avx512")
    )
    return name, isa


def machine_description() -> dict[str, Any]:
    """The machine a measurement ran on: Python, torch, CPU count and threads, processor (model name and widest
    vector extension), CUDA device."""
    name, isa = cpu_model()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": name,
        "cpu_vector_extension": isa,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


__all__ = ["RunResult", "timed_generate", "machine_description"]
