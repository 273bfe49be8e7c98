#!/usr/bin/env bash
# Sourced on the GPU machine before running binaries packed by scripts/gpu_pack.sh:
#   PACK=.gpu source scripts/gpu_env.sh
# cuBLAS from the toolkit or PyTorch's wheels, the packed libraries, the compiled-in
# source paths (testdata, the flexpert binary the system tests start) and NVIDIA MPS,
# so several ranks share the one GPU (stop it with `echo quit | nvidia-cuda-mps-control`).
PACK=${PACK:-.gpu}
# shellcheck source=scripts/gpu_libs.sh
source scripts/gpu_libs.sh
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
mkdir -p /work/main/build-cuda && cp "$PACK/bin/flexpert" /work/main/build-cuda/flexpert
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d 2>/dev/null || true
