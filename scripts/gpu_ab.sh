#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: an interleaved A/B of
# moe_layer_bench (the H200's timings drift by several per cent between runs and
# machines, so compare only within one run). Each variant is `NAME:ENV...` or
# `NAME:@DIR` (another packed bin/ directory, e.g. an older build copied to .gpu/old),
# run REPS times in turn; prints the layer and the two GEMMs per variant and shape.
#   PACK=.gpu source scripts/gpu_env.sh
#   VARIANTS="pdl: nopdl:FLEXPERT_NO_PDL=1" \
#     TOKENS=4096,16384 REPS=2 OUT=$OUT bash scripts/gpu_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/variants.sh
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/gpu_ab}
TOKENS=${TOKENS:-4096,16384}
SHAPES=${SHAPES:-qwen3-30b-a3b,deepseek-v3}
REPS=${REPS:-2}
VARIANTS=${VARIANTS:?"VARIANTS=\"name:ENV=1 name2:@dir ...\""}
export CUDA_MODULE_LOADING=EAGER
mkdir -p "$OUT"

for r in $(seq 1 "$REPS"); do
  for v in $VARIANTS; do
    name=${v%%:*} spec=${v#*:} bin=$BIN envs=()
    if [[ $spec == @* ]]; then
      bin=${spec#@}
    else
      variant_envs "$spec"
    fi
    log="$OUT/$name.$r.log"
    env "${envs[@]}" timeout "${BENCH_TIMEOUT:-200}" "$bin/moe_layer_bench" --shapes "$SHAPES" \
      --tokens "$TOKENS" --profile >"$log" 2>&1
    echo "== $name run $r: exit $?"
  done
done

# One line per (shape, tokens, variant): the layer and the GEMMs of every run.
echo
printf '%-14s %6s %-12s %s\n' shape tokens variant "layer us / gate_up us / down us (per run)"
for v in $VARIANTS; do
  name=${v%%:*}
  for r in $(seq 1 "$REPS"); do
    grep -E "tokens:|stages:" "$OUT/$name.$r.log" | paste - - |
      awk -v n="$name" '{
        for (i = 1; i <= NF; ++i) { if ($i == "gate_up") g = $(i + 1); if ($i == "down") d = $(i + 1) }
        printf "%-14s %6s %-12s %s / %s / %s\n", $1, $2, n, $4, g, d
      }'
  done
done | sort -k1,1 -k2,2n -k3,3 -s
