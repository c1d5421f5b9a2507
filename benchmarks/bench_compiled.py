"""Compiled against eager decoding on a static cache (issue #78): plain greedy and peagle side by side, by batch size.

For each batch size of `--batch_sizes`, `--prompts` batches of held-out prompts (`--examples` after `--skip`; all
left-padded to one width, so every batch has the same shapes) decode `--max_new_tokens` tokens on a static cache
(`cache_implementation="static"`, one `max_cache_len` for every call: the widest prompt, the new tokens and room
for the widest verify pass) four ways:

- eager plain: `generate()` with `disable_compile=True` (transformers would otherwise compile its decode steps on
  its own on CUDA);
- compiled plain: the same with the target's forward compiled, `torch.compile(forward, dynamic=False)` (`--mode`:
  torch.compile's mode; "default" has no CUDA graphs, transformers' own decode-step compile uses "reduce-overhead");
- eager peagle: the shipped head, a fixed rule (`assistant_confidence_threshold=0.0`: every round verifies K drafts,
  or the full tree with `--tree_size`), and `verify_widths="fixed"`, so every verify pass is 1, K + 1 or the tree
  budget + 1 wide (docs/DESIGN.md section 10.2);
- compiled peagle: the same on the compiled forward (the head runs eager).

Every variant first decodes each batch `--warmup` times untimed (the compiled ones compile every shape then), then
`--repeats` timed rounds over all batches (the median round). Reported per batch size and variant: seconds, new
tokens per second and speed over eager plain; for the compiled ones, the graphs dynamo compiled during the timed
rounds (`torch._dynamo` counters: 0 means nothing recompiled after the warm-up); for peagle, tokens per target
pass; and whether each output equals eager plain's (peagle eager must: exit status 1 otherwise) and, for compiled
peagle, compiled plain's (fused kernels round differently from eager ones, so near-ties may flip between the two).

Writes `<out>/compiled.json` and `<out>/compiled.png` (new tokens per second by variant and batch size).

Examples:
    # the measurement (a GPU; a fresh machine, nothing else running)
    python benchmarks/bench_compiled.py --batch_sizes 1,8 --max_new_tokens 128 --prompts 4 --out results/compiled
    # a quick end-to-end check (CPU; numbers mean nothing, compiling takes a few minutes)
    OMP_NUM_THREADS=1 python benchmarks/bench_compiled.py --batch_sizes 1,2 --max_new_tokens 8 --prompts 2 \\
        --warmup 1 --repeats 1 --device cpu --out /tmp/compiled
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

import peagle
from peagle.data.shards import load_examples
from peagle.evaluation.bench_batch import left_pad
from peagle.evaluation.long_inputs import prompt_part
from peagle.evaluation.results import save_figure, write_json_and_plot
from peagle.evaluation.timing import machine_description

VARIANTS = ("eager_plain", "compiled_plain", "eager_peagle", "compiled_peagle")


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def new_tokens(out: torch.Tensor, prompt: int, eos: set[int]) -> int:
    """New tokens of a batch's output: each row's, up to and including its first EOS."""
    total = 0
    for row in out[:, prompt:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        total += ends[0] + 1 if ends else len(row)
    return total


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(VARIANTS)
    for i, name in enumerate(VARIANTS):
        xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r[name]["tokens_per_second"] for r in rows], width, label=name.replace("_", " "))
    ax.set_xticks(range(len(rows)), [f"B = {r['batch_size']}" for r in rows])
    ax.set_ylabel("new tokens per second")
    ax.set_title("static cache: eager and compiled, plain and peagle", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_sizes", default="1,8")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4, help="batches per batch size")
    parser.add_argument("--tree_size", type=int, default=0, help="peagle's tree nodes per round (0: chains)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--mode", default="default", help="torch.compile mode (e.g. reduce-overhead)")
    parser.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    parser.add_argument(
        "--skip", type=int, default=48, help="held-out examples to skip (those calibrated on)"
    )
    parser.add_argument("--out", default="results/compiled")
    args = parser.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    target, tok = peagle.load_default_target(getattr(torch, args.dtype), device)
    head = peagle.load_default_drafter(target)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = set(torch.tensor(target.generation_config.eos_token_id).reshape(-1).tolist())
    k = head.config.num_speculative_tokens
    widest = max(k, args.tree_size) + 1
    examples = load_examples(args.examples)[args.skip :]
    need = args.prompts * max(sizes)
    if len(examples) < need:
        raise SystemExit(f"need {need} held-out prompts, found {len(examples)}")
    prompts = [torch.tensor(prompt_part(e)) for e in examples[:need]]
    width = max(len(p) for p in prompts)  # every batch left-padded to it: one prefill shape per batch size
    common = dict(
        max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad, disable_compile=True,
        cache_implementation="static", max_cache_len=width + args.max_new_tokens - 1 + widest,
    )  # fmt: skip
    drafting = dict(
        assistant_model=head, assistant_confidence_threshold=0.0, draft_tree_size=args.tree_size,
        verify_widths="fixed",
    )  # fmt: skip
    eager_forward = target.forward
    compiled_forward = torch.compile(eager_forward, dynamic=False, mode=args.mode)
    torch._dynamo.config.recompile_limit = 256  # B sizes x (plain, peagle) x widths: more than the default 8
    torch._dynamo.config.accumulated_recompile_limit = 4096

    def call(variant: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        target.forward = compiled_forward if variant.startswith("compiled") else eager_forward
        try:
            extra = drafting if variant.endswith("peagle") else {}
            return target.generate(ids, attention_mask=mask, **common, **extra)
        finally:
            target.forward = eager_forward

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows, lossless = [], True
    for batch in sizes:
        batches = []
        for i in range(args.prompts):
            ids, mask = left_pad(prompts[i * batch : (i + 1) * batch], pad)
            lead = width - ids.shape[1]
            ids = torch.cat([ids.new_full((batch, lead), pad), ids], dim=1).to(device)
            mask = torch.cat([mask.new_zeros(batch, lead), mask], dim=1).to(device)
            batches.append((ids, mask))
        row: dict = {"batch_size": batch, "prompt_width": width}
        outputs: dict[str, list[torch.Tensor]] = {}
        for variant in VARIANTS:
            warm = time.perf_counter()
            graphs = graphs_compiled()
            for _ in range(args.warmup):
                outputs[variant] = [call(variant, ids, mask) for ids, mask in batches]
            warm_seconds, warm_graphs = time.perf_counter() - warm, graphs_compiled() - graphs
            graphs, seconds, passes = graphs_compiled(), [], []
            for _ in range(args.repeats):
                sync()
                tic = time.perf_counter()
                outputs[variant] = [call(variant, ids, mask) for ids, mask in batches]
                sync()
                seconds.append(time.perf_counter() - tic)
                if variant.endswith("peagle"):
                    passes.append(head.last_generation_stats.tokens_per_target_pass)
            tokens = sum(new_tokens(out, width, eos) for out in outputs[variant])
            median = statistics.median(seconds)
            row[variant] = {
                "seconds": median,
                "new_tokens": tokens,
                "tokens_per_second": tokens / median,
                "warmup_seconds": warm_seconds,
                "graphs_compiled_in_warmup": warm_graphs,
                "graphs_compiled_while_timed": graphs_compiled() - graphs,
            }
            if passes:
                row[variant]["tokens_per_target_pass"] = statistics.median(passes)
        reference = outputs["eager_plain"]
        for variant in VARIANTS:
            same = all(torch.equal(a, b) for a, b in zip(outputs[variant], reference))
            row[variant]["same_as_eager_plain"] = same
            row[variant]["speedup_over_eager_plain"] = row["eager_plain"]["seconds"] / row[variant]["seconds"]
        row["compiled_peagle"]["same_as_compiled_plain"] = all(
            torch.equal(a, b) for a, b in zip(outputs["compiled_peagle"], outputs["compiled_plain"])
        )
        lossless &= row["eager_peagle"]["same_as_eager_plain"]
        rows.append(row)
        print(
            f"B={batch}: "
            + "; ".join(
                f"{v.replace('_', ' ')} {row[v]['tokens_per_second']:.1f} tok/s "
                f"({row[v]['speedup_over_eager_plain']:.2f}x, recompiled {row[v]['graphs_compiled_while_timed']}, "
                f"same {row[v]['same_as_eager_plain']})"
                for v in VARIANTS
            ),
            flush=True,
        )
    results = {
        "benchmark": "compiled",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "settings": {**vars(args), "num_speculative_tokens": k, "max_cache_len": common["max_cache_len"]},
        "summary": rows,
    }
    json_path, png_path = write_json_and_plot(results, args.out, "compiled", plot)
    print(f"written to {json_path} and {png_path}")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
