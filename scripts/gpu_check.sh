#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go: build (or use the binaries that
# scripts/gpu_pack.sh put in .gpu/), run the GPU tests, the PyTorch reference and
# the MoE layer benchmark, the CLI on the tiny checkpoints (Qwen3-MoE, DeepSeek-V3),
# `bench generate` at Qwen3-30B-A3B and DeepSeek-V2-Lite shapes, then print a summary.
#   bash scripts/gpu_check.sh            logs and JSON under $OUT (default out/gpu)
#   FLEXPERT_GPU_BUILD=1 bash ...        build here even if .gpu/ has binaries
#   GPU_CHECK_TOKENS=1,64 bash ...       benchmark token counts (default 1..16384)
#   GPU_CHECK_BENCH_FLAGS="--sweep --profile"  time every GEMM tile / every kernel too
#   GPU_CHECK_TORCH_JSON=F               reuse PyTorch times from an earlier run
#   GPU_CHECK_NO_MEMCHECK=1, GPU_CHECK_NO_GENERATE_BENCH=1, GPU_CHECK_NO_DEEPSEEK_BENCH=1
#                                        skip those steps
#   GPU_CHECK_DEEPSEEK_LAYERS=N          layers of the synthetic DeepSeek-V2-Lite (default 27)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
TOKENS=${GPU_CHECK_TOKENS:-1,4,16,64,256,1024,4096,16384}
export FLEXPERT_LOG=warn PYTHONUNBUFFERED=1
t_start=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t_start))s] $*"; }

stamp "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/nvidia-smi.txt"

