// SPDX-License-Identifier: Apache-2.0
// BackendMemory in CUDA device memory: how scenarios reach the buffers of device-memory
// backends (cuda_ipc). Only in builds with FLEXPERT_WITH_CUDA.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "conformance_harness.h"

namespace flexpert::conformance {
namespace {

// A scenario cannot go on without its buffers: a CUDA error ends the rank (a test failure).
void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "conformance device memory: %s: %s\n", what, cudaGetErrorString(err));
  std::fflush(stderr);
  std::abort();
}

class CudaMemory final : public BackendMemory {
 public:
  explicit CudaMemory(int device) : device_(device) {}

  // Each call selects the device: scenarios call these from more than one thread.
  void* allocate(size_t num_bytes) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    void* data = nullptr;
    check(cudaMalloc(&data, num_bytes == 0 ? 1 : num_bytes), "cudaMalloc");
    return data;
  }
  void release(void* data) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaFree(data), "cudaFree");
  }
  void copy_in(void* dst, const void* src, size_t n) override {
    if (n == 0) return;
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
    // NOTE: a copy from pageable memory may return before its DMA completed; peers in other
    // processes (reading a region) are not ordered after it, so wait for it here.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  void copy_out(void* dst, const void* src, size_t n) override {
    if (n == 0) return;
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy from the device");
  }

 private:
  int device_;
};

}  // namespace

std::unique_ptr<BackendMemory> make_cuda_memory(int device) {
  return std::make_unique<CudaMemory>(device);
}

}  // namespace flexpert::conformance
