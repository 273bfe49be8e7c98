#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: the FP8 wgmma GEMM
# (fp8_experts.h, docs/cuda.md "FP8 experts") against its references, its
# cuda_test cases first alone (an illegal instruction would poison the process), also
# with the persistent grid capped at 3 CTAs (several units per CTA, the ring wrapping),
# then every FP8 test, then moe_layer_bench with --fp8-paths at both shapes. Prints a
# short table last.
#   PACK=.gpu BIN=.gpu/bin OUT=$OUT bash scripts/gpu_fp8_check.sh
#   FP8_TOKENS=1,4,16,64,256,1024,4096,16384 (default)  FP8_SANITIZE=1: memcheck first
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/fp8_check}
TOKENS=${FP8_TOKENS:-1,4,16,64,256,1024,4096,16384}
mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER
stamp() { echo "== $(date +%T) $*"; }
wgmma=(--gtest_filter='Fp8Wgmma*')

if [ "${FP8_SANITIZE:-0}" != 0 ]; then
  stamp "compute-sanitizer memcheck: FP8 wgmma cases"
  timeout 240 compute-sanitizer --tool memcheck --print-limit 5 "$BIN/cuda_test" "${wgmma[@]}" \
    >"$OUT/fp8_sanitize.log" 2>&1
  echo "exit $?"
  grep -E "ERROR SUMMARY|Illegal|Invalid|^=========     at" "$OUT/fp8_sanitize.log" | head -10
fi
for cap in "" 3; do
  stamp "cuda_test FP8 wgmma cases ${cap:+(FLEXPERT_GEMM_MAX_CTAS=$cap)}"
  FLEXPERT_GEMM_MAX_CTAS=$cap timeout 180 "$BIN/cuda_test" "${wgmma[@]}" \
    >"$OUT/fp8_wgmma${cap}.log" 2>&1
  echo "exit $?"
  grep -E "quantized activations|FAILED|Failure|PASSED" "$OUT/fp8_wgmma${cap}.log" | head -20
done
stamp "cuda_test *Fp8*"
timeout 240 "$BIN/cuda_test" --gtest_filter='*Fp8*' >"$OUT/fp8_tests.log" 2>&1
echo "exit $?"
grep -E "FAILED|PASSED" "$OUT/fp8_tests.log" | head -10

stamp "moe_layer_bench --fp8-paths decode,wgmma --tokens $TOKENS"
timeout 420 "$BIN/moe_layer_bench" --fp8-paths decode,wgmma --shapes deepseek-v3,qwen3-30b-a3b \
  --tokens "$TOKENS" --json "$OUT/fp8_bench.json" >"$OUT/fp8_bench.log" 2>&1
echo "exit $?"
grep -E "tokens:|fp8 experts" "$OUT/fp8_bench.log"
