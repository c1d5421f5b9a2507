"""FP8 vs bf16 drafter heads on the default target: drafter latency per round and acceptance.

1. Latency: one drafting round, `head.draft()` = ONE drafter forward over the new real slots plus K-1 parallel
   slots, against a drafter KV cache of `--context` slots (cropped back after every call), for K = 1..10.
   CUDA events around each call, median (and p10/p90) over `--repeats` after `--warmup` calls.
2. Acceptance: `target.generate(ids, assistant_model=head)` with the bf16 head and each FP8 head on the first
   `--prompts` MT-Bench and HumanEval prompts, K = `--accept-k`.  Two acceptance lengths are reported:
   `tau` = new tokens / target forward passes (peagle.evaluation.bench's definition, prefill included) and
   `tau_rounds` = (accepted drafts + rounds) / rounds (peagle's generation stats).  Every run is compared
   with plain greedy decoding (`matches_greedy`); use a float32 target (the default) for a bit-exact check.

Writes `bench_fp8.json` and `bench_fp8.png` into `--out`, prints Markdown tables.

    python benchmarks/bench_fp8.py --out results/fp8                       # GPU, compute capability >= 8.9
    python benchmarks/bench_fp8.py --device cpu --fallback --random-head \\
        --ks 1,4 --repeats 3 --warmup 1 --prompts 1 --max-new-tokens 16 --out /tmp/fp8-smoke   # CPU smoke run

Without a shipped default head yet, pass `--head PATH` (a trained head) or `--random-head` (latency only: a
random head's acceptance means nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

import peagle
from peagle import fp8
from peagle.data.evalsets import chat_prompt_tensor, load_humaneval, load_mtbench
from peagle.evaluation.timing import machine_description, timed_generate
from peagle.targets import default_drafter_path, load_default_target

ACCEPTANCE_DROP_LIMIT = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default; needs compute capability >= 8.9) or cpu")
    p.add_argument(
        "--fallback",
        nargs="?",
        const="emulate",
        default=None,
        choices=fp8.FALLBACKS,
        help="allow a device without FP8 matmuls (smoke runs): FP8 layers emulate (default) or dequantize",
    )
    p.add_argument("--head", default=None, help="head folder (default: the head shipped with peagle)")
    p.add_argument(
        "--random-head", action="store_true", help="random head for the default target (latency only)"
    )
    p.add_argument("--granularities", default="row,block", help="FP8 variants to compare with bf16")
    p.add_argument("--block-size", default="128,128", help="tile of block granularity, rows,cols")
    p.add_argument("--include-lm-head", action="store_true", help="quantize lm_head too")
    p.add_argument(
        "--head-dtype", default="bfloat16", help="dtype of the baseline head and of FP8 activations"
    )
    p.add_argument(
        "--target-dtype", default="float32", help="dtype of the target (float32: exact verification)"
    )
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8,9,10", help="draft lengths K for the latency sweep")
    p.add_argument("--context", type=int, default=512, help="drafter cache length before each timed round")
    p.add_argument(
        "--new-slots", type=int, default=1, help="real slots appended per round (accepted + bonus)"
    )
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--datasets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=3, help="prompts per dataset for acceptance")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--accept-k", type=int, default=7, help="K for the acceptance runs")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-acceptance", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_fp8_results")
    return p.parse_args(argv)


def check_device(args: argparse.Namespace) -> torch.device:
    """Refuse devices without FP8 matmuls unless `--fallback` was given (then say what the numbers mean)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"bench_fp8: --device {args.device} but CUDA is not available (torch {torch.__version__}). "
            "Run on a GPU with compute capability >= 8.9, or smoke-test with --device cpu --fallback."
        )
    ok, why = fp8.fp8_device_support(device)
    if not ok and args.fallback is None:
        raise SystemExit(
            f"bench_fp8: FP8 matmuls are not available on {device}: {why}. This benchmark measures FP8 kernels "
            "on an NVIDIA GPU with compute capability >= 8.9 (H100 = 9.0, B200 = 10.0). For a smoke run on "
            "this machine pass --device cpu --fallback (FP8 layers emulated; latencies are not FP8 numbers)."
        )
    if not ok:
        print(
            f"bench_fp8: {why}; FP8 layers use fallback={args.fallback!r}, so FP8 latencies are not FP8 numbers"
        )
    return device


