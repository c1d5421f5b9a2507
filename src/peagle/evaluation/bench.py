"""Benchmark harness: plain greedy vs P-EAGLE vs an autoregressive (EAGLE-3) head vs prompt lookup.

All methods run on the same prompts with the same `max_new_tokens`, interleaved prompt by prompt so
that ratios are measured side by side.  Every run is checked against plain greedy output (a mismatch is
recorded and reported, never hidden).  Metrics are those of [`PEagleGenerationStats`]:
`tokens_per_target_pass` = new tokens / target forward passes (prefill included; plain decoding = 1.0), for
every method; `acceptance_length` = tokens per drafting round, bonus included, for the heads.  Time per
target pass is split into target forward, drafter forward and the rest (overhead) with forward hooks.

vLLM rows (`"vllm"`, `"vllm-peagle"`, `"vllm-eagle3"`, `run_vllm_rows`): the same prompts and lengths served by
vLLM, plain and with the heads exported to its layout, in the interpreter of a vLLM environment
(`PEAGLE_VLLM_PYTHON`); `integrations/vllm/runner.py` runs there.  Their tokens per target pass come from vLLM's counters
(`vllm:spec_decode_*`: new tokens / (new tokens - accepted drafts)); their time is not split.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..generation.stats import PEagleGenerationStats
from ..integrations.vllm.process import VLLM_PYTHON_ENV, VLLM_RUNNER, vllm_environ
from .results import save_figure, write_json_and_plot
from .timing import timed_generate

METHODS = ("greedy", "peagle", "eagle3", "pld")
HEAD_METHODS = ("peagle", "eagle3")
VLLM_METHODS = ("vllm", "vllm-peagle", "vllm-eagle3")
"""vLLM plain and vLLM with the P-EAGLE / EAGLE-3 head (its vLLM export), when a vLLM environment is set."""
AUTO = "-auto"
"""Suffix of a head's rows run with its default drafting rule (cost-aware unless the head sets a cut), e.g.
`"peagle-auto"`; the head's plain rows draft K every round (or with the cut the benchmark is given)."""


def method_kwargs(
    method: str, k: int, heads: dict[str, Any], confidence_threshold: float | None = None
) -> dict[str, Any]:
    """`timed_generate` keyword arguments that run `method` ("greedy", "pld", a key of `heads`, or such a key plus
    `"-auto"`: the head's default rule with its own K) with K=`k`."""
    if method == "greedy":
        return {}
    if method == "pld":
        return {"prompt_lookup_num_tokens": k}
    if method.endswith(AUTO):
        return {"assistant": heads[method[: -len(AUTO)]]}
    kwargs = {
        "assistant": heads[method],
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
    }
    if confidence_threshold is not None:  # None: the head's own default (its config's `confidence_threshold`)
        kwargs["assistant_confidence_threshold"] = confidence_threshold
    return kwargs


