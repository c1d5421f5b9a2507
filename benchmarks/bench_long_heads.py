"""Long contexts, head against head: tokens per target pass against context for heads and drafter windows (#67).

For each context length C of `--contexts` (0 = the prompt alone) and each held-out prompt, the input is a long
context followed by the prompt (`peagle.evaluation.long_inputs.build_input`): whole held-out self-distilled conversations
(`--context-source conversations`, the default) or the text of a folder of documents (`--context-source FOLDER`,
e.g. a kind of text absent from the heads' training data), cut to at most C tokens.  Every variant decodes the
same input greedily with K drafts every round (`--k`, chains) and, with `--trees N`, with draft trees of up to N
nodes; each output is checked against plain greedy decoding of the input (a mismatch is reported and makes the
exit status 1).  A variant is a head (`--heads label=FOLDER,...`; `shipped` is the shipped P-EAGLE head) with a
drafter window (`--windows none,256,...`: `drafter_window` of `generate()`; none = the whole context, whatever
the head's config says).

Tokens per target pass do not depend on the machine's speed (the rule is fixed: K every round), so this runs
beside other work; no time is reported.  Writes `<out>/long_heads.json` and `<out>/long_heads.png`.

Examples:
    python benchmarks/bench_long_heads.py --contexts 0,2048,4096,7936 --windows none,256 --trees 32
    python benchmarks/bench_long_heads.py --heads shipped,new=runs/long/head --context-source /usr/share/common-licenses
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle import PEagleDrafter
from peagle.evaluation.long_inputs import long_inputs, prompt_part
from peagle.evaluation.results import save_figure, write_json_and_plot
from peagle.evaluation.timing import machine_description


@dataclass
class Variants:
    """What every input is decoded with, besides plain greedy: each head of `heads` at each drafter window of
    `windows` (0: the whole context), with K = `k` drafts every round in chains and, when `trees` > 0, in draft
    trees of up to `trees` nodes, `max_new_tokens` new tokens each."""

    windows: list[int]
    k: int
    trees: int
    max_new_tokens: int


def run(
    target,
    heads: dict[str, Any],
    inputs: Iterable[tuple[int, int, list[int], dict[str, Any]]],
    variants: Variants,
    log: Callable[[str], Any],
) -> list[dict[str, Any]]:
    """Decode every input of `inputs` ([`long_inputs`]) plainly and with every variant; one row per input and
    variant, its tokens per target pass and whether its output is plain greedy's."""
    runs = []
    for context, index, ids, info in inputs:
        x = torch.tensor([ids])
        plain = target.generate(x, do_sample=False, max_new_tokens=variants.max_new_tokens)[
            0, len(ids) :
        ].tolist()
        for label, head in heads.items():
            for window in variants.windows:
                for kind, size in [("chain", 0)] + ([("tree", variants.trees)] if variants.trees else []):
                    out = target.generate(
                        x,
                        assistant_model=head,
                        do_sample=False,
                        max_new_tokens=variants.max_new_tokens,
                        num_assistant_tokens=variants.k,
                        assistant_confidence_threshold=0.0,
                        draft_tree_size=size,
                        drafter_window=window,
                        return_dict_in_generate=True,
                    )
                    stats = out.peagle_stats
                    row = {
                        "context": context,
                        **info,
                        "head": label,
                        "window": window,
                        "kind": kind,
                        "tokens_per_target_pass": stats.tokens_per_target_pass,
                        "new_tokens": stats.generated_tokens,
                        "identical": out.sequences[0, len(ids) :].tolist() == plain,
                    }
                    runs.append(row)
                    log(
                        f"context {context:>5} ({info['context_tokens']:>5} tok) prompt {index:>3} {label:>8} "
                        f"window {str(window):>5} {kind:>5}: {row['tokens_per_target_pass']:.2f} tok/pass"
                        + ("" if row["identical"] else "  OUTPUT DIFFERS FROM PLAIN GREEDY")
                    )
    return runs


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["head"], str(r["window"]), r["kind"], r["context"]), []).append(r)
    return [
        {
            "head": head,
            "window": window,
            "kind": kind,
            "context": context,
            "context_tokens_mean": statistics.mean(r["context_tokens"] for r in rows),
            "tokens_per_target_pass": statistics.mean(r["tokens_per_target_pass"] for r in rows),
            "per_prompt": [r["tokens_per_target_pass"] for r in rows],
            "identical": all(r["identical"] for r in rows),
        }
        for (head, window, kind, context), rows in groups.items()
    ]


