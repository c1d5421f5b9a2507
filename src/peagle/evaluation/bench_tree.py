"""Draft-tree benchmark: tokens per target pass against the node budget, for both head kinds, with and without
prompt-lookup branches, and the default rule's speed with trees against plain greedy and chains.

`peagle bench --tree_sizes 0,8,16,32,64` runs it.  For every prompt, plain greedy runs first (the reference every
other output must equal, and the timing baseline), then:

- acceptance rows: each head with K drafts (`num_assistant_tokens=K`) verifying a full tree of N nodes every round
  (`draft_tree_size=N, assistant_confidence_threshold=0.0`; N = 0 is the chain of K), with a prompt-lookup branch
  of each length in `lookups` (0: none);
- prompt lookup alone (transformers' own, `prompt_lookup_num_tokens=L`, no head), tokens per target pass counted
  from the target's forward calls;
- speed rows (unless `speed=False`): each head with its default rule and trees available (`"auto"`), and with
  chains only (`draft_tree_size=0`), timed side by side with the prompt's greedy run.

Acceptance does not depend on the machine; speed does (say which CPU a figure comes from).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..generation.stats import PEagleGenerationStats
from .results import save_figure, write_json_and_plot
from .timing import timed_generate


def tree_rows(
    heads: Sequence[str], tree_sizes: Sequence[int], lookups: Sequence[int], speed: bool
) -> list[dict]:
    """The benchmark's rows (after greedy): `{"label", "head", "kwargs", "kind"}`, kind "acceptance" or "speed"
    (or "pld" for prompt lookup alone)."""
    rows = []
    for head in heads:
        for n in tree_sizes:
            for look in lookups if n > 0 else [0]:
                kwargs: dict[str, Any] = {"assistant_confidence_threshold": 0.0, "draft_tree_size": n}
                if n > 0:
                    kwargs["prompt_lookup_num_tokens"] = look
                label = (
                    f"{head} chain" if n == 0 else f"{head} tree {n}" + (f" +lookup {look}" if look else "")
                )
                rows.append({"label": label, "head": head, "kwargs": kwargs, "kind": "acceptance", "nodes": n,
                             "lookup": look})  # fmt: skip
    for look in lookups:
        if look > 0:
            rows.append({"label": f"pld {look}", "head": None, "kwargs": {"prompt_lookup_num_tokens": look},
                         "kind": "pld", "nodes": None, "lookup": look})  # fmt: skip
    if speed:
        for head in heads:
            rows.append({"label": f"{head} default", "head": head, "kwargs": {}, "kind": "speed", "nodes": None,
                         "lookup": None})  # fmt: skip
            rows.append({"label": f"{head} default chains", "head": head, "kwargs": {"draft_tree_size": 0},
                         "kind": "speed", "nodes": None, "lookup": None})  # fmt: skip
    return rows


def run_tree_benchmark(
    target: Any,
    prompts: dict[str, list[torch.Tensor]],
    heads: dict[str, Any],
    tree_sizes: Sequence[int] = (0, 8, 16, 32, 64),
    num_speculative_tokens: int = 7,
    lookups: Sequence[int] = (0, 10),
    max_new_tokens: int = 64,
    speed: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every row on every prompt of every set (`prompts`: set name -> `(1, T)` prompt ids).

    Returns a JSON-ready dict: `runs` (one per prompt and row), `summary` (per set and row: tokens per target
    pass over all prompts, lossless, speedup over greedy on the same prompts) and `config`."""
    plan = tree_rows(list(heads), tree_sizes, lookups, speed)
    total = sum(len(p) for p in prompts.values()) * (len(plan) + 1)
    bar = tqdm(total=total, desc="bench trees", disable=not progress)
    runs: list[dict[str, Any]] = []
    for name, items in prompts.items():
        for i, ids in enumerate(items):
            greedy = timed_generate(target, ids, max_new_tokens)
            runs.append(_run_record(name, i, "greedy", "greedy", greedy, greedy.output))
            bar.update(1)
            for row in plan:
                kwargs = dict(row["kwargs"])
                head = heads.get(row["head"]) if row["head"] else None
                if row["kind"] == "acceptance":
                    kwargs["num_assistant_tokens"] = num_speculative_tokens
                result = timed_generate(target, ids, max_new_tokens, assistant=head, **kwargs)
                runs.append(_run_record(name, i, row["label"], row["kind"], result, greedy.output))
                bar.update(1)
    bar.close()
    return {
        "runs": runs,
        "summary": summarize_trees(runs, plan),
        "config": {
            "tree_sizes": list(tree_sizes),
            "lookups": list(lookups),
            "num_speculative_tokens": num_speculative_tokens,
            "max_new_tokens": max_new_tokens,
            "prompts": {name: len(items) for name, items in prompts.items()},
            "rows": [{k: v for k, v in r.items() if k != "kwargs"} | {"kwargs": r["kwargs"]} for r in plan],
        },
    }


