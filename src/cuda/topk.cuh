// SPDX-License-Identifier: Apache-2.0
// The router's softmax top-k for one token on one warp (kernels.cu, decode_moe.cu).
#pragma once

#include <cfloat>
#include <climits>

#include "cuda/device_util.cuh"
#include "cuda/kernels.h"

namespace flexpert::cuda {

// One warp per token; each lane holds experts lane, lane + 32, ... (PER of them: a
// kernel compiled for its expert count keeps fewer registers and shorter loops). kL2: the
// logits come from L2 (other blocks wrote them), else by plain loads (shared memory).
constexpr int kTopkMaxPerLane = 16;
template <int PER = kTopkMaxPerLane, bool kL2 = true>
__device__ __forceinline__ void topk_token(const TopkArgs& a, int t, int lane) {
  const float* l = a.logits + static_cast<int64_t>(t) * a.num_experts;
  float prob[PER];
  float mx = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < a.num_experts ? (kL2 ? __ldcg(l + e) : l[e]) : -FLT_MAX;
    mx = fmaxf(mx, prob[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < a.num_experts ? expf(prob[i] - mx) : 0.f;
    sum += prob[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < a.num_experts ? prob[i] / sum : -1.f;  // -1: never chosen.
  }
  int my_expert = 0;
  float my_prob = 0.f, top_sum = 0.f;
  for (int j = 0; j < a.top_k; ++j) {
    float best = -2.f;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (prob[i] > best) {  // Ascending e within a lane: ties keep the lower index.
        best = prob[i];
        best_e = lane + 32 * i;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (lane + 32 * i == best_e) prob[i] = -1.f;
    }
    if (lane == j) {
      my_expert = best_e;
      my_prob = best;
    }
    top_sum += best;
  }
  if (lane < a.top_k) {
    const int64_t p = static_cast<int64_t>(t) * a.top_k + lane;
    a.expert[p] = my_expert;
    a.weight[p] = a.norm_topk_prob ? my_prob / top_sum : my_prob;
    const int count = a.rep_count[my_expert];
    a.slot[p] = a.rep_slots[a.rep_start[my_expert] + (t + lane) % max(count, 1)];
  }
}

}  // namespace flexpert::cuda
