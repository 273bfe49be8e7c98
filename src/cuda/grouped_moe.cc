// SPDX-License-Identifier: Apache-2.0
#include "cuda/grouped_moe.h"

#include <cstdlib>
#include <string>

#include "cuda/decode_moe.h"
#include "cuda/kernels.h"
#include "cuda/knobs.h"

namespace flexpert::cuda {

namespace {

// DeepSeek's router over scratch.logits into scratch.expert, .weight and .slot.
GroupedTopkArgs grouped_args(const MoeDims& dims, const GroupedRouter& router,
                             const float* score_bias, const MoeLayerWeights& w, MoeScratch& scratch,
                             int num_tokens) {
  return GroupedTopkArgs{scratch.logits.as<float>(),
                         score_bias,
                         num_tokens,
                         dims.num_experts,
                         dims.top_k,
                         router.sigmoid,
                         router.method,
                         router.num_groups,
                         router.topk_groups,
                         dims.norm_topk_prob,
                         router.routed_scaling_factor,
                         w.rep_start,
                         w.rep_count,
                         w.rep_slots,
                         scratch.expert.as<int32_t>(),
                         scratch.weight.as<float>(),
                         scratch.slot.as<int32_t>()};
}

}  // namespace

Status route_grouped(const MoeDims& dims, const GroupedRouter& router, const float* score_bias,
                     const MoeLayerWeights& w, MoeScratch& scratch, const void* h, int num_tokens,
                     Blas& blas, cudaStream_t stream) {
  if (num_tokens == 0) return Status();
  if (num_tokens > scratch.max_tokens) {
    return internal_error("MoE step of " + std::to_string(num_tokens) +
                          " tokens over the scratch capacity " +
                          std::to_string(scratch.max_tokens));
  }
  const int H = dims.hidden;
  FLEX_RETURN_IF_ERROR(blas.gemm_nt(dims.dtype, h, num_tokens, H, w.router, dims.num_experts,
                                    DType::kF32, scratch.logits.data()));
  const GroupedTopkArgs topk = grouped_args(dims, router, score_bias, w, scratch, num_tokens);
  FLEX_CUDA_TRY(grouped_topk(topk, stream));
  return Status();
}

Status run_grouped_moe(const MoeDims& dims, const GroupedRouter& router, const float* score_bias,
                       const MoeLayerWeights& w, MoeScratch& scratch, const void* h, int num_tokens,
                       const int32_t* num_valid_tokens, float* out, bool accumulate, Blas& blas,
                       cudaStream_t stream, int force_tile) {
  const bool no_decode = knobs().no_decode_moe;
  if (num_tokens == 0) return Status();
  if (num_tokens > scratch.max_tokens) {
    return internal_error("MoE step of " + std::to_string(num_tokens) +
                          " tokens over the scratch capacity " +
                          std::to_string(scratch.max_tokens));
  }
  if (dims.fp8) {
    FLEX_RETURN_IF_ERROR(
        route_grouped(dims, router, score_bias, w, scratch, h, num_tokens, blas, stream));
    return run_fp8_experts(dims, w, scratch, h, num_tokens, num_valid_tokens, out, accumulate,
                           stream, force_tile);
  }
  if (force_tile < 0 && !no_decode && w.router != nullptr && uses_decode_path(dims, num_tokens)) {
    return run_decode_grouped(dims, w, scratch,
                              grouped_args(dims, router, score_bias, w, scratch, num_tokens), h,
                              num_tokens, num_valid_tokens, out, accumulate, stream);
  }
  const int H = dims.hidden, I = dims.intermediate, K = dims.top_k;
  const int64_t P = static_cast<int64_t>(num_tokens) * K;
  const GemmTile tile = force_tile >= 0 ? static_cast<GemmTile>(force_tile)
                                        : choose_tile(dims.dtype, P, dims.num_experts, H, I);
  if (!tile_supports(tile, dims.dtype, 2 * I, H) || !tile_supports(tile, dims.dtype, H, I)) {
    return invalid_argument("GEMM tile " + std::to_string(static_cast<int>(tile)) +
                            " does not fit the expert shapes");
  }
  const int block_m = tile_rows(tile);
  FLEX_RETURN_IF_ERROR(
      route_grouped(dims, router, score_bias, w, scratch, h, num_tokens, blas, stream));
  FLEX_CUDA_TRY(
      permute(permute_args(dims, w, scratch, num_tokens, block_m, num_valid_tokens), stream));
  return run_expert_gemms(dims, w, scratch, h, num_tokens, tile, out, accumulate, stream);
}

Status run_grouped_moe_norm(const MoeDims& dims, const GroupedRouter& router,
                            const float* score_bias, const MoeLayerWeights& w, MoeScratch& scratch,
                            const MoeInputNorm& norm, void* h, int num_tokens,
                            const int32_t* num_valid_tokens, float* out, bool accumulate,
                            Blas& blas, cudaStream_t stream, const SharedExperts* shared) {
  const bool no_decode = knobs().no_decode_moe;
  const bool no_shared_fusion = knobs().no_shared_fusion;
  if (num_tokens == 0) return Status();
  if (shared != nullptr && shared->inter == 0) shared = nullptr;
  const bool decode =
      !no_decode && w.router != nullptr && route_norm_fuses(dims, scratch, num_tokens);
  const bool shared_inside = decode && shared != nullptr && !no_shared_fusion &&
                             decode_moe_supported(num_tokens, dims.hidden, dims.intermediate,
                                                  dims.num_experts, dims.top_k, shared->inter);
  if (decode) {
    FLEX_RETURN_IF_ERROR(run_decode_grouped(
        dims, w, scratch, grouped_args(dims, router, score_bias, w, scratch, num_tokens), h,
        num_tokens, num_valid_tokens, out, accumulate, stream, &norm,
        shared_inside ? shared : nullptr));
  } else {
    FLEX_CUDA_TRY(rms_norm(dims.dtype, norm.x, nullptr, norm.weight, num_tokens, dims.hidden,
                           norm.eps, h, stream));
    FLEX_RETURN_IF_ERROR(run_grouped_moe(dims, router, score_bias, w, scratch, h, num_tokens,
                                         num_valid_tokens, out, accumulate, blas, stream));
  }
  if (shared == nullptr || shared_inside) return Status();
  const int H = dims.hidden, Is = shared->inter;
  FLEX_RETURN_IF_ERROR(blas.linear(dims.dtype, h, num_tokens, H, shared->gate_up, 2 * Is,
                                   shared->gu, /*accumulate=*/false));
  return blas.linear_swiglu(dims.dtype, shared->gu, num_tokens, Is, shared->down, H, out,
                            /*accumulate=*/true, shared->act);
}

}  // namespace flexpert::cuda