def load_head(args: argparse.Namespace, target, device: torch.device, dtype: torch.dtype):
    if args.head is not None:
        head = peagle.PEagleDrafter.from_pretrained(args.head, dtype=dtype)
        source = str(args.head)
    else:
        try:
            path = default_drafter_path("peagle")
            head = peagle.PEagleDrafter.from_pretrained(path, dtype=dtype)
            source = str(path)
        except FileNotFoundError as err:
            if not args.random_head:
                raise SystemExit(
                    f"bench_fp8: {err} Pass --head PATH, or --random-head for latency only."
                ) from None
            torch.manual_seed(args.seed)
            head = peagle.PEagleDrafter(peagle.PEagleConfig.for_target(target.config)).to(dtype)
            source = "random (PEagleConfig.for_target(default target))"
    if fp8.fp8_modules(head):
        raise SystemExit(f"bench_fp8: {source} is already FP8; pass the bf16 head, the script quantizes it.")
    return head.attach_target(target).to(device).eval(), source


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def draft_latency(head, device: torch.device, k: int, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of one `head.draft()` round with `args.context` cached slots (median, p10, p90)."""
    gen = torch.Generator().manual_seed(args.seed)
    width = 3 * head.config.target_hidden_size
    dtype = head.mask_hidden.dtype
    vocab = head.config.vocab_size - 1  # keep clear of the mask token
    ctx_ids = torch.randint(0, vocab, (1, args.context), generator=gen).to(device)
    ctx_feats = torch.randn(1, args.context, width, generator=gen).to(device, dtype)
    new_ids = torch.randint(0, vocab, (1, args.new_slots), generator=gen).to(device)
    new_feats = torch.randn(1, args.new_slots, width, generator=gen).to(device, dtype)
    cache = DynamicCache(config=head.config)
    head(ctx_ids, target_hidden_states=ctx_feats, cache=cache, use_cache=True)
    added = args.new_slots + k - 1
    times = []
    for i in range(args.warmup + args.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            head.draft(
                new_ids,
                new_feats,
                num_speculative_tokens=k,
                cache=cache,
                start_position=args.context,
            )
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            head.draft(
                new_ids,
                new_feats,
                num_speculative_tokens=k,
                cache=cache,
                start_position=args.context,
            )
            ms = 1e3 * (time.perf_counter() - t0)
        cache.crop(-added)
        if cache.get_seq_length() != args.context:
            raise RuntimeError(
                f"drafter cache has {cache.get_seq_length()} slots after crop; expected {args.context}"
            )
        if i >= args.warmup:
            times.append(ms)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_ms": statistics.median(times), "p10_ms": q[0], "p90_ms": q[-1], "repeats": len(times)}


def acceptance(target, tokenizer, heads: dict[str, Any], device: torch.device, args: argparse.Namespace):
    loaders = {"mtbench": load_mtbench, "humaneval": load_humaneval}
    runs = []
    for dataset in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        if dataset not in loaders:
            raise SystemExit(f"bench_fp8: unknown dataset {dataset!r}; expected some of {sorted(loaders)}")
        for idx, text in enumerate(loaders[dataset](args.prompts)):
            ids = chat_prompt_tensor(tokenizer, text).to(device)
            greedy = timed_generate(target, ids, args.max_new_tokens)
            outputs = {}
            for name, head in heads.items():
                r = timed_generate(
                    target,
                    ids,
                    args.max_new_tokens,
                    assistant=head,
                    num_assistant_tokens=args.accept_k,
                    assistant_confidence_threshold=0.0,  # K drafts every round: acceptance only
                    num_assistant_tokens_schedule="constant",
                )
                stats = head.last_generation_stats
                outputs[name] = r.output
                runs.append(
                    {
                        "dataset": dataset,
                        "prompt": idx,
                        "variant": name,
                        "new_tokens": r.new_tokens,
                        "target_calls": r.target_calls,
                        "rounds": stats.rounds if stats else None,
                        "accepted_tokens": stats.accepted_tokens if stats else None,
                        "seconds": r.seconds,
                        "drafter_seconds": r.drafter_seconds,
                        "matches_greedy": r.output == greedy.output,
                    }
                )
            for row in runs[-len(heads) :]:
                row["matches_first_variant"] = outputs[row["variant"]] == outputs[next(iter(heads))]
    return runs, summarize_acceptance(runs, next(iter(heads)))


def summarize_acceptance(runs: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["variant"]), []).append(r)
    out = []
    for (dataset, variant), rs in groups.items():
        rounds = sum(r["rounds"] or 0 for r in rs)
        out.append(
            {
                "dataset": dataset,
                "variant": variant,
                "prompts": len(rs),
                "tau": sum(r["new_tokens"] for r in rs) / max(1, sum(r["target_calls"] for r in rs)),
                "tau_rounds": (sum(r["accepted_tokens"] or 0 for r in rs) + rounds) / rounds
                if rounds
                else 0.0,
                "matches_greedy": all(r["matches_greedy"] for r in rs),
                "same_output_as_baseline": all(r["matches_first_variant"] for r in rs),
            }
        )
    base = {s["dataset"]: s["tau_rounds"] for s in out if s["variant"] == baseline}
    for s in out:
        b = base.get(s["dataset"])
        s["tau_drop_vs_baseline"] = 1 - s["tau_rounds"] / b if b else None
        s["within_2pct"] = (
            s["tau_drop_vs_baseline"] is not None and s["tau_drop_vs_baseline"] <= ACCEPTANCE_DROP_LIMIT
        )
    return out


def latency_table(rows: list[dict[str, Any]], variants: list[str]) -> str:
    lines = [
        "| K | "
        + " | ".join(f"{v} ms" for v in variants)
        + " | "
        + " | ".join(f"{v} / {variants[0]}" for v in variants[1:])
        + " |"
    ]
    lines.append("|" + "---|" * (1 + 2 * len(variants) - 1))
    by = {(r["variant"], r["k"]): r["median_ms"] for r in rows}
    for k in sorted({r["k"] for r in rows}):
        base = by[(variants[0], k)]
        cells = [f"{by[(v, k)]:.3f}" for v in variants] + [f"{by[(v, k)] / base:.2f}x" for v in variants[1:]]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def acceptance_table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| set | variant | prompts | tau | tau (rounds) | drop vs baseline | = greedy | = baseline |",
        "|" + "---|" * 8,
    ]
    for s in summary:
        drop = f"{100 * s['tau_drop_vs_baseline']:.1f}%" if s["tau_drop_vs_baseline"] is not None else "-"
        lines.append(
            f"| {s['dataset']} | {s['variant']} | {s['prompts']} | {s['tau']:.2f} | {s['tau_rounds']:.2f} | {drop} | "
            f"{'yes' if s['matches_greedy'] else 'NO'} | {'yes' if s['same_output_as_baseline'] else 'no'} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_fp8: matplotlib missing, no PNG (pip install 'peagle[bench]')")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = results.get("latency") or []
    for v in results["variants"]:
        pts = sorted((r["k"], r["median_ms"]) for r in rows if r["variant"] == v)
        if pts:
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
    axes[0].set_title(
        f"drafter round latency, context {results['config']['context']} ({results['device_label']})"
    )
    axes[0].set_xlabel("K (draft tokens per round)")
    axes[0].set_ylabel("ms (median)")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    summary = (results.get("acceptance") or {}).get("summary") or []
    datasets = sorted({s["dataset"] for s in summary})
    variants = list(results["variants"])
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        vals = [
            next((s["tau_rounds"] for s in summary if s["dataset"] == d and s["variant"] == v), 0.0)
            for d in datasets
        ]
        axes[1].bar([j + i * width for j in range(len(datasets))], vals, width=width, label=v)
    axes[1].set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(datasets))], datasets)
    axes[1].set_title(f"acceptance length (rounds), K={results['config']['accept_k']}")
    axes[1].grid(alpha=0.3, axis="y")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = check_device(args)
    head_dtype, target_dtype = getattr(torch, args.head_dtype), getattr(torch, args.target_dtype)
    block = tuple(int(b) for b in args.block_size.split(","))
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    torch.manual_seed(args.seed)

    target, tokenizer = load_default_target(dtype=target_dtype, device=device)
    head, source = load_head(args, target, device, head_dtype)
    baseline = str(head_dtype).removeprefix("torch.")
    heads: dict[str, Any] = {baseline: head}
    for g in [g.strip() for g in args.granularities.split(",") if g.strip()]:
        q = fp8.quantize_head(
            copy.deepcopy(head), g, block, include_lm_head=args.include_lm_head, fallback=args.fallback
        )
        heads[f"fp8-{g}"] = q
    variants = {name: fp8.fp8_summary(h, device) for name, h in heads.items()}
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    results: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_description(),
        "device_label": label,
        "fp8": fp8.fp8_kernel_info(device),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "head": source,
        "config": vars(args),
        "variants": variants,
    }
    if not args.skip_latency:
        rows = []
        for k in ks:
            for name, h in heads.items():
                rows.append({"variant": name, "k": k, **draft_latency(h, device, k, args)})
        results["latency"] = rows
        print(
            f"\nDrafter round latency ({label}, context {args.context}, {args.new_slots} new real slot(s)):\n"
        )
        print(latency_table(rows, list(heads)))
    if not args.skip_acceptance:
        runs, summary = acceptance(target, tokenizer, heads, device, args)
        results["acceptance"] = {"runs": runs, "summary": summary}
        print(
            f"\nAcceptance ({label}, K={args.accept_k}, {args.max_new_tokens} new tokens, head: {source}):\n"
        )
        print(acceptance_table(summary))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "bench_fp8.json"
    js.write_text(json.dumps(results, indent=2, default=str))
    png = plot(results, out / "bench_fp8.png")
    print(f"\nwrote {js}" + (f" and {png}" if png else ""))
    summary = (results.get("acceptance") or {}).get("summary") or []
    if any(not s["matches_greedy"] for s in summary):
        print("WARNING: some speculative outputs differ from plain greedy (see matches_greedy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