def run_benchmark(
    target,
    prompts: dict[str, Sequence[torch.Tensor]],
    heads: dict[str, Any],
    ks: Sequence[int] = (1, 3, 5, 7),
    max_new_tokens: int = 128,
    repeats: int = 3,
    methods: Sequence[str] = METHODS,
    progress: bool = True,
    confidence_threshold: float | None = None,
    default_rule: bool = False,
) -> dict[str, Any]:
    """Measure every method on every prompt, side by side.

    Args:
        target: the target causal LM.
        prompts: dataset name -> list of `(1, T)` prompt id tensors.
        heads: method name (`"peagle"`, `"eagle3"`) -> drafter head; methods without a head are skipped.
        ks: draft lengths K to sweep (PLD uses K as `prompt_lookup_num_tokens`).
        repeats: timed repeats per (prompt, method, K); the median time is kept.
        confidence_threshold: `assistant_confidence_threshold` for the heads (a round stops after its first
            draft below it; K is then the most drafts per round); None: each head's own default
            (`config.confidence_threshold`); 0 drafts K tokens every round.
        default_rule: also run each head with its default rule (no K, no cut given: cost-aware drafting for heads
            without a cut), as method `"<head>-auto"` with the head's K in the `k` column.

    Returns:
        A JSON-ready dict with `runs` (one row per prompt/method/K) and `summary` (per dataset/method/K:
        tau, tokens/s, speedup over greedy, time split per round, lossless flag).
    """
    methods = [m for m in methods if m in ("greedy", "pld") or m in heads]
    rows: list[dict[str, Any]] = []
    others = [m for m in methods if m != "greedy"]
    autos = (
        [(m + AUTO, heads[m].config.num_speculative_tokens) for m in others if m in heads]
        if default_rule
        else []
    )
    todo = sum(len(p) for p in prompts.values()) * (1 + len(ks) * len(others) + len(autos))
    bar = tqdm(total=todo, desc="bench", disable=not progress)
    for dataset, plist in prompts.items():
        for idx, ids in enumerate(plist):
            plan = [("greedy", 1)] + [(m, k) for k in ks for m in others] + autos
            reference: list[int] | None = None
            for method, k in plan:
                runs = [  # the first run also counts its host reads (the median of the others hides the wrapper)
                    timed_generate(
                        target,
                        ids,
                        max_new_tokens,
                        count_syncs=i == 0,
                        **method_kwargs(method, k, heads, confidence_threshold),
                    )
                    for i in range(max(1, repeats))
                ]
                first = runs[0]
                if method == "greedy":
                    reference = first.output
                med = statistics.median(r.seconds for r in runs)
                rows.append(
                    {
                        "dataset": dataset,
                        "prompt": idx,
                        "method": method,
                        "k": k if method != "greedy" else 0,
                        "new_tokens": first.new_tokens,
                        "seconds": med,
                        "target_passes": first.target_calls,
                        "target_seconds": statistics.median(r.target_seconds for r in runs),
                        "drafter_seconds": statistics.median(r.drafter_seconds for r in runs),
                        "drafter_calls": first.drafter_calls,
                        "host_syncs": first.host_syncs,
                        "lossless": all(r.output == reference for r in runs),
                        "stats": first.stats.to_dict() if first.stats is not None else None,
                        **({"output": first.output} if method == "greedy" else {}),  # vLLM rows compare
                    }
                )
                bar.update(1)
    bar.close()
    return {
        "runs": rows,
        "summary": summarize(rows),
        "config": {
            "ks": list(ks),
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "confidence_threshold": {  # per head, as used
                m: confidence_threshold
                if confidence_threshold is not None
                else heads[m].config.confidence_threshold
                for m in methods
                if m in heads
            },
        },
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aggregate runs per (dataset, method, K): totals over prompts, speedup vs greedy on the same prompts."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["method"], r["k"]), []).append(r)
    greedy_tps = {}
    prompt_tps = {}  # (dataset, prompt) -> greedy tokens/s of that prompt
    for (ds, m, _), rs in groups.items():
        if m == "greedy":
            greedy_tps[ds] = sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)
            for r in rs:
                if r["seconds"] > 0 and "prompt" in r:
                    prompt_tps[(ds, r["prompt"])] = r["new_tokens"] / r["seconds"]
    out = []
    for (ds, m, k), rs in sorted(groups.items()):
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        rounds = sum(r["target_passes"] for r in rs)
        tps = tokens / seconds if seconds else 0.0
        head_stats = [PEagleGenerationStats.from_dict(r["stats"]) for r in rs if r.get("stats")]
        merged = PEagleGenerationStats.merge(head_stats) if head_stats else None
        out.append(
            {
                "dataset": ds,
                "method": m,
                "k": k,
                "prompts": len(rs),
                "tokens_per_target_pass": tokens / rounds if rounds else 0.0,
                "acceptance_length": merged.acceptance_length if merged is not None else None,
                "tokens_per_s": tps,
                "speedup": tps / greedy_tps[ds] if ds in greedy_tps and greedy_tps[ds] else None,
                "min_prompt_speedup": min(per_prompt)
                if (per_prompt := _prompt_speedups(rs, prompt_tps))
                else None,
                **_time_split(rs, rounds),
                "host_syncs_per_round": _per_round(rs, "host_syncs", rounds),
                "lossless": all(r["lossless"] for r in rs),
            }
        )
    return out


def _time_split(rows: list[dict[str, Any]], rounds: int) -> dict[str, float | None]:
    """ms per target pass in the target, the drafter and the rest; None where not measured (vLLM rows)."""
    keys = ("ms_per_round_target", "ms_per_round_drafter", "ms_per_round_overhead")
    if any(r.get("target_seconds") is None for r in rows):
        return dict.fromkeys(keys)
    target = sum(r["target_seconds"] for r in rows)
    drafter = sum(r["drafter_seconds"] for r in rows)
    total = sum(r["seconds"] for r in rows)
    return dict(zip(keys, (1e3 * v / max(1, rounds) for v in (target, drafter, total - target - drafter))))


