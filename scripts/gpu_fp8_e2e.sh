#!/usr/bin/env bash
# FP8 experts end to end on one GPU, with binaries packed by scripts/gpu_pack.sh, on a
# synthetic block-FP8 DeepSeek-V2-Lite (all 27 layers, synthesised into /dev/shm, removed at the end):
#  (a) decode tok/s at batch 1, 16, 128 with FP8 experts beside the bf16 path (the same
#      checkpoint dequantized at load, --quantization bf16) in one run (second pass);
#  (b) the share of 64 prompts whose 32 greedy tokens with FP8 experts equal the bf16
#      path's (bench generate --agreement 64);
#  (c) what expert moves cost with FP8 against bf16 slots: GPU ranks of `serve` under MPS,
#      one scale-up 2 -> 3 before any load (the plan depends on the placement alone, so
#      both runs copy the same slots), then load and one rebalance (POST
#      /v1/eplb/rebalance): bytes per expert copy and the totals of each move.
# Chatty output goes to files under $OUT, with the JSON (fp8_e2e.json: the summary); a
# short table is printed last.
#   PACK=.gpuh OUT=$OUT bash scripts/gpu_fp8_e2e.sh
#   FP8_E2E_LAYERS=27  FP8_E2E_NO_WGMMA=1: also FP8 with FLEXPERT_NO_FP8_WGMMA=1 (two more loads)
#   FP8_E2E_DEVICE=cpu: a dry run of the plumbing on the CPU (bf16 alone, no PACK)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PACK=${PACK:-.gpuh}
OUT=${OUT:-/tmp/fp8_e2e}
LAYERS=${FP8_E2E_LAYERS:-27}
PRESET=${FP8_E2E_PRESET:-deepseek-v2-lite}
DEVICE=${FP8_E2E_DEVICE:-cuda}
mkdir -p "$OUT"
export FLEXPERT_LOG=warn
t0=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t0))s] $*"; }
if [ "$DEVICE" = cpu ]; then
  FLEXPERT=${FLEXPERT:-build/flexpert}
  QUANTS=(bf16)
else
  # shellcheck source=scripts/gpu_env.sh
  PACK=$PACK source scripts/gpu_env.sh
  FLEXPERT=$PACK/bin/flexpert
  QUANTS=(bf16 fp8)
fi
qlist=$(IFS=,; echo "${QUANTS[*]}")

DIR=/dev/shm/fp8e2e-$PRESET-L$LAYERS
if [ ! -e "$DIR/config.json" ]; then
  stamp "synth $PRESET --fp8, $LAYERS layers, into $DIR"
  "$FLEXPERT" synth --preset "$PRESET" --layers "$LAYERS" --fp8 --out "$DIR" >"$OUT/synth.log" 2>&1
  echo "exit $?"
fi
du -sh "$DIR"

# (a) and (b): one process, each quantization loaded in turn; the first (bf16) is the
# agreement's reference.
stamp "bench generate --quantization $qlist --agreement 64"
timeout 240 "$FLEXPERT" bench generate --model "$DIR" --device "$DEVICE" --quantization "$qlist" \
  --batches 1,16,128,1,16,128 --prompt-len 64 --gen-tokens 32 --agreement 64 \
  --json "$OUT/generate.json" >"$OUT/generate.log" 2>&1
echo "exit $?"
grep -E "^agreement" "$OUT/generate.log"
if [ "${FP8_E2E_NO_WGMMA:-0}" != 0 ] && [ "$DEVICE" != cpu ]; then
  stamp "the same with FLEXPERT_NO_FP8_WGMMA=1"
  FLEXPERT_NO_FP8_WGMMA=1 timeout 240 "$FLEXPERT" bench generate --model "$DIR" --device "$DEVICE" \
    --quantization "$qlist" --batches 1,16,128,1,16,128 --prompt-len 64 --gen-tokens 32 \
    --agreement 64 --json "$OUT/generate_no_wgmma.json" >"$OUT/generate_no_wgmma.log" 2>&1
  echo "exit $?"
  grep -E "^agreement" "$OUT/generate_no_wgmma.log"
fi

# (c): a serving group per quantization; its reports are the server's own counts.
port=18520
for q in "${QUANTS[@]}"; do
  port=$((port + 1))
  url=http://127.0.0.1:$port
  stamp "serve --quantization $q --ranks 2 --max-ranks 3 ($DEVICE)"
  "$FLEXPERT" serve --model "$DIR" --device "$DEVICE" --quantization "$q" --ranks 2 --max-ranks 3 \
    --max-sequences 16 --max-seq-len 512 --port "$port" >"$OUT/serve_$q.log" 2>&1 &
  serve_pid=$!
  up=0
  for _ in $(seq 600); do
    curl -sf "$url/health" >/dev/null 2>&1 && up=1 && break
    kill -0 "$serve_pid" 2>/dev/null || break
    sleep 0.5
  done
  if [ "$up" = 1 ]; then
    timeout 120 "$FLEXPERT" scale --url "$url" --to 3 >"$OUT/scale_$q.json" 2>"$OUT/scale_$q.err"
    echo "scale-up exit $?"
    timeout 120 "$FLEXPERT" bench serve --url "$url" --concurrency 16 --requests 64 --prompt-len 64 \
      --max-tokens 16 --json "$OUT/serve_load_$q.json" >"$OUT/serve_load_$q.log" 2>&1
    echo "load exit $?"
    curl -s -m 120 -X POST "$url/v1/eplb/rebalance" -d '{}' >"$OUT/rebalance_$q.json"
    echo "rebalance exit $?"
    curl -s "$url/metrics" >"$OUT/metrics_$q.txt"
  else
    echo "serve --quantization $q did not come up (see $OUT/serve_$q.log)"
  fi
  kill "$serve_pid" 2>/dev/null
  wait "$serve_pid" 2>/dev/null
