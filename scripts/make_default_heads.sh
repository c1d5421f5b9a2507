#!/usr/bin/env bash
# The exact commands behind the heads shipped in src/peagle/default_heads/ (CPU budget: see the README).
# Two cores: every stage runs two one-thread processes side by side.
set -euo pipefail
DATA=${DATA:-data}
STEPS=${STEPS:-2000}
export OMP_NUM_THREADS=1
mkdir -p "$DATA"
python scripts/default_prompts.py --out "$DATA/prompts.jsonl"
# self-distillation: the target answers every prompt itself (greedy, bf16, 256 new tokens at most)
distill=(--prompts "$DATA/prompts.jsonl" --batch-size 32 --max-new-tokens 256)
python scripts/distill_default_data.py "${distill[@]}" --limit 576 --out "$DATA/default_train_a.jsonl" &
python scripts/distill_default_data.py "${distill[@]}" --start 576 --out "$DATA/default_train_b.jsonl" &
wait
cat "$DATA/default_train_a.jsonl" "$DATA/default_train_b.jsonl" > "$DATA/default_train.jsonl"
# target features, computed once and shared by both heads
python scripts/make_default_heads.py --examples "$DATA/default_train.jsonl" --cache-only \
    --feature-cache "$DATA/features" --threads 2
# both heads: same examples, same layers, same draft vocabulary, same optimizer steps; one thread each
common=(--examples "$DATA/default_train.jsonl" --feature-cache "$DATA/features" --layers 2 --draft-vocab 8192
        --k-train 8 --grad-accum 2 --lr 1e-3 --max-steps "$STEPS" --threads 1)
python scripts/make_default_heads.py "${common[@]}" --kind peagle --out src/peagle/default_heads/smollm2-135m-peagle &
python scripts/make_default_heads.py "${common[@]}" --kind eagle3 --out src/peagle/default_heads/smollm2-135m-eagle3 &
wait