# cuBLAS: the toolkit's, else the one in PyTorch's wheels.
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib $(python3 -c \
    'import nvidia, os; [print(os.path.join(p, q, "lib")) for p in nvidia.__path__ for q in os.listdir(p)]' \
    2>/dev/null); do
  [ -e "$d/libcublas.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && break
done

BIN=""
if [ -z "${FLEXPERT_GPU_BUILD:-}" ] && [ -x .gpu/bin/cuda_test ]; then
  mkdir -p /tmp/flexpert-gpu && tar -C /tmp/flexpert-gpu -xJf .gpu/libs.tar.xz
  export LD_LIBRARY_PATH="/tmp/flexpert-gpu/lib:${LD_LIBRARY_PATH:-}"
  if .gpu/bin/cuda_test --gtest_list_tests >/dev/null 2>&1; then
    BIN=.gpu/bin
    stamp "using prebuilt binaries from .gpu/"
  else
    stamp "prebuilt binaries do not run here:"; ldd .gpu/bin/cuda_test | grep "not found"
  fi
fi
if [ -z "$BIN" ]; then
  stamp "configure + build (build-gpu/)"
  if cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLEXPERT_WITH_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/cmake.log" 2>&1 &&
    cmake --build build-gpu -j16 --target cuda_test moe_layer_bench flexpert >>"$OUT/cmake.log" 2>&1; then
    mkdir -p build-gpu/bin
    cp build-gpu/tests/cuda/cuda_test build-gpu/src/cuda/moe_layer_bench build-gpu/flexpert build-gpu/bin/
    BIN=build-gpu/bin
  else
    tail -30 "$OUT/cmake.log"
    echo "BUILD FAILED"
    exit 1
  fi
fi

stamp "GPU tests"
timeout 300 "$BIN/cuda_test" >"$OUT/cuda_test.log" 2>&1
test_rc=$?
tail -3 "$OUT/cuda_test.log"
if command -v compute-sanitizer >/dev/null && [ -z "${GPU_CHECK_NO_MEMCHECK:-}" ]; then
  stamp "kernel tests under compute-sanitizer memcheck"
  timeout 120 compute-sanitizer --tool memcheck --print-limit 20 "$BIN/cuda_test" \
    --gtest_filter='AllTiles/*:HeadDims/*:Fp8Shapes/*' >"$OUT/memcheck.log" 2>&1
  grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/memcheck.log" | sort | uniq -c | head -8
  # Barriers and shared memory of the attention tiles, the split merge, the PDL chain, the
  # decode MoE's route cluster (synccheck caught a divergent barrier in the tiles once).
  for tool in synccheck racecheck; do
    stamp "attention, PDL and GEMV tests under compute-sanitizer $tool"
    timeout 120 compute-sanitizer --tool "$tool" --print-limit 20 "$BIN/cuda_test" \
      --gtest_filter='CudaAttentionTileTest.*:CudaAttentionSplitTest.*:CudaPdlTest.*:CudaGemvTest.*:*DecodeMoe*' \
      >"$OUT/$tool.log" 2>&1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool.log" | head -4
  done
fi

stamp "CLI: flexpert generate --device cuda on qwen3moe-tiny and deepseekv3-tiny"
python3 - "$BIN/flexpert" <<'PY' 2>&1 | tee "$OUT/cli.log"
import json, subprocess, sys
for model, placement in (("qwen3moe-tiny", "replicate:8:1"), ("deepseekv3-tiny", "replicate:2:1")):
    ref = json.load(open(f"testdata/{model}/reference.json"))
    ids = ";".join(",".join(map(str, p["input_ids"])) for p in ref["prompts"])
    for dtype in ("f32", "bf16"):
        r = subprocess.run([sys.argv[1], "generate", "--model", f"testdata/{model}", "--prompt-ids", ids,
                            "--max-tokens", "16", "--placement", placement, "--device", "cuda",
                            "--cuda-dtype", dtype, "--json"], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"cli {model} {dtype}: exit {r.returncode}: {r.stderr.strip()[-300:]}")
            continue
        got = [c["token_ids"] for c in json.loads(r.stdout)["choices"]]
        same = sum(g == p["greedy"] for g, p in zip(got, ref["prompts"]))
        print(f"cli {model} {dtype}: {same}/{len(got)} prompts identical to the HF greedy reference")
PY

if [ -z "${GPU_CHECK_NO_GENERATE_BENCH:-}" ]; then
  stamp "flexpert bench generate --device cuda (qwen3-30b-a3b shapes, 2 layers, synthetic)"
  timeout 150 "$BIN/flexpert" bench generate --preset qwen3-30b-a3b --layers 2 --device cuda \
    --batches 1,8,32 --prompt-len 64 --gen-tokens 32 --cache /tmp/flexpert-synth \
    --json "$OUT/generate_bench.json" >"$OUT/generate_bench.log" 2>&1
  echo "exit $?"; grep -vE "^\s*$" "$OUT/generate_bench.log" | tr '\r' '\n' | grep -E "^(batch|[0-9])" | tail -5
fi

if [ -z "${GPU_CHECK_NO_DEEPSEEK_BENCH:-}" ]; then
  # Batches twice: the first pass of a batch size includes its decode graph capture.
  DS_LAYERS=${GPU_CHECK_DEEPSEEK_LAYERS:-27}
  stamp "flexpert bench generate --device cuda (deepseek-v2-lite, $DS_LAYERS layers, synthetic, bf16)"
  timeout 300 "$BIN/flexpert" bench generate --preset deepseek-v2-lite --layers "$DS_LAYERS" \
    --device cuda --batches 1,16,128,1,16,128 --prompt-len 64 --gen-tokens 32 \
    --cache /tmp/flexpert-synth --json "$OUT/deepseek_generate_bench.json" \
    >"$OUT/deepseek_generate_bench.log" 2>&1
  echo "exit $?"; tr '\r' '\n' <"$OUT/deepseek_generate_bench.log" | grep -E "^(batch|[0-9])" | tail -7
fi

if command -v cuobjdump >/dev/null; then
  echo "HGMMA instructions in moe_layer_bench: $(cuobjdump --dump-sass "$BIN/moe_layer_bench" | grep -c HGMMA)"
fi

TORCH_JSON="$OUT/torch.json"
if [ -n "${GPU_CHECK_TORCH_JSON:-}" ]; then
  TORCH_JSON=$GPU_CHECK_TORCH_JSON  # Reuse an earlier run's PyTorch times.
else
  stamp "PyTorch reference"
  timeout 200 python3 bench/moe_layer_torch.py --tokens "$TOKENS" --json "$TORCH_JSON" 2>&1 \
    | tee "$OUT/torch.log" | tail -20
fi

stamp "moe_layer_bench ${GPU_CHECK_BENCH_FLAGS:-}"
# shellcheck disable=SC2086
timeout 250 "$BIN/moe_layer_bench" --tokens "$TOKENS" --json "$OUT/moe_layer.json" \
  --torch "$TORCH_JSON" ${GPU_CHECK_BENCH_FLAGS:-} 2>&1 | tee "$OUT/bench.log" >/dev/null

stamp "summary"
grep -E "greedy tokens|prefill:|vs float64|GPU f32 vs CPU" "$OUT/cuda_test.log" | sort | uniq -c | head -20
grep -E "^  deepseek" "$OUT/cuda_test.log" | sort | uniq -c | head -16
grep -E "relative L2 vs CPU" "$OUT/cuda_test.log" | awk '{print $1, $2}' | sort | uniq -c | tr '\n' ';'; echo
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED  \]" "$OUT/cuda_test.log" | tail -25
grep -c "OK \]" "$OUT/cuda_test.log" | sed 's/^/tests OK: /'
[ -f "$OUT/memcheck.log" ] && grep -E "ERROR SUMMARY" "$OUT/memcheck.log" | tail -1
[ -f "$OUT/synccheck.log" ] && grep -E "ERROR SUMMARY" "$OUT/synccheck.log" | tail -1
[ -f "$OUT/racecheck.log" ] && grep -E "RACECHECK SUMMARY" "$OUT/racecheck.log" | tail -1
cat "$OUT/cli.log"
[ -f "$OUT/generate_bench.log" ] && tr '\r' '\n' <"$OUT/generate_bench.log" | grep -E "^(batch|[0-9])" | tail -4
[ -f "$OUT/deepseek_generate_bench.log" ] &&
  tr '\r' '\n' <"$OUT/deepseek_generate_bench.log" | grep -E "^(batch|[0-9])" | sed -n '1p;5,7p' |
  sed '1s/^/deepseek-v2-lite: /'
grep -E "tokens:|tiles:|stages:" "$OUT/bench.log"
sed -n '/^shape/,$p' "$OUT/bench.log"
grep -E "^device" "$OUT/bench.log"
stamp "done (tests exit $test_rc)"
