"""Benchmark sequence partitioning: peak memory and step time of one P-EAGLE training step vs sequence length.

Each (length, partitions) point runs in a fresh process: one warm-up step (unless `--no-warmup`), then
`--repeats` timed steps of `PEagleTrainer.training_step` (forward + backward of every segment) on one example
of that length, with target features supplied as a cache (so only the drafter's cost is measured).  Reported:
the median step time, the time to plan the step (COD + partition, CPU), the peak memory the steps add above
the memory held before them (GPU: `max_memory_allocated`; CPU: the process's peak RSS, reset after the
warm-up, with glibc returning freed blocks to the OS), the process's whole peak (GPU: `max_memory_reserved`;
CPU: peak RSS), the number of training elements and the size of the largest pass.

The drafter is the shipped head's shape by default (`--head-config`, default
`heads/src/peagle_heads/smollm2-135m-peagle/config.json`: width 576, 4 layers, 9 heads, 3 KV heads,
intermediate 1536, draft vocabulary 8192 of 49152, K_train 8, frozen target embeddings); any flag overrides
its field.

Memory guard.  Lengths run shortest first.  Before a point, its peak memory and step time are predicted from
the points already measured with the same S (the largest of: a least-squares quadratic in the length when >= 3
points, the linear and the power-law (exponent <= 2) extrapolations of the last two, the last value; one
point: its step's memory scaled by (L / L_1)^2, the rest by L / L_1).  The point is skipped when the predicted
whole peak exceeds `--memory-limit` (default: 80% of MemAvailable at start on CPU, of the free GPU memory on
GPU) or the predicted time of the point (warm-up + repeats steps) exceeds `--time-limit`; once skipped, every
longer length of that S is skipped too.  Skipped points are rows `{"skipped": true, "reason",
"predicted_peak_mib", "predicted_total_mib", "predicted_step_s"}` (`predicted_peak_mib` predicts the
`peak_mem_mib` column; `predicted_total_mib` is what the limit is compared with). On CPU a point whose RSS
still passes the limit is killed (an error row; longer lengths of its S are skipped).

`--budget 4GB` adds one row per length (S column "auto") trained with `partition_memory_budget=4GB` instead of
a fixed S, recording the S the trainer chose (`chosen_partitions`); with a peagle without that argument the
row is an error row.

Writes `<out>/bench_partition.json`, `<out>/bench_partition.png` (peak memory and step time vs length; skipped
points hollow, at their predicted value) and `<out>/bench_partition.md` (the printed table: rows = lengths,
columns = S, cells "MiB / s"), and prints the least-squares slope of memory vs length per S.

Examples:
    # CPU, tiny lengths
    python benchmarks/bench_partition.py --lengths 256,512 --partitions 1,2,4
    # GPU, the long-context table up to 20K tokens
    python benchmarks/bench_partition.py --lengths 2048,4096,8192,16384,20480 --partitions 1,4,8,16,32 \\
        --budget 4GB --out results/partition
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
from pathlib import Path

from peagle.evaluation.bench_partition import (
    MIN_MAX_POSITIONS,
    SHIPPED_HEAD_CONFIG,
    default_memory_limit_mib,
    gradient_check,
    guard,
    markdown_table,
    memory_slopes,
    model_shape,
    plot,
    probe_gpu,
    read_head_config,
    run_point,
)

# the shipped head, in this repository
DEFAULT_HEAD_CONFIG = Path(__file__).resolve().parents[1] / SHIPPED_HEAD_CONFIG


def _print_row(row: dict) -> None:
    s, length = row["partitions"], row["length"]
    if row.get("skipped"):
        pred = row.get("predicted_peak_mib")
        print(
            f"{length:>7} {s!s:>4}  skipped ({row['reason']}: {row['why']})"
            + (f", predicted ~{pred:,.0f} MiB" if pred is not None else "")
        )
    elif "error" in row:
        print(f"{length:>7} {s!s:>4}  failed: {row['error']}")
    else:
        chosen = f"  (chose S={row['chosen_partitions']})" if row.get("chosen_partitions") is not None else ""
        print(
            f"{length:>7} {s!s:>4} {row['elements']:>9} {row['largest_pass']:>8} {row['step_s']:>8.3f} "
            f"{row['plan_s']:>7.3f} {row['peak_mem_mib']:>9.1f} {row['peak_total_mib']:>9.1f}{chosen}"
        )


def parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="run shortest first")
    ap.add_argument("--partitions", default="1,2,4,8", help="fixed S values ('' for none)")
    ap.add_argument(
        "--segment-tokens",
        type=int,
        default=None,
        help="also a fixed segment length: S = length / N, rounded up (the series 'L/N')",
    )
    ap.add_argument(
        "--budget", default=None, help='also run each length with partition_memory_budget=BUDGET (e.g. "4GB")'
    )
    ap.add_argument(
        "--head-config",
        default=str(DEFAULT_HEAD_CONFIG),
        help="a head's config.json giving the drafter's shape (default: the shipped SmolLM2-135M head)",
    )
    ap.add_argument("--hidden", type=int, default=None, help="drafter/target width (shipped head: 576)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: width / head size)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: the head config's ratio)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (shipped head: 1536)")
    ap.add_argument("--layers", type=int, default=None, help="drafter layers (shipped head: 4)")
    ap.add_argument("--vocab", type=int, default=None, help="target vocabulary (shipped head: 49152)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="shipped head: 8192")
    ap.add_argument("--num-parallel-positions", type=int, default=None, help="K_train (shipped head: 8)")
    ap.add_argument(
        "--frozen-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="embed_from_target heads (no embedding-table gradient); shipped head: yes",
    )
    ap.add_argument("--cod-ratio", type=float, default=0.7)
    ap.add_argument("--cod-min-ratio", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per point (the median is reported)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up step (long lengths)")
    ap.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="MiB; skip points predicted to peak above it (default: 80%% of MemAvailable / free GPU memory)",
    )
    ap.add_argument(
        "--time-limit", type=float, default=None, help="seconds; skip points predicted to take longer"
    )
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on GPU, fp32 on CPU"
    )
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flex_attention"])
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument(
        "--gradients",
        action="store_true",
        help="instead of the table: compare one step's gradient between the --partitions at each length",
    )
    ap.add_argument("--out", default="bench_partition")
    return ap


def point_config(
    ap: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[dict, list[int], list[int | str]]:
    """`(cfg, lengths, series)`: what every point is measured with (the drafter's shape from --head-config and its
    overrides), the lengths (shortest first) and the S series (fixed S, then "L/N", then "auto")."""
    import torch

    head_config = args.head_config if args.head_config and Path(args.head_config).is_file() else None
    if args.head_config and head_config is None and args.head_config != str(DEFAULT_HEAD_CONFIG):
        ap.error(f"--head-config {args.head_config}: no such file")
    shape = model_shape(
        read_head_config(head_config),
        {
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "vocab": args.vocab,
            "draft_vocab": args.draft_vocab,
            "k": args.num_parallel_positions,
            "frozen_embeddings": args.frozen_embeddings,
        },
    )
    lengths = sorted({int(x) for x in args.lengths.split(",")})
    series: list[int | str] = list(_fixed_partitions(args))
    series += [f"L/{args.segment_tokens}"] if args.segment_tokens else []
    series += ["auto"] if args.budget else []
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {
        "device": device,
        "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        "head_config": head_config,
        **shape,
        "max_positions": max(MIN_MAX_POSITIONS, 2 * max(lengths)),
        "cod_ratio": args.cod_ratio,
        "cod_min_ratio": args.cod_min_ratio,
        "repeats": args.repeats,
        "warmup": not args.no_warmup,
        "budget": args.budget,
        "attn": args.attn,
        "threads": args.threads,
        "out": args.out,
    }
    return cfg, lengths, series


def _fixed_partitions(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.partitions.split(",") if x.strip()]


def write_gradients(cfg: dict, lengths: list[int], partitions: list[int], out: str) -> None:
    """`--gradients`: one step's gradient compared across `partitions` at each length, to
    `<out>/partition_gradients.json`."""
    import torch

    from peagle.evaluation.timing import machine_description

    torch.set_num_threads(cfg["threads"])
    grads = [row for length in lengths for row in gradient_check(cfg, length, partitions)]
    path = Path(out) / "partition_gradients.json"
    path.write_text(json.dumps({"config": cfg, "machine": machine_description(), "rows": grads}, indent=2))
    print(f"wrote {path}")


def run_metadata(cfg: dict, gpu: dict | None) -> dict:
    """The JSON's metadata: the configuration, torch, the machine and how memory was measured."""
    import torch

    return {
        "config": cfg,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "gpu": gpu["name"] if gpu else None,
        "memory_measure": "max_memory_allocated growth (whole: max_memory_reserved)"
        if gpu
        else "peak RSS growth of the process (whole: peak RSS)",
    }


