#!/usr/bin/env bash
# The DSpark drafter ablation (docs/results-index.md) on SmolLM2-135M-Instruct, 2 CPU cores: one data set the
# target writes with speculation on (train/ prompts, never eval/), target features once, then arms trained
# from the same data, features, batch, lr schedule and steps, two at a time (one thread each), each exporting
# the validation with the highest held-out tau_process. Every step resumes: rerun after an interruption.
#   bash scripts/ablate_dspark.sh                 # RUNS=runs/ablation PROMPTS=1200 STEPS=300
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/ablation}
PROMPTS=${PROMPTS:-1200}
STEPS=${STEPS:-300}
PY=${PY:-.venv/bin/python}
DATA=$RUNS/data
COMMON=(--config configs/train_dspark_smollm2.json --data "$DATA" --no-progress
        --set feature_cache="\"$RUNS/features\"" --set max_steps="$STEPS" --set eval_every=100
        --set select_by='"tau_process"' --set ckpt_every=50)

# 1. data: the served default (q4_1 target products, the shipped drafter with prompt lookup first) at 96
#    conversations per engine call; greedy, so the answers are the plain answers
$PY -m dspark prepare-data --out "$DATA" --max-prompts "$PROMPTS" --max-tokens 192 --max-prompt-tokens 384 \
    --batch-size 96 --matmul-dtype q4_1 --num-threads 2 --speculative-config default
# 2. target features once (taps, final hidden, log-sum-exp), shared by every arm
$PY -m dspark train "${COMMON[@]}" --out "$RUNS/features_pass" --precompute-features --set num_threads=2
# 3. the arms: NAME and its --set overrides
arm() {
  local name=$1; shift
  $PY -m dspark train "${COMMON[@]}" --out "$RUNS/$name" --resume "$@" > "$RUNS/$name.log" 2>&1
}
arm init_random &
arm warm_target --set warm_start='"target"' &
wait
# 4. the Markov head variants at the winning start: the arm with the higher best held-out tau_process
best_tau() { $PY -c 'import json,sys; print(max(json.loads(l).get("tau_process", 0) for l in open(sys.argv[1])))' "$1"; }
WARM=$($PY -c 'import sys; print("target" if float(sys.argv[2]) > float(sys.argv[1]) else "none")' \
    "$(best_tau "$RUNS/init_random/metrics.jsonl")" "$(best_tau "$RUNS/warm_target/metrics.jsonl")")
echo "Markov variants start from warm_start $WARM"
arm markov_gated --set warm_start="\"$WARM\"" --set markov_head_type='"gated"' &
arm markov_rnn --set warm_start="\"$WARM\"" --set markov_head_type='"rnn"' &
wait
# 5. where 4x the drafted blocks go, at the starting recipe (the reference is init_random: 8 sequences x 32
#    anchors a step): 4x the anchors per sequence, 4x the sequences a step (4 batches accumulated), 4x the steps
arm anchors_128 --set num_anchors=128 &
arm anchors_32_accum4 --set grad_accum=4 &
wait
arm anchors_32_steps4x --set max_steps=$((4 * STEPS)) --set eval_every=$STEPS --set ckpt_every=100
# 6. a warm stage from the shipped drafter (docs/results-index.md: run from the stage-5 weights) on this data (answers
#    to prompts its earlier stages saw), DSpark's loss against a 10x CE weight (loss_ce 1.0, the DFlash weight on the
#    greedy label): whether more steps or the loss mix pay without new data
SHIPPED='"dspark/assets/drafters/dspark-smollm2-135m"'
arm warm_seen_ref --set init_from="$SHIPPED" --set lr=2e-4 --set max_steps=400 --set eval_every=200 &
arm warm_seen_ce1 --set init_from="$SHIPPED" --set lr=2e-4 --set max_steps=400 --set eval_every=200 --set loss_ce=1.0 &
wait
