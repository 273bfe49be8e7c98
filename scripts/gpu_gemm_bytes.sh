#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: what the layer's two
# expert GEMMs (the first two wgmma_ws_kernel launches of moe_layer_bench: gate/up, then
# down) read from DRAM, how long they take and their L2 hit rate, under Nsight Compute
# at the GPU's own clocks, for each variant (`NAME:ENV,...`, as scripts/gpu_ab.sh) and
# each `shape:tokens` case; then a table (docs/cuda.md, "One MoE layer on an H200": where
# DeepSeek-V3's DRAM excess comes from, measured this way).
#   PACK=.gpu source scripts/gpu_env.sh; echo quit | nvidia-cuda-mps-control
#   VARIANTS="old:@.gpu/old new:" OUT=$OUT bash scripts/gpu_gemm_bytes.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/variants.sh
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/gpu_gemm_bytes}
CASES=${CASES:-deepseek-v3:4096 qwen3-30b-a3b:4096}
VARIANTS=${VARIANTS:-"default:"}
export CUDA_MODULE_LOADING=EAGER
mkdir -p "$OUT"
command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 1; }

for c in $CASES; do
  shape=${c%%:*} tokens=${c#*:}
  for v in $VARIANTS; do
    name=${v%%:*} envs=()
    variant_envs "${v#*:}"
    log="$OUT/${shape}_${tokens}_$name.log"
    env "${envs[@]}" timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none \
      --kernel-name regex:wgmma_ws_kernel --launch-count 2 \
      --metrics dram__bytes_read.sum,gpu__time_duration.sum,lts__t_sector_hit_rate.pct \
      "$BIN/moe_layer_bench" --shapes "$shape" --tokens "$tokens" >"$log" 2>&1
    echo "== $shape $tokens $name: exit $?"
  done
done

# One line per case and variant: the two launches' DRAM bytes, time and L2 hit rate.
echo
printf '%-14s %6s %-10s %s\n' shape tokens variant "gate/up: GB us hit% | down: GB us hit%"
for c in $CASES; do
  shape=${c%%:*} tokens=${c#*:}
  for v in $VARIANTS; do
    name=${v%%:*}
    awk -v s="$shape" -v t="$tokens" -v n="$name" '
      # Values in the units Nsight Compute picked, scaled to GB and us.
      $1 == "dram__bytes_read.sum" { f = $2 == "Tbyte" ? 1e3 : $2 == "Gbyte" ? 1 : $2 == "Mbyte" ? 1e-3 : 1e-6
                                     b[++nb] = $3 * f }
      $1 == "gpu__time_duration.sum" { f = $2 == "ms" ? 1e3 : $2 == "us" ? 1 : $2 == "s" ? 1e6 : 1e-3
                                       d[++nd] = $3 * f }
      $1 == "lts__t_sector_hit_rate.pct" { h[++nh] = $3 }
      END { printf "%-14s %6s %-10s %.2f %.0f %.1f | %.2f %.0f %.1f\n", s, t, n,
                   b[1], d[1], h[1], b[2], d[2], h[2] }' \
      <(tr -d ',' <"$OUT/${shape}_${tokens}_$name.log")
  done
done
