#!/usr/bin/env bash
# The exact commands behind the heads shipped in src/peagle/default_heads/ (CPU budget: see the README).
# Two cores: every stage runs two one-thread processes side by side.
set -euo pipefail
DATA=${DATA:-data}
STEPS=${STEPS:-2000}     # stage 1: optimizer steps from scratch
STEPS2=${STEPS2:-800}   # stage 2: optimizer steps continued on the combined data
STAGE1=${STAGE1:-runs/stage1}
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
        --num-parallel-positions 8 --grad-accum 2 --lr 1e-3 --max-steps "$STEPS" --threads 1)
python scripts/make_default_heads.py "${common[@]}" --kind peagle --out "$STAGE1/smollm2-135m-peagle" &
python scripts/make_default_heads.py "${common[@]}" --kind eagle3 --out "$STAGE1/smollm2-135m-eagle3" &
wait

# ---- stage 2: the templated prompts are narrow, so the target also writes user turns itself (Magpie) and
# answers them; both heads continue from stage 1 on old + new examples, again with the same steps each
python scripts/magpie_default_prompts.py --num 1000 --seed 1000 --out "$DATA/prompts_magpie_a.jsonl" &
python scripts/magpie_default_prompts.py --num 1000 --seed 2000 --out "$DATA/prompts_magpie_b.jsonl" &
wait
python scripts/magpie_default_prompts.py --merge "$DATA/prompts_magpie_a.jsonl" "$DATA/prompts_magpie_b.jsonl" \
    --out "$DATA/prompts_magpie.jsonl"
# of each half of the 2,000 merged turns, the first MAGPIE_PER_HALF were distilled (the session's CPU budget)
PER_HALF=${MAGPIE_PER_HALF:-768}
magpie=(--prompts "$DATA/prompts_magpie.jsonl" --batch-size 32 --max-new-tokens 256)
python scripts/distill_default_data.py "${magpie[@]}" --limit "$PER_HALF" --out "$DATA/magpie_train_a.jsonl" &
python scripts/distill_default_data.py "${magpie[@]}" --start 1000 --limit $((1000 + PER_HALF)) \
    --out "$DATA/magpie_train_b.jsonl" &
wait
cat "$DATA/default_train.jsonl" "$DATA/magpie_train_a.jsonl" "$DATA/magpie_train_b.jsonl" > "$DATA/combined_train.jsonl"
python scripts/make_default_heads.py --examples "$DATA/combined_train.jsonl" --cache-only \
    --feature-cache "$DATA/features_combined" --threads 2
stage2=(--examples "$DATA/combined_train.jsonl" --feature-cache "$DATA/features_combined" --num-parallel-positions 8
        --grad-accum 2 --lr 5e-4 --max-steps "$STEPS2" --threads 1)
for kind in peagle eagle3; do
    python scripts/make_default_heads.py "${stage2[@]}" --kind $kind --init-from "$STAGE1/smollm2-135m-$kind" \
        --out "src/peagle/default_heads/smollm2-135m-$kind" --run-dir "runs/stage2-$kind" &
done
wait

# ---- per-depth calibration of the heads' draft probabilities (cost-aware drafting multiplies them), fitted on
# held-out self-distilled prompts (the first 40 held-out examples; never the evaluation sets)
for kind in peagle eagle3; do
    peagle calibrate "src/peagle/default_heads/smollm2-135m-$kind" \
        --examples training_data/smollm2-135m-instruct/heldout --limit 40 --report "docs/results/calibration_$kind.json"
done
