"""Training prompts for the default SmolLM2 head (none from MT-Bench or HumanEval).

The set is `peagle.training.prompts.default_prompt_set`: instruction templates crossed with everyday topics
(chat), and public functions of Python's standard library asked for by signature and docstring (code).
Magpie-style prompts (the target writes user turns itself) come from `magpie_default_prompts.py`.

Usage: `python scripts/default_prompts.py --out prompts.jsonl` (prints the count).
"""

from __future__ import annotations

import argparse
import json

from peagle.training.prompts import default_prompt_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = default_prompt_set(args.seed)
    with open(args.out, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