def _per_round(rows: list[dict[str, Any]], name: str, rounds: int) -> float | None:
    """`name` summed over the rows, per target pass; None where a row did not count it (vLLM rows)."""
    if not rounds or any(r.get(name) is None for r in rows):
        return None
    return sum(r[name] for r in rows) / rounds


def _prompt_speedups(rows: list[dict[str, Any]], greedy: dict[tuple[str, int], float]) -> list[float]:
    """Speedup of each prompt's run over plain greedy on the same prompt."""
    out = []
    for r in rows:
        base = greedy.get((r["dataset"], r.get("prompt")))
        if base and r["seconds"] > 0:
            out.append(r["new_tokens"] / r["seconds"] / base)
    return out


def format_table(summary: list[dict[str, Any]]) -> str:
    """A Markdown table of the summary (one row per dataset/method/K)."""
    head = (
        "| set | method | K | tokens/target pass | tok/s | speedup | slowest prompt | ms/pass target | drafter "
        "| overhead | lossless |"
    )
    lines = [head, "|" + "---|" * 11]
    for s in summary:
        sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        low = f"{s['min_prompt_speedup']:.2f}x" if s.get("min_prompt_speedup") is not None else "-"
        split = " | ".join(
            "-" if s[k] is None else f"{s[k]:.0f}"
            for k in ("ms_per_round_target", "ms_per_round_drafter", "ms_per_round_overhead")
        )
        lines.append(
            f"| {s['dataset']} | {s['method']} | {s['k'] or '-'} | {s['tokens_per_target_pass']:.2f} | {s['tokens_per_s']:.1f} | {sp} | {low} | "
            f"{split} | {'yes' if s['lossless'] else 'NO'} |"
        )
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: str | Path) -> Path:
    """Speedup and acceptance length vs K, one line per method, one row per dataset (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({s["dataset"] for s in summary})
    fig, axes = plt.subplots(len(datasets), 2, figsize=(10, 3.6 * len(datasets)), squeeze=False)
    for row, ds in enumerate(datasets):
        for col, (key, label) in enumerate(
            (("speedup", "speedup over greedy"), ("tokens_per_target_pass", "new tokens per target pass"))
        ):
            ax = axes[row][col]
            for i, m in enumerate((*METHODS[1:], *VLLM_METHODS)):
                color = f"C{i}"
                pts = sorted((s["k"], s[key]) for s in summary if s["dataset"] == ds and s["method"] == m)
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        marker="o",
                        color=color,
                        label=f"{m} (fixed K)",
                    )
                auto = [s for s in summary if s["dataset"] == ds and s["method"] == m + AUTO]
                for s in auto:
                    ax.axhline(s[key], color=color, linestyle=":", linewidth=1.5)
                    ax.plot([s["k"]], [s[key]], marker="*", markersize=13, color=color, linestyle="none",
                            label=f"{m} (default rule, K<={s['k']})")  # fmt: skip
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain greedy")
            ax.set_title(f"{ds}: {label}")
            ax.set_xlabel("K (draft tokens per round)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_results(results: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write `bench.json` and `bench.png` into `out_dir`."""
    return write_json_and_plot(results, out_dir, "bench", plot)


def check_methods(methods: Sequence[str], vllm_python: str | None = None) -> None:
    """Raise a `ValueError` naming unknown benchmark methods, or vLLM methods without a vLLM environment."""
    known = (*METHODS, *VLLM_METHODS)
    unknown = sorted(set(methods) - set(known))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; expected some of {list(known)}.")
    wanted = [m for m in methods if m in VLLM_METHODS]
    if wanted and not vllm_python:
        raise ValueError(
            f"methods {wanted} need a vLLM environment: set {VLLM_PYTHON_ENV} (or --vllm_python) to its Python "
            "interpreter (tests/interop/peer_env.sh builds one)."
        )


