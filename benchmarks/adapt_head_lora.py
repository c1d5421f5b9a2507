"""Adapt the shipped SmolLM2 P-EAGLE head to French with a LoRA adapter, and measure acceptance before and after.

The default head was trained on English chat and Python standard-library code prompts.  This script

1. writes French prompts (instruction templates x topics; the held-out topics are never trained on),
2. lets the target answer them itself (`peagle.data.distill.self_distill`, greedy, with a French system prompt),
   plus a few English prompts of the head's original domain (`--replay-prompts`, against forgetting),
3. trains a LoRA adapter on the frozen head with `PEagleTrainer` (`peagle.integrations.peft.lora_for_training`),
4. merges it (`peagle.integrations.peft.merge_lora`) and measures, before and after, on held-out French prompts AND on
   held-out English prompts (did the head keep its original domain?):
   tau = new tokens / target forward calls (`peagle.evaluation.bench.timed_generate`, greedy, K = 7, constant schedule;
   the prefill counts as a call) and the generator's own acceptance length (accepted drafts + rounds) / rounds
   from `head.last_generation_stats`.  Data and training use a bfloat16 target (fast, as the head was trained);
   the measurements a float32 one (`--eval-dtype`), where speculative greedy output is bit-identical to plain
   greedy (a bfloat16 verify pass over several tokens rounds differently from one-token steps).

No MT-Bench or HumanEval prompt is used (`self_distill` refuses them; `check_not_evaluation` checks the held-out
measurement prompts).  Greedy
speculative output is the target's own: the script also checks that the base and adapted heads produce the same
tokens on every prompt.

Outputs under `--out`: the adapter (`adapter_config.json`, `adapter_model.safetensors`), the merged head
(`merged/`), `examples.jsonl`, `train_summary.json` and `results.json`.

Usage (the numbers in the README come from this command, on 1 CPU thread):
    python benchmarks/adapt_head_lora.py --out runs/lora-fr
The same adaptation from the command line, on your own prompts:
    peagle train --lora --prompts prompts_fr.txt --max_new_tokens 128 --max_steps 100 --learning_rate 2e-3 --output_dir runs/lora-fr
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from peagle.data.distill import self_distill
from peagle.data.prompts import chat_prompt_ids, check_not_evaluation, templated_chat_prompts
from peagle.data.shards import save_examples
from peagle.evaluation.timing import timed_generate
from peagle.integrations.peft import head_vocab_coverage, lora_config, lora_for_training, merge_lora
from peagle.modeling_peagle import PEagleDrafter
from peagle.targets import default_drafter_path, load_default_target
from peagle.training import DataArguments
from peagle.training.recipe import format_summary, train_head, training_arguments

FRENCH_SYSTEM = "Tu es un assistant utile. Réponds toujours en français."

FRENCH_TEMPLATES = [
    "Explique {topic} à un débutant en quelques paragraphes.",
    "Donne-moi cinq conseils pratiques sur {topic}.",
    "Écris un court e-mail amical à un collègue au sujet de {topic}.",
    "Quels sont les avantages et les inconvénients de {topic} ?",
    "Résume les idées principales de {topic} sous forme de liste.",
    "Écris un petit poème sur {topic}.",
    "Quelles sont les idées reçues les plus courantes sur {topic} ?",
    "Comment expliquerais-tu {topic} à un enfant de dix ans ?",
    "Décris une journée typique d'une personne qui travaille dans {topic}.",
    "Propose un plan de présentation sur {topic}, avec des titres de sections.",
]

FRENCH_TRAIN_TOPICS = [
    "l'énergie solaire",
    "la cuisine française",
    "l'histoire de Paris",
    "le sommeil",
    "les économies d'argent",
    "le vélo en ville",
    "la photographie",
    "le jardinage",
    "les réseaux sociaux",
    "la Révolution française",
    "le recyclage",
    "la musique classique",
    "les vacances à la mer",
    "le télétravail",
    "les abeilles",
    "le fromage",
    "la lecture",
    "les volcans",
    "le football",
    "l'intelligence artificielle",
]

FRENCH_HELDOUT_TOPICS = ["la boulangerie", "les trains", "la météo", "le cinéma", "les forêts", "la natation"]

ENGLISH_HELDOUT = [  # neither in the default head's training templates/topics nor in MT-Bench/HumanEval
    "Tell me about volcanoes and why they erupt.",
    "What should I pack for a weekend hiking trip?",
    "Describe how a bicycle gear system works.",
    "Write a short story about a lighthouse keeper.",
    "What are good habits for keeping a tidy kitchen?",
    "Explain how chess openings are usually classified.",
    "Give me a simple weekly plan for learning to draw.",
    "Why do cats purr, and what does it mean?",
]


def french_prompts(seed: int) -> tuple[list[str], list[str]]:
    """`(train, held_out)`: every template with the train topics, and with the held-out topics."""
    rng = random.Random(seed)
    train = [t.format(topic=x) for x in FRENCH_TRAIN_TOPICS for t in FRENCH_TEMPLATES]
    held = [t.format(topic=x) for x in FRENCH_HELDOUT_TOPICS for t in FRENCH_TEMPLATES]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def english_replay_prompts(count: int, seed: int) -> list[str]:
    """`count` prompts of the default head's own domain (its templated chat prompts,
    `peagle.data.prompts.templated_chat_prompts`), mixed into training so the head keeps its English
    acceptance; disjoint from `ENGLISH_HELDOUT`."""
    prompts = templated_chat_prompts()
    random.Random(seed).shuffle(prompts)
    overlap = set(prompts) & set(ENGLISH_HELDOUT)
    if overlap:
        raise ValueError(f"replay prompts overlap the held-out English prompts: {sorted(overlap)}")
    return prompts[:count]


def measure(target, head: PEagleDrafter, prompts: list[list[int]], max_new_tokens: int, k: int) -> dict:
    """Speculative greedy decoding of each prompt with `head`; aggregate tau and acceptance statistics."""
    new = calls = accepted = rounds = 0
    depth_acc = [0] * k
    depth_drafted = [0] * k
    seconds = 0.0
    outputs = []
    for ids in prompts:
        run = timed_generate(
            target,
            torch.tensor([ids]),
            max_new_tokens,
            assistant=head,
            num_assistant_tokens=k,
            assistant_confidence_threshold=0.0,  # K drafts every round: acceptance, not the machine
            num_assistant_tokens_schedule="constant",
        )
        st = head.last_generation_stats
        new += run.new_tokens
        calls += run.target_calls
        seconds += run.seconds
        accepted += st.accepted_tokens
        rounds += st.rounds
        depth_acc = [a + b for a, b in zip(depth_acc, st.accepted_per_depth)]
        depth_drafted = [a + b for a, b in zip(depth_drafted, st.drafted_per_depth)]
        outputs.append(run.output)
    return {
        "prompts": len(prompts),
        "new_tokens": new,
        "target_calls": calls,
        "tau_new_tokens_per_target_call": new / calls,
        "acceptance_length_per_round": (accepted + rounds) / rounds if rounds else 0.0,
        "acceptance_rate_per_depth": [a / d if d else 0.0 for a, d in zip(depth_acc, depth_drafted)],
        "tokens_per_second": new / seconds,
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/lora-fr", help="output folder (adapter, merged head, results)")
    ap.add_argument("--base-head", default=None, help="head to adapt (default: the shipped SmolLM2 head)")
    ap.add_argument("--train-prompts", type=int, default=160, help="French training prompts (<= 200)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="response cap for self-distillation")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per language")
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    ap.add_argument(
        "-k", "--num-speculative-tokens", type=int, default=7, help="K, draft tokens per round at evaluation"
    )
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--r", type=int, default=16, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="target dtype for data and training",
    )
    ap.add_argument(
        "--eval-dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="target dtype for the measurements (float32: speculative output is bit-identical to plain greedy)",
    )
    ap.add_argument(
        "--replay-prompts",
        type=int,
        default=40,
        help="English prompts of the head's original domain mixed into training (against forgetting; 0 = none)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    target, tokenizer = load_default_target(dtype=getattr(torch, args.dtype))
    base_path = args.base_head or default_drafter_path("peagle")
    head = PEagleDrafter.from_pretrained(base_path, dtype=torch.float32, target_model=target).eval()

    fr_train, fr_held = french_prompts(args.seed)
    if args.train_prompts > len(fr_train):
        raise ValueError(f"--train-prompts is {args.train_prompts}; at most {len(fr_train)} are available.")
    fr_train, fr_held = fr_train[: args.train_prompts], fr_held[: args.eval_prompts]
    en_held = ENGLISH_HELDOUT[: args.eval_prompts]
    check_not_evaluation(fr_held + en_held, source="held-out prompts")
    eval_sets = {
        "french": [chat_prompt_ids(tokenizer, p, system=FRENCH_SYSTEM) for p in fr_held],
        "english": [chat_prompt_ids(tokenizer, p) for p in en_held],
    }

    t0 = time.time()
    examples = self_distill(
        target,
        fr_train,
        tokenizer=tokenizer,
        system=FRENCH_SYSTEM,
        max_new_tokens=args.max_new_tokens,
        batch_size=16,
        seed=args.seed,
    )
    coverage = head_vocab_coverage(head, examples)
    print(f"{len(examples)} French examples, draft-vocab coverage of their responses {coverage:.3f}")
    en_replay = english_replay_prompts(args.replay_prompts, args.seed) if args.replay_prompts else []
    replay = (
        self_distill(
            target, en_replay, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, batch_size=16
        )
        if en_replay
        else []
    )
    save_examples(examples + replay, out / "examples.jsonl")
    distill_seconds = time.time() - t0

    eval_target = target
    if args.eval_dtype != args.dtype:
        eval_target, _ = load_default_target(dtype=getattr(torch, args.eval_dtype))
    t0 = time.time()
    before = {
        name: measure(eval_target, head, ids, args.eval_new_tokens, args.num_speculative_tokens)
        for name, ids in eval_sets.items()
    }
    eval_seconds = time.time() - t0

    t0 = time.time()
    model = lora_for_training(head, target, lora_config(r=args.r, lora_alpha=args.alpha))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model, summary = train_head(
        target,
        tokenizer,
        output_dir=out,
        examples=examples + replay,
        head=model,
        data_args=DataArguments(feature_cache=str(out / "features"), calibration_examples="0"),
        training_args=training_arguments(
            out / "checkpoints",
            num_parallel_positions=head.config.num_parallel_positions,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=1,
            learning_rate=args.lr,
            warmup_steps=0.05,
            save_strategy="no",
            seed=args.seed,
            use_cpu=True,
        ),
    )
    train_seconds = time.time() - t0
    print(format_summary(summary))
    merged = merge_lora(model).eval()
    merged.save_pretrained(out / "merged")

    t0 = time.time()
    merged.attach_target(eval_target)
    after = {
        name: measure(eval_target, merged, ids, args.eval_new_tokens, args.num_speculative_tokens)
        for name, ids in eval_sets.items()
    }
    eval_seconds += time.time() - t0

    results = {
        "command": " ".join(["python", *sys.argv]),
        "arguments": vars(args),
        "base_head": os.fspath(base_path),
        "tau_definition": "new tokens / target forward calls (prefill included); K drafts per round",
        "train_examples": len(examples),
        "replay_examples": len(replay),
        "train_response_tokens": summary["response_tokens"],
        "draft_vocab_coverage_train": coverage,
        "lora_trainable_parameters": trainable,
        "optimizer_steps": summary["optimizer_steps"],
        "seconds": {
            "distill": round(distill_seconds, 1),
            "train": round(train_seconds, 1),
            "eval": round(eval_seconds, 1),
            "total": round(time.time() - start, 1),
        },
    }
    rows = []
    for name in eval_sets:
        same = all(a == b for a, b in zip(before[name]["outputs"], after[name]["outputs"]))
        results[name] = {
            "identical_outputs": same,
            "before": {k: v for k, v in before[name].items() if k != "outputs"},
            "after": {k: v for k, v in after[name].items() if k != "outputs"},
        }
        if not same:
            print(
                f"WARNING: {name} outputs differ between the base and the adapted head (should be lossless)"
            )
        b, a = before[name], after[name]
        rows.append(
            f"{name:8s} {b['tau_new_tokens_per_target_call']:6.3f} -> {a['tau_new_tokens_per_target_call']:6.3f}   "
            f"{b['acceptance_length_per_round']:6.3f} -> {a['acceptance_length_per_round']:6.3f}   "
            f"{b['tokens_per_second']:5.1f} -> {a['tokens_per_second']:5.1f}"
        )
    with open(out / "results.json", "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=2)
    print(
        f"held-out  tau (tokens/target call)   acceptance length     tokens/s    (K={args.num_speculative_tokens}, greedy)"
    )
    print("\n".join(rows))
    print(f"results: {out / 'results.json'}  adapter: {out}  merged head: {out / 'merged'}")


if __name__ == "__main__":
    main()
