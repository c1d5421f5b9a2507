"""Batched benchmark: plain batched greedy against the heads at each batch size, on the same prompts.

`peagle bench --batch_sizes 1,2,4,8` runs it.  The prompts (MT-Bench and HumanEval, mixed lengths) are split
into consecutive batches of B, left-padded as a tokenizer with `padding_side="left"` pads them.  For every
batch, each method runs side by side with plain batched greedy (`target.generate(ids, attention_mask=...)`),
every row is checked against plain batched greedy's row, and against the prompt's own batch-1 greedy output
when batch size 1 is in the sweep (batched plain decoding itself may differ from batch 1 in the last bits).
Reported per (B, method): new tokens per second over all rows, speedup over plain batched greedy on the
same batches, the slowest batch's speedup, tokens per target pass per row, both checks, and for the default
rule its predicted against measured seconds per context bucket (`rule_seconds_by_context`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..generation.stats import PEagleGenerationStats
from .results import save_figure, write_json_and_plot

BATCH_METHODS = ("greedy", "peagle-auto", "peagle", "eagle3-auto")
"""Plain batched greedy; the P-EAGLE head with its default rule; the same head verifying all K drafts every
round (acceptance, not speed: tokens per target pass at B against B = 1); the EAGLE-3-style head's default."""