def _run_record(dataset: str, prompt: int, label: str, kind: str, result: Any, reference: list[int]) -> dict:
    stats = result.stats
    return {
        "dataset": dataset,
        "prompt": prompt,
        "label": label,
        "kind": kind,
        "new_tokens": result.new_tokens,
        "seconds": result.seconds,
        "target_calls": result.target_calls,
        "lossless": result.output == reference,
        "stats": stats.to_dict() if isinstance(stats, PEagleGenerationStats) else None,
    }


def summarize_trees(runs: list[dict[str, Any]], plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (set, row): tokens per target pass over all its prompts (from the head's stats, or new tokens over the
    target's forward calls without a head), lossless, and speed against greedy on the same prompts."""
    greedy = {(r["dataset"], r["prompt"]): r for r in runs if r["label"] == "greedy"}
    meta = {r["label"]: r for r in plan}
    out = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        for label in ["greedy", *meta]:
            rs = [r for r in runs if r["dataset"] == dataset and r["label"] == label]
            if not rs:
                continue
            stats = [PEagleGenerationStats.from_dict(r["stats"]) for r in rs if r["stats"] is not None]
            tokens = sum(r["new_tokens"] for r in rs)
            if stats:
                tpp = PEagleGenerationStats.merge(stats).tokens_per_target_pass
            else:
                tpp = tokens / max(sum(r["target_calls"] for r in rs), 1)
            seconds = sum(r["seconds"] for r in rs)
            base = sum(greedy[(dataset, r["prompt"])]["seconds"] for r in rs)
            row = meta.get(label, {"kind": "greedy", "nodes": None, "lookup": None})
            out.append(
                {
                    "dataset": dataset,
                    "label": label,
                    "kind": row["kind"],
                    "nodes": row["nodes"],
                    "lookup": row["lookup"],
                    "prompts": len(rs),
                    "new_tokens": tokens,
                    "tokens_per_target_pass": tpp,
                    "lossless": all(r["lossless"] for r in rs),
                    "tokens_per_s": tokens / seconds if seconds else 0.0,
                    "speedup": base / seconds if seconds else None,
                    "slowest_prompt": min(
                        greedy[(dataset, r["prompt"])]["seconds"] / r["seconds"] for r in rs
                    ),
                }
            )
    return out


def format_tree_table(summary: list[dict[str, Any]]) -> str:
    """A Markdown table: tokens per target pass per row and set; speed only where it means something."""
    lines = [
        "| set | row | tokens/target pass | = greedy | tok/s | speedup | slowest prompt |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        timed = s["kind"] in ("speed", "greedy")
        lines.append(
            f"| {s['dataset']} | {s['label']} | {s['tokens_per_target_pass']:.2f} | "
            f"{'yes' if s['lossless'] else 'NO'} | {s['tokens_per_s']:.1f} | "
            + (f"{s['speedup']:.2f}x | {s['slowest_prompt']:.2f}x |" if timed else "- | - |")
        )
    return "\n".join(lines)


def plot_trees(summary: list[dict[str, Any]], path: str | Path) -> Path:
    """Tokens per target pass against the node budget, one panel per set: a line per head and lookup length
    (the chain at N = K's place as a dashed level), prompt lookup alone as a dotted level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(s["dataset"] for s in summary))
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.0), squeeze=False)
    for ax, dataset in zip(axes[0], sets, strict=True):
        rows = [s for s in summary if s["dataset"] == dataset]
        lines: dict[str, list[tuple[int, float]]] = {}
        for s in rows:
            if s["kind"] == "acceptance" and s["nodes"]:
                head = s["label"].split(" ")[0]
                key = head + (f" + lookup {s['lookup']}" if s["lookup"] else "")
                lines.setdefault(key, []).append((s["nodes"], s["tokens_per_target_pass"]))
        for i, (key, pts) in enumerate(sorted(lines.items())):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=key)
        for j, s in enumerate(r for r in rows if r["kind"] == "acceptance" and r["nodes"] == 0):
            ax.axhline(
                s["tokens_per_target_pass"], color=f"C{j + 5}", linestyle="--", linewidth=1, label=s["label"]
            )
        for s in (r for r in rows if r["kind"] == "pld"):
            ax.axhline(
                s["tokens_per_target_pass"], color="gray", linestyle=":", linewidth=1.5, label=s["label"]
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft tree node budget N")
        ax.set_ylabel("tokens per target pass")
        ax.set_title(dataset)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def write_tree_results(results: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write `bench_tree.json` and `bench_tree.png` into `out_dir`."""
    return write_json_and_plot(results, out_dir, "bench_tree", plot_trees)


__all__ = [
    "format_tree_table",
    "plot_trees",
    "run_tree_benchmark",
    "summarize_trees",
    "tree_rows",
    "write_tree_results",
]
