#!/usr/bin/env bash
# Expert parallelism on one GPU, on the GPU machine, with the binaries that
#   BUILD=build-gep PACK=.gpu-gep bash scripts/gpu_pack.sh     (carry .gpu-gep)
# packed: the EP unit tests, the serve system test (4 ranks under MPS, reference tokens,
# rebalance, scale 4 -> 3 -> 4, graph captures) with the device exchange and again with
# FLEXPERT_EP_EXCHANGE=host, and `bench serve` on a synthetic Qwen3-30B-A3B (bf16, LAYERS
# layers) with 1 GPU rank, 4 (device exchange) and 4 (host exchange). Starts and stops MPS.
# TESTS=0: the benchmarks only. BUILT_AT=/path: where the packed binaries were built (the
# system test runs the flexpert binary and reads testdata at that build's paths).
# RUNS="1 4 4host" (default): the serve runs, ranks each, "host" = the host exchange;
# GPUS=N spreads the ranks over N GPUs (`serve --gpus N`, rank r on GPU r mod N). Logs
# under $OUT; summary last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu-ep}
PACK=${PACK:-.gpu-gep}
BIN=${BIN:-$PACK/bin}
LAYERS=${LAYERS:-4}
RUNS=${RUNS:-1 4 4host}
GPUS=${GPUS:-1}
mkdir -p "$OUT"
export FLEXPERT_LOG=warn
t0=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t0))s] $*"; }
# shellcheck source=scripts/gpu_libs.sh
source scripts/gpu_libs.sh
if [ -n "${BUILT_AT:-}" ]; then
  [ -e "$BUILT_AT/testdata" ] || { mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn "$PWD" "$BUILT_AT"; }
  mkdir -p "$BUILT_AT/build-gep" && cp "$BIN/flexpert" "$BUILT_AT/build-gep/flexpert"
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && stamp "MPS started"

if [ "${TESTS:-1}" = 1 ]; then
stamp "GPU unit tests (model, EP in one process)"
timeout 120 "$BIN/cuda_test" --gtest_filter='CudaModelTest.*:CudaEpTest.*' >"$OUT/cuda_test.log" 2>&1
rc_unit=$?
grep -E "OK \]|FAILED|Failure|Expected|Which is" "$OUT/cuda_test.log" | head -24

stamp "system test: serve --device cuda --cuda-dtype f32 --ranks 4 (device exchange)"
timeout 240 "$BIN/system_cuda_serve_test" >"$OUT/system.log" 2>&1
rc_system=$?
grep -E "graph captures|rebalance:|OK \]|FAILED|Failure|Expected|Which is|rror" "$OUT/system.log" | head -40
stamp "system test again with FLEXPERT_EP_EXCHANGE=host"
FLEXPERT_EP_EXCHANGE=host timeout 240 "$BIN/system_cuda_serve_test" >"$OUT/system_host.log" 2>&1
rc_system_host=$?
grep -E "OK \]|FAILED|Failure|Expected|Which is|rror" "$OUT/system_host.log" | head -20
else
  rc_unit=skipped rc_system=skipped rc_system_host=skipped
fi

stamp "synth qwen3-30b-a3b --layers $LAYERS"
DIR=/dev/shm/q30b-L$LAYERS
timeout 120 "$BIN/flexpert" synth --preset qwen3-30b-a3b --layers "$LAYERS" --out "$DIR" 2>&1 | tail -1
port=8300
for run in $RUNS; do
  ranks=${run%host}
  mode=device && [ "$run" != "$ranks" ] && mode=host
  port=$((port + 1))
  stamp "serve --ranks $ranks --gpus $GPUS (bf16, $mode exchange) + bench serve"
  FLEXPERT_EP_EXCHANGE=$mode setsid "$BIN/flexpert" serve --model "$DIR" --device cuda --ranks "$ranks" \
    --gpus "$GPUS" --port $port \
    --max-sequences 64 --max-seq-len 512 --transport-timeout-ms 60000 >"$OUT/serve$run.log" 2>&1 &
  spid=$!
  for _ in $(seq 240); do
    curl -sf "localhost:$port/health" >/dev/null 2>&1 && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.5
  done
  stamp "up"
  for c in 64 8; do
    timeout 120 "$BIN/flexpert" bench serve --url "http://127.0.0.1:$port" --concurrency $c \
      --requests $((c * 4)) --prompt-len 64 --max-tokens 64 --json "$OUT/bench$run-c$c.json" \
      >"$OUT/bench$run-c$c.log" 2>&1
    tail -4 "$OUT/bench$run-c$c.log"
  done
  curl -s "localhost:$port/metrics" | grep graph_captures >"$OUT/captures$run.txt"
  kill -TERM $spid
  for _ in $(seq 40); do kill -0 $spid 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- -$spid 2>/dev/null
  tail -5 "$OUT/serve$run.log"
done
rm -rf "$DIR"
echo quit | nvidia-cuda-mps-control

stamp "summary"
printf "%-40s %s\n" "GPU unit tests (rc)" "$rc_unit" "system test, 4 ranks f32 (rc)" "$rc_system" \
  "system test, host exchange (rc)" "$rc_system_host"
for run in $RUNS; do
  for c in 64 8; do
    python3 - "$OUT/bench$run-c$c.json" "$run" "$c" "$GPUS" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
    print("%-44s %.1f output tok/s, ITL p50 %.1f ms, %s failed" % (
        "bench serve, %s rank(s) on %s GPU(s), c=%s, bf16" % (sys.argv[2], sys.argv[4], sys.argv[3]),
        j.get("output_tokens_per_s", 0.0), 1e3 * j.get("itl_s", {}).get("p50", 0.0),
        j.get("failed", "?")))
except Exception as e:
    print("bench serve, %s rank(s), c=%s: no result (%s)" % (sys.argv[2], sys.argv[3], e))
PY
  done
  echo "   $(grep -v '^#' "$OUT/captures$run.txt" | tr '\n' ' ')"
done
