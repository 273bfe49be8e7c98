// SPDX-License-Identifier: Apache-2.0
#include "cuda/head_gemm.h"

#include <cstdlib>
#include <utility>

#include "cuda/blas.h"
#include "cuda/knobs.h"
#include "cuda/mla_kernels.h"

namespace flexpert::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 8u << 20;

cudaDataType_t to_cuda(DType d) { return d == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

}  // namespace

HeadGemm::~HeadGemm() {
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
}

HeadGemm::HeadGemm(HeadGemm&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)),
      stream_(o.stream_),
      workspace_(std::move(o.workspace_)) {}

HeadGemm& HeadGemm::operator=(HeadGemm&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) (void)cublasDestroy(handle_);
    handle_ = std::exchange(o.handle_, nullptr);
    stream_ = o.stream_;
    workspace_ = std::move(o.workspace_);
  }
  return *this;
}

Result<HeadGemm> HeadGemm::create(cudaStream_t stream) {
  HeadGemm g;
  FLEX_CUBLAS_TRY(cublasCreate(&g.handle_));
  FLEX_CUBLAS_TRY(cublasSetStream(g.handle_, stream));
  g.stream_ = stream;
  FLEX_ASSIGN_OR_RETURN(g.workspace_, DeviceBuffer::create(kWorkspaceBytes));
  FLEX_CUBLAS_TRY(cublasSetWorkspace(g.handle_, g.workspace_.data(), g.workspace_.num_bytes()));
  FLEX_CUBLAS_TRY(cublasSetMathMode(g.handle_, CUBLAS_DEFAULT_MATH));
  return g;
}

Status HeadGemm::run(DType in_dtype, const void* x, int64_t m, int64_t x_row_stride,
                     int64_t x_head_stride, const void* w, int64_t num_heads, int64_t n, int64_t k,
                     DType out_dtype, void* y, int64_t y_row_stride, int64_t y_head_stride,
                     const MlaRopeArgs* rope) {
  const bool no_gemv = knobs().no_head_gemv;
  if (m == 0 || n == 0 || num_heads == 0) return Status();
  const HeadGemvArgs args{x,
                          x_row_stride,
                          x_head_stride,
                          w,
                          static_cast<int>(m),
                          static_cast<int>(num_heads),
                          static_cast<int>(n),
                          static_cast<int>(k),
                          y,
                          out_dtype == DType::kBF16,
                          y_row_stride,
                          y_head_stride};
  if (!no_gemv && in_dtype == DType::kBF16 && m <= kHeadGemvMaxRows &&
      (out_dtype == DType::kF32 || out_dtype == DType::kBF16) &&
      num_heads * n * k <= kHeadGemvMaxElems && head_gemv_fits(args)) {
    FLEX_CUDA_TRY(head_gemv(args, stream_, rope));
    return Status();
  }
  if (rope != nullptr) FLEX_CUDA_TRY(mla_rope_store(in_dtype, *rope, stream_));
  // Per head, row-major y[m, n] = x[m, k] w[n, k]^T is column-major y^T = w^T x^T (see
  // Blas::gemm_nt); heads are batches with strides n * k (w), x_head_stride, y_head_stride.
  const cublasComputeType_t compute =
      in_dtype == DType::kF32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  const float alpha = 1.f, beta = 0.f;
  FLEX_CUBLAS_TRY(cublasGemmStridedBatchedEx(
      handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
      static_cast<int>(k), &alpha, w, to_cuda(in_dtype), static_cast<int>(k), n * k, x,
      to_cuda(in_dtype), static_cast<int>(x_row_stride), x_head_stride, &beta, y,
      to_cuda(out_dtype), static_cast<int>(y_row_stride), y_head_stride,
      static_cast<int>(num_heads), compute, CUBLAS_GEMM_DEFAULT));
  return Status();
}

}  // namespace flexpert::cuda
