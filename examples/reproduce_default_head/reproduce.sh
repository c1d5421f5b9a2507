#!/usr/bin/env bash
# Reproduce the shipped P-EAGLE head's recipe at a small size: data growth, training, calibration, model card.
# Usage: bash examples/reproduce_default_head/reproduce.sh OUT_DIR   (STEPS=... CYCLES=... to go further)
set -euo pipefail
OUT=${1:-runs/reproduce}
STEPS=${STEPS:-200}          # optimizer steps (the shipped head: 35,660 over 26 stages)
CYCLES=${CYCLES:-1}          # new data cycles grown to show the step (the shipped data: about 240 cycles)
DATA=training_data/smollm2-135m-instruct
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

# 1. data growth: new cycles (numbered after those already in $DATA, which are skipped), packed into shards
peagle grow-data --out "$OUT/rows.jsonl" --first_cycle 5000 --cycles $((5000 + CYCLES)) --magpie_per_cycle 8 \
    --code_per_cycle 4 --max_new_tokens 128
peagle pack "$OUT/rows.jsonl" "$OUT/grown"

# 2. training on the repository's shards (the flags are the fields of peagle.training.arguments)
peagle train --examples "$DATA/train" --output_dir "$OUT/head" --num_hidden_layers 4 --draft_vocab_size 8192 \
    --num_parallel_positions 8 --cod_ratio 0.7 --max_steps "$STEPS" --gradient_accumulation_steps 4 \
    --trainable_parameters '^(?!lm_head)' --calibration_examples 0

# 3. calibration and the held-out figure
peagle calibrate "$OUT/head" --examples "$DATA/heldout" --limit 32
peagle evaluate --heads "$OUT/head" --examples "$DATA/heldout:48:16" --num_speculative_tokens 7 \
    --out "$OUT/heldout.json"

# 4. the model card, in the upload folder (nothing is uploaded)
peagle push "$OUT/head" you/SmolLM2-135M-Instruct-peagle --target default \
    --training "$OUT/head/train_summary.json" --prepare_only "$OUT/card"
echo "head: $OUT/head   card: $OUT/card/README.md   held-out: $OUT/heldout.json"
