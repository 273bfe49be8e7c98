#!/usr/bin/env bash
# Runs the whole test suite: formatting, Release build + tests, ASan+UBSan build + tests.
# This is the README's test command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --deps-only
jobs=$(nproc)

echo "== module order"
bash scripts/check_modules.sh

echo "== thread-safety annotations (clang)"
bash scripts/check_thread_safety.sh

echo "== clang-format check"
git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror

echo "== Release build and tests (build/)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== ASan+UBSan build and tests (build-asan/)"
# CUDA is off here: the sanitizers do not instrument device code, and the GPU
# tests skip without a GPU anyway (the Release build above compiles them).
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLEXPERT_SANITIZE=ON \
  -DFLEXPERT_WITH_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs"

echo "== fuzz targets (libFuzzer + ASan/UBSan, 40 s each; see scripts/fuzz.sh)"
bash scripts/fuzz.sh 40
