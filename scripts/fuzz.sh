#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with ASan+UBSan and runs each for SECONDS
# (default 60) on a copy of its seed corpus (tests/fuzz/corpus/<target>/). Fails on
# any crash, sanitizer report, timeout or allocation above 2 GB; the input that
# did it is left in out/fuzz/ (artifact_prefix). CI runs `bash scripts/fuzz.sh 45`.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
targets=(fuzz_completion_request fuzz_chat_request fuzz_safetensors_header fuzz_model_config fuzz_control_message)

echo "== fuzz build (build-fuzz/, clang, -fsanitize=fuzzer,address,undefined)"
cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DFLEXPERT_FUZZ=ON -DFLEXPERT_BUILD_TESTS=OFF \
  -DFLEXPERT_WITH_CUDA=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target "${targets[@]}"

mkdir -p out/fuzz
for t in "${targets[@]}"; do
  name=${t#fuzz_}
  work=out/fuzz/corpus-$name
  mkdir -p "$work"
  echo "== $t for ${seconds}s"
  # New inputs go to $work; the seeds in the repository are only read.
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
    "build-fuzz/tests/fuzz/$t" "$work" "tests/fuzz/corpus/$name" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -artifact_prefix="out/fuzz/$name-" -print_final_stats=1 2>&1 | tail -n 12
done
echo "== fuzz: no crash"
