#!/usr/bin/env bash
# Sourced on the GPU machine before running binaries packed by scripts/gpu_pack.sh:
#   PACK=.gpu source scripts/gpu_env.sh
# cuBLAS from the toolkit or PyTorch's wheels, the packed libraries, the compiled-in
# source paths (testdata, the flexpert binary the system tests start) and NVIDIA MPS,
# so several ranks share the one GPU (stop it with `echo quit | nvidia-cuda-mps-control`).
PACK=${PACK:-.gpu}
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib $(python3 -c \
    'import nvidia, os; [print(os.path.join(p, q, "lib")) for p in nvidia.__path__ for q in os.listdir(p)]' \
    2>/dev/null); do
  [ -e "$d/libcublas.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" && break
done
mkdir -p /tmp/fg && tar -C /tmp/fg -xJf "$PACK/libs.tar.xz"
export LD_LIBRARY_PATH="/tmp/fg/lib:${LD_LIBRARY_PATH:-}"
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
mkdir -p /work/main/build-cuda && cp "$PACK/bin/flexpert" /work/main/build-cuda/flexpert
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d 2>/dev/null || true
