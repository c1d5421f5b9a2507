"""Benchmark sequence partitioning: peak memory and step time of one P-EAGLE training step vs sequence length.

Each (length, partitions) point runs in a fresh process: one warm-up step, then `--repeats` timed steps of
`PEagleTrainer.training_step` (forward + backward of every segment) on one example of that length, with target
features supplied as a cache (so only the drafter's cost is measured).  Reported: the median step time, the time
to plan the step (COD + partition, CPU), the peak memory the steps add above the memory held before them
(GPU: `max_memory_allocated`; CPU: the process's peak RSS, reset after the warm-up, with glibc returning freed
blocks to the OS), the number of training elements and the size of the largest pass.

Writes `<out>/bench_partition.json` and `<out>/bench_partition.png`.

Examples:
    # CPU, the width of SmolLM2-135M (576), a 1-layer drafter
    python benchmarks/bench_partition.py --lengths 512,1024,2048,4096 --partitions 1,2,4,8
    # GPU, paper-like lengths
    python benchmarks/bench_partition.py --lengths 1024,2048,4096,8192,16384 --partitions 1,2,4,8 --layers 2
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


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


def _measure(cfg: dict, length: int, partitions: int, queue) -> None:
    try:
        queue.put(_measure_inner(cfg, length, partitions))
    except Exception as exc:  # noqa: BLE001 - report any failure (e.g. out of memory) as a row
        queue.put({"length": length, "partitions": partitions, "error": f"{type(exc).__name__}: {exc}"[:300]})


def _measure_inner(cfg: dict, length: int, partitions: int) -> dict:
    import torch
    from transformers import LlamaConfig

    from peagle.training import PEagleDataCollator, PEagleTrainer, build_head, training_arguments

    _LMHeadOnly = _lm_head_only_class()
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    hidden, vocab = cfg["hidden"], cfg["vocab"]
    heads = max(1, hidden // 64)
    tcfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=8,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        vocab_size=vocab,
        max_position_embeddings=max(2 * length, 8192),
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
        num_hidden_layers=cfg["layers"],
        draft_vocab_size=cfg["draft_vocab"],
        num_parallel_positions=cfg["k"],
        max_position_embeddings=max(2 * length, 8192),
        embed_from_target=cfg["frozen_embeddings"],
        attn_implementation=cfg["attn"],
    ).to(device)
    args = training_arguments(
        os.path.join(cfg["out"], "tmp"),
        use_cpu=device.type == "cpu",
        sequence_partitions=partitions,
        num_parallel_positions=cfg["k"],
        cod_ratio=cfg["cod_ratio"],
        cod_min_ratio=cfg["cod_min_ratio"],
        max_length=length,
        gradient_accumulation_steps=1,
        bf16=cfg["dtype"] == "bfloat16",
        optim="sgd",
    )
    trainer = PEagleTrainer(
        model=head, target_model=target, args=args, train_dataset=[{"input_ids": [0], "loss_mask": [0]}]
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

    step()  # warm-up (kernel selection, allocator pools, lazy buffers)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status_kib("VmRSS") * 1024
        if not _reset_peak_rss():
            raise RuntimeError(
                "cannot reset the peak RSS (/proc/self/clear_refs); CPU memory is not measurable"
            )
    plan_times, step_times = [], []
    for _ in range(cfg["repeats"]):
        p, s, loss, plan = step()
        plan_times.append(p)
        step_times.append(s)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_kib("VmHWM") * 1024 - base
    return {
        "length": length,
        "partitions": partitions,
        "elements": int(plan.anchor.numel()),
        "supervised": plan.num_supervised,
        "largest_pass": max(len(s) for s in plan.segments),
        "step_s": statistics.median(step_times),
        "plan_s": statistics.median(plan_times),
        "peak_mem_mib": peak / 2**20,
        "loss": loss,
    }


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s in sorted({r["partitions"] for r in rows}):
        pts = sorted(
            (r for r in rows if r["partitions"] == s and "error" not in r), key=lambda r: r["length"]
        )
        if not pts:
            continue
        xs = [r["length"] for r in pts]
        axes[0].plot(xs, [r["peak_mem_mib"] for r in pts], marker="o", label=f"S={s}")
        axes[1].plot(xs, [r["step_s"] for r in pts], marker="o", label=f"S={s}")
    for ax, name in zip(axes, ("peak memory of a step (MiB)", "step time (s, median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--partitions", default="1,2,4,8")
    ap.add_argument("--hidden", type=int, default=576, help="drafter/target width (SmolLM2-135M: 576)")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=1, help="drafter layers")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--num-parallel-positions", type=int, default=8, help="K_train")
    ap.add_argument("--cod-ratio", type=float, default=0.7)
    ap.add_argument("--cod-min-ratio", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on GPU, fp32 on CPU"
    )
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flex_attention"])
    ap.add_argument(
        "--frozen-embeddings",
        action="store_true",
        help="embed_from_target heads (no embedding-table gradient)",
    )
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--out", default="bench_partition")
    args = ap.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {
        "device": device,
        "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "vocab": args.vocab,
        "draft_vocab": args.draft_vocab,
        "k": args.num_parallel_positions,
        "cod_ratio": args.cod_ratio,
        "cod_min_ratio": args.cod_min_ratio,
        "repeats": args.repeats,
        "attn": args.attn,
        "threads": args.threads,
        "frozen_embeddings": args.frozen_embeddings,
        "out": args.out,
    }
    os.makedirs(args.out, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    parts = [int(x) for x in args.partitions.split(",")]
    # glibc: serve every allocation above 64 KiB by mmap, so freed tensors leave the RSS and the peak RSS of a
    # step measures its live memory (the child processes inherit this at start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    rows = []
    header = (
        f"{'length':>7} {'S':>3} {'elements':>9} {'largest':>8} {'step s':>8} {'plan s':>7} {'peak MiB':>9}"
    )
    print(header)
    for length in lengths:
        for s in parts:
            queue = ctx.Queue()
            proc = ctx.Process(target=_measure, args=(cfg, length, s, queue))
            proc.start()
            proc.join()
            row = (
                queue.get()
                if not queue.empty()
                else {"length": length, "partitions": s, "error": f"exit {proc.exitcode}"}
            )
            rows.append(row)
            if "error" in row:
                print(f"{length:>7} {s:>3}  failed: {row['error']}")
            else:
                print(
                    f"{length:>7} {s:>3} {row['elements']:>9} {row['largest_pass']:>8} {row['step_s']:>8.3f} "
                    f"{row['plan_s']:>7.3f} {row['peak_mem_mib']:>9.1f}"
                )
    meta = {
        "config": cfg,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "memory_measure": "max_memory_allocated growth"
        if device == "cuda"
        else "peak RSS growth of the process",
    }
    with open(os.path.join(args.out, "bench_partition.json"), "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=2)
    title = (
        f"P-EAGLE training step, {device} {cfg['dtype']}, width {args.hidden}, {args.layers} layer(s), "
        f"K_train={args.num_parallel_positions}, COD r={args.cod_ratio}/{args.cod_min_ratio}, draft vocab {args.draft_vocab}"
        + (", frozen embeddings" if args.frozen_embeddings else "")
    )
    plot(rows, os.path.join(args.out, "bench_partition.png"), title)
    print(f"wrote {args.out}/bench_partition.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
