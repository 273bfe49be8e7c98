// SPDX-License-Identifier: Apache-2.0
// MLA and DeepSeek router kernels (see mla_kernels.h).
// NOTE: mla_attention is one block per (token, head, split), its four warps splitting
// the cached rows (chunks of 32: a lane scores one row, then the warp accumulates the 32
// latents, each lane owning kv_lora_rank / 32 consecutive dims), each with an online
// softmax, merged at the end (split-K as flash-decoding does); steps of few pairs split
// over several blocks and a second kernel merges them. Correct for prefill and
// decode; a tensor-core kernel sharing rows across all heads of a token would be the
// next step for long contexts and large batches.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "cuda/device_util.cuh"
#include "cuda/mla_kernels.h"

namespace flexpert::cuda {
namespace {

constexpr int kWarps = 4;
// Split steps of few (token, head) pairs until about this many blocks run (two per SM).
constexpr int kMlaSplitTargetBlocks = 264;
constexpr int kMlaMaxSplits = 32;

template <typename T>
__global__ void rms_norm_rows_kernel(const float* x, int64_t x_stride, const float* weight, int dim,
                                     float eps, T* out) {
  const int r = blockIdx.x;
  const float* xr = x + r * x_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  T* o = out + static_cast<int64_t>(r) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = from_f32<T>(xr[i] * inv * weight[i]);
}

// Rotates rope_dim values of src into dst (see kernels::rope); one warp.
template <typename S, typename D>
__device__ __forceinline__ void rope_warp(const S* src, D* dst, const float* cs, const float* sn,
                                          int rope_dim, bool interleaved, int lane) {
  const int half = rope_dim / 2;
  for (int i = lane; i < half; i += 32) {
    const float a = to_f32(src[interleaved ? 2 * i : i]);
    const float b = to_f32(src[interleaved ? 2 * i + 1 : i + half]);
    dst[i] = from_f32<D>(a * cs[i] - b * sn[i]);
    dst[i + half] = from_f32<D>(b * cs[i] + a * sn[i]);
  }
}

// Grid (tokens, heads + 1), one warp: block y < heads rotates that q head's rope part,
// y == heads normalises, rotates and stores the token's cache row.
template <typename T>
__global__ void mla_rope_store_kernel(MlaRopeArgs a) {
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const int pos = a.positions[t];
  const int half = a.rope_dim / 2;
  const float* cs = a.rope_cos + static_cast<int64_t>(pos) * half;
  const float* sn = a.rope_sin + static_cast<int64_t>(pos) * half;
  const int r = a.kv_lora_rank, row = r + a.rope_dim;
  if (h < a.num_heads) {
    const int64_t head = static_cast<int64_t>(t) * a.num_heads + h;
    const T* src = static_cast<const T*>(a.q) + head * (a.nope_dim + a.rope_dim) + a.nope_dim;
    rope_warp(src, a.q_latent + head * row + r, cs, sn, a.rope_dim, a.interleaved, lane);
    return;
  }
  const float* kv = a.kv + t * a.kv_stride;
  T* dst =
      static_cast<T*>(a.cache) + (static_cast<int64_t>(a.kv_slots[t]) * a.max_seq_len + pos) * row;
  float ss = 0.f;
  for (int i = lane; i < r; i += 32) ss += kv[i] * kv[i];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(r) + a.eps);
  for (int i = lane; i < r; i += 32) dst[i] = from_f32<T>(kv[i] * inv * a.kv_norm[i]);
  rope_warp(kv + r, dst + r, cs, sn, a.rope_dim, a.interleaved, lane);
}

// One block per (token, head); warp w takes the chunks of 32 rows w, w + kWarps, ...
// with its own online softmax, and the block merges the four partial results. Lane l
// owns latent dims [l * kPerLane, (l + 1) * kPerLane).
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kWarps * 32)
    mla_attention_kernel(MlaAttentionArgs a, int splits) {
  extern __shared__ __align__(16) float smem_q[];  // [row] query, then [kWarps][r] partials
  __shared__ float part_m[kWarps], part_l[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = a.kv_lora_rank + a.rope_dim;
  const int64_t idx = blockIdx.x / splits;  // t * heads + h
  const int sp = static_cast<int>(blockIdx.x % splits);
  const int t = static_cast<int>(idx / a.num_heads);
  const int len = a.positions[t] + 1;
  float* q = smem_q;
  float* part = smem_q + row;
  const float* qg = a.q_latent + idx * row;
  for (int d = threadIdx.x; d < row; d += kWarps * 32) q[d] = qg[d];
  __syncthreads();
  const T* cache =
      static_cast<const T*>(a.cache) + static_cast<int64_t>(a.kv_slots[t]) * a.max_seq_len * row;
  float m = -FLT_MAX, l = 0.f;
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  for (int c0 = (sp * kWarps + warp) * 32; c0 < len; c0 += splits * kWarps * 32) {
    const int j = c0 + lane;
    float s = -FLT_MAX;
    if (j < len) {
      const T* kr = cache + static_cast<int64_t>(j) * row;
      float dot = 0.f;
#pragma unroll 4
      for (int d = 0; d < row; d += 8) {
        float kv[8];
        load8(kr + d, kv);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += q[d + i] * kv[i];
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
    if constexpr (kPerLane % 8 == 0 && kPerLane <= 16) {
      // Four positions' latent loads in flight before their FMAs (as attention.cu's value
      // pass: one position at a time waits out its loads); same order of sums.
      constexpr int kGroup = 4;
      for (; jj + kGroup <= count; jj += kGroup) {
        float v[kGroup][kPerLane];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          const T* vr = cache + static_cast<int64_t>(c0 + jj + u) * row + lane * kPerLane;
#pragma unroll
          for (int i = 0; i < kPerLane; i += 8) {
            float w[8];
            load8(vr + i, w);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[u][i + e] = w[e];
          }
        }
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          const float pj = __shfl_sync(0xffffffffu, p, jj + u);
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) acc[i] += pj * v[u][i];
        }
      }
    }
    for (; jj < count; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const T* vr = cache + static_cast<int64_t>(c0 + jj) * row + lane * kPerLane;
      if constexpr (kPerLane % 8 == 0) {
#pragma unroll
        for (int i = 0; i < kPerLane; i += 8) {
          float v[8];
          load8(vr + i, v);
#pragma unroll
          for (int u = 0; u < 8; ++u) acc[i + u] += pj * v[u];
        }
      } else {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[i] += pj * to_f32(vr[i]);
      }
    }
    m = m_new;
  }
  if (lane == 0) {
    part_m[warp] = m;
    part_l[warp] = l;
  }
  __syncthreads();
  float mx = -FLT_MAX;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, part_m[w]);
  const float scale = expf(m - mx);  // 0 for a warp that saw no rows.
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    part[warp * a.kv_lora_rank + lane * kPerLane + i] = acc[i] * scale;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += part_l[w] * expf(part_m[w] - mx);
  if (splits > 1) {
    // This split's (max, sum, unnormalised latent) for mla_merge_kernel; a split without
    // rows leaves (-FLT_MAX, 0, 0).
    float* out = a.split_scratch + static_cast<int64_t>(blockIdx.x) * (a.kv_lora_rank + 2);
    if (threadIdx.x == 0) out[0] = mx, out[1] = total;
    for (int d = threadIdx.x; d < a.kv_lora_rank; d += kWarps * 32) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += part[w * a.kv_lora_rank + d];
      out[2 + d] = sum;
    }
    return;
  }
  const float inv = 1.0f / total;
  T* o = static_cast<T*>(a.out) + idx * a.kv_lora_rank;
  for (int d = threadIdx.x; d < a.kv_lora_rank; d += kWarps * 32) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += part[w * a.kv_lora_rank + d];
    o[d] = from_f32<T>(sum * inv);
  }
}

