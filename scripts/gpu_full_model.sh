#!/usr/bin/env bash
# Decode throughput of a synthetic Qwen3-30B-A3B with all 48 layers on one GPU, and
# the elastic benchmark on the GPU machine's cores (more cores than the dev VM, so the
# commit stall is seen without CPU contention). Uses the binaries scripts/gpu_pack.sh
# put in .gpu/ (carry it). Logs and JSON under $OUT.
#   bash scripts/gpu_full_model.sh          (GPU_FULL_NO_ELASTIC=1: decode only)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export FLEXPERT_LOG=warn
t0=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t0))s] $*"; }
PACK=${PACK:-.gpu}
# shellcheck source=scripts/gpu_libs.sh
source scripts/gpu_libs.sh
BIN=.gpu/bin
df -h /dev/shm /tmp | tee "$OUT/df.txt"
# 48 layers of bf16 weights are ~61 GB: in RAM when /dev/shm can hold them.
avail_gb=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
LAYERS=${LAYERS:-48}
DIR=/dev/shm/q30b
if [ "$avail_gb" -lt 66 ]; then DIR=/tmp/q30b; LAYERS=${LAYERS_FALLBACK:-24}; fi
stamp "synth qwen3-30b-a3b, $LAYERS layers, into $DIR"
$BIN/flexpert synth --preset qwen3-30b-a3b --layers "$LAYERS" --out "$DIR" 2>&1 | tail -2
du -sh "$DIR"
stamp "bench generate --device cuda (bf16)"
timeout 300 $BIN/flexpert bench generate --model "$DIR" --device cuda --batches 1,16,128,1,16,128 \
  --prompt-len 64 --gen-tokens 32 --json "$OUT/qwen3-30b-a3b-L$LAYERS.json" 2>&1 | tail -9
# GPU_FULL_BASELINE=path/to/flexpert: the same benchmark with another build (an A/B in one run).
if [ -n "${GPU_FULL_BASELINE:-}" ]; then
  stamp "baseline $GPU_FULL_BASELINE: bench generate --device cuda (bf16)"
  timeout 300 "$GPU_FULL_BASELINE" bench generate --model "$DIR" --device cuda \
    --batches 1,16,128,1,16,128 --prompt-len 64 --gen-tokens 32 \
    --json "$OUT/qwen3-30b-a3b-L$LAYERS-baseline.json" 2>&1 | tail -9
fi
rm -rf "$DIR"
if [ -z "${GPU_FULL_NO_ELASTIC:-}" ]; then
  stamp "bench elastic (CPU path, $(nproc) cores)"
  timeout 120 $BIN/flexpert bench elastic --cache /tmp/synth --json "$OUT/bench-elastic.json" \
    --plot "" 2>&1 | grep -v '^\[\|^  {' | tail -22
fi
stamp "done"
