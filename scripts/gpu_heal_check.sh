#!/usr/bin/env bash
# A group of GPU ranks (under MPS on one GPU) that loses ranks, on the GPU machine with
# binaries packed by scripts/gpu_pack.sh:
#   OUT=out/heal bash scripts/gpu_heal_check.sh
# 1. system_cuda_serve_test: reference tokens across map switches, scales and a kill
#    (in place on --min-ranks 3 slots, then healed back to 4 ranks), no graph recapture.
# 2. bench elastic --device cuda, kills with spare slots (--min-ranks 1: in place, then a
#    heal), without (--min-ranks 4: a replacement rank takes the lost experts), and with a
#    spare rank (--spare-ranks 1: the replacement is loaded and Ready beforehand).
# Prints a summary table last.
set -uo pipefail
OUT=${OUT:-out/heal}
PACK=${PACK:-.gpu}
BIN=$PACK/bin
mkdir -p "$OUT"
PACK=$PACK source scripts/gpu_env.sh
stamp() { echo "== $(date +%T) $*"; }

stamp "system_cuda_serve_test"
mkdir -p build && cp "$BIN/flexpert" build/flexpert  # The path the test binary starts.
timeout 400 "$BIN/system_cuda_serve_test" >"$OUT/serve_test.log" 2>&1
echo "system_cuda_serve_test rc $?"
grep -E '^\[  (PASSED|FAILED) |Failure' "$OUT/serve_test.log" | head -20

rm -rf /tmp/synth
run_elastic() {  # NAME, then flexpert bench elastic flags
  local name=$1
  shift
  stamp "bench elastic ($name)"
  CUDA_MODULE_LOADING=LAZY timeout 240 "$BIN/flexpert" bench elastic --device cuda \
    --cuda-dtype f32 --cache /tmp/synth --plot "" --modes live --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "bench elastic ($name) rc $?"
}
run_elastic inplace --ranks 4 --max-ranks 4 --min-ranks 1 --events 3:kill:1,7:kill:2 --duration 11
run_elastic replace --ranks 4 --max-ranks 4 --min-ranks 4 --events 3:kill:1,7:kill:2 \
  --duration 11
run_elastic spare --ranks 3 --max-ranks 4 --min-ranks 3 --spare-ranks 1 \
  --events 3:kill:1,7:kill:2 --duration 11

echo quit | nvidia-cuda-mps-control
stamp "summary"
for name in inplace replace spare; do
  echo "-- $name"
  grep -E '^== |^steady|^event|^kill|^scale' "$OUT/$name.log"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    for e in r["events"]:
        rec = e.get("recovery", {})
        print(f"  {e['label']}: {e.get('recovery_kind')}, recovered after "
              f"{(e.get('recovered_s', e['end_s']) - e['at_s']) * 1e3:.0f} ms, healed after "
              f"{(e['end_s'] - e['at_s']) * 1e3:.0f} ms, stall {e['stall_ms']:.1f} ms, "
              f"reload {rec.get('reload_s', 0) * 1e3:.1f} ms, failed {e['failed_requests']}")
PY
done
