// SPDX-License-Identifier: Apache-2.0
#include "cuda/blas.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <tuple>
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

struct Blas::Lt {
  // (in dtype, out dtype, n, k, rows rounded up to a power of two, beta != 0, the
  // pointers' common alignment) -> the algorithm, or none (nullopt: cublasGemmEx).
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, bool, int>;
  cublasLtHandle_t handle = nullptr;
  std::map<Key, std::optional<cublasLtMatmulAlgo_t>> algos;
  ~Lt() {
    if (handle != nullptr) (void)cublasLtDestroy(handle);
  }
};

Blas::Blas() = default;

Blas::~Blas() {
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
}

Blas::Blas(Blas&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)),
      stream_(o.stream_),
      workspace_(std::move(o.workspace_)),
      lt_(std::move(o.lt_)) {}

Blas& Blas::operator=(Blas&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) (void)cublasDestroy(handle_);
    handle_ = std::exchange(o.handle_, nullptr);
    stream_ = o.stream_;
    workspace_ = std::move(o.workspace_);
    lt_ = std::move(o.lt_);
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
  b.lt_ = std::make_unique<Lt>();
  FLEX_CUBLAS_TRY(cublasLtCreate(&b.lt_->handle));
  return b;
}

namespace {

// The largest power of two (at most 256) dividing the address.
int alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % static_cast<uintptr_t>(align) != 0) align /= 2;
  return align;
}

// cuBLASLt objects freed at scope exit.
struct LtObjects {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtObjects() {
    if (pref != nullptr) (void)cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) (void)cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) (void)cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) (void)cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) (void)cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace

Result<bool> Blas::gemm_lt(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w,
                           int64_t n, DType out_dtype, void* y, float alpha, float beta) {
  if (lt_ == nullptr) return false;
  const int align = std::min({alignment(x), alignment(w), alignment(y)});
  const Lt::Key key{static_cast<int>(in_dtype),
                    static_cast<int>(out_dtype),
                    n,
                    k,
                    static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(m))),
                    beta != 0.f,
                    align};
  const cublasComputeType_t compute =
      in_dtype == DType::kF32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  // As gemm_nt: y^T[n, m] = w^T (A: [k, n] column-major, transposed) x^T (B: [k, m]).
  auto describe = [&](int64_t rows, LtObjects* o) -> Status {
    FLEX_CUBLAS_TRY(cublasLtMatmulDescCreate(&o->desc, compute, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    FLEX_CUBLAS_TRY(
        cublasLtMatmulDescSetAttribute(o->desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    FLEX_CUBLAS_TRY(
        cublasLtMatmulDescSetAttribute(o->desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)));
    FLEX_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&o->a, to_cuda(in_dtype), k, n, k));
    FLEX_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&o->b, to_cuda(in_dtype), k, rows, k));
    FLEX_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&o->c, to_cuda(out_dtype), n, rows, n));
    return Status();
  };
  auto it = lt_->algos.find(key);
  if (it == lt_->algos.end()) {
    LtObjects o;
    FLEX_RETURN_IF_ERROR(describe(std::get<4>(key), &o));
    FLEX_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&o.pref));
    const uint64_t ws = workspace_.num_bytes();
    FLEX_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(
        o.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    const uint32_t a32 = static_cast<uint32_t>(align);
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      FLEX_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(o.pref, attr, &a32, sizeof(a32)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_->handle, o.desc, o.a, o.b, o.c,
                                                             o.c, o.pref, 1, &result, &found);
    std::optional<cublasLtMatmulAlgo_t> algo;
    if (st == CUBLAS_STATUS_SUCCESS && found > 0) algo = result.algo;
    it = lt_->algos.emplace(key, algo).first;
  }
  if (!it->second.has_value()) return false;
  LtObjects o;
  FLEX_RETURN_IF_ERROR(describe(m, &o));
  const cublasStatus_t st =
      cublasLtMatmul(lt_->handle, o.desc, &alpha, w, o.a, x, o.b, &beta, y, o.c, y, o.c,
                     &*it->second, workspace_.data(), workspace_.num_bytes(), stream_);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
    it->second.reset();  // Not for these rows after all: cublasGemmEx from now on.
    return false;
  }
  FLEX_CUBLAS_TRY(st);
  return true;
}

Status Blas::gemm_nt(DType in_dtype, const void* x, int64_t m, int64_t k, const void* w, int64_t n,
                     DType out_dtype, void* y, float alpha, float beta) {
  if (m == 0 || n == 0) return Status();
  // Row-major y[m, n] = x[m, k] w[n, k]^T is column-major y^T[n, m] = w^T x^T:
  // A = w viewed column-major [k, n] (op T), B = x viewed column-major [k, m].
  if (!std::has_single_bit(static_cast<uint64_t>(m))) {  // m > 0 here.
    FLEX_ASSIGN_OR_RETURN(const bool done,
                          gemm_lt(in_dtype, x, m, k, w, n, out_dtype, y, alpha, beta));
    if (done) return Status();
  }
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
