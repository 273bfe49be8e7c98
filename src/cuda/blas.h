// SPDX-License-Identifier: Apache-2.0
// Blas: a cuBLAS handle bound to one stream, with the one GEMM shape the model uses.
//
// Row counts that are powers of two (the decode buckets, which graphs capture) go through
// cublasGemmEx; any other (prefill pieces) through cuBLASLt with the algorithm chosen once
// for the next power of two and kept: cublasGemmEx's choice for a row count it has not seen
// took 2-4 ms of host time per call on an H200 under MPS, a step's worth, each time a new
// prefill length came (docs/benchmarks.md, "Losing a rank").
//
// gemm_nt computes y[m, n] = alpha * x[m, k] @ w[n, k]^T + beta * y (row-major, as
// the checkpoint stores linear weights) with f32 accumulation: x and w in F32 or
// BF16, y in F32 or BF16. F32 inputs run in strict f32 (no TF32). The handle owns
// a fixed workspace so that calls can be captured in CUDA graphs. Enqueues only;
// never synchronises. Not thread-safe.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <memory>

#include "cuda/device.h"
#include "flexpert/dtype.h"
#include "flexpert/status.h"

namespace flexpert::cuda {

Status cublas_status(cublasStatus_t status, const char* what);

class Blas {
 public:
  Blas();
  ~Blas();
  Blas(Blas&& o) noexcept;
  Blas& operator=(Blas&& o) noexcept;
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  static Result<Blas> create(cudaStream_t stream);

  Status gemm_nt(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w, int64_t n,
                 DType out_dtype, void* y, float alpha = 1.f, float beta = 0.f);

  // A dense layer's y[m, n] (f32) = x[m, k] @ w[n, k]^T, plus y when `accumulate`: bf16
  // products of up to kLinearGemvRows rows (decode steps) with weights up to
  // kLinearGemvMax elements by kernels.h's gemv_nt on the handle's stream, the rest by
  // gemm_nt. H200, 12-layer Qwen3-30B-A3B (the attention's qkv and o_proj), ms per step
  // with the GEMV up to 1 / 2 / 4 / 8 rows: batch 1 0.92 (cuBLAS 1.03), batch 2 1.23 /
  // 1.21, batch 4 1.72 / 1.72 / 1.78-1.81, batch 8 2.27 / 2.26 / 2.26-2.30 / 2.43-2.45.
  // The LM head stays with cuBLAS, which streams it at ~4.3 TB/s. FLEXPERT_NO_GEMV=1:
  // always gemm_nt (cuda/knobs.h).
  static constexpr int64_t kLinearGemvRows = 2;
  static constexpr int64_t kLinearGemvMax = int64_t{64} << 20;
  // Two rows take the GEMV only for rows up to kLinearGemvLongRow and weights up to
  // kLinearGemvMaxPair elements: H200, DeepSeek-V3 shapes at batch 2 (k = 7168 for the
  // kv_a and shared gate/up projections, 37.7 M elements in q_b) ran 2.075-2.10 ms a step
  // with the GEMV at two rows everywhere, 2.04 with cuBLAS there at two rows, where
  // DeepSeek-V2-Lite (k <= 2816, up to 11.5 M elements) ran 1.14 against 1.17.
  static constexpr int64_t kLinearGemvLongRow = 4096;
  static constexpr int64_t kLinearGemvMaxPair = int64_t{16} << 20;
  Status linear(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w, int64_t n,
                float* y, bool accumulate);
  // y = rms_norm(x) w^T: x f32 [m, k], normalised with norm_weight into h ([m, k] in
  // in_dtype), then linear(); where linear() takes the GEMV (bf16), the GEMV normalises x
  // itself (gemv_norm_nt, the same values) and h is left alone. FLEXPERT_NO_NORM_FUSION=1:
  // never fused (comparisons).
  Status linear_norm(DType in_dtype, const float* x, const float* norm_weight, float eps, int64_t m,
                     int64_t k, const void* w, int64_t n, float* y, void* h);
  // linear_norm of rows x_stride floats apart (x_stride % 4 == 0) into y of out_dtype (F32
  // or in_dtype; no accumulation): unfused, rms_norm_rows into h, then linear() or gemm_nt.
  Status linear_norm_rows(DType in_dtype, const float* x, int64_t x_stride,
                          const float* norm_weight, float eps, int64_t m, int64_t k, const void* w,
                          int64_t n, DType out_dtype, void* y, void* h);
  // Whether linear_norm / linear_norm_rows of this shape normalise inside the GEMV (and so
  // leave h alone).
  static bool norm_fuses(DType in_dtype, int64_t m, int64_t k, int64_t n);
  // y (+)= silu_mul(gu) w^T: gu f32 [m, 2 * inter] (gate | up). Where linear() takes the
  // GEMV (bf16), the GEMV makes silu(gate) * up itself (gemv_swiglu_nt, the same values)
  // and act is left alone; else silu_mul into act ([m, inter] in in_dtype), then linear().
  // FLEXPERT_NO_SWIGLU_FUSION=1: never fused (comparisons).
  Status linear_swiglu(DType in_dtype, const float* gu, int64_t m, int64_t inter, const void* w,
                       int64_t n, float* y, bool accumulate, void* act);

 private:
  struct Lt;  // cuBLASLt's handle and the algorithms chosen per shape (blas.cc).
  // The cuBLASLt path (above); false: that shape has no algorithm there (gemm_nt falls back).
  Result<bool> gemm_lt(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w,
                       int64_t n, DType out_dtype, void* y, float alpha, float beta);

  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer workspace_;
  std::unique_ptr<Lt> lt_;
};

}  // namespace flexpert::cuda

#define FLEX_CUBLAS_TRY(expr)                                         \
  do {                                                                \
    const cublasStatus_t flex_cublas_st_ = (expr);                    \
    if (flex_cublas_st_ != CUBLAS_STATUS_SUCCESS)                     \
      return ::flexpert::cuda::cublas_status(flex_cublas_st_, #expr); \
  } while (0)
