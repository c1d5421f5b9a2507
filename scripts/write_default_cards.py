"""Write the model cards of the shipped default heads (README.md in each head folder).

Usage: python scripts/write_default_cards.py [--bench bench_results/bench.json]
"""

from __future__ import annotations

import argparse
import json

from peagle import PEagleDrafter
from peagle.hub import render_model_card
from peagle.targets import DEFAULT_HEADS, default_drafter_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=None, help="a `peagle bench` JSON to include")
    args = ap.parse_args()
    for kind in DEFAULT_HEADS:
        folder = default_drafter_path(kind)
        head = PEagleDrafter.from_pretrained(folder)
        summary = json.loads((folder / "train_summary.json").read_text())
        stages = [summary]  # oldest first; a continued run keeps its start's summary as "previous_stage"
        while "previous_stage" in stages[0]:
            stages.insert(0, stages[0]["previous_stage"])
        first = stages[0].get("examples")
        data = (
            f"self-distilled: SmolLM2-135M-Instruct answering {first} chat and Python-stdlib coding prompts "
            "(scripts/default_prompts.py)"
        )
        if len(stages) > 1:
            data += (
                f", then {summary.get('examples') - first} more prompts the target wrote itself (Magpie, "
                "scripts/magpie_default_prompts.py)"
            )
        training = {
            "trained_by": "peagle's PEagleTrainer (scripts/make_default_heads.sh)",
            "data": data + "; greedy, up to 256 tokens; no MT-Bench or HumanEval prompts",
            "examples": summary.get("examples"),
            "response_tokens": summary.get("response_tokens"),
            "optimizer_steps": " + ".join(str(s.get("optimizer_steps")) for s in stages)
            + (" (stage 1 on the first prompts, stage 2 continued on all)" if len(stages) > 1 else ""),
            "budget": f"{sum(float(s.get('seconds', 0)) for s in stages):.0f} s on a 2-core CPU (one thread per "
            "head, both heads side by side), bf16 autocast, target features cached once",
            "last_logged_top1_by_depth": summary.get("last_logged_accuracy"),
        }
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
