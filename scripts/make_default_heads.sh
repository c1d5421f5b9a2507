#!/usr/bin/env bash
# The exact commands behind the heads shipped in src/peagle/default_heads/ (CPU budget: see the README).
set -euo pipefail
DATA=${DATA:-data}
mkdir -p "$DATA"
python scripts/default_prompts.py --out "$DATA/prompts.jsonl"
python scripts/distill_default_data.py --prompts "$DATA/prompts.jsonl" --out "$DATA/default_train.jsonl" \
    --batch-size 32 --max-new-tokens 256 --limit "${LIMIT:-544}"
# both heads: same examples, same layers, same draft vocabulary, same optimizer steps; one thread each
common=(--examples "$DATA/default_train.jsonl" --layers 2 --draft-vocab 8192 --k-train 8 --grad-accum 2
        --lr 1e-3 --max-steps "${STEPS:-300}" --threads 1)
python scripts/make_default_heads.py "${common[@]}" --kind peagle --out src/peagle/default_heads/smollm2-135m-peagle &
python scripts/make_default_heads.py "${common[@]}" --kind eagle3 --out src/peagle/default_heads/smollm2-135m-eagle3 &
wait
