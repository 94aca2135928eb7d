#!/usr/bin/env bash
# The kernel and drafter-dtype tests under each instruction-set level of the CPU kernels this CPU runs
# (DSPARK_CPU_ISA: docs/usage.md) and with the kernels off (DSPARK_CPU_KERNELS=0); a level the CPU cannot run
# is skipped. Each level builds its own kernels once (~1 min on two cores, cached beside the native build).
# torch's own dispatch is held to the level too (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
# MKL_ENABLE_INSTRUCTIONS), so its bf16 products run as on a CPU of that level. The native level is the
# main test run's (.ci/run); name it to run it here too.
#   bash scripts/isa_matrix.sh                      # avx2 avx512 avx512_bf16 amx off, those this CPU runs
#   bash scripts/isa_matrix.sh avx512 off           # the levels named (native among them if wanted)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TESTS=(tests/test_kernels.py tests/test_dspark_drafter_dtypes.py tests/test_q4_1.py tests/test_gguf_blocks.py
       tests/test_fused_proposal.py tests/test_draft_topk.py tests/test_dspark_drafter.py tests/test_models.py
       tests/test_gemma3.py tests/test_attention.py tests/test_kernel_isa.py tests/test_recurrent_kernels.py)
levels=("$@")
[ ${#levels[@]} -gt 0 ] || levels=(avx2 avx512 avx512_bf16 amx off)
supported=" $($PY -c 'from dspark.kernels.compiled import supported_isas; print(" ".join(supported_isas()))') "
command -v "${CXX:-c++}" >/dev/null || supported=" "  # no compiler (torch's builder runs $CXX): kernels off only

torch_env() {  # torch's own kernels, oneDNN's and MKL's held to the level
  case "$1" in
    avx2) echo "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" ;;
    avx512) echo "ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512" ;;
    avx512_bf16) echo "ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" ;;
  esac
}

summary=() failed=0
for level in "${levels[@]}"; do
  case "$level" in
    off) env_=(DSPARK_CPU_KERNELS=0) ;;
    native|avx2|avx512|avx512_bf16|amx)
      if [[ "$supported" != *" $level "* ]]; then
        summary+=("$(printf '%-12s skipped: this CPU cannot run it (or no C++ compiler)' "$level")")
        continue
      fi
      # shellcheck disable=SC2207
      env_=(DSPARK_CPU_ISA="$level" DSPARK_CPU_KERNELS=require $(torch_env "$level")) ;;
    *) echo "isa_matrix: unknown level $level (native, avx2, avx512, avx512_bf16, amx, off)" >&2; exit 2 ;;
  esac
  echo "== $level: ${env_[*]}"
  start=$SECONDS
  if [ "$level" != off ] && ! env "${env_[@]}" "$PY" -m dspark.kernels; then
    summary+=("$(printf '%-12s FAILED: the kernels did not build' "$level")")
    failed=1
    continue
  fi
  log=$(mktemp)
  env "${env_[@]}" "$PY" -m pytest -q "${TESTS[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  result=$(grep -E '(passed|failed|error)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  rm -f "$log"
  [ "$rc" = 0 ] || failed=1
  summary+=("$(printf '%-12s %s (%ss with the build)' "$level" "${result:-pytest exited $rc}" $((SECONDS - start)))")
done
echo "== ISA matrix (${#TESTS[@]} test files)"
printf '%s\n' "${summary[@]}"
exit $failed
