"""Sequence partitioning measured: the peak memory and step time of one P-EAGLE training step against the sequence
length, one (length, S) point per fresh process (`benchmarks/bench_partition.py` is its command line).

- the drafter's shape: [`read_head_config`] (a head's `config.json`) and [`model_shape`] (with overrides);
- the memory guard, pure: [`extrapolate`] predicts a point's peak memory and step time from the shorter points of
  its S, and [`guard`] returns the skip row of a point predicted over the memory or time limit;
- summaries, pure: [`partitions_for`], [`series_order`], [`memory_slopes`], [`markdown_table`];
- measuring: [`measure_point`] (one point in this process), [`run_point`] (in a child process, killed on CPU
  when its RSS passes the limit), [`gradient_check`] (one step's gradient across S), [`plot`].
"""

from __future__ import annotations

import gc
import json
import math
import os
import queue as queue_module
import statistics
import time
from pathlib import Path

SHIPPED_HEAD_CONFIG = "heads/src/peagle_heads/smollm2-135m-peagle/config.json"
"""The shipped P-EAGLE head's `config.json`, relative to the repository root."""
SHIPPED_HEAD = {  # the shipped head's fields, used when its config.json is not there
    "hidden": 576,
    "layers": 4,
    "heads": 9,
    "kv_heads": 3,
    "head_dim": 64,
    "intermediate": 1536,
    "vocab": 49152,
    "draft_vocab": 8192,
    "k": 8,
    "frozen_embeddings": True,
}
MIN_MAX_POSITIONS = 32768


# ---------------------------------------------------------------------------------------------- head shape


