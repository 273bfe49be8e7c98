#!/usr/bin/env bash
# Serving benchmark for expert load balancing: the same skewed load before, during
# and after a rebalance. Prints a table and writes out/bench-eplb-serve.json.
#   bash bench/eplb_serve.sh [MODEL_DIR] [RANKS]
# BIN: the flexpert binary (default build/flexpert); SERVE_ARGS: more `serve` flags, e.g.
# "--device cuda --gpus 2" for GPU ranks (the rebalance then copies slots device to device), or
# "--eplb-smoothing 0.5 --eplb-min-gain 0.01" (load smoothing, skip threshold).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-testdata/qwen3moe-tiny}
RANKS=${2:-4}
PORT=${PORT:-18123}
BIN=${BIN:-build/flexpert}
read -r -a EXTRA <<< "${SERVE_ARGS:-}"
mkdir -p out
$BIN serve --model "$MODEL" --ranks "$RANKS" --port "$PORT" --eplb-spare-slots 2 \
  --eplb-window-s 30 --threads-per-worker 1 --max-seq-len 256 "${EXTRA[@]}" > out/eplb-serve.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 120); do grep -q "serving on" out/eplb-serve.log && break; sleep 0.5; done
URL=http://127.0.0.1:$PORT
LOAD=(--url "$URL" --concurrency 16 --requests "${REQUESTS:-512}" --prompt-len 16 --max-tokens 32)
status() { curl -s "$URL/v1/status"; }
eplb() { curl -s "$URL/v1/eplb"; }

$BIN bench serve "${LOAD[@]}" --seed 1 --json out/eplb-before.json > /dev/null 2>&1
status > out/eplb-status-before.json
eplb > out/eplb-before-map.json
# During: the same load, with a rebalance triggered once it runs.
$BIN bench serve "${LOAD[@]}" --seed 2 --json out/eplb-during.json > /dev/null 2>&1 &
BENCH=$!
sleep 0.3
curl -s -X POST "$URL/v1/eplb/rebalance" -d '{}' > out/eplb-rebalance.json
wait $BENCH
status > out/eplb-status-during.json
$BIN bench serve "${LOAD[@]}" --seed 3 --json out/eplb-after.json > /dev/null 2>&1
status > out/eplb-status-after.json
eplb > out/eplb-after-map.json

python3 - "$MODEL" "$RANKS" <<'PY'
import json, sys
model, ranks = sys.argv[1], int(sys.argv[2])
phases = {p: json.load(open(f"out/eplb-{p}.json")) for p in ("before", "during", "after")}
steps = {p: json.load(open(f"out/eplb-status-{p}.json")) for p in ("before", "during", "after")}
maps = {p: json.load(open(f"out/eplb-{p}-map.json")) for p in ("before", "after")}
reb = json.load(open("out/eplb-rebalance.json"))
def bal(m): return sum(l["balancedness"] for l in m["layers"]) / len(m["layers"])
def step_ms(s): return max(r["step_ms"] for r in s["ranks"])
rows = []
print(f"model {model}, {ranks} ranks; rebalance: {reb.get('planned_moved_slots')} slots, "
      f"{reb.get('moved_bytes', 0) / 2**20:.1f} MiB in {reb.get('duration_s', 0) * 1e3:.1f} ms, status {reb.get('status')}")
pull_s = reb.get("pull_s", 0)
if pull_s > 0:
    print(f"movers' copy time {pull_s * 1e3:.1f} ms over {reb.get('pull_commands')} pulls: "
          f"{reb.get('moved_bytes', 0) / pull_s / 1e9:.1f} GB/s; longest step around the moves "
          f"{reb.get('max_step_ms_during', 0):.2f} ms (mean step before {reb.get('mean_step_ms_before', 0):.2f} ms)")
print(f"{'phase':8} {'tok/s':>9} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'slowest rank step ms':>21} {'failed':>6}")
for p, r in phases.items():
    itl = r["itl_s"]
    print(f"{p:8} {r['output_tokens_per_s']:9.0f} {itl['p50']*1e3:8.2f} {itl['p99']*1e3:8.2f} "
          f"{itl['max']*1e3:8.2f} {step_ms(steps[p]):21.3f} {r['failed']:6d}")
print(f"balancedness (mean over layers): before {bal(maps['before']):.3f}, after {bal(maps['after']):.3f}")
stall = phases["during"]["itl_s"]["max"] - max(phases["before"]["itl_s"]["max"], phases["after"]["itl_s"]["max"])
print(f"stall: max ITL during minus max ITL before/after = {stall*1e3:.2f} ms")
json.dump({"model": model, "ranks": ranks, "rebalance": reb, "phases": phases,
           "balancedness_before": bal(maps["before"]), "balancedness_after": bal(maps["after"]),
           "stall_s": stall}, open("out/bench-eplb-serve.json", "w"), indent=2)
PY
