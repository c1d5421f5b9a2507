"""Train the two heads shipped for the embedded SmolLM2-135M-Instruct target, with peagle's own trainer.

- `peagle`: P-EAGLE parallel head (K_train parallel positions, COD), the default drafter;
- `eagle3`: EAGLE-3-style autoregressive head (training-time-test unroll) on the SAME examples, same
  layers, same draft vocabulary, same number of optimizer steps: the baseline.

Both heads: 2 decoder layers of width 576, the target's (frozen) embeddings plus a learned mask
embedding (`embed_from_target`, so the shipped files stay small), a draft vocabulary of the most
frequent response tokens, random initialisation (copying the target's lm_head/norm rows started the KL
at 20.5 instead of 8.3 in a 4-step trial), bf16 on disk.

Data: `distill_default_data.py` output (chat and stdlib-code prompts, never MT-Bench or HumanEval: `train_head`
checks every example's prompt; answered greedily by the target itself), a JSONL file or a token-shard folder.
Features are cached once (`--feature-cache`) and reused by both heads and every epoch.  The head comes from
`peagle.training.recipe.build_head`, the arguments from `training_arguments`.

Usage (the exact commands behind the shipped heads are in `make_default_heads.sh`):
    python scripts/make_default_heads.py --examples data.jsonl --kind peagle --out DIR --epochs 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from peagle import PEagleConfig
from peagle.runtime import native_bf16, preferred_dtype
from peagle.targets import DEFAULT_TARGET_NAME, load_default_target
from peagle.training.features import FeatureCache
from peagle.training.recipe import (
    build_head,
    format_summary,
    load_head_for_training,
    train_head,
    training_arguments,
    training_budget,
)
from peagle.training.shards import load_examples, parse_cycle_ranges, read_shards
from peagle.training.trainer import epoch_order

MASK_TOKEN_ID = 16  # SmolLM2's "<empty_output>": a reserved special token that never occurs in chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", required=True)
    ap.add_argument("--kind", choices=["peagle", "eagle3"], default="peagle")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers of a new head (default 2); with --init-from, grow the head to this many (grow_layers)",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft vocabulary of a new head (default 8192); with --init-from, grow (or shrink) the head's to this size",
    )
    ap.add_argument("--num-parallel-positions", type=int, default=8, help="K_train of a new head")
    ap.add_argument(
        "--lm-head-init",
        choices=["target", "random"],
        default=None,
        help="LM head of a new head (build_head's)",
    )
    ap.add_argument(
        "--layers-init",
        choices=["random", "target"],
        default=None,
        help="decoder layers of a new head: random (build_head's default) or the target's last layers",
    )
    ap.add_argument("--loss-type", choices=["kl", "ce"], default="kl")
    ap.add_argument("--cod-ratio", type=float, default=0.7, help="COD keep ratio per depth")
    ap.add_argument(
        "--lr-scheduler", default="linear", help="transformers scheduler name (linear, cosine, constant)"
    )
    ap.add_argument(
        "--save-total-limit", type=int, default=2, help="checkpoints kept (the scaling curve wants all)"
    )
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument(
        "--trainable-parameters",
        default=None,
        help="regex over the head's parameter names: train only those (e.g. lm_head), freeze the rest",
    )
    ap.add_argument(
        "--lr-scale",
        action="append",
        default=[],
        dest="lr_scales",
        metavar="REGEX=SCALE",
        help="head parameters whose names match train at SCALE times --lr (repeatable), e.g. lm_head=0.1",
    )
    ap.add_argument("--feature-cache", default=None)
    ap.add_argument(
        "--resume-from-checkpoint",
        default=None,
        help="a checkpoint of --run-dir to resume (optimizer, schedule, data order, budget count); the other "
        "arguments must be the run's own, except --max-steps, which may shorten or lengthen the schedule",
    )
    ap.add_argument(
        "--min-cycle",
        type=int,
        default=None,
        help="with a shard folder as --examples: only its shards of grow_data.py cycles >= this one",
    )
    ap.add_argument(
        "--cycles",
        default=None,
        help="with a shard folder as --examples: only its shards whose grow_data.py cycles lie in these "
        "ranges, e.g. 78-93,513- (N, N-M or N-, comma-separated)",
    )
    ap.add_argument(
        "--skip-seen",
        type=int,
        default=0,
        metavar="N",
        help="drop the N examples an earlier, stopped run over the same examples (seed 0, batch 1) trained on "
        "first: its optimizer steps x its --grad-accum; the rest are examples that run never saw",
    )
    ap.add_argument(
        "--skip-seen-cycles",
        default=None,
        metavar="RANGES",
        help="with --skip-seen: the earlier run's own --cycles, when this run's --cycles add shards to them; "
        "only examples of those shards are dropped",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--run-dir", default=None, help="checkpoints and logs (default: runs/<name of --out>)")
    ap.add_argument("--save-steps", type=int, default=100000, help="checkpoint every N optimizer steps")
    ap.add_argument(
        "--init-from",
        default=None,
        help="continue training this head folder (keeps its layers, K and, without --draft-vocab, its draft "
        "vocabulary) instead of a new head",
    )
    ap.add_argument(
        "--cache-only",
        action="store_true",
        help="only build --feature-cache (shared by both heads), then exit",
    )
    args = ap.parse_args()
    if args.init_from and (args.lm_head_init is not None or args.layers_init is not None):
        ap.error(
            "--lm-head-init and --layers-init shape a new head; --init-from continues a head with its own"
        )
    if args.out is None and not args.cache_only:
        ap.error("--out is required unless --cache-only")
    if args.cache_only and args.feature_cache is None:
        ap.error("--cache-only needs --feature-cache")
    if args.threads:
        torch.set_num_threads(args.threads)

    # --min-cycle / --cycles: the shards added since an earlier stage (by the cycles in the folder's manifest)
    if args.min_cycle is not None or args.cycles is not None:
        if args.min_cycle is not None and args.cycles is not None:
            ap.error("--min-cycle N is --cycles N-: give one of them")
        cycles = [(args.min_cycle, None)] if args.cycles is None else parse_cycle_ranges(args.cycles)
        examples = read_shards(args.examples, cycles=cycles)
    else:
        examples = load_examples(args.examples)
    if args.skip_seen_cycles and not args.skip_seen:
        ap.error("--skip-seen-cycles goes with --skip-seen")
    if args.skip_seen:
        # the earlier run's examples, in the order its trainer drew them (seed 0, batch 1)
        earlier = (
            read_shards(args.examples, cycles=parse_cycle_ranges(args.skip_seen_cycles))
            if args.skip_seen_cycles
            else examples
        )
        seen = {tuple(earlier[i]["input_ids"]) for i in epoch_order(len(earlier), seed=0)[: args.skip_seen]}
        examples = [ex for ex in examples if tuple(ex["input_ids"]) not in seen]
        print(
            f"--skip-seen {args.skip_seen}: training on the {len(examples)} examples the earlier run never saw"
        )
    target, tokenizer = load_default_target(dtype=preferred_dtype())  # bf16 only where native
    if args.cache_only:  # the target layers every new head reads (PEagleConfig.for_target's default)
        aux = PEagleConfig.for_target(target.config).eagle_aux_hidden_state_layer_ids
        print(FeatureCache.build(target, examples, args.feature_cache, aux))
        return
    if args.init_from:
        head = load_head_for_training(args.init_from, target)
        want = "parallel" if args.kind == "peagle" else "autoregressive"
        if head.config.drafting_mode != want:
            ap.error(
                f"--init-from {args.init_from} is a {head.config.drafting_mode} head; --kind {args.kind}"
            )
        # the continued head's training K, as --help says
        args.num_parallel_positions = head.config.num_parallel_positions
    else:
        head = build_head(
            target,
            examples,
            drafting_mode="parallel" if args.kind == "peagle" else "autoregressive",
            num_hidden_layers=args.layers or 2,
            draft_vocab_size=args.draft_vocab or 8192,
            num_parallel_positions=args.num_parallel_positions,
            num_speculative_tokens=7 if args.kind == "peagle" else 3,
            embed_from_target=True,
            mask_token_id=MASK_TOKEN_ID,
            target_model_name=DEFAULT_TARGET_NAME,
            **({"lm_head_init": args.lm_head_init} if args.lm_head_init else {}),
            **({"layers_init": args.layers_init} if args.layers_init else {}),
        )
    out = Path(args.out)
    run_dir = Path(args.run_dir or Path("runs") / out.name)
    training_args = training_arguments(
        run_dir / "checkpoints",
        num_parallel_positions=args.num_parallel_positions,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        loss_type=args.loss_type,
        cod_ratio=args.cod_ratio,
        warmup_steps=0.02,
        gradient_accumulation_steps=args.grad_accum,
        bf16=native_bf16(),
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        seed=0,
        trainable_parameters=args.trainable_parameters,
        lr_scales=args.lr_scales,
    )
    head, summary = train_head(
        target,
        tokenizer,
        output_dir=run_dir,
        examples=examples,
        head=head,
        num_hidden_layers=args.layers if args.init_from else None,
        draft_vocab_size=args.draft_vocab if args.init_from else None,
        feature_cache=args.feature_cache,
        training_args=training_args,
        resume_from_checkpoint=args.resume_from_checkpoint,
    )
    if args.init_from and (Path(args.init_from) / "train_summary.json").is_file():
        summary["previous_stage"] = json.loads((Path(args.init_from) / "train_summary.json").read_text())
    summary["cumulative"] = training_budget(summary)
    head.to(torch.bfloat16).save_pretrained(out)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(format_summary(summary))


if __name__ == "__main__":
    main()
