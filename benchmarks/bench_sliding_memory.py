"""Peak KV-cache memory of sliding-window targets: `generate()` with a P-EAGLE head against plain `generate()`
(issue #80).

Tiny random targets shaped like the seeds' sliding-window families, with a long position range: a Gemma-3-like one
(6 layers, 5 of them sliding), a GPT-OSS-like one (4 layers, sliding and full alternating) and the same alternating
layout on a Qwen-3 config, all with a `--window`-token window. GPT-OSS runs eager attention only (its attention
sinks), whose score matrices outgrow this machine's memory past 8K tokens, so it stops at `--eager-max` tokens and
the Qwen-3 one carries its layout (what the cache holds) through SDPA to the longest context. Each gets a random prompt of every `--contexts` length and `--max-new-tokens` greedy
tokens, from plain `generate()`, from the head drafting K = 7 chains every round, and from the head verifying
`--tree-size`-node trees every round. A hook on the target counts, after every target pass, the bytes of keys and
values its cache holds (`peagle.evaluation.cache_memory.CachePeak`: a count, not a timing); the table shows the
peak over the call, the most slots a sliding layer held, and the ratio to plain's peak. Every output is checked
against plain's. The head is random (its drafts are rejected), so each round verifies its full chain or tree and
keeps one token: the most slots a round adds. It drafts through a 128-slot window; its own cache is not counted.

Writes `<out>/sliding_memory.json` and `<out>/sliding_memory.png` (peak bytes against context). Exit status 1 when
an output differed from plain or a ratio is above `--goal` (1.2x).

Example (the table in docs/benchmarks.md section 21; about ten minutes on one core, 12 GB of memory at 32K):
    python benchmarks/bench_sliding_memory.py --contexts 2048,8192,32768 --out docs/results/sliding_memory
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import transformers

import peagle
from peagle.evaluation.cache_memory import CachePeak

COMMON = dict(
    vocab_size=128, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


LABELS = {
    "gemma3": "Gemma-3-like, 5 of 6 layers sliding",
    "gpt_oss": "GPT-OSS-like, 2 of 4",
    "alternating": "GPT-OSS layout on Qwen-3, 2 of 4",
}


def target_config(family: str, window: int, positions: int):
    """A tiny target of `family` ("gemma3", "gpt_oss", "alternating") with a `window`-token window and `positions` positions."""
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=window,
            max_position_embeddings=positions, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )  # fmt: skip
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **COMMON, num_hidden_layers=4, num_local_experts=2, num_experts_per_tok=1, sliding_window=window,
            max_position_embeddings=positions, rope_parameters={"rope_type": "default", "rope_theta": 150_000.0},
        )  # fmt: skip
    if family == "alternating":
        return transformers.Qwen3Config(
            **COMMON, num_hidden_layers=4, sliding_window=window, use_sliding_window=True,
            max_position_embeddings=positions, layer_types=["sliding_attention", "full_attention"] * 2,
        )  # fmt: skip
    raise ValueError(f"family {family!r}: expected 'gemma3', 'gpt_oss' or 'alternating'")


def measure(target, head, ids: torch.LongTensor, new: int, **drafting) -> tuple[CachePeak, torch.LongTensor]:
    kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new)
    with CachePeak(target) as peak:
        out = target.generate(
            ids, **kw, **({"assistant_model": head, **drafting} if head is not None else {})
        )
    return peak, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--families", default="gemma3,gpt_oss,alternating")
    parser.add_argument("--eager-max", type=int, default=8192, help="longest context of an eager-only target")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tree-size", type=int, default=16)
    parser.add_argument("--goal", type=float, default=1.2, help="the most peak memory over plain's allowed")
    parser.add_argument("--out", default="bench_results/sliding_memory")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    positions = max(40_960, max(contexts) + args.max_new_tokens + 64)
    methods = {
        "chains K=7": dict(draft_tree_size=0),
        f"trees {args.tree_size}": dict(draft_tree_size=args.tree_size),
    }
    records = []
    print("| target | context | method | peak cache | sliding layer slots | x plain | = plain |")
    print("|---|---:|---|---:|---:|---:|---|")
    for family in args.families.split(","):
        torch.manual_seed(0)
        config = target_config(family, args.window, positions)
        attn = "eager" if family == "gpt_oss" else "sdpa"
        target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        torch.manual_seed(1)
        head_config = peagle.PEagleConfig.for_target(
            target, num_hidden_layers=1, mask_token_id=127, confidence_threshold=0.0, drafter_window=128
        )
        head = peagle.PEagleDrafter(head_config).eval()
        for context in [c for c in contexts if attn == "sdpa" or c <= args.eager_max]:
            ids = torch.randint(3, 127, (1, context), generator=torch.Generator().manual_seed(context))
            plain, reference = measure(target, None, ids, args.max_new_tokens)
            rows = [("plain generate()", plain, True)]
            for name, drafting in methods.items():
                peak, out = measure(target, head, ids, args.max_new_tokens, **drafting)
                rows.append((name, peak, bool(torch.equal(out, reference))))
            for name, peak, same in rows:
                ratio = peak.bytes / plain.bytes
                record = dict(
                    family=family, context=context, method=name, peak_bytes=peak.bytes, ratio=ratio,
                    sliding_slots=peak.sliding_slots, full_slots=peak.full_slots, passes=peak.passes,
                    equals_plain=same,
                )  # fmt: skip
                records.append(record)
                print(
                    f"| {LABELS[family]} | {context:,} | {name} | {peak.bytes / 2**20:.2f} MiB | "
                    f"{peak.sliding_slots} | {ratio:.2f}x | {'yes' if same else 'NO'} |",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(
        command=" ".join(["python", "benchmarks/bench_sliding_memory.py", *(argv or sys.argv[1:])]),
        date=datetime.date.today().isoformat(),
        window=args.window,
        max_new_tokens=args.max_new_tokens,
        goal=args.goal,
        torch=torch.__version__,
        transformers=transformers.__version__,
        records=records,
    )
    (out / "sliding_memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(records, out / "sliding_memory.png")
    worst = max(r["ratio"] for r in records)
    lossless = all(r["equals_plain"] for r in records)
    print(f"worst ratio {worst:.2f}x (goal {args.goal:.1f}x); every output equals plain: {lossless}")
    return 0 if lossless and worst <= args.goal else 1


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in records})
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 4), squeeze=False)
    for ax, family in zip(axes[0], families):
        for method in dict.fromkeys(r["method"] for r in records):
            rows = [r for r in records if r["family"] == family and r["method"] == method]
            ax.plot(
                [r["context"] for r in rows],
                [r["peak_bytes"] / 2**20 for r in rows],
                marker="o",
                label=method,
            )
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="peak KV cache (MiB)")
        ax.set_title(LABELS[family], fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
