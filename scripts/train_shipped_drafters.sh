#!/usr/bin/env bash
# Reproduces the drafters shipped in dspark/assets/drafters/ for SmolLM2-135M-Instruct on 2 CPU cores,
# about 4.5 hours. Stage 1 (session 4, ~2.5 h): data ~40 + ~25 min, features ~12 min, DSpark / DFlash /
# EAGLE-3 trained from scratch side by side (one thread each) ~75 min. Stage 2 (session 16, ~2 h): a
# second data set (q4_1 target, Magpie-style prompts the target writes itself), features, and each
# drafter warm-started from its stage-1 weights (`init_from`, same draft vocabulary) for the same steps;
# then calibration ~10 min. Every step is resumable: rerun after an interruption.
#   bash scripts/train_shipped_drafters.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
DATA=data/smollm2_train_v2

# 1. the target regenerates answers to ../shared/datasets/train prompts (never eval/), greedy: the first
#    1,500 shuffled prompts in bf16 (session 1), then the remaining ones in fp32 with the fused kernels
#    (session 4, 2x faster); prepare-data skips prompts already written
python -m dspark prepare-data --out "$DATA" --max-prompts 1500 --max-tokens 192 --max-prompt-tokens 384 \
    --batch-size 128 --dtype bfloat16 --num-threads 2
python -m dspark prepare-data --out "$DATA" --max-prompts 3130 --max-tokens 192 --max-prompt-tokens 384 \
    --batch-size 48 --dtype float32 --num-threads 2
# 2. target features once (taps + final hidden + full-vocab logsumexp), shared by the three methods
python -m dspark train --config configs/train_dspark_smollm2.json --data "$DATA" --out runs/features_v2_pass \
    --precompute-features --set num_threads=2 --no-progress
# 3. DSpark, DFlash and EAGLE-3 with the same data, features, batch and steps, side by side
for m in dspark dflash eagle3; do
  python -m dspark train --config configs/train_${m}_smollm2.json --data "$DATA" --out runs/${m}2 \
      --no-progress --resume &
done
wait
# 3b. stage 2: the target (q4_1 products, the served default) answers every train prompt that fits plus
#     1,500 requests it writes itself (Magpie-style, chat-like; 1,327 kept), ~23 min; features ~18 min; each
#     stage-1 drafter trains on them from its own weights (init_from: its weights and draft vocabulary),
#     1,200 steps with the same batch and a warm-up + cosine schedule from lr 3e-4, side by side, ~60 min
DATA3=data/smollm2_train_v3
python -m dspark prepare-data --out "$DATA3" --max-tokens 192 --max-prompt-tokens 384 --batch-size 96 \
    --matmul-dtype q4_1 --num-threads 2 --magpie 1500
python -m dspark train --config configs/train_dspark_smollm2.json --data "$DATA3" --out runs/features_v3_pass \
    --precompute-features --set num_threads=2 --set feature_cache='"runs/features_v3"' \
    --set init_from='"runs/dspark2/export"' --no-progress
for m in dspark dflash eagle3; do
  python -m dspark train --config configs/train_${m}_smollm2.json --data "$DATA3" --out runs/${m}3 \
      --set feature_cache='"runs/features_v3"' --set init_from="\"runs/${m}2/export\"" --set lr=3e-4 \
      --set max_steps=1200 --no-progress --resume &
done
wait
# 4. Sequential Temperature Scaling on the held-out split of the training data (not eval/): a greedy
#    fit and a sampling fit (calibration.json "greedy_temperatures" / "temperatures")
#    (stage 2: with the served default's q4_1 target products, on the stage-2 held-out split)
python -m dspark calibrate --drafter runs/dspark3/export --data "$DATA3" --num-prompts 0 --max-tokens 192 \
    --temperature 0 --fit-bias --plot docs/img/reliability_dspark_smollm2_greedy.png --num-threads 2
python -m dspark calibrate --drafter runs/dspark3/export --data "$DATA3" --num-prompts 0 --max-tokens 192 \
    --temperature 1 --fit-bias --plot docs/img/reliability_dspark_smollm2.png --num-threads 2
# 5. ship
mkdir -p dspark/assets/drafters
for m in dspark dflash eagle3; do
  rm -rf dspark/assets/drafters/${m}-smollm2-135m
  cp -r runs/${m}3/export dspark/assets/drafters/${m}-smollm2-135m
done
# 6. the step-cost tables the adaptive policies of `dspark serve` read, one per matmul dtype of the target
#    (machine-specific: re-profile on yours)
python -m dspark profile --speculative-config '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m"}' \
    --matmul-dtype float32 --repeats 9 --out dspark/assets/drafters/dspark-smollm2-135m/cost_table.json
python -m dspark profile --speculative-config '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m"}' \
    --matmul-dtype bfloat16 --repeats 9 --out dspark/assets/drafters/dspark-smollm2-135m/cost_table_bf16.json
#    q4_1 per kind of kernels: cost_table_q4_1.json on AVX2 (session 13), cost_table_q4_1_avx512.json on AVX-512
#    (bf16 LM head, VNNI pairs of Q4_1 tiles; session 14): dspark.drafters.shipped.shipped_cost_table
KIND=$(python -c 'from dspark.kernels import kernel_kind; print(kernel_kind())')
Q4_TABLE=cost_table_q4_1$([ "$KIND" = avx512 ] && echo _avx512).json
python -m dspark profile --speculative-config '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m"}' \
    --matmul-dtype q4_1 --repeats 9 --out dspark/assets/drafters/dspark-smollm2-135m/$Q4_TABLE
