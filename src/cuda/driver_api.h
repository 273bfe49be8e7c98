// SPDX-License-Identifier: Apache-2.0
// Driver API entry points taken through the runtime (no link against libcuda): the tensor
// maps of the wgmma GEMMs, the stream memory operations of the expert-parallel exchange.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace flexpert::cuda {

// The driver's `name` (its CUDA 12.0 version), or nullptr where this driver lacks it.
template <typename Fn>
Fn driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace flexpert::cuda
