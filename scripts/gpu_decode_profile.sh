#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: Nsight Compute over a
# few decode steps of a synthetic model (every graph node timed alone, cold caches, so
# small kernels read high), then one step's kernels in order with their times and DRAM
# bytes, and the sum by kernel name. Compare the sum with the step time of `flexpert bench
# generate`: the difference is what the chain's hand-offs cost.
#   PACK=.gpu source scripts/gpu_env.sh; echo quit | nvidia-cuda-mps-control
#   PRESET=qwen3-30b-a3b LAYERS=12 BATCH=1 OUT=$OUT bash scripts/gpu_decode_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 1; }
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/gpu_decode_profile}
PRESET=${PRESET:-qwen3-30b-a3b}
LAYERS=${LAYERS:-12}
BATCH=${BATCH:-1}
PROMPT=${PROMPT:-64}
MODEL=${MODEL:-/dev/shm/decode-profile-$PRESET-L$LAYERS}
NAME=${NAME:-${PRESET}_L${LAYERS}_b${BATCH}}
mkdir -p "$OUT"
[ -e "$MODEL/config.json" ] ||
  timeout 300 "$BIN/flexpert" synth --preset "$PRESET" --layers "$LAYERS" --out "$MODEL" | tail -1
csv=$OUT/ncu_$NAME.csv
timeout "${NCU_TIMEOUT:-400}" ncu --graph-profiling node --clock-control none --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  "$BIN/flexpert" bench generate --model "$MODEL" --device cuda --batches "$BATCH" \
  --prompt-len "$PROMPT" --gen-tokens 4 >"$csv" 2>"$OUT/ncu_$NAME.log"
echo "== ncu exit $?"
python3 - "$csv" <<'PY'
import collections, csv, re, sys
rows = collections.OrderedDict()
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    k = rows.setdefault(int(r["ID"]), {"name": r["Kernel Name"], "grid": r["Grid Size"]})
    k[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
ids = sorted(rows)
starts = [i for i in ids if "embedding_kernel" in rows[i]["name"]]
if len(starts) < 2:
    sys.exit("fewer than two steps in the profile")
step = [i for i in ids if starts[-2] <= i < starts[-1]]
def short(n):
    n = re.sub(r"\(.*", "", n)
    n = re.sub(r"^void ", "", n)
    n = re.sub(r"flexpert::(\(anonymous namespace\)|<unnamed>)::", "", n)
    return n.replace("flexpert::", "").replace("cuda::", "")[:70]
total = 0.0
by = collections.OrderedDict()
print(f"{'kernel':70s} {'grid':>14s} {'us':>8s} {'MB':>8s}")
for i in step:
    k = rows[i]
    us = k.get("gpu__time_duration.sum", 0) / 1e3
    mb = k.get("dram__bytes_read.sum", 0) / 1e6
    total += us
    n = short(k["name"])
    b = by.setdefault(n, [0, 0.0, 0.0])
    b[0] += 1; b[1] += us; b[2] += mb
    if len(step) <= 80 or i - step[0] < 40 or step[-1] - i < 15:
        print(f"{n:70s} {k['grid']:>14s} {us:8.2f} {mb:8.2f}")
print(f"\none step: {len(step)} kernels, {total:.1f} us summed\n")
print(f"{'kernel':70s} {'count':>5s} {'us':>9s} {'us each':>8s} {'MB':>8s}")
for n, (c, us, mb) in sorted(by.items(), key=lambda x: -x[1][1]):
    print(f"{n:70s} {c:5d} {us:9.1f} {us / c:8.2f} {mb:8.1f}")
PY
