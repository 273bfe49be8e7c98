#!/usr/bin/env bash
# Sourced on the GPU machine by the gpu_*.sh scripts: puts cuBLAS (the CUDA toolkit's or
# PyTorch's wheels') and the libraries scripts/gpu_pack.sh packed into $PACK/libs.tar.xz
# (PACK defaults to .gpu) on LD_LIBRARY_PATH.
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib $(python3 -c \
    'import nvidia, os; [print(os.path.join(p, q, "lib")) for p in nvidia.__path__ for q in os.listdir(p)]' \
    2>/dev/null); do
  [ -e "$d/libcublas.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && break
done
if [ -e "${PACK:-.gpu}/libs.tar.xz" ]; then
  mkdir -p /tmp/flexpert-gpu && tar -C /tmp/flexpert-gpu -xJf "${PACK:-.gpu}/libs.tar.xz"
  export LD_LIBRARY_PATH="/tmp/flexpert-gpu/lib:${LD_LIBRARY_PATH:-}"
fi
