"""Write the model cards of the shipped default heads (README.md in each head folder).

Usage: python scripts/write_default_cards.py [--bench bench_results/bench.json] [--heldout peagle=decoded.json]

`--heldout KIND=JSON` adds the held-out decoding of that kind's head to its card: a `scripts/eval_acceptance.py`
JSON (one head, pooled or not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peagle import PEagleDrafter
from peagle.hub import render_model_card
from peagle.targets import DEFAULT_HEADS, default_drafter_path
from peagle.training.recipe import training_budget

sys.path.insert(0, str(Path(__file__).parent))
from eval_acceptance import heldout_spec  # noqa: E402
from scaling_curve import split_spec  # noqa: E402


def _steps(stage: dict) -> str:
    """A stage's optimizer steps; a weight average of arms as "(a + b)", each arm's own."""
    arms = stage.get("arms")
    if arms:
        return "(" + " + ".join(str(a.get("optimizer_steps")) for a in arms) + ")"
    return str(stage.get("optimizer_steps"))


def _layers(stage: dict) -> int | None:
    """A stage's decoder layers; a weight average of arms records them per arm."""
    arms = stage.get("arms") or [stage]
    return arms[0].get("num_hidden_layers")


def _heldout_line(path: str) -> str:
    """The card's line for an `eval_acceptance.py` record of one head."""
    record = json.loads(Path(path).read_text())
    results = list(record["results"].values())
    if len(results) != 1:
        raise SystemExit(f"{path}: expected the decoding of one head, found {len(results)}")
    result, settings = results[0], record["settings"]
    sets = sorted({heldout_spec(spec, 0, 0)[0] for spec in settings["examples"]})
    return (
        f"{result['tokens_per_target_pass']:.3f} new tokens per target pass at K={settings['num_speculative_tokens']} "
        f"(K drafts every round, greedy, {settings['max_new_tokens']} new tokens, {settings['head_dtype']} head): "
        f"{result['new_tokens']:,} tokens in {result['target_passes']:,} target passes over {result['prompts']} "
        f"held-out examples of {', '.join(sets)}, "
        + (
            "every output identical to plain greedy"
            if result["lossless"]
            else "NOT identical to plain greedy"
        )
    )


def _heldout_files(items: list[str]) -> dict[str, str]:
    """`--heldout KIND=JSON` values as {kind: path}; SystemExit for a value without `=` or an unknown kind."""
    files = {}
    for item in items:
        try:
            kind, path = split_spec("--heldout", item, "KIND=JSON, e.g. peagle=decoded.json")
        except ValueError as err:
            raise SystemExit(str(err)) from None
        if kind not in DEFAULT_HEADS:
            raise SystemExit(f"--heldout: unknown head kind {kind!r}; known: {', '.join(DEFAULT_HEADS)}")
        files[kind] = path
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=None, help="a `peagle bench` JSON to include")
    ap.add_argument(
        "--heldout",
        action="append",
        default=[],
        metavar="KIND=JSON",
        help=f"an eval_acceptance.py JSON of one head's held-out decoding; KIND one of {', '.join(DEFAULT_HEADS)}",
    )
    args = ap.parse_args()
    heldout = _heldout_files(args.heldout)
    for kind in DEFAULT_HEADS:
        folder = default_drafter_path(kind)
        head = PEagleDrafter.from_pretrained(folder)
        summary = json.loads((folder / "train_summary.json").read_text())
        stages = [summary]  # oldest first; a continued run keeps its start's summary as "previous_stage"
        while "previous_stage" in stages[0]:
            stages.insert(0, stages[0]["previous_stage"])
        budget = training_budget(summary)
        data = (
            "self-distilled: SmolLM2-135M-Instruct answering chat, Magpie (prompts the target wrote itself under "
            "varied system prompts) and Python-stdlib coding prompts, greedy, up to 256 tokens (320 from stage 3 on, "
            "generated with transformers or the vLLM engine); no MT-Bench or "
            "HumanEval prompts"
        )
        # scripts/average_heads.py: the last stage may be a weight average of arms
        arms = summary.get("arms") or []
        last = arms or [summary]
        examples = " + ".join(str(a.get("examples")) for a in last)
        if arms:
            data += (
                f"; the last stage the weight average of {len(arms)} arms trained side by side from the stage "
                f"before, drawing on {examples} examples of training_data/smollm2-135m-instruct/train (heads/README.md)"
            )
        elif summary.get("examples") != stages[0].get("examples"):
            data += (
                f"; the last stage on {examples} examples of "
                "training_data/smollm2-135m-instruct/train (heads/README.md)"
            )
        layers_before = _layers(summary.get("previous_stage") or {})
        if layers_before and layers_before != _layers(summary):
            data += f"; grown from {layers_before} to {_layers(summary)} decoder layers at its start (grow_layers)"
        chain = summary.get("chain_average")  # average_heads.py --chain: averaged with the stages before it
        if chain:
            before = "the stage" if chain["stages"] == 2 else f"the {chain['stages'] - 1} stages"
            data += f", then weight-averaged with {before} before it"
        logged = [a.get("last_logged_accuracy") or {} for a in last]
        accuracy = {
            k: round(sum(a[k] for a in logged) / len(logged), 4)
            for k in logged[0]
            if all(k in a for a in logged)
        }
        training = {
            "trained_by": "peagle's PEagleTrainer (scripts/make_default_heads.py; stages in heads/README.md)",
            "data": data,
            "examples": examples,
            "response_tokens": " + ".join(str(a.get("response_tokens")) for a in last),
            "stages": budget["stages"],
            "optimizer_steps": " + ".join(_steps(s) for s in stages),
            "token_passes": f"{budget['response_tokens_trained']:,} response tokens trained, all stages"
            + (" (earlier stages estimated from steps x examples per step)" if budget["estimated"] else ""),
            "budget": f"{budget['cpu_hours']:.2f} CPU-hours on a 2-core CPU (one thread), "
            "bf16 autocast (float32 on CPUs without native bf16)",
            (
                "last_logged_top1_by_depth (mean of the arms)" if arms else "last_logged_top1_by_depth"
            ): accuracy or None,
        }
        if kind in heldout:
            training["held_out_decoding"] = _heldout_line(heldout[kind])
        card = render_model_card(
            head,
            base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
            bench=args.bench,
            training=training,
        )
        card.save(folder / "README.md")
        print(f"wrote {folder / 'README.md'}")


if __name__ == "__main__":
    main()