# ---------------------------------------------------------------------------------------------- vLLM rows
def run_vllm(python: str | os.PathLike, request: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """Run `integrations/vllm/runner.py` (see its docstring for `request` and the result) in a vLLM environment's
    interpreter `python`; raises `RuntimeError` with the end of its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="peagle-vllm-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(request))
        env = vllm_environ()
        proc = subprocess.run(
            [str(python), str(VLLM_RUNNER), str(req)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
            timeout=timeout,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"{python} {VLLM_RUNNER.name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def vllm_head_stats(counters: dict[str, Any], new_tokens: int, k: int, mode: str) -> PEagleGenerationStats:
    """vLLM's counters of one request as `PEagleGenerationStats` (rounds = drafts; per-depth acceptance)."""
    rounds, accepted = int(counters["num_drafts"]), int(counters["num_accepted_tokens"])
    per_pos = list(counters["accepted_per_pos"]) + [0] * max(0, k - len(counters["accepted_per_pos"]))
    return PEagleGenerationStats(
        drafting_mode=mode,
        num_speculative_tokens=k,
        rounds=rounds,
        draft_tokens=int(counters["num_draft_tokens"]),
        accepted_tokens=accepted,
        plain_steps=max(0, new_tokens - accepted - rounds),
        generated_tokens=new_tokens,
        accepted_per_depth=per_pos[:k],
        drafted_per_depth=[rounds] * k,
        draft_policy="fixed",
    )


def run_vllm_rows(
    python: str | os.PathLike,
    target: str | os.PathLike,
    prompts: dict[str, Sequence[torch.Tensor]],
    head_dirs: dict[str, str | os.PathLike],
    ks: Sequence[int] = (3,),
    max_new_tokens: int = 128,
    repeats: int = 1,
    methods: Sequence[str] = VLLM_METHODS,
    dtype: str = "float32",
    references: dict[tuple[str, int], list[int]] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark rows (as `run_benchmark`'s) of vLLM on the same prompts: `"vllm"` plain, and `"vllm-<head>"` at
    each K with the head exported to vLLM's layout in `head_dirs[<head>]` (`"peagle"`: parallel drafting).

    Args:
        python: the interpreter of a vLLM environment.
        target: the target as vLLM loads it (a folder, or a Hub id).
        references: (dataset, prompt index) -> transformers' greedy output; a vLLM row is lossless when it
            equals vLLM's plain output (or, without a `"vllm"` row, this reference).
    """
    runs: list[dict[str, Any]] = []
    if "vllm" in methods:
        runs.append({"name": "vllm", "k": 0, "speculative_config": None})
    for method in methods:
        head = method.removeprefix("vllm-")
        if method == "vllm" or head not in head_dirs:
            continue
        for k in ks:
            spec: dict[str, Any] = {
                "method": "eagle3",
                "model": str(head_dirs[head]),
                "num_speculative_tokens": k,
            }
            if head == "peagle":
                spec["parallel_drafting"] = True
            runs.append({"name": method, "k": k, "speculative_config": spec})
    flat = [(ds, i, ids) for ds, plist in prompts.items() for i, ids in enumerate(plist)]
    longest = max(int(ids.shape[-1]) for _, _, ids in flat) + max_new_tokens + max(ks) + 8
    request = {
        "target": str(target),
        "dtype": dtype,
        "prompts": [ids[0].tolist() for _, _, ids in flat],
        "max_tokens": max_new_tokens,
        "max_model_len": max(512, longest),
        "repeats": repeats,
        "runs": [{"name": r["name"], "speculative_config": r["speculative_config"]} for r in runs],
    }
    result = run_vllm(python, request)
    plain = next((r["outputs"] for r in result["runs"] if r["name"] == "vllm"), None)
    rows = []
    for run, res in zip(runs, result["runs"]):
        for j, (ds, i, _) in enumerate(flat):
            out, new = res["outputs"][j], res["new_tokens"][j]
            counters = res["counters"][j]
            reference = plain[j] if plain is not None else (references or {}).get((ds, i))
            stats = None
            if run["k"]:
                mode = "parallel" if run["name"] == "vllm-peagle" else "autoregressive"
                stats = vllm_head_stats(counters, new, run["k"], mode)
            rows.append(
                {
                    "dataset": ds,
                    "prompt": i,
                    "method": run["name"],
                    "k": run["k"],
                    "new_tokens": new,
                    "seconds": res["seconds"][j],
                    "target_passes": max(1, new - int(counters["num_accepted_tokens"])),
                    "target_seconds": None,
                    "drafter_seconds": None,
                    "drafter_calls": int(counters["num_drafts"]),
                    "lossless": reference is None or out == reference,
                    "matches_transformers": (references or {}).get((ds, i)) == out if references else None,
                    "stats": stats.to_dict() if stats is not None else None,
                }
            )
    return rows


__all__ = [
    "AUTO",
    "METHODS",
    "VLLM_METHODS",
    "run_vllm",
    "run_vllm_rows",
    "check_methods",
    "run_benchmark",
    "method_kwargs",
    "summarize",
    "format_table",
    "plot",
    "write_results",
]
