"""Long contexts: what the shipped P-EAGLE head does at inference as the context grows (issue #61).

For each context length C of `--contexts` (0 = the short prompt alone) and each held-out prompt (`--skip`,
`--limit`: examples of `--examples`, by default the repository's self-distilled held-out set, never MT-Bench or
HumanEval), the input is a long context followed by that prompt: whole earlier held-out examples (system prompt,
user turn and the target's own greedy response, each followed by the "\\n" the chat template writes after
`<|im_end|>`), the ones just before the prompt's example going back (wrapping round to the end of the set, never
the prompt's own example), as many as fit in C tokens, then the prompt part of the prompt's example (its tokens
before the first `loss_mask` 1).  The context is therefore at most C tokens (whole examples only); its real length
is reported.

Measured at each context:

1. Tokens per target pass: greedy `target.generate(ids, assistant_model=head, do_sample=False,
   max_new_tokens=N)` with the head's default drafting rule (or K every round with `--num-assistant-tokens K`),
   the head's `PEagleGenerationStats.tokens_per_target_pass` (new tokens / target forward passes, prefill
   included) averaged over the prompts, its acceptance length (tokens per drafting round), and plain greedy
   decoding of the same input, whose output every head run is checked against (a mismatch is reported, never
   hidden).  Wall times of both runs are recorded too (speedup per prompt and overall; on a busy machine they
   are noise), with the cost rule's predicted against measured seconds per context bucket.  The head runs as
   in a user's process: the cost curve is kept with its online factors from run to run, and the warm-up times
   the curve's context points for every context first (what a user's first call at that length does, once
   per machine; its seconds are recorded as `cost_timing_seconds`), so no measured run includes that timing.
2. The cost of one drafting round against context: on the first prompt's input (T tokens, the target's own
   features of it), the drafter cache is filled with the context's T-1-R real slots in one round (its time is
   `first round`, once), then one steady round (R = `--real-slots` new real slots + K-1 parallel slots over that
   cache, `PEagleDrafter.draft_round`, greedy selection) and one target verify pass of K+1 tokens over the
   target's T-token cache (aux hidden states requested, as decoding does) are timed, interleaved with a one-token
   target step, `--repeats` times after a warm-up each; the medians and the draft/verify ratio are reported.

The embedded target (SmolLM2-135M-Instruct) has `max_position_embeddings` 8192.  Where a context's positions
(input + new tokens, or the timed cache + K + 1) exceed it, the target is a copy built from a copy of its config
with `max_position_embeddings` raised to `--extend-positions` (default 32768) and the same weights: its RoPE is
computed on the fly (rope_type default), so nothing else changes, but the target then runs PAST ITS TRAINED
RANGE, and the table and JSON say so (`past_trained_range`).  The head (its config also says 8192) was trained on
conversations of a few hundred tokens: every long context is beyond what it saw in training.

Any failure (e.g. out of memory) is recorded in the JSON and printed, never hidden; the exit status is 1 when a
run failed or an output differed from plain greedy.  Writes `<out>/long_context.json` and
`<out>/long_context.png` (tokens per target pass against context; round costs against context).

Examples:
    # the measurement (CPU, on an otherwise idle machine): about an hour on one core of an AMD EPYC, most of it
    # in the 16K context's seven target prefills (~5 min each: 2 per prompt and 1 for the round timing)
    python benchmarks/bench_long_context.py --contexts 0,2048,4096,8192,16384
    # a quick end-to-end check
    OMP_NUM_THREADS=1 python benchmarks/bench_long_context.py --contexts 0,512 --limit 1 --max-new-tokens 8 \\
        --repeats 1 --out /tmp/long_context
    # K=7 every round instead of the default (cost-aware) rule, on a GPU
    python benchmarks/bench_long_context.py --num-assistant-tokens 7 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from peagle import PEagleDrafter  # importing peagle installs the generate() hook (assistant_model=head)
from peagle.evaluation.long_context import (
    DEFAULT_EXAMPLES,
    LongContextSettings,
    plot,
    run_long_context,
)
from peagle.evaluation.long_inputs import checked_long_inputs
from peagle.evaluation.results import write_json_and_plot
from peagle.evaluation.timing import machine_description


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--contexts", default="0,2048,4096,8192,16384", help="context lengths in tokens (0: none)"
    )
    ap.add_argument("--examples", default=DEFAULT_EXAMPLES, help="held-out self-distilled examples (shards)")
    ap.add_argument(
        "--skip", type=int, default=48, help="the first prompt's example (0-39 calibrate the head)"
    )
    ap.add_argument("--limit", type=int, default=3, help="prompts (examples --skip .. --skip + N - 1)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--num-assistant-tokens",
        type=int,
        default=None,
        help="draft K every round (default: the head's default, cost-aware rule)",
    )
    ap.add_argument("--head", default=None, help="head folder (default: the shipped P-EAGLE head)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    ap.add_argument("--head-dtype", default=None, choices=["float32", "bfloat16"], help="default: --dtype")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of each round cost (median kept)")
    ap.add_argument("--real-slots", type=int, default=3, help="new real slots in a timed drafting round")
    ap.add_argument("--extend-positions", type=int, default=32768,
                    help="max_position_embeddings of the target copy used past its trained range")  # fmt: skip
    ap.add_argument("--no-timing", action="store_true", help="skip the round-cost measurement")
    ap.add_argument("--context-source", default="conversations",
                    help="'conversations' (earlier held-out examples) or a folder of documents before each prompt")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="bench_results/long_context")
    args = ap.parse_args(argv)

    from peagle.data.shards import load_examples
    from peagle.targets import default_drafter_path, load_default_drafter, load_default_target

    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = getattr(torch, args.dtype)
    head_dtype = getattr(torch, args.head_dtype) if args.head_dtype else dtype
    target, tokenizer = load_default_target(dtype=dtype, device=args.device)
    if args.head:
        head = PEagleDrafter.from_pretrained(args.head, dtype=head_dtype).attach_target(target)
        head = head.to(target.device).eval()
    else:
        head = load_default_drafter(target, dtype=head_dtype)
    examples = load_examples(args.examples)
    indices = list(range(args.skip, min(args.skip + args.limit, len(examples))))
    if not indices:
        raise SystemExit(f"no prompts: {args.examples} holds {len(examples)} examples, --skip {args.skip}.")
    separator, inputs = checked_long_inputs(examples, tokenizer, contexts, indices, args.context_source)
    t0 = time.perf_counter()
    settings = LongContextSettings(
        max_new_tokens=args.max_new_tokens,
        separator=separator,
        num_assistant_tokens=args.num_assistant_tokens,
        repeats=args.repeats,
        real_slots=args.real_slots,
        extend_positions=args.extend_positions,
        timing=not args.no_timing,
    )
    results = run_long_context(target, head, examples, contexts, indices, settings, inputs=inputs)
    results["config"].update(
        examples=args.examples,
        context_source=args.context_source,
        head=str(args.head or default_drafter_path("peagle")),
        target=str(target.config._name_or_path),
        dtype=args.dtype,
        head_dtype=str(head_dtype).replace("torch.", ""),
        device=args.device,
    )
    results["machine"] = machine_description()
    results["seconds"] = time.perf_counter() - t0
    results["command"] = "python benchmarks/bench_long_context.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    js, png = write_json_and_plot(results, args.out, "long_context", plot)
    summary = results["summary"]
    bad = [s["context"] for s in summary if s["failed"] or s["timing_error"] or s["identical"] is False]
    past = [s["context"] for s in summary if s["past_trained_range"]]
    if past:
        print(
            f"contexts {past}: the target ran PAST ITS TRAINED RANGE (max_position_embeddings "
            f"{results['config']['target_max_position_embeddings']} raised to {args.extend_positions})"
        )
    print(f"outputs identical to plain greedy: {all(s['identical'] is not False for s in summary)}; "
          f"failures at contexts {bad or 'none'}; {results['seconds']:.0f} s")  # fmt: skip
    print(f"wrote {js} and {png}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
