// SPDX-License-Identifier: Apache-2.0
// HeadGemm: per-head products of MLA (kv_b's absorbed key and value parts) as one
// strided-batched cuBLAS call, on its own handle bound to one stream with a fixed
// workspace (graph-capturable), like Blas. Enqueues only; not thread-safe.
#pragma once

#include <cublas_v2.h>

#include <cstdint>

#include "cuda/device.h"
#include "cuda/mla_kernels.h"
#include "flexpert/dtype.h"
#include "flexpert/status.h"

namespace flexpert::cuda {

class HeadGemm {
 public:
  HeadGemm() = default;
  ~HeadGemm();
  HeadGemm(HeadGemm&& o) noexcept;
  HeadGemm& operator=(HeadGemm&& o) noexcept;
  HeadGemm(const HeadGemm&) = delete;
  HeadGemm& operator=(const HeadGemm&) = delete;

  static Result<HeadGemm> create(cudaStream_t stream);

  // As kernels::matmul_nt_heads: y[t, h, :n] = x[t, h, :k] @ w[h]^T for t < m and
  // h < num_heads, w [num_heads, n, k]; row t, head h of x starts at x + t * x_row_stride
  // + h * x_head_stride (elements), likewise y. x and w in `in_dtype` (F32: strict f32),
  // y in `out_dtype`, f32 accumulation. bf16 steps of up to kHeadGemvMaxRows tokens over
  // weights of up to kHeadGemvMaxElems run head_gemv (mla_kernels.h: no cuBLAS launch in
  // the decode chain of programmatic dependent launches); FLEXPERT_NO_HEAD_GEMV=1: always
  // cuBLAS (comparisons). H200, DeepSeek-V2-Lite's 16 heads (1 M elements): batch 1 0.91
  // -> 0.88 ms a step; DeepSeek-V3's 128 heads (8.4 M): cuBLAS was faster (batch 2 2.095
  // against 2.12 ms), so larger weights stay with it.
  static constexpr int64_t kHeadGemvMaxElems = int64_t{4} << 20;
  // With rope (its tokens m, dtype in_dtype): mla_rope_store(rope) as well, inside the
  // GEMV's launch where it runs.
  Status run(DType in_dtype, const void* x, int64_t m, int64_t x_row_stride, int64_t x_head_stride,
             const void* w, int64_t num_heads, int64_t n, int64_t k, DType out_dtype, void* y,
             int64_t y_row_stride, int64_t y_head_stride, const MlaRopeArgs* rope = nullptr);

 private:
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer workspace_;
};

}  // namespace flexpert::cuda
