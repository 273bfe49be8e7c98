#!/usr/bin/env bash
# How fast GPU ranks notice a dead peer, on the GPU machine with binaries packed by
# scripts/gpu_pack.sh (PACK=.gpu source scripts/gpu_env.sh first: library paths, MPS):
#   OUT=out/fault bash scripts/gpu_fault_check.sh
# 1. transport_bench --death-mb: kill-to-report and kill-to-exit of a SIGKILLed rank, for
#    cuda_ipc (a victim with a CUDA context) and shm, victims of 0 and 4096 MB.
# 2. The fault conformance suite for cuda_ipc (prints each survivor's "ms after the kill").
# 3. The EP tests of cuda_test (device exchange: a silent peer, a departed one).
# 4. flexpert bench elastic --device cuda with a kill (the kill's stall and the rest).
# Prints a summary last.
set -uo pipefail
OUT=${OUT:-out/fault}
PACK=${PACK:-.gpu}
BIN=$PACK/bin
mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER
stamp() { echo "== $(date +%T) $*"; }

stamp "death: cuda_ipc"
timeout 120 "$BIN/transport_bench" --backend cuda_ipc --ranks '' --death-mb 0,4096 \
  --json "$OUT/death_cuda_ipc.json" 2>&1 | tee "$OUT/death_cuda_ipc.log"
stamp "death: shm"
timeout 120 "$BIN/transport_bench" --backend shm --ranks '' --death-mb 0,4096 \
  --json "$OUT/death_shm.json" 2>&1 | tee "$OUT/death_shm.log"

stamp "fault conformance (cuda_ipc)"
timeout 240 "$BIN/transport_conformance_fault_test" --gtest_filter='*cuda_ipc*' \
  >"$OUT/fault.log" 2>&1
echo "fault suite rc $?"
grep -E 'after the kill|FAILED|PASSED' "$OUT/fault.log" | head -20

stamp "EP tests"
timeout 240 "$BIN/cuda_test" --gtest_filter='CudaEpTest.*' >"$OUT/ep.log" 2>&1
echo "EP tests rc $?"
grep -E '^\[  (PASSED|FAILED) ' "$OUT/ep.log"

stamp "bench elastic --device cuda"
rm -rf /tmp/synth
# Lazy module loading for the workers: an eager joiner stalls the serving ranks
# (docs/benchmarks.md).
CUDA_MODULE_LOADING=LAZY timeout 300 "$BIN/flexpert" bench elastic --device cuda --cuda-dtype f32 --cache /tmp/synth \
  --plot "" --modes live --json "$OUT/elastic.json" >"$OUT/elastic.log" 2>&1
echo "bench elastic rc $?"
tail -25 "$OUT/elastic.log"

stamp "summary"
grep -h '^death ' "$OUT"/death_*.log | sed "s/^/  /"
grep -h 'after the kill' "$OUT/fault.log" | sed -E 's/.*\] ([0-9.]+) ms.*/\1/' | sort -n |
  awk '{a[NR]=$1} END {if (NR) printf "  cuda_ipc fault suite: %d reports, %s-%s ms after the kill\n", NR, a[1], a[NR]}'
