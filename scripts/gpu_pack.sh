#!/usr/bin/env bash
# Packs the GPU binaries built here (build-cuda/) with the shared libraries the GPU
# machine's image may lack into .gpu/ (git-ignored via .git/info/exclude), so that
# scripts/gpu_check.sh can run them there without building. cuBLAS is not packed:
# the GPU machine has it (CUDA toolkit or PyTorch's wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-cuda -j2 --target cuda_test moe_layer_bench flexpert
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp build-cuda/tests/cuda/cuda_test build-cuda/src/cuda/moe_layer_bench build-cuda/flexpert .gpu/bin/
strip .gpu/bin/*
skip='linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv|libstdc\+\+|libgcc_s|libcublas|libcudart'
for b in .gpu/bin/*; do
  ldd "$b" | awk '/=>/ {print $3}' | grep -Ev "$skip" || true
done | sort -u | while read -r lib; do cp -L "$lib" .gpu/lib/; done
tar -C .gpu -cJf .gpu/libs.tar.xz lib && rm -rf .gpu/lib
du -sh .gpu/bin .gpu/libs.tar.xz
