#!/usr/bin/env bash
# The prepared device check for one GPU (under 8 minutes): greedy parity of speculative vs plain decoding on
# CUDA for every drafter, HF transformers' logits parity in bf16 (and fp32), graphs captured under allocator
# poison (a freed tensor read by a graph asserts at once), CUDA-graph replay == eager, batch-1 and c=32 tok/s
# plain vs speculative with and without graphs, TP=2 when two GPUs are present, and the new target families
# (tiny random Gemma 4 and hybrid Qwen3.5: device == CPU, speculative == plain, tok/s). One JSON out.
#
#   bash benchmarks/device_check.sh [OUT.json]        # default benchmarks/results/device_check_cuda.json
#
# Needs a CUDA build of the pinned torch in the environment (scripts/setup.sh installs the CPU wheel), e.g.
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# The CPU rehearsal of the same script (no GPU; checks the script, not CUDA):
#   python benchmarks/device_check.py --device cpu --quick --out /tmp/device_check_cpu.json
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results/device_check_cuda.json}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'device_check: torch sees no CUDA device')"
export DSPARK_CPU_KERNELS=0   # never build the CPU kernels on the GPU machine (the CUDA path does not use them)
timeout 470 python benchmarks/device_check.py --device cuda --out "$OUT"
python - "$OUT" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ok = r.get("pass") is True
print("device check:", "PASS" if ok else "FAIL", "->", sys.argv[1])
sys.exit(0 if ok else 1)
PY
