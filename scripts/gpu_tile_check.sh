#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: the grouped-GEMM tile
# tests (every tile against the f32 reference and the mma.sync tile, the permutation's
# tile tables), also with the persistent grid capped at 3 CTAs (several units per CTA),
# then moe_layer_bench sweeping the 128-row tiles at the compute-bound sizes, with each
# tile's two GEMMs timed alone. Prints a short table last.
#   PACK=.gpu BIN=.gpu/bin OUT=$OUT bash scripts/gpu_tile_check.sh
#   TILE_TOKENS=1024,4096,16384 TILE_LIST=ws128,ws128pp,pp128  (defaults)
#   TILE_TESTS=0: the benchmark only
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/tile_check}
TOKENS=${TILE_TOKENS:-1024,4096,16384}
TILES=${TILE_LIST:-ws128,ws128pp,pp128}
mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER
stamp() { echo "== $(date +%T) $*"; }

if [ "${TILE_TESTS:-1}" != 0 ]; then
  filter='AllTiles/*:CudaMoeTest.*:CudaPermuteTest.*'
  for cap in "" 3; do
    stamp "cuda_test $filter ${cap:+(FLEXPERT_GEMM_MAX_CTAS=$cap)}"
    FLEXPERT_GEMM_MAX_CTAS=$cap timeout 240 "$BIN/cuda_test" --gtest_filter="$filter" \
      >"$OUT/tiles${cap}.log" 2>&1
    echo "exit $?"
    grep -E "vs mma64|FAILED|Failure|PASSED" "$OUT/tiles${cap}.log" | head -20
  done
fi

stamp "moe_layer_bench --tokens $TOKENS --sweep --profile --tiles $TILES"
timeout 420 "$BIN/moe_layer_bench" --tokens "$TOKENS" --sweep --profile --tiles "$TILES" \
  --json "$OUT/tile_sweep.json" >"$OUT/tile_sweep.log" 2>&1
echo "exit $?"
grep -vE "^\s*$" "$OUT/tile_sweep.log" | tail -40
