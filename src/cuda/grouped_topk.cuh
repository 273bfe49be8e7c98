// SPDX-License-Identifier: Apache-2.0
// DeepSeek's grouped router for one token, by one warp (device code, header-only): used
// by grouped_topk (mla_kernels.cu) and the decode route kernel (decode_moe.cu).
#pragma once

#include <cfloat>
#include <climits>

#include "cuda/device_util.cuh"
#include "cuda/mla_kernels.h"

namespace flexpert::cuda {

// Warp-wide argmax of (v, idx); idx == INT_MAX marks "no candidate". Ties: lower idx.
__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (oi != INT_MAX && (idx == INT_MAX || ov > v || (ov == v && oi < idx))) {
      v = ov;
      idx = oi;
    }
  }
}

constexpr int kGroupedTopkPerLane = 16;  // Experts per lane: up to 512.

// Token t of a (as grouped_topk), by the 32 lanes of a warp; score: 2 * num_experts
// floats of shared memory of this warp's own.
__device__ __forceinline__ void grouped_topk_token(const GroupedTopkArgs& a, int t, int lane,
                                                   float* score) {
  const int E = a.num_experts;
  float* choice = score + E;
  const float* l = a.logits + static_cast<int64_t>(t) * E;
  if (a.sigmoid) {
    for (int e = lane; e < E; e += 32) score[e] = 1.0f / (1.0f + expf(-l[e]));
  } else {
    float mx = -FLT_MAX;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) {
      score[e] = expf(l[e] - mx);
      sum += score[e];
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) score[e] /= sum;
  }
  const bool noaux = a.method == GroupedTopkMethod::kNoauxTc;
  for (int e = lane; e < E; e += 32) choice[e] = noaux ? score[e] + a.bias[e] : score[e];
  __syncwarp();
  // Groups kept: bit g of `kept`.
  uint32_t kept = 0xffffffffu;
  int group_size = E;
  if (a.method != GroupedTopkMethod::kGreedy) {
    group_size = E / a.num_groups;
    float gv = -FLT_MAX;
    int gi = INT_MAX;
    if (lane < a.num_groups) {
      const float* c = choice + lane * group_size;
      float first = -INFINITY, second = -INFINITY;
      for (int i = 0; i < group_size; ++i) {
        if (c[i] > first) {
          second = first;
          first = c[i];
        } else if (c[i] > second) {
          second = c[i];
        }
      }
      gv = noaux && group_size > 1 ? first + second : first;
      gi = lane;
    }
    kept = 0;
    for (int j = 0; j < a.topk_groups; ++j) {
      float v = gv;
      int idx = gi;
      warp_argmax(v, idx);
      kept |= 1u << idx;
      if (lane == idx) gi = INT_MAX;  // Taken.
    }
  }
  float val[kGroupedTopkPerLane];
  bool live[kGroupedTopkPerLane];
#pragma unroll
  for (int i = 0; i < kGroupedTopkPerLane; ++i) {
    const int e = lane + 32 * i;
    live[i] = e < E && ((kept >> (e / group_size)) & 1u);
    val[i] = live[i] ? choice[e] : -FLT_MAX;
  }
  int my_expert = 0;
  for (int j = 0; j < a.top_k; ++j) {
    float best = -FLT_MAX;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kGroupedTopkPerLane; ++i) {
      // Ascending e within a lane: a tie keeps the lower index.
      if (live[i] && (best_e == INT_MAX || val[i] > best)) {
        best = val[i];
        best_e = lane + 32 * i;
      }
    }
    warp_argmax(best, best_e);
#pragma unroll
    for (int i = 0; i < kGroupedTopkPerLane; ++i) {
      if (lane + 32 * i == best_e) live[i] = false;
    }
    if (lane == j) my_expert = best_e;
  }
  const float s = lane < a.top_k ? score[my_expert] : 0.f;
  const float sum = warp_sum(s);
  const float norm = a.norm_topk_prob ? 1.0f / (sum + 1e-20f) : 1.0f;
  if (lane < a.top_k) {
    const int64_t p = static_cast<int64_t>(t) * a.top_k + lane;
    a.expert[p] = my_expert;
    a.weight[p] = s * norm * a.routed_scaling_factor;
    const int count = a.rep_count[my_expert];
    a.slot[p] = a.rep_slots[a.rep_start[my_expert] + (t + lane) % max(count, 1)];
  }
}

}  // namespace flexpert::cuda
