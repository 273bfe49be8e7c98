// SPDX-License-Identifier: Apache-2.0
// Device helpers shared by the kernels: element conversion, 8-wide vector
// loads, warp and block reductions, dtype dispatch. Header-only, device code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "flexpert/dtype.h"

namespace flexpert::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

// Eight consecutive elements starting at p (16-byte aligned for bf16, 32 for f32).
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
// Eight bf16 (one 16-byte load) as f32.
__device__ __forceinline__ void bf16x8(const uint4& raw, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
// The eight products' sum in index order: the per-chunk dot product of the decode and
// GEMV kernels whose outputs must agree bit for bit (the same order everywhere).
__device__ __forceinline__ float dot8(const float (&w)[8], const float (&x)[8]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += w[i] * x[i];
  return s;
}
// NOTE: the 16-byte load goes to a named local first; passing the dereference straight
// to bf16x8 let nvcc split it into four 4-byte loads (a 30 % slower decode step, H200).
__device__ __forceinline__ void load8(const bf16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  bf16x8(raw, v);
}

template <typename T>  // float, double
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it.
template <typename T>  // float, double
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call.
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x / 32;
  T t = lane < num_warps ? partial[lane] : T(0);
  return warp_sum(t);
}

// RMSNorm of one f32 row by a block of kRmsThreads threads (dim % 4 == 0, dim <= 4 *
// kRmsThreads * kRmsVec): thread i loads float4s i, i + kRmsThreads, ... of the row into
// v (all its loads in flight at once) and every thread gets 1 / rms. rms_norm and the
// kernels that normalise their input themselves (the decode GEMV and route kernels) all
// go through these two, so they round alike: a fused row equals rms_norm's bit for bit.
constexpr int kRmsThreads = 256, kRmsVec = 8;
__device__ __forceinline__ float block_inv_rms(const float* x, int dim, float eps,
                                               float4 (&v)[kRmsVec]) {
  const float4* xr = reinterpret_cast<const float4*>(x);
  const int n4 = dim / 4;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kRmsVec; ++k) {
    const int i = threadIdx.x + k * kRmsThreads;
    v[k] = i < n4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int k = 0; k < kRmsVec; ++k)
    ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
  ss = block_sum(ss);
  return 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
}
// out[j] = x[j] * inv * weight[j] as T for this thread's float4s of block_inv_rms.
template <typename T>
__device__ __forceinline__ void block_rms_store(const float4 (&v)[kRmsVec], float inv,
                                                const float* weight, int dim, T* out) {
  const float4* w4 = reinterpret_cast<const float4*>(weight);
  const int n4 = dim / 4;
#pragma unroll
  for (int k = 0; k < kRmsVec; ++k) {
    const int i = threadIdx.x + k * kRmsThreads;
    if (i >= n4) break;
    const float4 w = w4[i];
    out[4 * i] = from_f32<T>(v[k].x * inv * w.x);
    out[4 * i + 1] = from_f32<T>(v[k].y * inv * w.y);
    out[4 * i + 2] = from_f32<T>(v[k].z * inv * w.z);
    out[4 * i + 3] = from_f32<T>(v[k].w * inv * w.w);
  }
}
// Brings this thread's float4s of block_rms_store's weight into L1 (constant weights,
// before a kernel's grid_dep_wait: the store after the wait then does not wait on L2).
__device__ __forceinline__ void block_rms_prefetch(const float* weight, int dim) {
#pragma unroll
  for (int k = 0; k < kRmsVec; ++k) {
    const int i = threadIdx.x + k * kRmsThreads;
    if (4 * i >= dim) break;
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(weight + 4 * i));
  }
}
__host__ __device__ constexpr bool rms_vec_fits(int64_t dim) {
  return dim % 4 == 0 && dim > 0 && dim <= 4 * kRmsThreads * kRmsVec;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// Raises kernel Kernel's dynamic shared-memory limit to `bytes`, once per device (before
// any graph capture: the first launch of each kernel runs eagerly). Thread-safe.
template <auto Kernel>
cudaError_t ensure_smem_limit(size_t bytes) {
  static std::atomic<uint64_t> done{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes));
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

}  // namespace flexpert::cuda

// Runs the statement with `T` bound to the element type of `dtype` (F32 or BF16).
#define FLEX_DISPATCH_DTYPE(dtype, ...)              \
  do {                                               \
    if ((dtype) == ::flexpert::DType::kBF16) {       \
      using T = ::flexpert::cuda::bf16;              \
      __VA_ARGS__;                                   \
    } else if ((dtype) == ::flexpert::DType::kF32) { \
      using T = float;                               \
      __VA_ARGS__;                                   \
    } else {                                         \
      return cudaErrorInvalidValue;                  \
    }                                                \
  } while (0)
