#!/usr/bin/env bash
# The runs of several GPUs (one rank per GPU over NVLink, and several per GPU under MPS),
# on a machine of GPUS GPUs with the binaries packed by scripts/gpu_pack.sh:
#   PACK=.gpu source scripts/gpu_env.sh; OUT=out/multi GPUS=2 bash scripts/gpu_multi_check.sh
# 1. ep_exchange_bench: the device EP exchange at DeepSeek-V3 shapes (hidden 7168, top-8,
#    256 experts), 128 and 4096 tokens per rank: 2 and 4 ranks over the GPUs, and the same
#    ranks on one GPU under MPS.
# 2. EPLB between GPU ranks: bench/eplb_serve.sh with `serve --device cuda --gpus GPUS` on a
#    synthetic Qwen3-30B-A3B (bf16, 4 layers): bytes the mover copied, in how long, and the
#    stall it caused.
# 3. flexpert bench elastic --device cuda --gpus GPUS, both modes (ELASTIC_EVENTS, default
#    4 ranks -> 8 -> 6, then a kill).
# 4. bench serve with SERVE_RUNS ranks over the GPUs (scripts/gpu_ep_check.sh).
# Everything lands in $OUT/multi.tgz (the device tool brings few files back); summary last.
# STEPS="ep eplb elastic serve" picks steps.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-out/multi}
PACK=${PACK:-.gpu}
BIN=$PACK/bin
GPUS=${GPUS:-2}
STEPS=${STEPS:-ep eplb elastic serve}
W=$(mktemp -d /tmp/multi.XXXX)
mkdir -p "$OUT"
stamp() { echo "== $(date +%T) $*"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi topo -m >"$W/topo.txt" 2>&1

if has ep; then
  for rg in "2 $GPUS" "2 1" "4 $GPUS" "4 1"; do
    read -r r g <<<"$rg"
    stamp "ep_exchange_bench: $r ranks on $g GPU(s)"
    timeout 180 "$BIN/ep_exchange_bench" --ranks "$r" --gpus "$g" --tokens 128,4096 \
      --json "$W/ep_r${r}_g${g}.json" 2>&1 | tee "$W/ep_r${r}_g${g}.log"
  done
fi

if has eplb; then
  DIR=/dev/shm/q30b-L4
  stamp "synth qwen3-30b-a3b --layers 4"
  timeout 120 "$BIN/flexpert" synth --preset qwen3-30b-a3b --layers 4 --out "$DIR" 2>&1 | tail -1
  stamp "EPLB between GPU ranks (2 ranks, --gpus $GPUS)"
  BIN=$BIN/flexpert SERVE_ARGS="--device cuda --gpus $GPUS --max-sequences 64" REQUESTS=256 \
    timeout 400 bash bench/eplb_serve.sh "$DIR" 2 2>&1 | tee "$W/eplb.log"
  cp out/bench-eplb-serve.json "$W/eplb.json" 2>/dev/null
  cp out/eplb-serve.log "$W/eplb-serve.log" 2>/dev/null
  rm -rf "$DIR"
fi

if has elastic; then
  EVENTS=${ELASTIC_EVENTS:-3:scale:8,6:scale:6,9:kill:1}
  stamp "bench elastic --gpus $GPUS --ranks 4 --max-ranks 8 --events $EVENTS"
  rm -rf /tmp/synth
  CUDA_MODULE_LOADING=LAZY timeout 420 "$BIN/flexpert" bench elastic --device cuda \
    --cuda-dtype f32 --gpus "$GPUS" --ranks 4 --max-ranks 8 --duration 12 --events "$EVENTS" \
    --cache /tmp/synth --modes live,stop-the-world --json "$W/elastic.json" \
    --plot "$W/elastic.png" >"$W/elastic.log" 2>&1
  echo "bench elastic rc $?"
  tail -30 "$W/elastic.log"
fi

if has serve; then
  stamp "bench serve: ${SERVE_RUNS:-8} ranks over $GPUS GPUs"
  OUT=$W/serve PACK=$PACK TESTS=0 GPUS=$GPUS RUNS="${SERVE_RUNS:-8}" timeout 400 \
    bash scripts/gpu_ep_check.sh 2>&1 | tail -12
  # gpu_ep_check.sh stops MPS at its end.
  nvidia-cuda-mps-control -d 2>/dev/null || true
fi

stamp "summary"
for f in "$W"/ep_r*.log; do
  [ -e "$f" ] && { echo "-- $(basename "$f")"; grep -E '^ +[0-9]+ +[0-9]+ ' "$f"; }
done
[ -e "$W/eplb.log" ] && grep -E 'rebalance:|stall:|balancedness' "$W/eplb.log"
[ -e "$W/elastic.log" ] && grep -iE 'stall|failed|mode' "$W/elastic.log" | tail -12
tar -C "$W" -czf "$OUT/multi.tgz" .
