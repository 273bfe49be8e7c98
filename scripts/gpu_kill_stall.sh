#!/usr/bin/env bash
# What a GPU rank's SIGKILL costs its survivors (docs/benchmarks.md, "Losing a rank"), on the
# GPU machine with binaries packed by scripts/gpu_pack.sh:
#   OUT=out/killstall bash scripts/gpu_kill_stall.sh
# 1. cuda_kill_stall without MPS: nothing shared, legacy CUDA IPC, VMM file descriptors
#    (0.5-16 GiB); then a survivor making driver calls, pinned host memory in the victim, a
#    victim dying inside a kernel.
# 2. bench elastic --device cuda without MPS (f32 synthetic Qwen3-30B-A3B, 2 layers,
#    --min-replicas 2, kill rank 1), lazy then eager module loading, each with
#    bench/kill_probe.py sampling the survivors' threads (which ioctl holds them, and where);
#    then CPU ranks on the same model (the same kill with host memory only: if it stalls as
#    long, the wait is not the GPU driver's).
# 3. Last, as it leaves the MPS server refusing clients (driver 580): cuda_kill_stall under
#    MPS, nothing special, a victim held by a stream wait, a victim whose spinning kernel
#    ends 0-20 ms after the kill, then one dying inside a kernel that never ends.
# Prints a summary last.
set -uo pipefail
OUT=${OUT:-out/killstall}
PACK=${PACK:-.gpu}
BIN=$PACK/bin
mkdir -p "$OUT"
PACK=$PACK source scripts/gpu_env.sh
echo quit | nvidia-cuda-mps-control  # gpu_env.sh starts MPS; parts 1 and 2 run without.
stamp() { echo "== $(date +%T) $*"; }

K="$BIN/cuda_kill_stall --pre-ms 500 --post-ms 1500"
stamp "cuda_kill_stall, no MPS"
{
  timeout 60 $K --modes none,legacy,vmm --gib 0.5,4,16
  timeout 30 $K --modes none,legacy,vmm --gib 4 --survivor-rm | tail -3
  timeout 20 $K --modes none --gib 4 --victim-pinned-gib 4 | tail -1
  timeout 20 $K --modes none --gib 4 --victim-pinned-gib 4 --survivor-rm | tail -1
  timeout 30 $K --modes none,legacy --gib 4 --victim-spin | tail -2
} >"$OUT/kill_stall.md" 2>&1

DIR=/dev/shm/q30b-L2
stamp "synth"
[ -e $DIR/config.json ] || timeout 120 "$BIN/flexpert" synth --preset qwen3-30b-a3b --layers 2 \
  --out $DIR >"$OUT/synth.log" 2>&1
for loading in LAZY EAGER; do
  stamp "bench elastic, kill, no MPS, $loading"
  python3 bench/kill_probe.py --out "$OUT/probe_$loading.txt" --seconds 120 &
  probe=$!
  CUDA_MODULE_LOADING=$loading timeout 120 "$BIN/flexpert" bench elastic --device cuda \
    --model $DIR --cuda-dtype f32 --plot "" --modes live --json "$OUT/elastic_$loading.json" \
    --ranks 4 --max-ranks 4 --min-ranks 2 --min-replicas 2 --events 3:kill:1 --duration 6 \
    >"$OUT/elastic_$loading.log" 2>&1
  echo "bench elastic ($loading) rc $?"
  wait $probe
done
stamp "bench elastic, kill, CPU ranks"
python3 bench/kill_probe.py --out "$OUT/probe_cpu.txt" --seconds 120 &
probe=$!
timeout 150 "$BIN/flexpert" bench elastic --device cpu --model $DIR --plot "" --modes live \
  --json "$OUT/elastic_cpu.json" --ranks 4 --max-ranks 4 --min-ranks 2 --min-replicas 2 \
  --events 3:kill:1 --duration 6 >"$OUT/elastic_cpu.log" 2>&1
echo "bench elastic (cpu) rc $?"
wait $probe

stamp "cuda_kill_stall under MPS"
nvidia-cuda-mps-control -d
{
  timeout 30 $K --modes none,legacy,vmm --gib 4 | tail -3
  timeout 20 $K --modes none --gib 4 --victim-wait | tail -1
  for ms in 0 1 5 20; do timeout 20 $K --modes none --gib 4 --victim-spin --release-ms $ms | tail -1; done
  timeout 30 $K --modes none,legacy --gib 4 --victim-spin | tail -2
} >>"$OUT/kill_stall.md" 2>&1
echo quit | nvidia-cuda-mps-control

stamp "summary"
cat "$OUT/kill_stall.md"
for run in LAZY EAGER cpu; do
  echo "-- bench elastic, $run"
  grep -E "^kill rank|^steady" "$OUT/elastic_$run.log"
  head -30 "$OUT/probe_$run.txt"
done
