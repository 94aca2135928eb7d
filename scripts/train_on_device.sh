#!/usr/bin/env bash
# Generate drafter training data with the engine and train a drafter for a fixed number of minutes on an
# accelerator, exporting the weights as safetensors shards of at most SHARD_MB each. Every setting is an
# environment variable (defaults for a CUDA machine and the embedded SmolLM2 target):
#   DEVICE=cuda MINUTES=30 bash scripts/train_on_device.sh
# MODEL (target), METHOD (dspark | dflash | eagle3), CONFIG (train preset), PROMPTS (train prompt folder, never
# eval/), MAX_PROMPTS, MAX_TOKENS, MAX_PROMPT_TOKENS, MIN_ANSWER_TOKENS, BATCH (concurrent requests while generating), SPEC (the
# generating engine's speculative config: "default" = the shipped drafter, "none", or a JSON object), HOLDOUT,
# OUT (run folder), SHARD_MB, PYTHON; MAGPIE (prompts the target writes itself, beside PROMPTS), DATA_MINUTES
# (generate for at most this long; MINUTES is then the training's own), SEED_DATA (a prepare-data folder to go on
# from: its prompts are not generated again), EAGER (1, the default: generate without CUDA graphs, whose
# replay raised a device-side assert on an H200; 0: with them, --no-enforce-eager); EXTRA: more `--set key=value` train overrides (space-separated).
# The lr schedule spans the steps that fit MINUTES (schedule_by_time).
# Writes OUT/data (prepare-data), OUT/train (train.log, metrics.jsonl, checkpoints/), OUT/export (the drafter).
# CPU test: tests/test_train_on_device.py runs it end to end on a tiny model with DEVICE=cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-30}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
METHOD=${METHOD:-dspark}
CONFIG=${CONFIG:-configs/train_${METHOD}_smollm2.json}
PROMPTS=${PROMPTS:-../shared/datasets/train}
MAX_PROMPTS=${MAX_PROMPTS:-100000}
MAX_TOKENS=${MAX_TOKENS:-384}
MAX_PROMPT_TOKENS=${MAX_PROMPT_TOKENS:-1024}
MIN_ANSWER_TOKENS=${MIN_ANSWER_TOKENS:-14}
BATCH=${BATCH:-128}
SPEC=${SPEC:-default}
HOLDOUT=${HOLDOUT:-0.05}
OUT=${OUT:-runs/device_${METHOD}}
SHARD_MB=${SHARD_MB:-16}
EXTRA=${EXTRA:-}
MAGPIE=${MAGPIE:-0}
DATA_MINUTES=${DATA_MINUTES:-}
SEED_DATA=${SEED_DATA:-}
case "$PROMPTS" in *datasets/eval*) echo "error: PROMPTS must not be the eval/ prompts" >&2; exit 2;; esac
mkdir -p "$OUT"
if [ -n "$SEED_DATA" ] && [ ! -d "$OUT/data" ]; then cp -r "$SEED_DATA" "$OUT/data"; fi
gen_args=()
[ "$SPEC" != "none" ] && gen_args=(--speculative-config "$SPEC")
[ -n "$DATA_MINUTES" ] && gen_args+=(--max-minutes "$DATA_MINUTES")
[ "${EAGER:-1}" = 0 ] && gen_args+=(--no-enforce-eager)
# 1. data: the target answers the train prompts at high concurrency, speculation on (lossless at T=0),
#    duplicates dropped; resumable (a rerun skips what is written)
"$PYTHON" -m dspark prepare-data --model "$MODEL" --out "$OUT/data" --prompts "$PROMPTS" --max-prompts "$MAX_PROMPTS" \
    --max-tokens "$MAX_TOKENS" --max-prompt-tokens "$MAX_PROMPT_TOKENS" --min-answer-tokens "$MIN_ANSWER_TOKENS" --batch-size "$BATCH" --holdout "$HOLDOUT" \
    --magpie "$MAGPIE" --device "$DEVICE" "${gen_args[@]}" 2>&1 | tee -a "$OUT/prepare.log"
# 2. train for MINUTES minutes (features cached once on the device, bf16 autocast), export sharded weights
set_args=(--set model="\"$MODEL\"" --set max_minutes="$MINUTES" --set export_shard_mb="$SHARD_MB"
          --set drafter_autocast='"bfloat16"' --set feature_cache="\"$OUT/features\"" --set num_threads=null --set schedule_by_time=true)
for kv in $EXTRA; do set_args+=(--set "$kv"); done
"$PYTHON" -m dspark train --config "$CONFIG" --data "$OUT/data" --out "$OUT/train" --export "$OUT/export" \
    --device "$DEVICE" "${set_args[@]}" --resume --no-progress 2>&1 | tee -a "$OUT/train_stdout.log"
# 3. every exported shard within the limit
"$PYTHON" - "$OUT/export" "$SHARD_MB" <<'PY'
import sys
from pathlib import Path
limit = float(sys.argv[2]) * 2 ** 20
files = sorted(Path(sys.argv[1]).glob("*.safetensors"))
big = [f.name for f in files if f.stat().st_size > limit]
assert files and not big, f"shards over {sys.argv[2]} MB: {big or 'no weights written'}"
print(f"exported {len(files)} safetensors file(s), largest {max(f.stat().st_size for f in files) / 2 ** 20:.2f} MB")
PY