// One block per (token, head): the splits' partial softmaxes at their common maximum.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) mla_merge_kernel(MlaAttentionArgs a, int splits) {
  const int64_t idx = blockIdx.x;
  const int r = a.kv_lora_rank;
  const float* part = a.split_scratch + idx * splits * (r + 2);
  float mx = -FLT_MAX;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part[s * (r + 2)]);
  float total = 0.f;
  for (int s = 0; s < splits; ++s) total += part[s * (r + 2) + 1] * expf(part[s * (r + 2)] - mx);
  const float inv = 1.0f / total;
  T* o = static_cast<T*>(a.out) + idx * r;
  for (int d = threadIdx.x; d < r; d += kWarps * 32) {
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) {
      sum += part[s * (r + 2) + 2 + d] * expf(part[s * (r + 2)] - mx);
    }
    o[d] = from_f32<T>(sum * inv);
  }
}

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

constexpr int kTopkPerLane = 16;  // Experts per lane: up to 512.

// One warp per token; smem per warp: score [E], choice [E].
__global__ void grouped_topk_kernel(GroupedTopkArgs a) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= a.num_tokens) return;
  const int E = a.num_experts;
  float* score = smem + static_cast<int64_t>(warp) * 2 * E;
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
  float val[kTopkPerLane];
  bool live[kTopkPerLane];
