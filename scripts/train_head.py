"""Train a P-EAGLE (or EAGLE-3) head for a target: prompts -> self-distilled responses -> trained head.

The same as `peagle train` (`peagle.cli.train`); every option is listed by `--help`.

Examples:
    # the embedded SmolLM2 target, 200 Magpie prompts + 100 stdlib coding prompts, 4 partitions per example
    python scripts/train_head.py --magpie 200 --code-prompts 100 --output heads/smollm2-peagle \
        --num-parallel-positions 8 --partitions 4 --epochs 3 --max-new-tokens 256

    # any Llama-family target, prompts from a file, pre-generated examples reused, multi-process
    accelerate launch scripts/train_head.py --target path/to/model --examples data.jsonl --output heads/x --bf16
"""

from __future__ import annotations

import sys

from peagle.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