def read_head_config(path: str | os.PathLike | None) -> dict:
    """The drafter's shape from a head's `config.json` (`SHIPPED_HEAD`'s keys); `SHIPPED_HEAD` if `path` is
    None."""
    if path is None:
        return dict(SHIPPED_HEAD)
    cfg = json.loads(Path(path).read_text())
    hidden = int(cfg["hidden_size"])
    heads = int(cfg.get("num_attention_heads", max(1, hidden // 64)))
    return {
        "hidden": hidden,
        "layers": int(cfg["num_hidden_layers"]),
        "heads": heads,
        "kv_heads": int(cfg.get("num_key_value_heads", heads)),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "intermediate": int(cfg["intermediate_size"]),
        "vocab": int(cfg["vocab_size"]),
        "draft_vocab": int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        "k": int(cfg.get("num_parallel_positions", 8)),
        "frozen_embeddings": bool(cfg.get("embed_from_target", True)),
    }


def model_shape(base: dict, overrides: dict) -> dict:
    """`base` (from `read_head_config`) with the non-None `overrides`.  A width given without heads keeps the
    base's head size and query/KV-head ratio (width 64 with the shipped head: 1 head, 1 KV head)."""
    shape = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    if overrides.get("hidden") is not None and overrides.get("heads") is None:
        shape["heads"] = max(1, shape["hidden"] // base["head_dim"])
    if overrides.get("kv_heads") is None and (overrides.get("heads") or overrides.get("hidden")) is not None:
        ratio = max(1, base["heads"] // max(1, base["kv_heads"]))
        shape["kv_heads"] = max(1, shape["heads"] // ratio)
    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise ValueError(
            f"width {shape['hidden']}, {shape['heads']} heads and {shape['kv_heads']} KV heads: the heads "
            "must divide the width and the KV heads the heads; pass --heads/--kv-heads."
        )
    shape["head_dim"] = shape["hidden"] // shape["heads"]
    return shape


# ------------------------------------------------------------------------------------ guard (pure functions)


def extrapolate(points: list[tuple[float, float]], x: float, single_exponent: float = 2.0) -> float | None:
    """A conservative prediction at `x` from `(length, value)` points measured at shorter lengths.

    None without points; one point: scaled by ``(x / x_1)**single_exponent``; otherwise the largest of the
    last value, the linear and the power-law (exponent at most 2) extrapolations of the last two points and,
    with >= 3 points, a least-squares fit ``a + b*L + c*L**2``.
    """
    pts = sorted(dict(points).items())  # one value per length
    if not pts:
        return None
    xl, yl = pts[-1]
    if len(pts) == 1:
        return yl * max(1.0, x / xl) ** single_exponent if yl > 0 else yl
    x1, y1 = pts[-2]
    candidates = [yl, yl + (yl - y1) / (xl - x1) * (x - xl)]
    if y1 > 0 and yl > y1:
        power = min(2.0, math.log(yl / y1) / math.log(xl / x1))
        candidates.append(yl * (x / xl) ** power)
    if len(pts) >= 3:
        import numpy as np

        xs = np.array([px for px, _ in pts], dtype=float)
        ys = np.array([py for _, py in pts], dtype=float)
        c, b, a = np.polyfit(xs, ys, 2)
        candidates.append(float(a + b * x + c * x * x))
    return max(candidates)


def _is_measured(row: dict) -> bool:
    return "peak_mem_mib" in row and "error" not in row and not row.get("skipped")


def guard(
    rows: list[dict],
    length: int,
    partitions: int | str,
    *,
    memory_limit_mib: float | None = None,
    time_limit_s: float | None = None,
    steps_per_point: int = 1,
) -> dict | None:
    """The skip row of point (`length`, `partitions`), or None to run it.

    Predictions use the measured `rows` of the same `partitions` at shorter lengths (`extrapolate`): the whole
    peak (the step's `peak_mem_mib` plus the memory held before it, `peak_total_mib - peak_mem_mib`, which one
    point scales linearly; `peak_mem_mib` alone for rows without `peak_total_mib`) against `memory_limit_mib`,
    and `steps_per_point` times the step time against `time_limit_s`.  A point is also skipped when a shorter
    one of the same `partitions` was skipped, or failed for memory (row `reason` "memory").
    """
    same = sorted(
        (r for r in rows if r["partitions"] == partitions and r["length"] < length), key=lambda r: r["length"]
    )
    measured = [r for r in same if _is_measured(r)]
    # "auto" rows change S with the length: their memory follows the budget, not a curve
    peak = (
        None
        if partitions == "auto"
        else extrapolate([(r["length"], r["peak_mem_mib"]) for r in measured], length)
    )
    total = peak
    if peak is not None and all("peak_total_mib" in r for r in measured):
        # the whole peak = the memory held before the step (runtime, model, features: scaled linearly from one
        # point) + the step's own (`peak`)
        rest = [(r["length"], r["peak_total_mib"] - r["peak_mem_mib"]) for r in measured]
        total = peak + extrapolate(rest, length, single_exponent=1.0)
    step = extrapolate([(r["length"], r["step_s"]) for r in measured], length)
    reason = None
    earlier = next((r for r in same if r.get("reason") in ("memory", "time")), None)
    if earlier is not None:
        reason = earlier["reason"]
        why = f"{'skipped' if earlier.get('skipped') else 'failed'} at {earlier['length']} tokens"
    elif memory_limit_mib is not None and total is not None and total > memory_limit_mib:
        reason, why = "memory", f"predicted peak {total:,.0f} MiB > limit {memory_limit_mib:,.0f} MiB"
    elif time_limit_s is not None and step is not None and step * steps_per_point > time_limit_s:
        reason = "time"
        why = f"predicted {steps_per_point} x {step:,.1f} s > limit {time_limit_s:,.0f} s"
    if reason is None:
        return None
    return {
        "length": length,
        "partitions": partitions,
        "skipped": True,
        "reason": reason,
        "why": why,
        "predicted_peak_mib": peak,
        "predicted_total_mib": total,
        "predicted_step_s": step,
    }


# ------------------------------------------------------------------------------- summaries (pure functions)


def partitions_for(series: int | str, length: int) -> int:
    """S of a fixed series (an int) or of a fixed segment length ("L/N": one segment per N tokens, rounded up).

    >>> partitions_for(8, 4096), partitions_for("L/1024", 20480), partitions_for("L/1024", 1500)
    (8, 20, 2)
    """
    if isinstance(series, str) and series.startswith("L/"):
        return max(1, -(-length // int(series[2:])))
    return int(series)


def series_order(rows: list[dict]) -> list[int | str]:
    """The S values of `rows`: the fixed ones ascending, then "auto"."""
    values = {r["partitions"] for r in rows}
    return sorted(v for v in values if not isinstance(v, str)) + sorted(
        v for v in values if isinstance(v, str)
    )


def memory_slopes(rows: list[dict]) -> dict[str, float]:
    """Least-squares slope of `peak_mem_mib` vs length per S (with >= 2 lengths), in MiB per 1,000 tokens."""
    out = {}
    for s in series_order(rows):
        pts = [(r["length"], r["peak_mem_mib"]) for r in rows if r["partitions"] == s and _is_measured(r)]
        if len({x for x, _ in pts}) < 2:
            continue
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[str(s)] = 1000.0 * slope
    return out


def _mib(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 10 else f"{v:.1f}"


def _sec(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:,.0f}"


def format_cell(row: dict | None) -> str:
    """A table cell: "MiB / s" ("... (S=k)" for "auto"), "(~N MiB, skipped)", "(~T s, skipped)", "failed"."""
    if row is None:
        return ""
    if row.get("skipped"):
        if row.get("reason") == "time" and row.get("predicted_step_s") is not None:
            return f"(~{_sec(row['predicted_step_s'])} s, skipped)"
        if row.get("predicted_peak_mib") is not None:
            return f"(~{_mib(row['predicted_peak_mib'])} MiB, skipped)"
        return "(skipped)"
    if "error" in row:
        return "failed"
    cell = f"{_mib(row['peak_mem_mib'])} / {_sec(row['step_s'])}"
    if isinstance(row["partitions"], str) and row.get("chosen_partitions") is not None:
        cell += f" (S={row['chosen_partitions']})"
    return cell


def markdown_table(rows: list[dict], budget: str | None = None) -> str:
    """Rows = lengths, columns = S (then "auto"), cells `format_cell`; the elements of the measured rows."""
    series = series_order(rows)
    lengths = sorted({r["length"] for r in rows})
    names = [f"auto ({budget})" if s == "auto" and budget else f"S = {s}" for s in series]
    lines = [
        "| tokens | elements | " + " | ".join(names) + " |",
        "|---:|---:|" + "---:|" * len(series),
    ]
    for length in lengths:
        at = {r["partitions"]: r for r in rows if r["length"] == length}
        elements = next((r["elements"] for r in at.values() if "elements" in r), None)
        cells = [f"{length:,}", "" if elements is None else f"{elements:,}"]
        cells += [format_cell(at.get(s)) for s in series]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- one point (child)


def _status_kib(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _lm_head_only_class():
    import torch

    class _LMHeadOnly(torch.nn.Module):
        """The part of a target a cached-feature training step uses: its config and `lm_head`."""

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)

        def get_input_embeddings(self):
            return self.embed_tokens

        def get_output_embeddings(self):
            return self.lm_head

    return _LMHeadOnly


def _memory_error(text: str) -> bool:
    text = text.lower()
    return "out of memory" in text or "memoryerror" in text or "cannot allocate memory" in text


def _measure(cfg: dict, length: int, partitions: int | str, queue) -> None:
    try:
        queue.put(measure_point(cfg, length, partitions))
    except Exception as exc:  # noqa: BLE001 - report any failure (e.g. out of memory) as a row
        error = f"{type(exc).__name__}: {exc}"[:300]
        row = {"length": length, "partitions": partitions, "error": error}
        if _memory_error(error):
            row["reason"] = "memory"
        queue.put(row)


def _setup(cfg: dict, length: int):
    """The target (its `lm_head` only), one example of `length` random tokens with cached random features, and
    a fresh head of the configured shape: `(device, target, example, head)`."""
    import torch
    from transformers import LlamaConfig

    from ..training import HeadArguments, build_head

    _LMHeadOnly = _lm_head_only_class()
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    hidden, vocab = cfg["hidden"], cfg["vocab"]
    tcfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=8,
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        head_dim=hidden // cfg["heads"],
        vocab_size=vocab,
        max_position_embeddings=cfg["max_positions"],
    )
    target = _LMHeadOnly(tcfg)  # features come from the "cache": only the target's lm_head rows are used
    dtype = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(length)
    prompt = min(64, length // 8)
    example = {
        "input_ids": torch.randint(0, cfg["draft_vocab"], (length,), generator=g).tolist(),
        "loss_mask": [0] * prompt + [1] * (length - prompt),
        "target_hidden_states": torch.randn(length, 3 * hidden, generator=g, dtype=torch.float32).to(dtype),
        "target_last_hidden": torch.randn(length, hidden, generator=g, dtype=torch.float32).to(dtype),
    }
    torch.manual_seed(0)
    head = build_head(
        target,
        [example],  # its ids lie below draft_vocab: the draft vocabulary is ids 0 .. draft_vocab-1
        HeadArguments(
            num_hidden_layers=cfg["layers"],
            draft_vocab_size=cfg["draft_vocab"],
            embed_from_target=cfg["frozen_embeddings"],
        ),
        num_parallel_positions=cfg["k"],
        max_position_embeddings=cfg["max_positions"],
        attn_implementation=cfg["attn"],
    ).to(device)
    return device, target, example, head


def _arguments(cfg: dict, device, length: int, **chooser):
    """The training arguments of one step at `length`, with `chooser` (`sequence_partitions` or
    `partition_memory_budget`)."""
    from ..training import training_arguments

    return training_arguments(
        os.path.join(cfg["out"], "tmp"),
        use_cpu=device.type == "cpu",
        progress=False,
        num_parallel_positions=cfg["k"],
        cod_ratio=cfg["cod_ratio"],
        cod_min_ratio=cfg["cod_min_ratio"],
        max_length=length,
        gradient_accumulation_steps=1,
        bf16=cfg["dtype"] == "bfloat16",
        optim="sgd",
        **chooser,
    )


def _memory_mark(device) -> int:
    """The memory held now (bytes; GPU: allocated, CPU: the RSS), with the peak mark reset to it."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    base = _status_kib("VmRSS") * 1024
    if not _reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs); CPU memory is not measurable")
    return base


def _memory_peak(device, base: int) -> tuple[int, int]:
    """`(the peak added above `base`, the whole peak)` in bytes since the last [`_memory_mark`]."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved()
    total = _status_kib("VmHWM") * 1024
    return total - base, total


def measure_point(cfg: dict, length: int, partitions: int | str) -> dict:
    """One (length, S) point in this process: a warm-up step (unless `cfg["warmup"]` is false), then
    `cfg["repeats"]` timed training steps; the row of their median step and planning times, the peak memory the
    steps add and the whole peak, the elements and the largest pass (S "auto": the S the trainer chose)."""
    import torch

    from ..training import PEagleDataCollator, PEagleTrainer

    device, target, example, head = _setup(cfg, length)
    if partitions == "auto":
        chooser = {"partition_memory_budget": cfg["budget"]}
    else:
        chooser = {"sequence_partitions": partitions_for(partitions, length)}
    try:
        args = _arguments(cfg, device, length, **chooser)
    except TypeError as exc:
        if partitions != "auto":
            raise
        return {
            "length": length,
            "partitions": "auto",
            "budget": cfg["budget"],
            "error": f"partition_memory_budget is not supported by this peagle ({exc})"[:300],
        }
    trainer = PEagleTrainer(
        model=head, target_model=target, args=args, train_dataset=[{"input_ids": [0, 1], "loss_mask": [0, 1]}]
    )
    model = trainer.model
    batch = PEagleDataCollator()([example])

    def step():
        t0 = time.perf_counter()
        plans = trainer.plan_batch(batch, step=0)
        t1 = time.perf_counter()
        inputs = dict(batch, peagle_plans=plans)
        loss = trainer.training_step(model, inputs, sum(p.num_supervised for p in plans))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, float(loss), plans[0]

    if cfg["warmup"]:
        step()  # warm-up (kernel selection, allocator pools, lazy buffers)
    base = _memory_mark(device)
    plan_times, step_times = [], []
    for _ in range(cfg["repeats"]):
        p, s, loss, plan = step()
        plan_times.append(p)
        step_times.append(s)
    peak, total = _memory_peak(device, base)
    row = {
        "length": length,
        "partitions": partitions,
        "elements": int(plan.anchor.numel()),
        "supervised": plan.num_supervised,
        "largest_pass": max(len(s) for s in plan.segments),
        "step_s": statistics.median(step_times),
        "plan_s": statistics.median(plan_times),
        "peak_mem_mib": peak / 2**20,
        "peak_total_mib": total / 2**20,
        "loss": loss,
    }
    if partitions == "auto":
        row["budget"] = cfg["budget"]
    if isinstance(partitions, str):
        row["chosen_partitions"] = len(plan.segments)
    try:  # what the trainer's memory model (partition_memory_budget) predicts for this partition
        from ..training.memory import StepMemoryModel

        row["model_mib"] = StepMemoryModel(trainer._head().config, online=False).step([plan]) / 2**20
    except ImportError:
        pass
    return row


def _probe_gpu(queue) -> None:
    import torch

    queue.put({"free": torch.cuda.mem_get_info()[0], "name": torch.cuda.get_device_name()})


def probe_gpu(ctx) -> dict:
    """The current GPU's free memory (bytes) and name, asked in a child process (this one keeps no CUDA
    context)."""
    q = ctx.Queue()
    proc = ctx.Process(target=_probe_gpu, args=(q,))
    proc.start()
    proc.join()
    return q.get(timeout=10)


def default_memory_limit_mib(device: str, gpu: dict | None = None) -> float:
    """80% of MemAvailable (CPU) or of the GPU's free memory (`gpu`, from `probe_gpu`), in MiB."""
    if device.startswith("cuda"):
        return 0.8 * gpu["free"] / 2**20
    return 0.8 * _meminfo_kib("MemAvailable") / 1024


def _meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/meminfo has no {field}")


def run_point(ctx, cfg: dict, length: int, partitions: int | str, rss_limit_mib: float | None) -> dict:
    """Measure one point in a fresh process; on CPU, kill it when its RSS passes `rss_limit_mib`."""
    q = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(cfg, length, partitions, q))
    proc.start()
    killed = None
    while proc.is_alive():
        proc.join(0.2)
        if rss_limit_mib is not None and proc.is_alive():
            try:
                rss = _status_kib("VmRSS", proc.pid) / 1024
            except (OSError, RuntimeError):
                continue
            if rss > rss_limit_mib:
                proc.kill()
                proc.join()
                killed = rss
    if killed is not None:
        return {
            "length": length,
            "partitions": partitions,
            "error": f"killed at {killed:,.0f} MiB RSS (over the memory limit {rss_limit_mib:,.0f} MiB)",
            "reason": "memory",
        }
    try:
        return q.get(timeout=10)
    except queue_module.Empty:
        row = {"length": length, "partitions": partitions, "error": f"exit {proc.exitcode}"}
        if proc.exitcode == -9:  # SIGKILL: most likely the OOM killer
            row["reason"] = "memory"
        return row


# ------------------------------------------------------------------------------------------------ outputs


def gradient_check(cfg: dict, length: int, partitions: list[int]) -> list[dict]:
    """One step's gradient with each S in `partitions` (the same head, example and COD draw), each against the
    first: ``||g_S - g_first|| / ||g_first||`` over every trainable parameter, with the step's seconds."""
    from ..training import PEagleDataCollator, PEagleTrainer

    device, target, example, head = _setup(cfg, length)
    batch = PEagleDataCollator()([example])
    rows, reference = [], None
    for s in partitions:
        args = _arguments(cfg, device, length, sequence_partitions=s)
        trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=[example])
        head.zero_grad(set_to_none=True)
        plans = trainer.plan_batch(batch, step=0)
        t0 = time.perf_counter()
        trainer.training_step(
            trainer.model, dict(batch, peagle_plans=plans), sum(p.num_supervised for p in plans)
        )
        seconds = time.perf_counter() - t0
        grads = {k: p.grad.detach().clone() for k, p in head.named_parameters() if p.grad is not None}
        reference = reference or (s, grads)
        ref = reference[1]
        num = sum(float(((grads[k] - ref[k]) ** 2).sum()) for k in ref) ** 0.5
        den = sum(float((ref[k] ** 2).sum()) for k in ref) ** 0.5
        rows.append(
            {
                "length": length,
                "partitions": s,
                "reference": reference[0],
                "relative_difference": num / den,
                "step_s": seconds,
            }
        )
        print(
            f"{length:>7} S={s:<3} against S={reference[0]:<3} relative difference {num / den:.3e}  {seconds:.1f} s"
        )
    return rows


def plot(rows: list[dict], path: str | os.PathLike, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .results import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    panels = ((axes[0], "peak_mem_mib", "predicted_peak_mib"), (axes[1], "step_s", "predicted_step_s"))
    labelled = []  # the axes with hollow markers
    for s in series_order(rows):
        mine = sorted((r for r in rows if r["partitions"] == s), key=lambda r: r["length"])
        pts = [r for r in mine if _is_measured(r)]
        budget = next((r["budget"] for r in mine if r.get("budget")), None)
        label = f"S={s}" if s != "auto" else f"auto ({budget})" if budget else "auto"
        color = None
        for ax, key, predicted in panels:
            (line,) = ax.plot(
                [r["length"] for r in pts], [r[key] for r in pts], marker="o", label=label, color=color
            )
            color = line.get_color()
            pred = [
                (r["length"], r[predicted]) for r in mine if r.get("skipped") and r.get(predicted) is not None
            ]
            if pred:
                ax.plot(
                    [x for x, _ in pred], [y for _, y in pred], linestyle="none", marker="o", markersize=9,
                    markerfacecolor="none", markeredgecolor=color,
                )  # fmt: skip
                labelled += [ax] if ax not in labelled else []
        for r in pts:
            if r.get("chosen_partitions") is not None:
                axes[0].annotate(
                    f"S={r['chosen_partitions']}", (r["length"], r["peak_mem_mib"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10),
                )  # fmt: skip
    for ax in labelled:  # one legend entry for the hollow markers of every S
        ax.plot([], [], linestyle="none", marker="o", markersize=9, markerfacecolor="none", color="gray",
                label="predicted, skipped")  # fmt: skip
    for ax, name in zip(axes, ("peak memory of a step (MiB)", "step time (s, median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # S = 1 grows quadratically: a linear axis flattens the other lines
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


__all__ = [
    "MIN_MAX_POSITIONS",
    "SHIPPED_HEAD",
    "SHIPPED_HEAD_CONFIG",
    "default_memory_limit_mib",
    "extrapolate",
    "format_cell",
    "gradient_check",
    "guard",
    "markdown_table",
    "measure_point",
    "memory_slopes",
    "model_shape",
    "partitions_for",
    "plot",
    "probe_gpu",
    "read_head_config",
    "run_point",
    "series_order",
]
