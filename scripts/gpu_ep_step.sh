#!/usr/bin/env bash
# What expert parallelism costs a serving step on GPU ranks: `flexpert serve --step-timing`
# on a synthetic Qwen3-30B-A3B (bf16, LAYERS layers, in /dev/shm) with 1, 2 and 4 GPU ranks
# under MPS on one GPU, each loaded by `bench serve` with BATCH sequences per rank
# (concurrency BATCH x ranks); every rank's busy steps, split into the step, the step header
# all-gather before it and the MoE exchanges inside it (docs/benchmarks.md, "Serving with
# GPU ranks"). Binaries packed by
#   BUILD=build-cuda PACK=.gpuh bash scripts/gpu_pack.sh     (carry .gpuh)
# First (TESTS=1, the default) the GPU test of step timing (system_cuda_serve_test
# CudaServeTest.StepTiming*: two ranks keep the reference tokens, exchange > 0 and within
# the step); it runs the flexpert binary and reads testdata at the build's paths:
# BUILT_AT=/path/of/the/checkout BUILD=build-cuda as in gpu_ep_check.sh.
# Starts and stops MPS. Logs and JSON (bench serve's per run, summary.json) under $OUT; a
# table last. RANKS="1 2 4", BATCHES="1 16", LAYERS=4, MAX_TOKENS=64, PROMPT=16 by default;
# FLEXPERT_EP_EXCHANGE=host in the environment times the host exchange instead.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu-ep-step}
PACK=${PACK:-.gpuh}
BIN=${BIN:-$PACK/bin}
LAYERS=${LAYERS:-4}
RANKS=${RANKS:-1 2 4}
BATCHES=${BATCHES:-1 16}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT=${PROMPT:-16}
mkdir -p "$OUT"
export FLEXPERT_LOG=warn
t0=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t0))s] $*"; }
# shellcheck source=scripts/gpu_libs.sh
source scripts/gpu_libs.sh
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && stamp "MPS started"

rc_test=skipped
if [ "${TESTS:-1}" = 1 ]; then
  if [ -n "${BUILT_AT:-}" ]; then
    [ -e "$BUILT_AT/testdata" ] || { mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn "$PWD" "$BUILT_AT"; }
    mkdir -p "$BUILT_AT/${BUILD:-build-cuda}" && cp "$BIN/flexpert" "$BUILT_AT/${BUILD:-build-cuda}/flexpert"
  fi
  stamp "system test: serve --device cuda --ranks 2 --step-timing"
  timeout 120 "$BIN/system_cuda_serve_test" --gtest_filter='CudaServeTest.StepTiming*' \
    >"$OUT/system.log" 2>&1
  rc_test=$?
  grep -E "OK \]|FAILED|Failure|Expected|Which is|^rank|^[0-9]+ |^all" "$OUT/system.log" | head -20
fi

stamp "synth qwen3-30b-a3b --layers $LAYERS"
DIR=/dev/shm/q30b-step-L$LAYERS
timeout 120 "$BIN/flexpert" synth --preset qwen3-30b-a3b --layers "$LAYERS" --out "$DIR" 2>&1 | tail -1
port=8400
for ranks in $RANKS; do
  port=$((port + 1))
  stamp "serve --ranks $ranks --step-timing (bf16, ${FLEXPERT_EP_EXCHANGE:-device} exchange)"
  setsid "$BIN/flexpert" serve --model "$DIR" --device cuda --ranks "$ranks" --port $port \
    --step-timing --max-sequences 64 --max-seq-len 512 --transport-timeout-ms 60000 \
    >"$OUT/serve$ranks.log" 2>&1 &
  spid=$!
  for _ in $(seq 240); do
    curl -sf "localhost:$port/health" >/dev/null 2>&1 && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.5
  done
  stamp "up"
  for b in $BATCHES; do
    c=$((b * ranks))
    # Three waves of requests; the placement gives each rank b of them at a time.
    timeout 120 "$BIN/flexpert" bench serve --url "http://127.0.0.1:$port" --concurrency $c \
      --requests $((c * 3)) --prompt-len "$PROMPT" --max-tokens "$MAX_TOKENS" \
      --json "$OUT/bench-r$ranks-b$b.json" >"$OUT/bench-r$ranks-b$b.log" 2>&1
    tail -n $((ranks + 3)) "$OUT/bench-r$ranks-b$b.log"
  done
  curl -s "localhost:$port/metrics" | grep -E "exchange_seconds|busy_step_seconds" >"$OUT/metrics$ranks.txt"
  kill -TERM $spid
  for _ in $(seq 40); do kill -0 $spid 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- -$spid 2>/dev/null
  tail -3 "$OUT/serve$ranks.log"
done
rm -rf "$DIR"
echo quit | nvidia-cuda-mps-control

stamp "summary (per rank's busy step, mean over the ranks' steps; ms)"
echo "system test StepTiming (rc): $rc_test"
python3 - "$OUT" "$LAYERS" "$RANKS" "$BATCHES" "${FLEXPERT_EP_EXCHANGE:-device}" <<'PY'
import json, sys
out, layers, ranks, batches, mode = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split(), sys.argv[5]
rows = []
print("%-6s %-6s %9s %9s %9s %8s %10s %10s %10s %6s" % ("batch", "ranks", "step", "exchange",
      "share", "header", "ITL p50", "tok/s", "rank-steps", "failed"))
for b in batches:
    base = None
    for r in ranks:
        path = "%s/bench-r%s-b%s.json" % (out, r, b)
        try:
            j = json.load(open(path))
        except Exception as e:
            print("%-6s %-6s no result (%s)" % (b, r, e))
            continue
        s = j.get("steps", {}).get("all", {})
        row = {"batch_per_rank": int(b), "ranks": int(r), "layers": int(layers), "exchange": mode,
               "step_ms": s.get("step_ms"), "exchange_ms": s.get("exchange_ms"),
               "exchange_share": s.get("exchange_share"), "header_ms": s.get("header_ms"),
               "steps": s.get("steps"), "itl_p50_ms": 1e3 * j.get("itl_s", {}).get("p50", 0.0),
               "output_tokens_per_s": j.get("output_tokens_per_s"), "failed": j.get("failed"),
               "per_rank": j.get("steps", {}).get("ranks", [])}
        rows.append(row)
        f = lambda v, fmt="%9.3f": fmt % v if isinstance(v, (int, float)) else "%9s" % "-"
        print("%-6s %-6s %s %s %s %s %s %s %10s %6s" % (b, r, f(row["step_ms"]), f(row["exchange_ms"]),
              f(100 * row["exchange_share"], "%8.1f%%") if row["exchange_share"] is not None else "%9s" % "-",
              f(row["header_ms"], "%8.3f"), f(row["itl_p50_ms"], "%10.2f"),
              f(row["output_tokens_per_s"], "%10.1f"), row["steps"], row["failed"]))
json.dump({"layers": int(layers), "exchange": mode, "runs": rows}, open(out + "/summary.json", "w"), indent=1)
PY
