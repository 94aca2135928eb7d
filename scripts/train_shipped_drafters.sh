#!/usr/bin/env bash
# Reproduces the drafters shipped in dspark/assets/drafters/ for SmolLM2-135M-Instruct on 2 CPU cores,
# about 5.5 hours. Stage 1 (2026-11-29, ~2.5 h): data ~40 + ~25 min, features ~12 min, DSpark / DFlash /
# EAGLE-3 trained from scratch side by side (one thread each) ~75 min. Stage 2 (2026-12-02, ~2 h): a
# second data set (q4_1 target, Magpie-style prompts the target writes itself), features, and each
# drafter warm-started from its stage-1 weights (`init_from`, same draft vocabulary) for the same steps;
# stage 3 (2026-12-02, ~1.2 h): a third data set (the stage-2 one plus 1,500 more Magpie-style prompts), features,
# each drafter warm-started from its stage-2 weights for 1,000 steps, the export chosen by held-out tau_process;
# then calibration ~10 min. Every step is resumable: rerun after an interruption.
#   bash scripts/train_shipped_drafters.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
DATA=data/smollm2_train_v2

# 1. the target regenerates answers to ../shared/datasets/train prompts (never eval/), greedy: the first
#    1,500 shuffled prompts in bf16, then the remaining ones in fp32 with the fused kernels
#    (2x faster); prepare-data skips prompts already written
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
# warm-start stage N: the target (q4_1 products, the served default) answers every train prompt that fits plus
# MAGPIE requests it writes itself (prepare-data), features once, then each drafter of stage N-1 trains on them
# from its own weights (init_from: its weights and draft vocabulary), side by side; extra --set overrides follow
warm_stage() {
  local n=$1 magpie=$2; shift 2
  python -m dspark prepare-data --out data/smollm2_train_v$n --max-tokens 192 --max-prompt-tokens 384 \
      --batch-size 96 --matmul-dtype q4_1 --num-threads 2 --magpie "$magpie"
  python -m dspark train --config configs/train_dspark_smollm2.json --data data/smollm2_train_v$n \
      --out runs/features_v${n}_pass --precompute-features --set num_threads=2 \
      --set feature_cache="\"runs/features_v$n\"" --set init_from="\"runs/dspark$((n - 1))/export\"" --no-progress
  for m in dspark dflash eagle3; do
    python -m dspark train --config configs/train_${m}_smollm2.json --data data/smollm2_train_v$n --out runs/$m$n \
        --set feature_cache="\"runs/features_v$n\"" --set init_from="\"runs/$m$((n - 1))/export\"" "$@" \
        --no-progress --resume &
  done
  wait
}
# 3b. stage 2: 1,500 Magpie-style requests (chat-like; 1,327 kept), data ~23 min, features ~18 min; 1,200 steps,
#     warm-up + cosine from lr 3e-4, ~60 min
warm_stage 3 1500 --set lr=3e-4 --set max_steps=1200
# 3c. stage 3: --magpie 3000 asks for stage 2's 1,500 again with the same seeds and 1,500 new ones (2,602 kept),
#     data ~26 min, features ~13 min; 1,000 steps from lr 2e-4, validated every 250 steps, exporting the validation
#     with the highest tau_process (select_by; the starting weights included), ~32 min
warm_stage 4 3000 --set lr=2e-4 --set max_steps=1000 --set eval_every=250 --set select_by='"tau_process"'
DATA4=data/smollm2_train_v4
# 4. Sequential Temperature Scaling on the held-out split of the training data (not eval/): a greedy
#    fit and a sampling fit (calibration.json "greedy_temperatures" / "temperatures")
#    (with the served default's q4_1 target products, on the stage-3 held-out split)
python -m dspark calibrate --drafter runs/dspark4/export --data "$DATA4" --num-prompts 0 --max-tokens 192 \
    --temperature 0 --fit-bias --plot docs/img/reliability_dspark_smollm2_greedy.png --num-threads 2
python -m dspark calibrate --drafter runs/dspark4/export --data "$DATA4" --num-prompts 0 --max-tokens 192 \
    --temperature 1 --fit-bias --plot docs/img/reliability_dspark_smollm2.png --num-threads 2
# 5. ship
mkdir -p dspark/assets/drafters
for m in dspark dflash eagle3; do
  rm -rf dspark/assets/drafters/${m}-smollm2-135m
  cp -r runs/${m}4/export dspark/assets/drafters/${m}-smollm2-135m
done
# 6. the step-cost tables the adaptive policies of `dspark serve` read, one per matmul dtype of the target
#    (machine-specific: re-profile on yours)
python -m dspark profile --speculative-config '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m"}' \
    --matmul-dtype float32 --repeats 9 --out dspark/assets/drafters/dspark-smollm2-135m/cost_table.json
python -m dspark profile --speculative-config '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m"}' \
    --matmul-dtype bfloat16 --repeats 9 --out dspark/assets/drafters/dspark-smollm2-135m/cost_table_bf16.json
#    q4_1 per kind of kernels: cost_table_q4_1.json on AVX2, cost_table_q4_1_avx512.json on AVX-512
#    (bf16 LM head, VNNI pairs of Q4_1 tiles): dspark.drafters.shipped.shipped_cost_table
KIND=$(python -c 'from dspark.kernels import kernel_kind; print(kernel_kind())')
Q4_TABLE=cost_table_q4_1$([ "$KIND" = avx512 ] && echo _avx512).json
python -m dspark profile --speculative-config '{"method": "dspark", "model": "dspark/assets/drafters/dspark-smollm2-135m"}' \
    --matmul-dtype q4_1 --repeats 9 --out dspark/assets/drafters/dspark-smollm2-135m/$Q4_TABLE
