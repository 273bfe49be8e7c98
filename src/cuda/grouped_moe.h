// SPDX-License-Identifier: Apache-2.0
// The MoE block of DeepSeek-V2/V3 on one GPU: run_moe (moe_layer.h) with DeepSeek's
// router (mla_kernels.h grouped_topk: sigmoid or softmax scores, correction bias,
// group-limited top-k, routed scaling) in place of the softmax top-k. Same scratch,
// slot layout, routing tables and grouped GEMMs; no host synchronisation (graph-safe).
// Shared experts are not part of it (the model adds them).
#pragma once

#include "cuda/blas.h"
#include "cuda/mla_kernels.h"
#include "cuda/moe_layer.h"

namespace flexpert::cuda {

struct GroupedRouter {
  bool sigmoid = true;
  GroupedTopkMethod method = GroupedTopkMethod::kNoauxTc;
  int num_groups = 1;
  int topk_groups = 1;
  float routed_scaling_factor = 1.0f;  // dims.norm_topk_prob says whether to normalise.
};

// The router alone: logits, grouped top-k with replica choice into scratch.expert,
// .weight and .slot (expert parallelism runs the experts elsewhere).
Status route_grouped(const MoeDims& dims, const GroupedRouter& router, const float* score_bias,
                     const MoeLayerWeights& w, MoeScratch& scratch, const void* h, int num_tokens,
                     Blas& blas, cudaStream_t stream);

// out[t] (+)= MoE(h[t]) for t < num_tokens, as run_moe (bf16 decode steps in three
// kernels, run_decode_grouped; FLEXPERT_NO_DECODE_MOE=1 or force_tile >= 0: the grouped
// GEMMs; dims.fp8: run_fp8_experts); score_bias: f32 [E] device array (read by kNoauxTc
// only).
Status run_grouped_moe(const MoeDims& dims, const GroupedRouter& router, const float* score_bias,
                       const MoeLayerWeights& w, MoeScratch& scratch, const void* h, int num_tokens,
                       const int32_t* num_valid_tokens, float* out, bool accumulate, Blas& blas,
                       cudaStream_t stream, int force_tile = -1);

// run_grouped_moe of h = rms_norm(norm.x) (h: [T, H] in dims.dtype, written here), then
// out += the shared experts of h where given. On the decode path of one or two tokens the
// route kernel normalises (route_norm_fuses), so no RMSNorm kernel runs, and the shared
// experts run inside the decode kernels (decode_moe.h); else as a dense MLP (Blas::linear,
// linear_swiglu). FLEXPERT_NO_SHARED_FUSION=1: never inside (comparisons).
Status run_grouped_moe_norm(const MoeDims& dims, const GroupedRouter& router,
                            const float* score_bias, const MoeLayerWeights& w, MoeScratch& scratch,
                            const MoeInputNorm& norm, void* h, int num_tokens,
                            const int32_t* num_valid_tokens, float* out, bool accumulate,
                            Blas& blas, cudaStream_t stream, const SharedExperts* shared = nullptr);

}  // namespace flexpert::cuda
