// SPDX-License-Identifier: Apache-2.0
// Causal grouped-query attention over the paged-by-slot KV cache (kernels.h).
// NOTE: one warp per (token, query head, split) with an online softmax over chunks of
// 32 keys (a lane scores one key, then the warp accumulates the 32 values with
// each lane owning D / 32 output dims); steps of few pairs split the chunks over
// several warps and merge (kernels.h). Correct for prefill and decode alike;
// a tensor-core flash kernel would be the next step for long prompts.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

#include "cuda/device_util.cuh"
#include "cuda/kernels.h"
#include "cuda/pdl.cuh"

namespace flexpert::cuda {
namespace {

constexpr int kWarps = 4;
// Split steps of few (token, head) pairs until about this many warps run.
constexpr int kSplitTargetWarps = 2048;
constexpr int kMaxSplits = 64;

// Warp (pair idx, split sp of `splits`) takes the chunks sp, sp + splits, ... of 32
// positions; with splits > 1 it leaves (m, l, unnormalised acc) for the merge.
template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) attention_kernel(AttentionArgs a, int splits) {
  constexpr int kPerLane = D / 32;
  __shared__ __align__(16) float sq[kWarps][D];
  grid_dep_wait();
  grid_dep_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t idx = task / splits;
  const int sp = static_cast<int>(task % splits);
  if (idx >= static_cast<int64_t>(a.num_tokens) * a.num_q_heads) return;
  const int t = static_cast<int>(idx / a.num_q_heads);
  const int h = static_cast<int>(idx % a.num_q_heads);
  const int kvh = h / (a.num_q_heads / a.num_kv_heads);
  const int len = a.positions[t] + 1;
  if (splits > 1 && sp * 32 >= len) {
    // No positions in this split (short contexts leave most empty): the merge reads
    // only (m, l) of it and skips it.
    if (lane == 0) {
      float* part = a.split_scratch + task * (D + 2);
      part[0] = -FLT_MAX, part[1] = 0.f;
    }
    return;
  }
  const T* q = static_cast<const T*>(a.q) + idx * D;
  for (int d = lane; d < D; d += 32) sq[warp][d] = to_f32(q[d]);
  __syncwarp();
  const int64_t pos_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const int64_t base = static_cast<int64_t>(a.kv_slots[t]) * a.max_seq_len * pos_stride +
                       static_cast<int64_t>(kvh) * D;
  const T* kc = static_cast<const T*>(a.k_cache) + base;
  const T* vc = static_cast<const T*>(a.v_cache) + base;
  float m = -FLT_MAX, l = 0.f;
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  for (int c0 = sp * 32; c0 < len; c0 += splits * 32) {
    const int j = c0 + lane;
    float s = -FLT_MAX;
    if (j < len) {
      const T* kr = kc + j * pos_stride;
      float dot = 0.f;
#pragma unroll
      for (int d = 0; d < D; d += 8) {
        float kv[8];
        load8(kr + d, kv);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += sq[warp][d + i] * kv[i];
      }
      s = dot * a.scale;
    }
    const float m_new = fmaxf(m, warp_max(s));
    const float p = j < len ? expf(s - m_new) : 0.f;
    const float corr = expf(m - m_new);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] *= corr;
    const int count = min(32, len - c0);
    int jj = 0;
    // Eight positions' V loads in flight before their FMAs (a loop of one position at a
    // time waits out a load per position: decode attention was latency-bound); the
    // FMAs keep the position order, so the sums are the same.
    for (; jj + 8 <= count; jj += 8) {
      float v[8][kPerLane];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const T* vr = vc + (c0 + jj + u) * pos_stride;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) v[u][i] = to_f32(vr[lane + 32 * i]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float pj = __shfl_sync(0xffffffffu, p, jj + u);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[i] += pj * v[u][i];
      }
    }
    for (; jj < count; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const T* vr = vc + (c0 + jj) * pos_stride;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] += pj * to_f32(vr[lane + 32 * i]);
    }
    m = m_new;
  }
  if (splits > 1) {
    float* part = a.split_scratch + task * (D + 2);
    if (lane == 0) part[0] = m, part[1] = l;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) part[2 + lane + 32 * i] = acc[i];
    return;
  }
  T* o = static_cast<T*>(a.out) + idx * D;
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) o[lane + 32 * i] = from_f32<T>(acc[i] * inv);
}

