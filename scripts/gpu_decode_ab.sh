#!/usr/bin/env bash
# On the GPU machine, with binaries packed by scripts/gpu_pack.sh: decode steps of a
# synthetic model for several builds or settings, interleaved in one run (the H200's
# timings drift between runs), with `flexpert bench generate`; then a table of ms per
# decode step (second pass) per variant, prompt length and batch, and a plot of it
# (bench/plot_decode.py, where python3 has matplotlib). Each variant is `NAME:ENV,...`
# (environment settings, possibly none; a value may hold commas: scripts/variants.sh) or
# `NAME:@BIN` (another flexpert binary, e.g. an older build copied into .gpu/bin), run
# REPS times in turn per prompt length.
#   PACK=.gpu source scripts/gpu_env.sh; echo quit | nvidia-cuda-mps-control
#   VARIANTS="head:FLEXPERT_NO_GQA_ATTENTION=1 gqa:" PROMPTS="64 2048" OUT=$OUT \
#     bash scripts/gpu_decode_ab.sh
# SUMMARY_ONLY=1 prints the table (and plots) of the JSON files already in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/variants.sh
BIN=${BIN:-.gpu/bin}
OUT=${OUT:-/tmp/gpu_decode_ab}
VARIANTS=${VARIANTS:?"VARIANTS=\"name:ENV=1 name2:@bin ...\""}
PROMPTS=${PROMPTS:-64 2048}
BATCHES=${BATCHES:-1,16,64,128}
GEN=${GEN:-32}
REPS=${REPS:-2}
LAYERS=${LAYERS:-12}
PRESET=${PRESET:-qwen3-30b-a3b}
MODEL=${MODEL:-}
mkdir -p "$OUT"

if [ -z "${SUMMARY_ONLY:-}" ]; then
  if [ -z "$MODEL" ]; then
    MODEL=/dev/shm/decode-ab-$PRESET-L$LAYERS
    timeout 300 "$BIN/flexpert" synth --preset "$PRESET" --layers "$LAYERS" --out "$MODEL" |
      tail -1
  fi
  for r in $(seq 1 "$REPS"); do
    for v in $VARIANTS; do
      name=${v%%:*} spec=${v#*:} flexpert=$BIN/flexpert envs=()
      if [[ $spec == @* ]]; then
        flexpert=${spec#@}
      elif [ -n "$spec" ]; then
        variant_envs "$spec"
      fi
      for p in $PROMPTS; do
        env "${envs[@]}" timeout "${BENCH_TIMEOUT:-150}" "$flexpert" bench generate \
          --model "$MODEL" --device cuda --batches "$BATCHES,$BATCHES" --prompt-len "$p" \
          --gen-tokens "$GEN" --json "$OUT/g_${name}_${p}_$r.json" >"$OUT/g_${name}_${p}_$r.log" 2>&1
        echo "== $name prompt $p run $r: exit $?"
      done
    done
  done
fi

# One line per (variant, prompt): each batch's ms per step, run by run.
python3 - "$OUT" $VARIANTS <<'PY'
import glob, json, os, sys
out, variants = sys.argv[1], [v.split(":", 1)[0] for v in sys.argv[2:]]
def second_pass(path):
    d = json.load(open(path))
    runs = d["runs"][len(d["runs"]) // 2:]
    return d["prompt_len"], {r["batch"]: r["decode_ms_per_step"] for r in runs}
rows = {}
for v in variants:
    for path in sorted(glob.glob(os.path.join(out, "g_%s_*.json" % v))):
        prompt, ms = second_pass(path)
        for b, x in ms.items():
            rows.setdefault((prompt, v), {}).setdefault(b, []).append(x)
print("ms per decode step (second pass), run by run")
for (prompt, v) in sorted(rows, key=lambda k: (k[0], variants.index(k[1]))):
    cells = ["b%d %s" % (b, " / ".join("%.2f" % x for x in xs))
             for b, xs in sorted(rows[(prompt, v)].items())]
    print("prompt %5d %-12s %s" % (prompt, v, "   ".join(cells)))
PY
plot_args=()
for v in $VARIANTS; do plot_args+=("${v%%:*}=$OUT/g_${v%%:*}_*.json"); done
for py in /usr/bin/python3 python3; do
  if "$py" -c 'import matplotlib' 2>/dev/null; then
    "$py" bench/plot_decode.py "$OUT/decode_ab.png" "decode, ms per step" "${plot_args[@]}" &&
      echo "wrote $OUT/decode_ab.png"
    break
  fi
done
