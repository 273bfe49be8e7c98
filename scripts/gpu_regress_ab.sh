#!/usr/bin/env bash
# Same-run A/B of two builds on the GPU machine, for the figures a refactoring must not
# move: decode ms per step and prefill tok/s on one GPU (`bench generate`), serving with 4
# GPU ranks under MPS (`bench serve`, the EP exchange on every step), the device EP
# exchange alone (`ep_exchange_bench`, 2 ranks under MPS) and the elastic stall (`bench
# elastic --device cuda`, scale events). Runs alternate between the builds, REPS times.
# Each build is a directory of packed binaries (scripts/gpu_pack.sh) holding at least
# flexpert and ep_exchange_bench; A is the baseline.
#   A=.gpuh/old B=.gpuh/bin PACK=.gpuh OUT=$OUT bash scripts/gpu_regress_ab.sh
# PARTS="decode serve exchange elastic" (default: all) picks what runs. Summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
A=${A:?"A=dir of the baseline's binaries"}
B=${B:?"B=dir of the candidate's binaries"}
PACK=${PACK:-.gpu}
OUT=${OUT:-out/regress-ab}
REPS=${REPS:-2}
LAYERS=${LAYERS:-12}
PARTS=${PARTS:-decode serve exchange elastic}
mkdir -p "$OUT"
PACK=$PACK source scripts/gpu_env.sh
export FLEXPERT_LOG=warn
t0=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t0))s] $*"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }

model=/dev/shm/regress-ab-L$LAYERS
timeout 300 "$B/flexpert" synth --preset qwen3-30b-a3b --layers "$LAYERS" --out "$model" | tr "\r" "\n" | tail -1

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
stamp "MPS started (scripts/gpu_env.sh)"

serve_once() {  # BUILD_DIR NAME REP: 4 GPU ranks, bench serve at c=8 and c=64
  local bin=$1 name=$2 rep=$3 port=$((18700 + rep * 10 + ${#name}))
  setsid "$bin/flexpert" serve --model "$model" --device cuda --ranks 4 --max-ranks 4 \
    --port "$port" --max-sequences 64 --max-seq-len 512 --transport-timeout-ms 60000 \
    >"$OUT/serve_${name}_$rep.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  for c in 8 64; do
    timeout 120 "$bin/flexpert" bench serve --url "http://127.0.0.1:$port" --concurrency $c \
      --requests $((c * 4)) --prompt-len 64 --max-tokens 64 \
      --json "$OUT/bs_${name}_${rep}_c$c.json" >>"$OUT/serve_${name}_$rep.log" 2>&1
  done
  kill -TERM $pid
  for _ in $(seq 40); do kill -0 $pid 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- -$pid 2>/dev/null
  wait $pid 2>/dev/null
}

for rep in $(seq 1 "$REPS"); do
  for v in "old:$A" "new:$B"; do
    name=${v%%:*} bin=${v#*:}
    if has decode; then
      for p in 64 2048; do
        stamp "$name bench generate prompt $p (rep $rep)"
        timeout 200 "$bin/flexpert" bench generate --model "$model" --device cuda \
          --batches 1,16,128,1,16,128 --prompt-len "$p" --gen-tokens 32 \
          --json "$OUT/g_${name}_${p}_$rep.json" >"$OUT/g_${name}_${p}_$rep.log" 2>&1 ||
          echo "exit $?"
      done
    fi
    if has serve; then
      stamp "$name serve, 4 ranks (rep $rep)"
      serve_once "$bin" "$name" "$rep"
    fi
    if has exchange; then
      stamp "$name ep_exchange_bench, 2 ranks (rep $rep)"
      timeout 120 "$bin/ep_exchange_bench" --ranks 2 --gpus 1 --tokens 128,4096 --iters 50 \
        --json "$OUT/x_${name}_$rep.json" >"$OUT/x_${name}_$rep.log" 2>&1 || echo "exit $?"
    fi
    if has elastic; then
      stamp "$name bench elastic, scale 4 -> 2 -> 4 -> 3 -> 4 (rep $rep)"
      CUDA_MODULE_LOADING=LAZY timeout 200 "$bin/flexpert" bench elastic --device cuda \
        --cuda-dtype f32 --cache /tmp/synth --plot "" --modes live --ranks 4 --max-ranks 4 \
        --events 3:scale:2,6:scale:4,9:scale:3,12:scale:4 --duration 14 \
        --json "$OUT/e_${name}_$rep.json" >"$OUT/e_${name}_$rep.log" 2>&1 || echo "exit $?"
    fi
  done
done
echo quit | nvidia-cuda-mps-control

stamp "summary (old = $A, new = $B; one value per rep)"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def load(pattern):
    rows = {}
    for path in sorted(glob.glob(os.path.join(out, pattern))):
        try:
            rows[path] = json.load(open(path))
        except Exception as e:
            print("unreadable", path, e)
    return rows
def cells(name, key):
    return " / ".join(key(d) for _, d in sorted(load(name).items())) or "-"
print("%-34s %-40s %s" % ("figure", "old", "new"))
for p in (64, 2048):
    for b in (1, 16, 128):
        def dec(d, b=b):
            runs = d["runs"][len(d["runs"]) // 2:]
            return "%.3f" % next(r["decode_ms_per_step"] for r in runs if r["batch"] == b)
        def pre(d, b=b):
            runs = d["runs"][len(d["runs"]) // 2:]
            return "%.0f" % next(r["prefill_tokens_per_s"] for r in runs if r["batch"] == b)
        print("%-34s %-40s %s" % ("decode ms/step p%d b%d" % (p, b),
              cells("g_old_%d_*.json" % p, dec), cells("g_new_%d_*.json" % p, dec)))
        print("%-34s %-40s %s" % ("prefill tok/s p%d b%d" % (p, b),
              cells("g_old_%d_*.json" % p, pre), cells("g_new_%d_*.json" % p, pre)))
for c in (8, 64):
    def tps(d):
        return "%.0f (%s failed)" % (d.get("output_tokens_per_s", 0), d.get("failed", "?"))
    print("%-34s %-40s %s" % ("serve 4 ranks c=%d tok/s" % c,
          cells("bs_old_*_c%d.json" % c, tps), cells("bs_new_*_c%d.json" % c, tps)))
def xch(d, t):
    rows = [r for r in d["runs"] if r["tokens"] == t]
    if not rows:
        return "?"
    return "%.0f+%.0f" % (max(r["dispatch_us"] for r in rows), max(r["combine_us"] for r in rows))
for t in (128, 4096):
    print("%-34s %-40s %s" % ("exchange us disp+comb %d tok" % t,
          cells("x_old_*.json", lambda d, t=t: xch(d, t)),
          cells("x_new_*.json", lambda d, t=t: xch(d, t))))
def stalls(d):
    return ",".join("%.1f" % e["stall_ms"] for r in d for e in r["events"])
print("%-34s %-40s %s" % ("elastic stall ms (4>2,2>4,4>3,3>4)",
      cells("e_old_*.json", stalls), cells("e_new_*.json", stalls)))
PY