def measure_all(ctx, cfg: dict, lengths: list[int], series: list[int | str], meta: dict) -> list[dict]:
    """Every (length, S) point, shortest first, each measured in a child process or skipped by the memory guard;
    the rows so far are rewritten to `<out>/bench_partition.json` after every point."""
    memory_limit, time_limit = cfg["memory_limit_mib"], cfg["time_limit_s"]
    partial = Path(cfg["out"]) / "bench_partition.json"  # rewritten after every point, then with the summary
    steps_per_point = cfg["repeats"] + (1 if cfg["warmup"] else 0)
    print(
        f"memory limit {memory_limit:,.0f} MiB"
        + (f", time limit {time_limit:,.0f} s per point" if time_limit else "")
    )
    print(
        f"{'length':>7} {'S':>4} {'elements':>9} {'largest':>8} {'step s':>8} {'plan s':>7} "
        f"{'peak MiB':>9} {'whole MiB':>9}"
    )
    rows: list[dict] = []
    for length in lengths:
        for s in series:
            row = guard(
                rows,
                length,
                s,
                memory_limit_mib=memory_limit,
                time_limit_s=time_limit,
                steps_per_point=steps_per_point,
            )
            if row is None:
                row = run_point(ctx, cfg, length, s, memory_limit if cfg["device"] == "cpu" else None)
            if s == "auto":
                row.setdefault("budget", cfg["budget"])
            rows.append(row)
            _print_row(row)
            partial.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    return rows


