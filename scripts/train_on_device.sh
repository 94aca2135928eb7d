#!/usr/bin/env bash
# Generate drafter training data with the engine and train a drafter for a fixed number of minutes on an
# accelerator, exporting the weights as safetensors shards of at most SHARD_MB each. Every setting is an
# environment variable (defaults for a CUDA machine and the embedded SmolLM2 target):
#   DEVICE=cuda MINUTES=30 bash scripts/train_on_device.sh
# MODEL (target), METHOD (dspark | dflash | eagle3), CONFIG (train preset; "{method}" in it is replaced by the method),
# PROMPTS (train prompt folder, never eval/), MAX_PROMPTS, MAX_TOKENS, MAX_PROMPT_TOKENS, MIN_ANSWER_TOKENS, BATCH
# (concurrent requests while generating), SPEC (the generating engine's speculative config: "default" = the shipped
# drafter, "none", or a JSON object), HOLDOUT, OUT (run folder), SHARD_MB, PYTHON; MAGPIE (prompts the target writes
# itself, beside PROMPTS), DATA_MINUTES (generate for at most this long; MINUTES is then the training's own),
# SEED_DATA (a prepare-data folder to go on from: its prompts are not generated again), EAGER (1, the default:
# generate without CUDA graphs, whose replay raised a device-side assert on an H200; 0: with them,
# --no-enforce-eager); EXTRA: more `--set key=value` train overrides (space-separated; "{method}" replaced).
# METHODS (space-separated, default METHOD): several train side by side on one device from one data set and one
# feature pass (the presets share their taps), each into OUT/train_M and OUT/export_M; STEPS: every method runs
# exactly this many steps (the cosine over them; MINUTES stays a cap): the equal-budget comparison.
# Without STEPS the lr schedule spans the steps that fit MINUTES (schedule_by_time).
# Writes OUT/data (prepare-data), OUT/train (train.log, metrics.jsonl, checkpoints/), OUT/export (the drafter;
# with several METHODS, OUT/train_M and OUT/export_M).
# CPU test: tests/test_train_on_device.py runs it end to end on a tiny model with DEVICE=cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-30}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
METHOD=${METHOD:-dspark}
METHODS=${METHODS:-$METHOD}
CONFIG=${CONFIG:-"configs/train_{method}_smollm2.json"}
STEPS=${STEPS:-}
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
          --set drafter_autocast='"bfloat16"' --set feature_cache="\"$OUT/features\"" --set num_threads=null)
if [ -n "$STEPS" ]; then set_args+=(--set max_steps="$STEPS"); else set_args+=(--set schedule_by_time=true); fi
read -r -a methods <<< "$METHODS"
config_of() { echo "${CONFIG//\{method\}/$1}"; }
extra_of() { local kv; for kv in $EXTRA; do printf '%s\n' "--set" "${kv//\{method\}/$1}"; done; }
if [ "${#methods[@]}" -eq 1 ]; then
    mapfile -t extra < <(extra_of "${methods[0]}")
    "$PYTHON" -m dspark train --config "$(config_of "${methods[0]}")" --data "$OUT/data" --out "$OUT/train" --export "$OUT/export" \
        --device "$DEVICE" "${set_args[@]}" "${extra[@]}" --resume --no-progress 2>&1 | tee -a "$OUT/train_stdout.log"
    exports=("$OUT/export")
else
    # one feature pass for all (the first method's preset), then the methods side by side, each its own log
    mapfile -t extra < <(extra_of "${methods[0]}")
    "$PYTHON" -m dspark train --config "$(config_of "${methods[0]}")" --data "$OUT/data" --out "$OUT/features_run" \
        --device "$DEVICE" "${set_args[@]}" "${extra[@]}" --precompute-features --no-progress 2>&1 | tee -a "$OUT/train_stdout.log"
    pids=(); exports=()
    for m in "${methods[@]}"; do
        mapfile -t extra < <(extra_of "$m")
        "$PYTHON" -m dspark train --config "$(config_of "$m")" --data "$OUT/data" --out "$OUT/train_$m" --export "$OUT/export_$m" \
            --device "$DEVICE" "${set_args[@]}" "${extra[@]}" --resume --no-progress > "$OUT/train_$m.log" 2>&1 &
        pids+=($!); exports+=("$OUT/export_$m")
    done
    for i in "${!pids[@]}"; do wait "${pids[$i]}" || { echo "error: ${methods[$i]} failed, see $OUT/train_${methods[$i]}.log" >&2; exit 1; }; done
fi
# 3. every exported shard within the limit
for export in "${exports[@]}"; do
"$PYTHON" - "$export" "$SHARD_MB" <<'PY'
import sys
from pathlib import Path
limit = float(sys.argv[2]) * 2 ** 20
files = sorted(Path(sys.argv[1]).glob("*.safetensors"))
big = [f.name for f in files if f.stat().st_size > limit]
assert files and not big, f"shards over {sys.argv[2]} MB: {big or 'no weights written'}"
print(f"exported {len(files)} safetensors file(s) to {sys.argv[1]}, largest {max(f.stat().st_size for f in files) / 2 ** 20:.2f} MB")
PY
done