def plot(summary: list[dict[str, Any]], path: str | Path, k: int) -> Path:
    """Tokens per target pass against context, one line per head and window, one panel per chains / trees."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({s["kind"] for s in summary})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for variant in sorted({(s["head"], s["window"]) for s in summary if s["kind"] == kind}):
            pts = sorted(
                (s for s in summary if s["kind"] == kind and (s["head"], s["window"]) == variant),
                key=lambda s: s["context"],
            )
            label = f"{variant[0]}, window {variant[1]}"
            ax.plot([s["context_tokens_mean"] for s in pts], [s["tokens_per_target_pass"] for s in pts],
                    marker="o", label=label)  # fmt: skip
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("context tokens before the prompt (mean over prompts)")
        ax.set_ylabel("new tokens per target pass")
        ax.set_title(f"{kind}s, K = {k} every round", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--contexts", default="0,2048,4096,7936")
    ap.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--trees", type=int, default=0, help="also draft trees of up to N nodes (0: chains only)")
    ap.add_argument("--windows", default="none,256", help="drafter windows; none = the whole context")
    ap.add_argument("--heads", default="shipped", help="label=FOLDER entries; 'shipped': the shipped head")
    ap.add_argument(
        "--context-source", default="conversations", help="'conversations' or a folder of documents"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench_results/long_heads")
    args = ap.parse_args(argv)

    from peagle.data.prompts import check_not_evaluation
    from peagle.data.shards import load_examples
    from peagle.targets import load_default_drafter, load_default_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target(dtype=torch.float32)
    heads = {}
    for entry in args.heads.split(","):
        label, _, folder = entry.partition("=")
        heads[label] = (
            load_default_drafter(target)
            if label == "shipped" and not folder
            else PEagleDrafter.from_pretrained(folder, target_model=target).eval()
        )
    # "none": the whole context (0), not the head's own `drafter_window` (which None would select)
    windows = [0 if w == "none" else int(w) for w in args.windows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    examples = load_examples(args.examples)
    prompts = list(range(args.skip, min(args.skip + args.limit, len(examples))))
    check_not_evaluation(
        [prompt_part(examples[i]) for i in prompts], tokenizer, source="long-context prompts"
    )
    sep = tokenizer("\n", add_special_tokens=False).input_ids
    docs = None if args.context_source == "conversations" else args.context_source
    t0 = time.perf_counter()
    by_context = long_inputs(examples, contexts, prompts, sep, tokenizer, docs)
    inputs = [(c, ids_info[1]["prompt_example"], *ids_info) for c in contexts for ids_info in by_context[c]]
    runs = run(target, heads, inputs, Variants(windows, args.k, args.trees, args.max_new_tokens), print)
    results = {
        "runs": runs,
        "summary": summarize(runs),
        "config": vars(args),
        "machine": machine_description(),
        "seconds": time.perf_counter() - t0,
        "command": "python benchmarks/bench_long_heads.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    js, png = write_json_and_plot(results, args.out, "long_heads", lambda s, p: plot(s, p, args.k))
    for s in results["summary"]:
        print(f"{s['head']:>8} window {s['window']:>5} {s['kind']:>5} context {s['context']:>5}: "
              f"{s['tokens_per_target_pass']:.2f} tok/pass, identical {s['identical']}")  # fmt: skip
    print(f"wrote {js} and {png}")
    return 0 if all(r["identical"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