def write_results(rows: list[dict], cfg: dict, meta: dict) -> None:
    """Print the table and the memory slopes; write `<out>/bench_partition.json`, `.png` and `.md`."""
    from peagle.evaluation.results import write_json_and_plot

    out, budget = cfg["out"], cfg["budget"]
    slopes = memory_slopes(rows)
    table = markdown_table(rows, budget)
    title = (
        f"P-EAGLE training step, {cfg['device']} {cfg['dtype']}, width {cfg['hidden']}, "
        f"{cfg['layers']} layer(s), "
        f"{cfg['heads']}/{cfg['kv_heads']} heads, K_train={cfg['k']}, COD r={cfg['cod_ratio']}/"
        f"{cfg['cod_min_ratio']}, draft vocab {cfg['draft_vocab']}"
        + (", frozen embeddings" if cfg["frozen_embeddings"] else ", trained embeddings")
    )
    slope_line = "memory slope (least squares, MiB per 1K tokens): " + (
        ", ".join(f"S = {s}: {v:,.1f}" for s, v in slopes.items()) or "needs 2 lengths"
    )
    print()
    print(table)
    print()
    print(slope_line)
    results = {**meta, "summary": {"memory_slope_mib_per_1k_tokens": slopes}, "rows": rows}
    write_json_and_plot(results, out, "bench_partition", lambda _summary, path: plot(rows, path, title))
    md = Path(out) / "bench_partition.md"
    md.write_text(
        f"{title}\n\nCells: peak memory added by the step (MiB) / step time (s); skipped points show their "
        f"prediction (memory limit {cfg['memory_limit_mib']:,.0f} MiB).\n\n{table}\n\n{slope_line}\n"
    )
    print(f"wrote {out}/bench_partition.json, .png and .md")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    cfg, lengths, series = point_config(ap, args)
    os.makedirs(args.out, exist_ok=True)
    if args.gradients:
        write_gradients(cfg, lengths, _fixed_partitions(args), args.out)
        return 0
    # glibc: serve every allocation above 64 KiB by mmap, so freed tensors leave the RSS and the peak RSS of a
    # step measures its live memory (the child processes inherit this at start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    gpu = probe_gpu(ctx) if cfg["device"].startswith("cuda") else None
    cfg["memory_limit_mib"] = (
        args.memory_limit if args.memory_limit is not None else default_memory_limit_mib(cfg["device"], gpu)
    )
    cfg["time_limit_s"] = args.time_limit
    meta = run_metadata(cfg, gpu)
    rows = measure_all(ctx, cfg, lengths, series, meta)
    write_results(rows, cfg, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
