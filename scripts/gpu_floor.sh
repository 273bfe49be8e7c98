#!/usr/bin/env bash
# Decode against its byte floor on the GPU machine, with binaries packed by
# scripts/gpu_pack.sh (PACK=... as there):
#   OUT=out/floor bash scripts/gpu_floor.sh
# bench generate --floor for the 48-layer Qwen3-30B-A3B and the 27-layer DeepSeek-V2-Lite
# (synthetic, bf16) at batch 1, 16 and 128, twice (the second pass is the figure: the first
# includes each batch's graph capture).
set -uo pipefail
OUT=${OUT:-out/floor}
PACK=${PACK:-.gpu}
mkdir -p "$OUT"
PACK=$PACK source scripts/gpu_env.sh
for spec in qwen3-30b-a3b:48 deepseek-v2-lite:27; do
  preset=${spec%%:*} layers=${spec##*:}
  rm -rf /tmp/synth  # 64 GiB of disk: one synthetic model at a time.
  echo "== $(date +%T) $preset, $layers layers"
  timeout 500 "$PACK/bin/flexpert" bench generate --preset "$preset" --layers "$layers" \
    --device cuda --batches 1,16,128,1,16,128 --gen-tokens 32 --floor --cache /tmp/synth \
    --json "$OUT/$preset.json" 2>&1 | tr '\r' '\n' | grep -v '^synthesising\|^loading' | tail -5
done
echo quit | nvidia-cuda-mps-control
