"""No hidden cost (issue #78): first calls against repeated ones, and peagle against plain greedy, by batch size.

For each batch size, on a fresh cost cache and with the cost curves of this process forgotten: the first peagle
call (default rule: it times a quick curve, within about half a second), the same call repeated (`--repeats`,
median) and plain batched greedy on the same prompts (median), the two alternated.  Per batch size it reports the
first call's seconds over the repeated call's (the goal: at most 1.5), the first call's `cost_timing_seconds`,
peagle's speed over plain's, target passes, the time per target pass outside the target's and the drafter's
forwards, and host reads of tensors per target pass (`evaluation/host_syncs.py`; one extra counted call each,
untimed) for both.  Every peagle output is compared with plain's.

Prompts: the user turns of `--examples` (held-out, after `--skip`), left-padded into batches.

Per round (from the end of one target pass to the end of the next), drafting rounds and plain steps apart: the
time outside the target's and the drafter's forwards and the host reads made outside the target's forward.

Writes `<out>/no_hidden_cost.json` and `.png`; exit status 1 when an output differed from plain.

Examples:
    # the measurement (an otherwise idle machine, 1 thread as a new user would have on a shared one)
    OMP_NUM_THREADS=1 python benchmarks/bench_no_hidden_cost.py --batch_sizes 1,2,4,8 --max_new_tokens 64 \\
        --out docs/results/no_hidden_cost
    # a quick end-to-end check on tiny random models (no download, numbers mean nothing)
    python benchmarks/bench_no_hidden_cost.py --tiny --batch_sizes 1,2 --max_new_tokens 8 --repeats 1 \\
        --out /tmp/no_hidden_cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle.evaluation.results import write_json_and_plot
from peagle.evaluation.timing import machine_description, timed_generate
from peagle.generation import cost as cost_mod


def tiny_models():
    """A tiny random Llama target and a P-EAGLE head for it (the script's own check; numbers mean nothing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import peagle

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    head_config = peagle.PEagleConfig.for_target(config, num_hidden_layers=1, mask_token_id=127)
    return target, peagle.PEagleDrafter(head_config).eval(), None


def prompts(args, tokenizer) -> list[torch.Tensor]:
    """Prompt token ids, one 1D tensor each."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return [
            torch.randint(3, 127, (int(n),), generator=gen)
            for n in torch.randint(8, 24, (64,), generator=gen)
        ]
    from peagle.data.shards import load_examples
    from peagle.evaluation.long_inputs import prompt_part

    return [torch.tensor(prompt_part(e)) for e in load_examples(args.examples)[args.skip :]]


def batch_of(ids: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(B, L)` ids and their attention mask."""
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(out)
    for b, x in enumerate(ids):
        out[b, width - len(x) :] = x
        mask[b, width - len(x) :] = 1
    return out, mask


def run(target, head, ids, mask, args, assistant: bool, count: bool = False):
    kw = dict(attention_mask=mask, pad_token_id=args.pad, count_syncs=count)
    return timed_generate(target, ids, args.max_new_tokens, head if assistant else None, **kw)


def row_of(runs, counted, first=None) -> dict:
    """One side's figures: median seconds of `runs`, target passes, and per round (from the end of one target pass
    to the end of the next) the time outside the target's and the drafter's forwards (medians over `runs`) and
    the host reads (from the `counted` run), split into drafting rounds and plain steps."""
    passes = runs[0].target_calls
    seconds = statistics.median(r.seconds for r in runs)
    out = {"seconds": seconds, "target_passes": passes}
    for kind, drafted in (("drafting_round", True), ("plain_step", False)):
        per_run = [[f for f in r.rounds() if f.drafted == drafted] for r in runs]
        reads = [f.host_syncs for f in counted.rounds() if f.drafted == drafted]
        out[f"{kind}s"] = len(per_run[0])
        out[f"ms_outside_forwards_per_{kind}"] = (
            1e3 * statistics.median(statistics.mean(f.outside_seconds for f in fs) for fs in per_run if fs)
            if any(per_run)
            else None
        )
        out[f"host_syncs_per_{kind}"] = statistics.mean(reads) if reads else None
        out[f"most_host_syncs_per_{kind}"] = max(reads) if reads else None
    if first is not None:
        out["first_call_seconds"] = first.seconds
        out["first_call_cost_timing_seconds"] = first.stats.cost_timing_seconds if first.stats else None
        out["first_over_repeated"] = first.seconds / seconds
    return out


def plot(rows: list[dict], path: Path) -> Path:
    """Left: peagle's speed over plain batched greedy by batch size; right: the first call over the repeated one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.bar([str(b) for b in sizes], [r["speedup"] for r in rows], color="tab:blue")
    left.axhline(1.0, color="grey", lw=0.8)
    left.axhline(0.99, color="tab:red", lw=0.8, ls="--", label="goal where drafting does not pay")
    left.set_xlabel("batch size")
    left.set_ylabel("peagle / plain speed (repeated calls)")
    left.legend(fontsize=7)
    right.bar([str(b) for b in sizes], [r["peagle"]["first_over_repeated"] for r in rows], color="tab:orange")
    right.axhline(1.5, color="tab:red", lw=0.8, ls="--", label="goal: at most 1.5")
    right.set_xlabel("batch size")
    right.set_ylabel("first call / repeated call")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch_sizes", default="1,2,4,8")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    ap.add_argument("--skip", type=int, default=48, help="held-out examples to skip (those calibrated on)")
    ap.add_argument("--tiny", action="store_true", help="tiny random models: checks the script runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.batch_sizes.split(",")]
    if args.tiny:
        target, head, tokenizer = tiny_models()
    else:
        import peagle

        target, tokenizer = peagle.load_default_target()
        head = peagle.load_default_drafter(target)
    args.pad = int(target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    pool = prompts(args, tokenizer)
    if len(pool) < sum(sizes):
        raise SystemExit(f"need {sum(sizes)} prompts for batch sizes {sizes}, found {len(pool)}")
    results, lossless, used = [], True, 0
    for rows in sizes:
        ids, mask = batch_of(pool[used : used + rows], args.pad)
        used += rows
        os.environ["PEAGLE_COST_CACHE"] = tempfile.mkdtemp(prefix="peagle-cost-")  # a fresh cost cache
        cost_mod.forget_cost_models()
        first = run(target, head, ids, mask, args, True)
        again, plain = [], []  # alternated: a drift in the machine's speed hits both sides alike
        for _ in range(max(1, args.repeats)):
            again.append(run(target, head, ids, mask, args, True))
            plain.append(run(target, head, ids, mask, args, False))
        counted = (
            run(target, head, ids, mask, args, True, count=True),
            run(target, head, ids, mask, args, False, True),
        )
        same = all(r.output == plain[0].output for r in [first, *again])
        same = same and torch.equal(  # every row, not only the first
            target.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                            pad_token_id=args.pad, assistant_model=head),
            target.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                            pad_token_id=args.pad),
        )  # fmt: skip
        lossless &= same
        peagle_row, plain_row = row_of(again, counted[0], first), row_of(plain, counted[1])
        peagle_row["host_syncs_per_pass"] = counted[0].host_syncs / counted[0].target_calls
        plain_row["host_syncs_per_pass"] = counted[1].host_syncs / counted[1].target_calls
        stats = again[0].stats
        results.append(
            {
                "batch_size": rows,
                "speedup": plain_row["seconds"] / peagle_row["seconds"],
                "peagle": peagle_row,
                "plain": plain_row,
                "skipped_drafter_rounds": stats.skipped_drafter_rounds if stats else None,
                "rounds": stats.rounds if stats else None,
                "lossless": same,
            }
        )
        r = results[-1]

        def ms(row, kind):
            value = row[f"ms_outside_forwards_per_{kind}"]
            return "-" if value is None else f"{value:.2f} ms"

        print(
            f"B={rows}: {r['speedup']:.2f}x of plain; first call {peagle_row['first_over_repeated']:.2f}x the repeated "
            f"one (timing {peagle_row['first_call_cost_timing_seconds']:.2f} s); outside forwards per drafting round "
            f"{ms(peagle_row, 'drafting_round')}, per plain step {ms(peagle_row, 'plain_step')} (plain "
            f"{ms(plain_row, 'plain_step')}); host reads per drafting round "
            f"{peagle_row['host_syncs_per_drafting_round']}, per plain step {peagle_row['host_syncs_per_plain_step']} "
            f"(plain {plain_row['host_syncs_per_plain_step']}); lossless {same}",
            flush=True,
        )
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_description(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": results,
    }
    js, png = write_json_and_plot(report, args.out, "no_hidden_cost", plot)
    print(f"written to {js} and {png}")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