def left_pad(
    prompts: Sequence[torch.Tensor], pad_token_id: int = 0
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(input_ids, attention_mask)` of `(1, T)` prompts, left-padded to the longest."""
    rows = [p.reshape(-1) for p in prompts]
    width = max(r.shape[0] for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[0] :] = r
        mask[i, width - r.shape[0] :] = 1
    return ids, mask


def row_outputs(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS token (padding after it dropped)."""
    out = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end])
    return out


def _method_kwargs(method: str, heads: dict[str, Any]) -> dict[str, Any] | None:
    if method == "greedy":
        return {}
    name, _, rule = method.partition("-")
    head = heads.get(name)
    if head is None:
        return None
    if rule == "auto":
        return {"assistant_model": head}
    return {"assistant_model": head, "assistant_confidence_threshold": 0.0}


def run_batch_benchmark(
    target: Any,
    prompts: Sequence[torch.Tensor],
    heads: dict[str, Any],
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    max_new_tokens: int = 128,
    methods: Sequence[str] = BATCH_METHODS,
    pad_token_id: int = 0,
    eos_token_ids: Sequence[int] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Measure every method at every batch size on the same prompts, batch by batch, side by side.

    Args:
        target: the target causal LM.
        prompts: `(1, T)` prompt ids; the first `N` of them are used, `N` the largest multiple of every batch
            size that fits (so every batch size decodes the same prompts).
        heads: `"peagle"` / `"eagle3"` -> head; methods whose head is missing are skipped.
        batch_sizes: B values.
        methods: some of [`BATCH_METHODS`].
        pad_token_id, eos_token_ids: the target's padding and end tokens (rows end at their first EOS).

    Returns:
        A JSON-ready dict: `runs` (one row per batch and method), `summary` (per B and method) and `config`.
    """
    step = math.lcm(*batch_sizes)
    used = len(prompts) - len(prompts) % step
    if used == 0:
        raise ValueError(
            f"{len(prompts)} prompts cannot fill whole batches of every size in {list(batch_sizes)}; "
            f"give at least {step} (a multiple of {step})."
        )
    prompts = list(prompts[:used])
    plan = [m for m in methods if _method_kwargs(m, heads) is not None]
    eos = set(int(e) for e in eos_token_ids)
    runs: list[dict[str, Any]] = []
    batch1: dict[int, list[int]] = {}
    bar = tqdm(
        total=sum(used // b for b in batch_sizes) * len(plan), desc="bench batches", disable=not progress
    )
    for batch in sorted(batch_sizes):
        for first in range(0, used, batch):
            ids, mask = left_pad(prompts[first : first + batch], pad_token_id)
            reference: list[list[int]] | None = None
            for method in plan:
                kwargs = _method_kwargs(method, heads)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(
                        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **kwargs
                    )
                seconds = time.perf_counter() - t0
                rows = row_outputs(out, ids.shape[1], eos)
                if method == "greedy":
                    reference = rows
                    if batch == 1:
                        batch1[first] = rows[0]
                head = kwargs.get("assistant_model")
                stats = head.last_generation_stats if head is not None else None
                agree = [batch1.get(first + i) == r for i, r in enumerate(rows)] if batch1 else []
                runs.append(
                    {
                        "batch_size": batch,
                        "first_prompt": first,
                        "method": method,
                        "new_tokens": sum(len(r) for r in rows),
                        "seconds": seconds,
                        "lossless": rows == reference,
                        "agrees_with_batch1": sum(agree) if batch1 else None,
                        "rows": len(rows),
                        "stats": stats.to_dict() if isinstance(stats, PEagleGenerationStats) else None,
                    }
                )
                bar.update(1)
    bar.close()
    return {
        "runs": runs,
        "summary": summarize_batches(runs),
        "config": {
            "batch_sizes": sorted(batch_sizes),
            "prompts": used,
            "max_new_tokens": max_new_tokens,
            "methods": plan,
        },
    }


def summarize_batches(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (B, method): totals over its batches; speedup against plain batched greedy on the same batches."""
    greedy = {(r["batch_size"], r["first_prompt"]): r["seconds"] for r in runs if r["method"] == "greedy"}
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["batch_size"], r["method"]), []).append(r)
    out = []
    for (batch, method), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], BATCH_METHODS.index(kv[0][1]))
    ):
        seconds = sum(r["seconds"] for r in rs)
        tokens = sum(r["new_tokens"] for r in rs)
        base = sum(greedy[(batch, r["first_prompt"])] for r in rs)
        stats = [PEagleGenerationStats.from_dict(r["stats"]) for r in rs if r["stats"] is not None]
        merged = PEagleGenerationStats.merge(stats) if stats else None
        agree = [r["agrees_with_batch1"] for r in rs if r["agrees_with_batch1"] is not None]
        buckets = merged.seconds_by_context if merged else {}
        measured = sum(b["measured_seconds"] for b in buckets.values())
        out.append(
            {
                "batch_size": batch,
                "method": method,
                "new_tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds else 0.0,
                "speedup": base / seconds if seconds else None,
                "slowest_batch_speedup": min(greedy[(batch, r["first_prompt"])] / r["seconds"] for r in rs),
                "tokens_per_target_pass": merged.tokens_per_target_pass if merged else 1.0,
                "lossless": all(r["lossless"] for r in rs),
                "rows_equal_to_batch1": f"{sum(agree)}/{sum(r['rows'] for r in rs)}" if agree else None,
                "rule_seconds_by_context": buckets,
                "rule_predicted_over_measured": (
                    sum(b["predicted_seconds"] for b in buckets.values()) / measured if measured else None
                ),
            }
        )
    return out


def format_batch_table(summary: list[dict[str, Any]]) -> str:
    """A Markdown table of the summary."""
    lines = [
        "| B | method | tokens/target pass per row | tok/s | speedup | slowest batch | = plain batched | = batch-1 greedy "
        "| rule predicted / measured s |",
        "|" + "---|" * 9,
    ]
    for s in summary:
        lines.append(
            f"| {s['batch_size']} | {s['method']} | {s['tokens_per_target_pass']:.2f} | {s['tokens_per_s']:.1f} | "
            f"{s['speedup']:.2f}x | {s['slowest_batch_speedup']:.2f}x | {'yes' if s['lossless'] else 'NO'} | "
            f"{s['rows_equal_to_batch1'] or '-'} | {_ratio(s.get('rule_predicted_over_measured'))} |"
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_batches(summary: list[dict[str, Any]], path: str | Path) -> Path:
    """Speedup over plain batched greedy and tokens per target pass per row, against B (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (key, label) in zip(
        axes,
        (
            ("speedup", "speedup over plain batched greedy"),
            ("tokens_per_target_pass", "tokens per target pass per row"),
        ),
        strict=True,
    ):
        for i, method in enumerate(BATCH_METHODS):
            pts = sorted((s["batch_size"], s[key]) for s in summary if s["method"] == method)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=method)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_batch_results(results: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write `bench_batch.json` and `bench_batch.png` into `out_dir`."""
    return write_json_and_plot(results, out_dir, "bench_batch", plot_batches)


__all__ = [
    "BATCH_METHODS",
    "format_batch_table",
    "left_pad",
    "plot_batches",
    "row_outputs",
    "run_batch_benchmark",
    "summarize_batches",
    "write_batch_results",
]
