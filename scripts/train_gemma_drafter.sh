#!/usr/bin/env bash
# The DSpark drafter for gemma-3-270m (a base model: plain-text continuations), on 2 CPU cores: the target
# continues train/ prompts (never eval/) with prompt-lookup speculation on, features once, DSpark trained from
# scratch (no warm start: Gemma's layers are not the drafter's), the export chosen by held-out tau_process, then
# the confidence head's temperatures fitted greedy and sampling on the held-out split. Every step resumes.
#   bash scripts/train_gemma_drafter.sh            # RUNS=runs/gemma3 PROMPTS=800 STEPS=400
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/gemma3}
PROMPTS=${PROMPTS:-800}
STEPS=${STEPS:-400}
PY=${PY:-.venv/bin/python}
DATA=$RUNS/data
TRAIN=(--config configs/train_dspark_gemma3.json --data "$DATA" --no-progress
       --set feature_cache="\"$RUNS/features\"" --set max_steps="$STEPS" --set export_shard_mb=40)

$PY -m dspark prepare-data --model gemma-3-270m --out "$DATA" --prompt-format plain --max-prompts "$PROMPTS" \
    --max-tokens 128 --max-prompt-tokens 256 --batch-size 64 --num-threads "${THREADS:-1}" \
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
$PY -m dspark train "${TRAIN[@]}" --out "$RUNS/features_pass" --precompute-features --set num_threads=2
$PY -m dspark train "${TRAIN[@]}" --out "$RUNS/dspark" --resume --set num_threads=2
for t in 0 1; do
  $PY -m dspark calibrate --model gemma-3-270m --drafter "$RUNS/dspark/export" --data "$DATA" --num-prompts 0 \
      --max-tokens 128 --temperature $t --fit-bias --num-threads 2
done
