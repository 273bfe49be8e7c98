// SPDX-License-Identifier: Apache-2.0
#include "cuda/blas.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "cuda/kernels.h"
#include "cuda/knobs.h"

namespace flexpert::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

cudaDataType_t to_cuda(DType d) { return d == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; }

}  // namespace

Status cublas_status(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status();
  std::string msg = std::string(what) + ": " + cublasGetStatusName(status) + " (" +
                    cublasGetStatusString(status) + ")";
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return resource_exhausted(std::move(msg));
  return internal_error(std::move(msg));
}

Blas::~Blas() {
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
}

Blas::Blas(Blas&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)),
      stream_(o.stream_),
      workspace_(std::move(o.workspace_)) {}

Blas& Blas::operator=(Blas&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) (void)cublasDestroy(handle_);
    handle_ = std::exchange(o.handle_, nullptr);
    stream_ = o.stream_;
    workspace_ = std::move(o.workspace_);
  }
  return *this;
}

Result<Blas> Blas::create(cudaStream_t stream) {
  Blas b;
  FLEX_CUBLAS_TRY(cublasCreate(&b.handle_));
  FLEX_CUBLAS_TRY(cublasSetStream(b.handle_, stream));
  b.stream_ = stream;
  FLEX_ASSIGN_OR_RETURN(b.workspace_, DeviceBuffer::create(kWorkspaceBytes));
  FLEX_CUBLAS_TRY(cublasSetWorkspace(b.handle_, b.workspace_.data(), b.workspace_.num_bytes()));
  FLEX_CUBLAS_TRY(cublasSetMathMode(b.handle_, CUBLAS_DEFAULT_MATH));
  return b;
}

Status Blas::gemm_nt(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w, int64_t n,
                     DType out_dtype, void* y, float alpha, float beta) {
  if (m == 0 || n == 0) return Status();
  // Row-major y[m, n] = x[m, k] w[n, k]^T is column-major y^T[n, m] = w^T x^T:
  // A = w viewed column-major [k, n] (op T), B = x viewed column-major [k, m].
  const cublasComputeType_t compute =
      in_dtype == DType::kF32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  FLEX_CUBLAS_TRY(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                               static_cast<int>(m), static_cast<int>(k), &alpha, w,
                               to_cuda(in_dtype), static_cast<int>(k), x, to_cuda(in_dtype),
                               static_cast<int>(k), &beta, y, to_cuda(out_dtype),
                               static_cast<int>(n), compute, CUBLAS_GEMM_DEFAULT));
  return Status();
}

namespace {

// Rows up to which linear() takes the GEMV.
int64_t gemv_max_rows() { return knobs().no_gemv ? int64_t{0} : Blas::kLinearGemvRows; }

// Whether linear() and its fused forms take the GEMV for m rows of k over n columns (more
// than one row: short rows of small weights only, blas.h).
bool gemv_takes(int64_t m, int64_t k, int64_t n) {
  return m <= gemv_max_rows() && n * k <= Blas::kLinearGemvMax &&
         (m == 1 || (k <= Blas::kLinearGemvLongRow && n * k <= Blas::kLinearGemvMaxPair));
}

}  // namespace

Status Blas::linear(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w, int64_t n,
                    float* y, bool accumulate) {
  if (gemv_takes(m, k, n) && gemv_nt_fits(in_dtype, m, k)) {
    FLEX_CUDA_TRY(gemv_nt(x, static_cast<int>(m), static_cast<int>(k), w, static_cast<int>(n), y,
                          accumulate, stream_));
    return Status();
  }
  return gemm_nt(in_dtype, x, m, k, w, n, DType::kF32, y, 1.f, accumulate ? 1.f : 0.f);
}

bool Blas::norm_fuses(DType in_dtype, int64_t m, int64_t k, int64_t n) {
  const bool no_fusion = knobs().no_norm_fusion;
  return !no_fusion && in_dtype == DType::kBF16 && gemv_takes(m, k, n) && gemv_norm_nt_fits(m, k);
}

Status Blas::linear_norm(DType in_dtype, const float* x, const float* norm_weight, float eps,
                         int64_t m, int64_t k, const void* w, int64_t n, float* y, void* h) {
  return linear_norm_rows(in_dtype, x, k, norm_weight, eps, m, k, w, n, DType::kF32, y, h);
}

Status Blas::linear_norm_rows(DType in_dtype, const float* x, int64_t x_stride,
                              const float* norm_weight, float eps, int64_t m, int64_t k,
                              const void* w, int64_t n, DType out_dtype, void* y, void* h) {
  if (norm_fuses(in_dtype, m, k, n) && x_stride % 4 == 0 && x_stride >= k &&
      (out_dtype == DType::kF32 || out_dtype == DType::kBF16)) {
    FLEX_CUDA_TRY(gemv_norm_nt_rows(x, x_stride, norm_weight, eps, static_cast<int>(m),
                                    static_cast<int>(k), w, static_cast<int>(n), out_dtype, y,
                                    stream_));
    return Status();
  }
  FLEX_CUDA_TRY(rms_norm_rows(in_dtype, x, x_stride, norm_weight, static_cast<int>(m),
                              static_cast<int>(k), eps, h, stream_));
  if (out_dtype == DType::kF32) {
    return linear(in_dtype, h, m, k, w, n, static_cast<float*>(y), /*accumulate=*/false);
  }
  return gemm_nt(in_dtype, h, m, k, w, n, out_dtype, y);
}

Status Blas::linear_swiglu(DType in_dtype, const float* gu, int64_t m, int64_t inter, const void* w,
                           int64_t n, float* y, bool accumulate, void* act) {
  const bool no_fusion = knobs().no_swiglu_fusion;
  if (!no_fusion && in_dtype == DType::kBF16 && gemv_takes(m, inter, n) &&
      gemv_swiglu_nt_fits(m, inter)) {
    FLEX_CUDA_TRY(gemv_swiglu_nt(gu, static_cast<int>(m), static_cast<int>(inter), w,
                                 static_cast<int>(n), y, accumulate, stream_));
    return Status();
  }
  FLEX_CUDA_TRY(silu_mul(in_dtype, gu, static_cast<int>(m), static_cast<int>(inter), act, stream_));
  return linear(in_dtype, act, m, inter, w, n, y, accumulate);
}

}  // namespace flexpert::cuda
