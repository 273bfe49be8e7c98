// SPDX-License-Identifier: Apache-2.0
// Programmatic dependent launch (sm_90, also inside CUDA graphs), for the kernels of a
// decode step: a kernel launched by launch_pdl may start while its predecessor still
// runs; it calls grid_dep_wait() before it reads what the predecessor wrote (the
// predecessor then is complete and its writes visible), then grid_dep_launch() to let
// its own successor start. Every block waits before it exits, early exits included: a
// grid whose blocks all left without waiting would count as complete before its
// predecessor, and its successor's wait would not cover that one.
// Since no kernel lets its successor start before its own wait returned, the kernel
// two back is complete when a kernel starts. So before its wait a kernel may read
// constants (weights, routing tables: written between steps), the step's inputs
// (positions, KV slots: uploaded before its first kernel) and what only kernels two or
// more back wrote; never what its predecessor writes. Keep grid_dep_launch() after
// grid_dep_wait() everywhere: that is what the rule rests on.
// FLEXPERT_NO_PDL=1 in the environment launches plainly (then both are no-ops).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cuda/knobs.h"

namespace flexpert::cuda {

__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A 16-byte weight load that skips L1 (streamed once). Volatile: issued where written
// (before a grid_dep_wait that follows it).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

inline bool pdl_enabled() { return !knobs().no_pdl; }

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialisation,
// and with cluster_x > 0 in clusters of cluster_x blocks (grid.x a multiple of it).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl_cluster(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args&&... args) {
  return launch_pdl_cluster(kernel, grid, block, smem, stream, 0u, std::forward<Args>(args)...);
}

}  // namespace flexpert::cuda
