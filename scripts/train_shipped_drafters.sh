#!/usr/bin/env bash
# Reproduces the drafters shipped in dspark/assets/drafters/ for SmolLM2-135M-Instruct (2 CPU cores,
# about 75 minutes: data ~40 min, features ~6 min, DSpark and DFlash trained side by side ~38 min,
# calibration ~3 min). Every step is resumable: rerun the script after an interruption.
#   bash scripts/train_shipped_drafters.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
DATA=data/smollm2_train
STEPS=${STEPS:-1300}

# 1. the target regenerates answers to ../shared/datasets/train prompts (never eval/), bf16, greedy
python -m dspark prepare-data --out "$DATA" --max-prompts 1500 --max-tokens 192 --max-prompt-tokens 384 \
    --batch-size 128 --dtype bfloat16 --num-threads 2
# 2. target features once (taps + final hidden + full-vocab logsumexp), shared by DSpark and DFlash
python -m dspark train --config configs/train_dspark_smollm2.json --data "$DATA" --out runs/dspark1 \
    --precompute-features --set num_threads=2
# 3. DSpark and DFlash with the same data and budget, one core each
python -m dspark train --config configs/train_dspark_smollm2.json --data "$DATA" --out runs/dspark1 \
    --set max_steps="$STEPS" --set num_threads=1 --no-progress --resume &
python -m dspark train --config configs/train_dflash_smollm2.json --data "$DATA" --out runs/dflash1 \
    --set max_steps="$STEPS" --set num_threads=1 --no-progress --resume &
wait
# 4. Sequential Temperature Scaling on the held-out split of the training data (not eval/)
python -m dspark calibrate --drafter runs/dspark1/export --data "$DATA" --num-prompts 0 --max-tokens 256 \
    --plot docs/img/reliability_dspark_smollm2.png
# 5. ship
mkdir -p dspark/assets/drafters
rm -rf dspark/assets/drafters/dspark-smollm2-135m dspark/assets/drafters/dflash-smollm2-135m
cp -r runs/dspark1/export dspark/assets/drafters/dspark-smollm2-135m
cp -r runs/dflash1/export dspark/assets/drafters/dflash-smollm2-135m