// One warp per (token, head): the splits' softmaxes rescaled to their common maximum.
// Lane i holds (m, l) of splits i and i + 32 (a warp reduction gives the maximum and the
// sum), then the warp adds up the values of the non-empty splits (l > 0) in split order,
// four splits' loads in flight at a time. (Split by split, one load after the other, the
// merge of a batch-1 step took ~32 us: 64 splits of ~3 non-empty ones, latency-bound.)
template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32) attention_merge_kernel(AttentionArgs a, int splits) {
  constexpr int kPerLane = D / 32, kHalves = kMaxSplits / 32;
  grid_dep_wait();
  grid_dep_launch();
  const int lane = threadIdx.x % 32;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (idx >= static_cast<int64_t>(a.num_tokens) * a.num_q_heads) return;
  const float* part = a.split_scratch + idx * splits * (D + 2);
  float ms[kHalves], ls[kHalves];
  float mx = -FLT_MAX;
#pragma unroll
  for (int j = 0; j < kHalves; ++j) {
    const int sp = lane + 32 * j;
    ms[j] = sp < splits ? part[sp * (D + 2)] : -FLT_MAX;
    ls[j] = sp < splits ? part[sp * (D + 2) + 1] : 0.f;
    mx = fmaxf(mx, ms[j]);
  }
  mx = warp_max(mx);
  float w[kHalves], l = 0.f;
#pragma unroll
  for (int j = 0; j < kHalves; ++j) {
    w[j] = ls[j] > 0.f ? expf(ms[j] - mx) : 0.f;
    l += ls[j] * w[j];
  }
  l = warp_sum(l);
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
#pragma unroll
  for (int j = 0; j < kHalves; ++j) {
    unsigned mask = __ballot_sync(0xffffffffu, ls[j] > 0.f);
    while (mask != 0) {
      constexpr int kInFlight = 4;
      int src[kInFlight];
      float v[kInFlight][kPerLane];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        src[u] = mask != 0 ? __ffs(mask) - 1 : -1;
        mask &= mask - 1;
        if (src[u] >= 0) {
          const float* p = part + (32 * j + src[u]) * (D + 2) + 2;
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) v[u][i] = p[lane + 32 * i];
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (src[u] < 0) break;
        const float ws = __shfl_sync(0xffffffffu, w[j], src[u]);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[i] += v[u][i] * ws;
      }
    }
  }
  T* o = static_cast<T*>(a.out) + idx * D;
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) o[lane + 32 * i] = from_f32<T>(acc[i] * inv);
}

template <typename T, int D>
cudaError_t launch_dim(const AttentionArgs& a, cudaStream_t stream) {
  const int splits = attention_splits(a);
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  const unsigned blocks = static_cast<unsigned>((pairs * splits + kWarps - 1) / kWarps);
  cudaError_t err =
      launch_pdl(attention_kernel<T, D>, dim3(blocks), dim3(kWarps * 32), 0, stream, a, splits);
  if (err != cudaSuccess || splits == 1) return err;
  const unsigned merge_blocks = static_cast<unsigned>((pairs + kWarps - 1) / kWarps);
  return launch_pdl(attention_merge_kernel<T, D>, dim3(merge_blocks), dim3(kWarps * 32), 0, stream,
                    a, splits);
}

template <typename T>
cudaError_t launch(const AttentionArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 32:
      return launch_dim<T, 32>(a, stream);
    case 64:
      return launch_dim<T, 64>(a, stream);
    case 128:
      return launch_dim<T, 128>(a, stream);
    case 256:
      return launch_dim<T, 256>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

int64_t attention_split_floats(int head_dim) {
  // splits > 1 only below the target, so pairs * splits < 2 * target.
  return int64_t{2} * kSplitTargetWarps * (head_dim + 2);
}

int attention_splits(const AttentionArgs& a) {
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  if (a.split_scratch == nullptr || pairs <= 0 || pairs >= kSplitTargetWarps) return 1;
  int splits =
      static_cast<int>(std::min<int64_t>(kMaxSplits, (kSplitTargetWarps + pairs - 1) / pairs));
  while (splits > 1 && pairs * splits * (a.head_dim + 2) > a.split_capacity) --splits;
  return splits;
}

cudaError_t attention(DType dtype, const AttentionArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.num_kv_heads < 1 || args.num_q_heads % args.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  FLEX_DISPATCH_DTYPE(dtype, return launch<T>(args, stream));
  return cudaSuccess;
}

}  // namespace flexpert::cuda