done
rm -rf "$DIR"

stamp "summary"
python3 - "$OUT" "$PRESET" "$LAYERS" "$qlist" "$DEVICE" <<'EOF'
import json, os, sys
out, preset, layers, qlist, device = sys.argv[1:4] + [sys.argv[4].split(","), sys.argv[5]]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
summary = {"preset": preset, "layers": int(layers), "prompt_len": 64, "gen_tokens": 32}
print(f"FP8 experts end to end: synthetic {preset}, {layers} layers, block-FP8 checkpoint")
print("(a) decode tok/s (ms/step), second pass, prompt 64, 32 steps")
runs = {}
for name, label in (("generate.json", ""), ("generate_no_wgmma.json", " no-wgmma")):
    g = load(name)
    if not g:
        continue
    for r in g["runs"]:  # The second pass overwrites the first.
        runs[(r["quantization"] + label, r["batch"])] = r
    agreements = g.get("agreement", {}).get("items", [])
    for a in agreements:
        summary.setdefault("agreement", {})[a["quantization"] + label] = a
print("    %-12s %18s %18s %18s" % ("experts", "batch 1", "batch 16", "batch 128"))
for q in sorted({k[0] for k in runs}, key=lambda s: (s != "bf16", s)):
    cells = []
    for b in (1, 16, 128):
        r = runs.get((q, b))
        cells.append("%9.1f (%5.2f)" % (r["decode_tokens_per_s"], r["decode_ms_per_step"])
                     if r else "-")
    print("    %-12s %18s %18s %18s" % (q, *cells))
summary["decode"] = [dict(r, experts=k[0]) for k, r in sorted(runs.items())]
print("(b) 64 prompts, 32 greedy tokens: prompts equal to the bf16 path (dequantized at load)")
for q, a in summary.get("agreement", {}).items():
    print("    %-12s %d / %d (%.1f %%), %.2f leading tokens equal on average"
          % (q, a["equal_prompts"], a["prompts"], 100 * a["equal_share"],
             a["mean_common_prefix"]))
print("(c) expert moves, %s: bytes per copy; scale-up 2 -> 3 (no load yet);"
      " one rebalance after load" % ("CPU ranks" if device == "cpu" else "GPU ranks under MPS"))
print("    %-6s %12s %16s %16s %16s %14s" % ("slots", "bytes/copy", "scale-up copies",
                                             "scale-up MB", "rebalance slots", "rebalance MB"))
moves = {}
for q in qlist:
    up, rb = load(f"scale_{q}.json"), load(f"rebalance_{q}.json")
    if not up or not rb or up.get("status") != "ok" or rb.get("status") != "ok":
        print(f"    {q:6s} (no report: see scale_{q}.* and rebalance_{q}.json)")
        continue
    copies, copied = up["expert_copies"], up["copied_bytes"]
    per_copy = copied / copies if copies else 0
    if rb["moved_slots"] and rb["moved_bytes"] != rb["moved_slots"] * per_copy:
        print(f"    {q}: the rebalance's bytes per copy differ from the scale-up's")
    up_total = copied + up.get("converge_moved_bytes", 0)
    moves[q] = {"bytes_per_copy": per_copy, "scale_up_copies": copies,
                "scale_up_copied_bytes": copied,
                "scale_up_converge_slots": up.get("converge_moved_slots", 0),
                "scale_up_converge_bytes": up.get("converge_moved_bytes", 0),
                "scale_up_total_bytes": up_total,
                "rebalance_slots": rb["moved_slots"], "rebalance_bytes": rb["moved_bytes"],
                "scale_up": up, "rebalance": rb}
    print("    %-6s %12d %16s %16.1f %16d %14.1f"
          % (q, per_copy, "%d + %d" % (copies, up.get("converge_moved_slots", 0)),
             up_total / 1e6, rb["moved_slots"], rb["moved_bytes"] / 1e6))
if "fp8" in moves and "bf16" in moves:
    f, b = moves["fp8"], moves["bf16"]
    ratio = {k: f[k] / b[k] if b[k] else None
             for k in ("bytes_per_copy", "scale_up_total_bytes", "rebalance_bytes")}
    moves["fp8_over_bf16"] = ratio
    fmt = lambda x: "-" if x is None else "%.4f" % x
    print("    fp8 / bf16: per copy %s, scale-up %s, rebalance %s (its slots: %d against %d)"
          % (fmt(ratio["bytes_per_copy"]), fmt(ratio["scale_up_total_bytes"]),
             fmt(ratio["rebalance_bytes"]), f["rebalance_slots"], b["rebalance_slots"]))
summary["moves"] = moves
with open(os.path.join(out, "fp8_e2e.json"), "w") as f:
    json.dump(summary, f, indent=1)
print("wrote", os.path.join(out, "fp8_e2e.json"))
EOF
stamp "done"