#pragma unroll
  for (int i = 0; i < kTopkPerLane; ++i) {
    const int e = lane + 32 * i;
    live[i] = e < E && ((kept >> (e / group_size)) & 1u);
    val[i] = live[i] ? choice[e] : -FLT_MAX;
  }
  int my_expert = 0;
  for (int j = 0; j < a.top_k; ++j) {
    float best = -FLT_MAX;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kTopkPerLane; ++i) {
      // Ascending e within a lane: a tie keeps the lower index.
      if (live[i] && (best_e == INT_MAX || val[i] > best)) {
        best = val[i];
        best_e = lane + 32 * i;
      }
    }
    warp_argmax(best, best_e);
#pragma unroll
    for (int i = 0; i < kTopkPerLane; ++i) {
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

template <typename T>
cudaError_t launch_attention(const MlaAttentionArgs& a, cudaStream_t stream) {
  const int splits = mla_attention_splits(a);
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_heads;
  const unsigned blocks = static_cast<unsigned>(pairs * splits);
  const size_t smem =
      (static_cast<size_t>(a.kv_lora_rank + a.rope_dim) + kWarps * a.kv_lora_rank) * sizeof(float);
  switch (a.kv_lora_rank) {
    case 32:
      mla_attention_kernel<T, 1><<<blocks, kWarps * 32, smem, stream>>>(a, splits);
      break;
    case 64:
      mla_attention_kernel<T, 2><<<blocks, kWarps * 32, smem, stream>>>(a, splits);
      break;
    case 128:
      mla_attention_kernel<T, 4><<<blocks, kWarps * 32, smem, stream>>>(a, splits);
      break;
    case 256:
      mla_attention_kernel<T, 8><<<blocks, kWarps * 32, smem, stream>>>(a, splits);
      break;
    case 512:
      mla_attention_kernel<T, 16><<<blocks, kWarps * 32, smem, stream>>>(a, splits);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (splits > 1) {
    mla_merge_kernel<T><<<static_cast<unsigned>(pairs), kWarps * 32, 0, stream>>>(a, splits);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t mla_attention_split_floats(int kv_lora_rank) {
  // splits > 1 only below the target, so pairs * splits < 2 * target.
  return int64_t{2} * kMlaSplitTargetBlocks * (kv_lora_rank + 2);
}

int mla_attention_splits(const MlaAttentionArgs& a) {
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_heads;
  if (a.split_scratch == nullptr || pairs <= 0 || pairs >= kMlaSplitTargetBlocks) return 1;
  int splits = static_cast<int>(
      std::min<int64_t>(kMlaMaxSplits, (kMlaSplitTargetBlocks + pairs - 1) / pairs));
  while (splits > 1 && pairs * splits * (a.kv_lora_rank + 2) > a.split_capacity) --splits;
  return splits;
}

cudaError_t rms_norm_rows(DType dtype, const float* x, int64_t x_stride, const float* weight,
                          int rows, int dim, float eps, void* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  FLEX_DISPATCH_DTYPE(dtype, rms_norm_rows_kernel<T><<<rows, 256, 0, stream>>>(
                                 x, x_stride, weight, dim, eps, static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t mla_rope_store(DType dtype, const MlaRopeArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.rope_dim % 2 != 0) return cudaErrorInvalidValue;
  const dim3 grid(args.num_tokens, args.num_heads + 1);
  FLEX_DISPATCH_DTYPE(dtype, mla_rope_store_kernel<T><<<grid, 32, 0, stream>>>(args));
  return cudaGetLastError();
}

cudaError_t mla_attention(DType dtype, const MlaAttentionArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.rope_dim % 8 != 0) return cudaErrorInvalidValue;
  FLEX_DISPATCH_DTYPE(dtype, return launch_attention<T>(args, stream));
  return cudaSuccess;
}

cudaError_t grouped_topk(const GroupedTopkArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  const bool grouped = a.method != GroupedTopkMethod::kGreedy;
  const int groups = grouped ? a.num_groups : 1;
  if (a.num_experts < 1 || a.num_experts > 32 * kTopkPerLane || a.top_k < 1 || a.top_k > 32 ||
      groups < 1 || groups > 32 || a.num_experts % groups != 0 ||
      (grouped && (a.topk_groups < 1 || a.topk_groups > groups ||
                   a.top_k > a.topk_groups * (a.num_experts / groups))) ||
      a.top_k > a.num_experts || (a.method == GroupedTopkMethod::kNoauxTc && a.bias == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = static_cast<size_t>(kWarps) * 2 * a.num_experts * sizeof(float);
  grouped_topk_kernel<<<(a.num_tokens + kWarps - 1) / kWarps, kWarps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace flexpert::cuda
