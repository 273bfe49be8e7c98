#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: where the grouped
# GEMM's time goes. The SASS of the warp-specialised kernel's consumer loop (wgmma and
# the waits between them), then Nsight Compute on the first gathered gate/up launch of
# Qwen3-30B-A3B at 16384 tokens and DeepSeek-V3 at 4096 (speed of light, warp states).
#   PACK=.gpu BIN=.gpu/bin OUT=$OUT bash scripts/gpu_gemm_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/gemm_profile}
mkdir -p "$OUT"
stamp() { echo "== $(date +%T) $*"; }

stamp "SASS: wgmma_ws_kernel<128, gathered A>"
fn=$(cuobjdump -symbols "$BIN/moe_layer_bench" 2>/dev/null | grep -o '_ZN[^ ]*wgmma_ws_kernelILi128ELb0E[^ ]*' | head -1)
cuobjdump -sass -fun "$fn" "$BIN/moe_layer_bench" >"$OUT/ws128.sass" 2>&1
echo "HGMMA $(grep -c HGMMA "$OUT/ws128.sass"), WARPGROUP $(grep -c WARPGROUP "$OUT/ws128.sass")," \
  "SYNCS $(grep -c SYNCS "$OUT/ws128.sass"), lines $(wc -l <"$OUT/ws128.sass")"
grep -nE "HGMMA|WARPGROUP|SYNCS|BAR|DEPBAR|BRA" "$OUT/ws128.sass" | head -50

if command -v ncu >/dev/null; then
  for spec in "qwen3-30b-a3b 16384" "deepseek-v3 4096"; do
    set -- $spec
    stamp "ncu: $1 $2 tokens, first wgmma_ws_kernel launch"
    timeout 200 ncu --kernel-name regex:wgmma_ws_kernel --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
      --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
      "$BIN/moe_layer_bench" --shapes "$1" --tokens "$2" >"$OUT/ncu_$1.log" 2>&1
    echo "exit $?"
    grep -E "Duration|Throughput|Frequency|gmma|Stall|Warp Cycles|Issued|Eligible|Active Warps|Pipe" \
      "$OUT/ncu_$1.log" | head -40
  done
else
  echo "no ncu on this machine"
fi
