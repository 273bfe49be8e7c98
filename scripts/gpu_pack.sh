#!/usr/bin/env bash
# Packs the GPU binaries built here ($BUILD, default build-cuda/) with the shared
# libraries the GPU machine's image may lack into $PACK (default .gpu/, git-ignored via
# .git/info/exclude), so that scripts/gpu_check.sh (and gpu_ep_check.sh) can run them
# there without building. cuBLAS is not packed: the GPU machine has it (CUDA toolkit or
# PyTorch's wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
PACK=${PACK:-.gpu}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j2 --target cuda_test moe_layer_bench gemv_bench flexpert system_cuda_serve_test \
  transport_conformance_test transport_conformance_fault_test transport_cuda_ipc_test transport_bench \
  ep_exchange_bench cuda_kill_stall
rm -rf "$PACK" && mkdir -p "$PACK/bin" "$PACK/lib"
cp "$BUILD/tests/cuda/cuda_test" "$BUILD/src/cuda/moe_layer_bench" "$BUILD/src/cuda/gemv_bench" "$BUILD/flexpert" \
  "$BUILD/tests/system/system_cuda_serve_test" \
  "$BUILD/tests/transport/transport_conformance_test" "$BUILD/tests/transport/transport_conformance_fault_test" \
  "$BUILD/tests/transport/transport_cuda_ipc_test" "$BUILD/src/transport/transport_bench" \
  "$BUILD/src/cuda/ep_exchange_bench" "$BUILD/src/cuda/cuda_kill_stall" \
  "$PACK/bin/"
strip "$PACK"/bin/*
skip='linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv|libstdc\+\+|libgcc_s|libcublas|libcudart|libcuda\.so'
for b in "$PACK"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -Ev "$skip" || true
done | sort -u | while read -r lib; do cp -L "$lib" "$PACK/lib/"; done
tar -C "$PACK" -cJf "$PACK/libs.tar.xz" lib && rm -rf "${PACK:?}/lib"
du -sh "$PACK/bin" "$PACK/libs.tar.xz"
