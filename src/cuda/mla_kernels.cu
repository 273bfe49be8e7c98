// SPDX-License-Identifier: Apache-2.0
// MLA and DeepSeek router kernels (see mla_kernels.h).
// NOTE: bf16 steps of kv_lora_rank 128 / 256 / 512 run mla_mma_kernel (tensor cores, a
// block per token, 16 heads and split, the heads sharing each cache row); others
// mla_attention_kernel (CUDA cores, a block per (token, head, split), its four warps
// splitting the cached rows). Both keep an online softmax; steps of few blocks split
// each context over several (split-K as flash-decoding does) and a second kernel
// merges them (mla_merge_kernel or, for steps of many pairs, mla_merge_pairs_kernel).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <type_traits>

#include "cuda/device_util.cuh"
#include "cuda/grouped_topk.cuh"
#include "cuda/knobs.h"
#include "cuda/mla_kernels.h"
#include "cuda/mma_sync.cuh"
#include "cuda/pdl.cuh"

namespace flexpert::cuda {
namespace {

constexpr int kWarps = 4;
// Split steps of few (token, head) pairs until about this many blocks run (two per SM).
constexpr int kMlaSplitTargetBlocks = 264;
constexpr int kMlaMaxSplits = 32;

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

// Warp task h of token t: h < heads rotates that q head's rope part, h == heads
// normalises, rotates and stores the token's cache row. Its step inputs (position, KV
// slot) and constants (rotary rows, kv_norm) come first, by rope_store_prepare, which a
// kernel calls before its wait (pdl.cuh): the constants into L1.
struct RopeStoreInputs {
  int pos;
  int64_t slot;
};
__device__ __forceinline__ RopeStoreInputs rope_store_prepare(const MlaRopeArgs& a, int t, int h,
                                                              int lane) {
  const RopeStoreInputs in{a.positions[t], h < a.num_heads ? 0 : a.kv_slots[t]};
  const int half = a.rope_dim / 2;
  const int64_t at = static_cast<int64_t>(in.pos) * half;
  for (int i = 32 * lane; i < half; i += 32 * 32) {  // A 128-byte line a lane.
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a.rope_cos + at + i));
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a.rope_sin + at + i));
  }
  if (h == a.num_heads) {
    for (int i = 32 * lane; i < a.kv_lora_rank; i += 32 * 32) {
      asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a.kv_norm + i));
    }
  }
  return in;
}
template <typename T>
__device__ __forceinline__ void rope_store_warp(const MlaRopeArgs& a, int t, int h, int lane,
                                                RopeStoreInputs in) {
  const int pos = in.pos;
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
  T* dst = static_cast<T*>(a.cache) + (in.slot * a.max_seq_len + pos) * row;
  float ss = 0.f;
  for (int i = lane; i < r; i += 32) ss += kv[i] * kv[i];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(r) + a.eps);
  for (int i = lane; i < r; i += 32) dst[i] = from_f32<T>(kv[i] * inv * a.kv_norm[i]);
  rope_warp(kv + r, dst + r, cs, sn, a.rope_dim, a.interleaved, lane);
}

// Grid (tokens, heads + 1), one warp: rope_store_warp(blockIdx.x, blockIdx.y).
template <typename T>
__global__ void mla_rope_store_kernel(MlaRopeArgs a) {
  const RopeStoreInputs in = rope_store_prepare(a, blockIdx.x, blockIdx.y, threadIdx.x);
  grid_dep_wait();  // pdl.cuh: the step's inputs and constants only before it.
  grid_dep_launch();
  rope_store_warp<T>(a, blockIdx.x, blockIdx.y, threadIdx.x, in);
}

// One block per (token, head, split); warp w takes the split's chunks of 32 rows w,
// w + kWarps, ... with its own online softmax (a lane scores one row, then the warp
// accumulates the 32 latents), and the block merges the four partial results. Lane l
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

// Both merges: the first warp weighs the splits of the pair whose partials start at part
// (lane s: split s, kMlaMaxSplits <= 32; splits without rows, l = 0, weigh 0) into weight[]
// and the inverse total; the caller syncs the block after.
__device__ __forceinline__ void merge_weights(const float* part, int splits, int r, float* weight,
                                              float* inv_total) {
  const int s = threadIdx.x;
  if (s >= 32) return;
  const float m = s < splits ? part[s * (r + 2)] : -FLT_MAX;
  const float l = s < splits ? part[s * (r + 2) + 1] : 0.f;
  const float mx = warp_max(l > 0.f ? m : -FLT_MAX);
  const float w = l > 0.f ? expf(m - mx) : 0.f;
  const float total = warp_sum(l * w);
  weight[s] = w;
  if (s == 0) *inv_total = 1.0f / total;
}

// Block (pair, j): the splits' partial softmaxes of one (token, head) pair at their common
// maximum, for latent dims [128 j, 128 j + 128) (kv_lora_rank / 128 blocks a pair; 32 or
// 64 dims: one). After merge_weights (splits weighing 0 are not read) warp w sums splits w,
// w + 4, ... for its lanes' dims, all of its loads in flight, and the warps' sums are
// added in warp order. (A thread per dim looping over the splits four loads at a time
// took ~15 us at batch 1 and 32 splits on the H200.)
constexpr int kMergeDims = 128, kMergeMaxPerWarp = kMlaMaxSplits / kWarps;
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) mla_merge_kernel(MlaAttentionArgs a, int splits) {
  grid_dep_wait();  // pdl.cuh: nothing is read before the predecessor is complete.
  grid_dep_launch();
  __shared__ float weight[kMlaMaxSplits];
  __shared__ float inv_total;
  __shared__ float partial[kWarps][kMergeDims];
  const int r = a.kv_lora_rank, dims = min(r, kMergeDims);
  const int per_pair = r / dims;
  const int64_t idx = blockIdx.x / per_pair;
  const int d0 = static_cast<int>(blockIdx.x % per_pair) * dims;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* part = a.split_scratch + idx * splits * (r + 2);
  merge_weights(part, splits, r, weight, &inv_total);
  __syncthreads();
  // Lane l: dims d0 + l + 32 i (i < dims / 32).
  float v[kMergeMaxPerWarp][kMergeDims / 32];
#pragma unroll
  for (int j = 0; j < kMergeMaxPerWarp; ++j) {
    const int s = warp + kWarps * j;
    const bool live = s < splits && weight[s] != 0.f;
#pragma unroll
    for (int i = 0; i < kMergeDims / 32; ++i) {
      const int d = lane + 32 * i;
      v[j][i] = live && d < dims ? part[s * (r + 2) + 2 + d0 + d] : 0.f;
    }
  }
#pragma unroll
  for (int i = 0; i < kMergeDims / 32; ++i) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kMergeMaxPerWarp; ++j) {
      const int s = warp + kWarps * j;
      if (s < splits) sum += v[j][i] * weight[s];
    }
    partial[warp][lane + 32 * i] = sum;
  }
  __syncthreads();
  T* o = static_cast<T*>(a.out) + idx * r + d0;
  for (int d = threadIdx.x; d < dims; d += kWarps * 32) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += partial[w][d];
    o[d] = from_f32<T>(sum * inv_total);
  }
}

// The same merge with a block per pair, each thread looping over its dims and the splits
// four loads at a time: for steps of many pairs (above, decode at batch 128 and 16 heads
// ran 8192 small blocks, ~15 us a layer slower on the H200).
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    mla_merge_pairs_kernel(MlaAttentionArgs a, int splits) {
  grid_dep_wait();  // pdl.cuh: nothing is read before the predecessor is complete.
  grid_dep_launch();
  __shared__ float weight[kMlaMaxSplits];
  __shared__ float inv_total;
  const int64_t idx = blockIdx.x;
  const int r = a.kv_lora_rank;
  const float* part = a.split_scratch + idx * splits * (r + 2);
  merge_weights(part, splits, r, weight, &inv_total);
  __syncthreads();
  T* o = static_cast<T*>(a.out) + idx * r;
  for (int d = threadIdx.x; d < r; d += kWarps * 32) {
    float sum = 0.f;
    for (int s0 = 0; s0 < splits; s0 += 4) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int s = s0 + u;
        v[u] = s < splits && weight[s] != 0.f ? part[s * (r + 2) + 2 + d] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (s0 + u < splits) sum += v[u] * weight[s0 + u];
      }
    }
    o[d] = from_f32<T>(sum * inv_total);
  }
}

// Steps of fewer pairs than this merge by (pair, 128 dims), others a block per pair.
constexpr int64_t kMergeByDimsMaxPairs = 512;

template <typename T>
cudaError_t launch_merge(const MlaAttentionArgs& a, int splits, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_heads;
  if (pairs < kMergeByDimsMaxPairs) {
    const int per_pair = a.kv_lora_rank / std::min(a.kv_lora_rank, kMergeDims);
    return launch_pdl(mla_merge_kernel<T>, dim3(static_cast<unsigned>(pairs * per_pair)),
                      dim3(kWarps * 32), 0, stream, a, splits);
  }
  return launch_pdl(mla_merge_pairs_kernel<T>, dim3(static_cast<unsigned>(pairs)),
                    dim3(kWarps * 32), 0, stream, a, splits);
}

// ---------------------------------------------------------------------------
// MLA on tensor cores (bf16; kv_lora_rank 128, 256 or 512, rope_dim a multiple of 8 up
// to 64). In the absorbed form all heads of a token read the same cache rows (one "kv
// head" of kv_lora_rank + rope_dim dims), so a block takes kMmaRows (16) heads of one
// token as the rows of mma.sync m16n8k16 tiles (heads past num_heads are zero rows and
// not written) and one split of its positions, in chunks of kMmaCols (32) cache rows
// that cp.async copies into shared memory (double-buffered; rows past the context are
// zero-filled, as are the columns from the row's end to a multiple of 16). Warp w scores
// the chunk's positions 8w .. 8w + 7 (S = Q K^T over all kv_lora_rank + rope_dim dims,
// f32), the four warps' row maxima meet in shared memory, each writes its P (bf16) there,
// and then computes O += P V over the whole chunk for its quarter of the latent dims (V
// by ldmatrix.trans); each warp keeps the row sums of its positions, added at the end.
// (Every warp scoring all 32 positions itself, so that P stays in its registers, was
// slower: on the H200 DeepSeek-V3 shapes prefilled 38k against 45k tok/s at prompts of
// 2048, decode at batch 64 took 6.96 against 6.49 ms a step.) Q is q_latent times
// scale * log2(e), rounded to bf16 (the softmax runs in base 2). Splits take consecutive
// chunks and leave the partials of mla_attention_kernel for the merge (launch_merge).
// FLEXPERT_NO_MLA_MMA=1: mla_attention_kernel instead (for comparisons).
constexpr int kMmaWarps = 4, kMmaRows = 16, kMmaCols = 32, kMmaPLd = kMmaCols + 8;

__host__ __device__ constexpr int mla_mma_kd(int r, int rope_dim) {
  return (r + rope_dim + 15) / 16 * 16;
}
// Q's rows, then the two chunk buffers; rows kd + 8 elements apart (ldmatrix's eight row
// addresses then fall in distinct bank groups).
inline size_t mla_mma_smem_bytes(int r, int rope_dim, int group) {
  return static_cast<size_t>(group * kMmaRows + 2 * kMmaCols) * (mla_mma_kd(r, rope_dim) + 8) *
             sizeof(bf16) +
         group * (kMmaRows * kMmaPLd * sizeof(bf16) + kMmaWarps * kMmaRows * sizeof(float));
}

template <int R, int G>
__global__ void __launch_bounds__(kMmaWarps * 32 * G)
    mla_mma_kernel(MlaAttentionArgs a, int splits) {
  constexpr int kOTiles = R / kMmaWarps / 8, kThreads = kMmaWarps * 32 * G;
  static_assert(kMmaCols == 8 * kMmaWarps, "a warp scores 8 positions of a chunk");
  extern __shared__ __align__(128) unsigned char mla_smem[];
  // Row group rg (warps 4 rg .. 4 rg + 3): token t0 + rg of the block's G.
  const int rg = threadIdx.x / (kMmaWarps * 32), warp = threadIdx.x / 32 % kMmaWarps;
  const int lane = threadIdx.x % 32;
  const int row = R + a.rope_dim, kd = mla_mma_kd(R, a.rope_dim), LQ = kd + 8;
  bf16* const sQ = reinterpret_cast<bf16*>(mla_smem);                  // [G * kMmaRows][LQ]
  bf16* const sKV = sQ + G * kMmaRows * LQ;                            // [2][kMmaCols][LQ]
  bf16* const sP = sKV + 2 * kMmaCols * LQ + rg * kMmaRows * kMmaPLd;  // [kMmaRows][kMmaPLd]
  auto sMax =
      reinterpret_cast<float(*)[kMmaRows]>(sKV + 2 * kMmaCols * LQ + G * kMmaRows * kMmaPLd) +
      rg * kMmaWarps;  // [warps][rows] of this row group
  const int hblocks = (a.num_heads + kMmaRows - 1) / kMmaRows;
  const int64_t unit = blockIdx.x / splits;
  const int sp = static_cast<int>(blockIdx.x % splits);
  const int t0 = static_cast<int>(unit / hblocks) * G,
            h0 = static_cast<int>(unit % hblocks) * kMmaRows;
  const int heads = min(kMmaRows, a.num_heads - h0);
  const int t = t0 + rg;
  const int len = t < a.num_tokens ? a.positions[t] + 1 : 0;  // 0: no token here.
  // The group's tokens share their chunks when they are in one KV slot (a prompt's
  // consecutive positions): one pass over the longest context. Otherwise pass p serves
  // row group p alone (the other warps only meet the barriers).
  bool shared = true;
  int max_len = 0;
  for (int i = 0; i < G && t0 + i < a.num_tokens; ++i) {
    shared = shared && a.kv_slots[t0 + i] == a.kv_slots[t0];
    max_len = max(max_len, a.positions[t0 + i] + 1);
  }
  const int passes = shared ? 1 : min(G, a.num_tokens - t0);
  const int64_t slot0 = t0 < a.num_tokens ? a.kv_slots[t0] : 0;
  // The step's inputs (positions, KV slots) are read above, before the wait (pdl.cuh).
  grid_dep_wait();
  grid_dep_launch();
  auto pass_range = [&](int pass, int& c_begin, int& c_end) {
    const int l = shared ? max_len : a.positions[t0 + pass] + 1;
    const int chunks = (l + kMmaCols - 1) / kMmaCols, per = (chunks + splits - 1) / splits;
    c_begin = sp * per;
    c_end = min(chunks, c_begin + per);
  };
  bool any = false;
  for (int pass = 0; pass < passes; ++pass) {
    int cb, ce;
    pass_range(pass, cb, ce);
    any = any || cb < ce;
  }
  const int64_t pair0 = static_cast<int64_t>(t) * a.num_heads + h0;
  if (!any) {  // No positions in this split: the merge skips it.
    if (len > 0 && threadIdx.x % (kMmaWarps * 32) < heads) {
      float* part =
          a.split_scratch + ((pair0 + threadIdx.x % (kMmaWarps * 32)) * splits + sp) * (R + 2);
      part[0] = -FLT_MAX, part[1] = 0.f;
    }
    return;
  }
  const float qscale = a.scale * 1.4426950408889634f;
  // Four dims a thread at a time (row and kd are multiples of 8), loads in flight.
#pragma unroll 4
  for (int i = threadIdx.x; i < G * kMmaRows * kd / 4; i += kThreads) {
    const int r = i / (kd / 4), d = 4 * (i % (kd / 4));
    const int tr = t0 + r / kMmaRows, hr = r % kMmaRows;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (tr < a.num_tokens && hr < heads && d < row) {
      v = *reinterpret_cast<const float4*>(
          a.q_latent + (static_cast<int64_t>(tr) * a.num_heads + h0 + hr) * row + d);
    }
    *reinterpret_cast<uint2*>(sQ + r * LQ + d) = make_uint2(
        pack_bf16x2(v.x * qscale, v.y * qscale), pack_bf16x2(v.z * qscale, v.w * qscale));
  }
  for (int i = threadIdx.x; i < 2 * kMmaCols * (kd - row); i += kThreads) {
    sKV[(i / (kd - row)) * LQ + row + i % (kd - row)] = __float2bfloat16(0.f);
  }
  const int g = lane / 4, tq = lane % 4;
  const int mi = lane / 8, ri = lane % 8;  // ldmatrix: this lane's matrix and row.
  const int d0 = warp * (R / kMmaWarps);   // This warp's latent dims.
  const bf16* const sQg = sQ + rg * kMmaRows * LQ;
  float o[kOTiles][4];
#pragma unroll
  for (int n = 0; n < kOTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // Rows g and g + 8: running maxima (base-2 scores) and this lane's part of the sums;
  // -inf until the row's first position.
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  for (int pass = 0; pass < passes; ++pass) {
    int c_begin, c_end;
    pass_range(pass, c_begin, c_end);
    if (c_begin >= c_end) continue;  // Uniform: every thread skips.
    const bool active = len > 0 && (shared || rg == pass);
    const bf16* cache = static_cast<const bf16*>(a.cache) +
                        (pass == 0 ? slot0 : a.kv_slots[t0 + pass]) * a.max_seq_len * row;
    const int load_len = shared ? max_len : a.positions[t0 + pass] + 1;
    // Chunk c into buffer buf (one commit group per thread).
    auto load_chunk = [&](int c, int buf) {
      const int pieces = row / 8, c0 = c * kMmaCols;
      bf16* dst = sKV + buf * kMmaCols * LQ;
      for (int i = threadIdx.x; i < kMmaCols * pieces; i += kThreads) {
        const int j = i / pieces, k = i % pieces;
        const int pos = min(c0 + j, load_len - 1);
        cp_async16_zfill(dst + j * LQ + 8 * k, cache + static_cast<int64_t>(pos) * row + 8 * k,
                         c0 + j < load_len ? 16 : 0);
      }
      cp_async_commit();
    };
    __syncthreads();  // Every warp is done with the previous pass's buffers.
    load_chunk(c_begin, 0);
    for (int c = c_begin, buf = 0; c < c_end; ++c, buf ^= 1) {
      cp_async_wait<0>();
      __syncthreads();  // Chunk c is in; every warp is done with chunk c - 1's buffer.
      if (c + 1 < c_end) load_chunk(c + 1, buf ^ 1);
      const bf16* sK = sKV + buf * kMmaCols * LQ;
      const int c0 = c * kMmaCols;
      // Warp w: the scores of positions 8w .. 8w + 7 over all of Q's dims.
      float sc[4] = {0.f, 0.f, 0.f, 0.f};
      if (active) {
        int kk = 0;
#pragma unroll 2
        for (; kk + 1 < kd / 16; kk += 2) {
          // Matrices: this warp's positions x dims 16 kk + 8 mi (two k-steps).
          uint32_t qa0[4], qa1[4], b[4];
          ldmatrix_x4(qa0, sQg + (ri + 8 * (mi % 2)) * LQ + 16 * kk + 8 * (mi / 2));
          ldmatrix_x4(qa1, sQg + (ri + 8 * (mi % 2)) * LQ + 16 * (kk + 1) + 8 * (mi / 2));
          ldmatrix_x4(b, sK + (8 * warp + ri) * LQ + 16 * kk + 8 * mi);
          mma_bf16_16816(sc, qa0, b[0], b[1]);
          mma_bf16_16816(sc, qa1, b[2], b[3]);
        }
        if (kk < kd / 16) {
          uint32_t qa0[4], b[4];
          ldmatrix_x4(qa0, sQg + (ri + 8 * (mi % 2)) * LQ + 16 * kk + 8 * (mi / 2));
          ldmatrix_x4(b, sK + (8 * warp + ri) * LQ + 16 * kk + 8 * (mi % 2));
          mma_bf16_16816(sc, qa0, b[0], b[1]);
        }
      }
      // Positions past this row group's context masked; a row group another pass serves
      // masks them all (its maxima, sums and O stay as they are).
      if (!active || c0 + kMmaCols > len) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!active || c0 + 8 * warp + 2 * tq + e >= len) sc[e] = sc[2 + e] = -INFINITY;
        }
      }
      // The chunk's row maxima over the four warps' positions.
      float mx0 = fmaxf(sc[0], sc[1]), mx1 = fmaxf(sc[2], sc[3]);
#pragma unroll
      for (int o2 = 1; o2 <= 2; o2 *= 2) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
      }
      if (tq == 0) sMax[warp][g] = mx0, sMax[warp][g + 8] = mx1;
      __syncthreads();
      mx0 = m0, mx1 = m1;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w)
        mx0 = fmaxf(mx0, sMax[w][g]), mx1 = fmaxf(mx1, sMax[w][g + 8]);
      // A row with no position yet (a chunk past its context) keeps -inf and zeros.
      const float base0 = mx0 == -INFINITY ? 0.f : mx0, base1 = mx1 == -INFINITY ? 0.f : mx1;
      const float corr0 = exp2f(m0 - base0), corr1 = exp2f(m1 - base1);  // 0 at the first.
      m0 = mx0, m1 = mx1;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[e] = exp2f(sc[e] - base0);
        sc[2 + e] = exp2f(sc[2 + e] - base1);
      }
      // This warp's part of the row sums (the four warps' are added at the end).
      l0 = l0 * corr0 + sc[0] + sc[1];
      l1 = l1 * corr1 + sc[2] + sc[3];
      *reinterpret_cast<uint32_t*>(sP + g * kMmaPLd + 8 * warp + 2 * tq) =
          pack_bf16x2(sc[0], sc[1]);
      *reinterpret_cast<uint32_t*>(sP + (g + 8) * kMmaPLd + 8 * warp + 2 * tq) =
          pack_bf16x2(sc[2], sc[3]);
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) {
        o[n][0] *= corr0, o[n][1] *= corr0;
        o[n][2] *= corr1, o[n][3] *= corr1;
      }
      __syncthreads();  // P of the whole chunk.
      if (!active) continue;
#pragma unroll
      for (int kk2 = 0; kk2 < kMmaCols / 16; ++kk2) {
        uint32_t pf[4];
        ldmatrix_x4(pf, sP + (ri + 8 * (mi % 2)) * kMmaPLd + 16 * kk2 + 8 * (mi / 2));
#pragma unroll
        for (int n = 0; n < kOTiles; n += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b,
                            sK + (16 * kk2 + ri + 8 * (mi % 2)) * LQ + d0 + 8 * n + 8 * (mi / 2));
          mma_bf16_16816(o[n], pf, b[0], b[1]);
          mma_bf16_16816(o[n + 1], pf, b[2], b[3]);
        }
      }
    }
  }
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
  }
  // The sums of the four warps' positions (every warp is past its last read of sMax).
  __syncthreads();
  if (tq == 0) sMax[warp][g] = l0, sMax[warp][g + 8] = l1;
  __syncthreads();
  l0 = l1 = 0.f;
#pragma unroll
  for (int w = 0; w < kMmaWarps; ++w) l0 += sMax[w][g], l1 += sMax[w][g + 8];
  if (len == 0) return;  // No token in this row group.
  // Row r's results (its m, l and O elements e, e + 1 of each 8-column block).
  auto store_row = [&](int r, float m, float l, int e) {
    if (r >= heads) return;
    if (splits > 1) {
      // The merge's softmax is base e over scaled scores; a row without positions in this
      // split (l = 0) is skipped there.
      float* part = a.split_scratch + ((pair0 + r) * splits + sp) * (R + 2);
      if (warp == 0 && tq == 0) {
        part[0] = l > 0.f ? m * 0.6931471805599453f : -FLT_MAX, part[1] = l;
      }
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) {
        *reinterpret_cast<float2*>(part + 2 + d0 + 8 * n + 2 * tq) =
            make_float2(o[n][e], o[n][e + 1]);
      }
      return;
    }
    bf16* out = static_cast<bf16*>(a.out) + (pair0 + r) * R;
    const float inv = 1.0f / l;
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
      *reinterpret_cast<__nv_bfloat162*>(out + d0 + 8 * n + 2 * tq) =
          __floats2bfloat162_rn(o[n][e] * inv, o[n][e + 1] * inv);
    }
  };
  store_row(g, m0, l0, 0);
  store_row(g + 8, m1, l1, 2);
}

bool mla_mma_ok(DType dtype, const MlaAttentionArgs& a) {
  const bool off = knobs().no_mla_mma;
  return !off && dtype == DType::kBF16 &&
         (a.kv_lora_rank == 128 || a.kv_lora_rank == 256 || a.kv_lora_rank == 512) &&
         a.rope_dim % 8 == 0 && a.rope_dim <= 64;
}

// Tokens a block of mla_mma_kernel takes: kMlaGroup in steps that are mostly prompt
// tokens (MlaAttentionArgs::prompt_groups), else 1.
constexpr int kMlaGroup = 4;
int mla_mma_group(const MlaAttentionArgs& a) {
  return a.prompt_groups && a.num_tokens >= kMlaGroup ? kMlaGroup : 1;
}

// Splits of mla_mma_kernel: blocks of (G tokens, 16 heads) below about
// kMlaSplitTargetBlocks split their positions, as scratch allows.
int mla_mma_splits(const MlaAttentionArgs& a) {
  const int group = mla_mma_group(a);
  const int64_t units = (static_cast<int64_t>(a.num_tokens) + group - 1) / group *
                        ((a.num_heads + kMmaRows - 1) / kMmaRows);
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_heads;
  if (a.split_scratch == nullptr || units <= 0 || units >= kMlaSplitTargetBlocks) return 1;
  int splits = static_cast<int>(
      std::min<int64_t>(kMlaMaxSplits, (kMlaSplitTargetBlocks + units - 1) / units));
  while (splits > 1 && pairs * splits * (a.kv_lora_rank + 2) > a.split_capacity) --splits;
  return splits;
}

template <int R, int G>
cudaError_t launch_mma(const MlaAttentionArgs& a, cudaStream_t stream) {
  const size_t smem = mla_mma_smem_bytes(R, a.rope_dim, G);
  if (const cudaError_t e = ensure_smem_limit<mla_mma_kernel<R, G>>(mla_mma_smem_bytes(R, 64, G));
      e != cudaSuccess) {
    return e;
  }
  const int splits = mla_mma_splits(a);
  const int64_t units =
      (static_cast<int64_t>(a.num_tokens) + G - 1) / G * ((a.num_heads + kMmaRows - 1) / kMmaRows);
  if (const cudaError_t e =
          launch_pdl(mla_mma_kernel<R, G>, dim3(static_cast<unsigned>(units * splits)),
                     dim3(kMmaWarps * 32 * G), smem, stream, a, splits);
      e != cudaSuccess) {
    return e;
  }
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess || splits == 1) return e;
  return launch_merge<bf16>(a, splits, stream);
}

template <int R>
cudaError_t launch_mma_grouped(const MlaAttentionArgs& a, cudaStream_t stream) {
  return mla_mma_group(a) == kMlaGroup ? launch_mma<R, kMlaGroup>(a, stream)
                                       : launch_mma<R, 1>(a, stream);
}

// head_gemv: lanes [g * L, (g + 1) * L) of the grid's threads take weight row g (head
// g / n, output j = g % n), chunk c of 8 elements at lane c % L, pass c / L.
constexpr int kHeadGemvThreads = 256, kHeadGemvPasses = 4;
// Blocks from gemv_blocks on (with_rope) do mla_rope_store's work instead, a warp per
// (token, task).
template <int M>
__global__ void __launch_bounds__(kHeadGemvThreads)
    head_gemv_kernel(HeadGemvArgs a, int lanes, unsigned gemv_blocks, bool with_rope,
                     MlaRopeArgs rope) {
  if (with_rope && blockIdx.x >= gemv_blocks) {
    const int task = (blockIdx.x - gemv_blocks) * (kHeadGemvThreads / 32) + threadIdx.x / 32;
    const int per_token = rope.num_heads + 1;
    const bool active = task < rope.num_tokens * per_token;
    const int t = task / per_token, h = task % per_token, lane = threadIdx.x % 32;
    const RopeStoreInputs in = active ? rope_store_prepare(rope, t, h, lane) : RopeStoreInputs{};
    grid_dep_wait();
    grid_dep_launch();
    if (active) rope_store_warp<bf16>(rope, t, h, lane, in);
    return;
  }
  const int64_t g = (static_cast<int64_t>(blockIdx.x) * kHeadGemvThreads + threadIdx.x) / lanes;
  const int sub = threadIdx.x % lanes;
  const int64_t rows = static_cast<int64_t>(a.num_heads) * a.n;
  const int64_t row = min(g, rows - 1);  // Past the last row: stream it, store nothing.
  const int h = static_cast<int>(row / a.n), j = static_cast<int>(row % a.n);
  const int chunks = a.k / 8;
  const uint4* wr = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.w) + row * a.k);
  uint4 wv[kHeadGemvPasses];
#pragma unroll
  for (int u = 0; u < kHeadGemvPasses; ++u) {
    const int c = sub + u * lanes;
    if (c < chunks) wv[u] = ld_stream(wr + c);  // Constant weights: before the wait.
  }
  grid_dep_wait();
  grid_dep_launch();
  float acc[M];
#pragma unroll
  for (int t = 0; t < M; ++t) acc[t] = 0.f;
#pragma unroll
  for (int u = 0; u < kHeadGemvPasses; ++u) {
    const int c = sub + u * lanes;
    if (c >= chunks) break;
    float wf[8];
    bf16x8(wv[u], wf);
#pragma unroll
    for (int t = 0; t < M; ++t) {
      float xv[8];
      load8(static_cast<const bf16*>(a.x) + t * a.x_row_stride + h * a.x_head_stride + 8 * c, xv);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[t] += xv[i] * wf[i];
    }
  }
#pragma unroll
  for (int t = 0; t < M; ++t) {
    float v = acc[t];
    for (int off = lanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (g < rows && sub == 0) {
      const int64_t i = t * a.y_row_stride + h * a.y_head_stride + j;
      if (a.y_bf16) {
        static_cast<bf16*>(a.y)[i] = from_f32<bf16>(v);
      } else {
        static_cast<float*>(a.y)[i] = v;
      }
    }
  }
}

// One warp per token; smem per warp: score [E], choice [E].
__global__ void grouped_topk_kernel(GroupedTopkArgs a) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= a.num_tokens) return;
  grouped_topk_token(a, t, lane, smem + static_cast<int64_t>(warp) * 2 * a.num_experts);
}

template <typename T>
cudaError_t launch_attention(const MlaAttentionArgs& a, cudaStream_t stream) {
  const int splits = mla_attention_splits(std::is_same_v<T, bf16> ? DType::kBF16 : DType::kF32, a);
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
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess || splits == 1) return e;
  return launch_merge<T>(a, splits, stream);
}

}  // namespace

int64_t mla_attention_split_floats(int kv_lora_rank) {
  // splits > 1 only below the target, so blocks = units * splits < 2 * target, and a
  // block of mla_mma_kernel holds up to kMmaRows (token, head) pairs.
  return int64_t{2} * kMlaSplitTargetBlocks * kMmaRows * (kv_lora_rank + 2);
}

int mla_attention_splits(DType dtype, const MlaAttentionArgs& a) {
  if (mla_mma_ok(dtype, a)) return mla_mma_splits(a);
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_heads;
  if (a.split_scratch == nullptr || pairs <= 0 || pairs >= kMlaSplitTargetBlocks) return 1;
  int splits = static_cast<int>(
      std::min<int64_t>(kMlaMaxSplits, (kMlaSplitTargetBlocks + pairs - 1) / pairs));
  while (splits > 1 && pairs * splits * (a.kv_lora_rank + 2) > a.split_capacity) --splits;
  return splits;
}

cudaError_t mla_rope_store(DType dtype, const MlaRopeArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.rope_dim % 2 != 0) return cudaErrorInvalidValue;
  const dim3 grid(args.num_tokens, args.num_heads + 1);
  FLEX_DISPATCH_DTYPE(dtype,
                      return launch_pdl(mla_rope_store_kernel<T>, grid, dim3(32), 0, stream, args));
  return cudaGetLastError();
}

cudaError_t mla_attention(DType dtype, const MlaAttentionArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.rope_dim % 8 != 0) return cudaErrorInvalidValue;
  if (mla_mma_ok(dtype, args)) {
    switch (args.kv_lora_rank) {
      case 128:
        return launch_mma_grouped<128>(args, stream);
      case 256:
        return launch_mma_grouped<256>(args, stream);
      default:
        return launch_mma_grouped<512>(args, stream);
    }
  }
  FLEX_DISPATCH_DTYPE(dtype, return launch_attention<T>(args, stream));
  return cudaSuccess;
}

bool head_gemv_fits(const HeadGemvArgs& a) {
  return a.num_tokens >= 0 && a.num_tokens <= kHeadGemvMaxRows && a.num_heads >= 1 && a.n >= 1 &&
         a.k >= 8 && a.k % 8 == 0 && a.k <= 32 * 8 * kHeadGemvPasses && a.x_row_stride % 8 == 0 &&
         a.x_head_stride % 8 == 0;
}

cudaError_t head_gemv(const HeadGemvArgs& a, cudaStream_t stream, const MlaRopeArgs* rope) {
  if (!head_gemv_fits(a) ||
      (rope != nullptr && (rope->num_tokens != a.num_tokens || rope->rope_dim % 2 != 0))) {
    return cudaErrorInvalidValue;
  }
  if (a.num_tokens == 0) return cudaSuccess;
  int lanes = 1;
  while (lanes < 32 && lanes < a.k / 8) lanes *= 2;
  const int64_t threads = static_cast<int64_t>(a.num_heads) * a.n * lanes;
  const auto gemv_blocks =
      static_cast<unsigned>((threads + kHeadGemvThreads - 1) / kHeadGemvThreads);
  constexpr int kWarpsPerBlock = kHeadGemvThreads / 32;
  const unsigned rope_blocks =
      rope != nullptr
          ? static_cast<unsigned>((a.num_tokens * (rope->num_heads + 1) + kWarpsPerBlock - 1) /
                                  kWarpsPerBlock)
          : 0;
  auto kernel = a.num_tokens == 1 ? head_gemv_kernel<1> : head_gemv_kernel<2>;
  static_assert(kHeadGemvMaxRows == 2);
  return launch_pdl(kernel, dim3(gemv_blocks + rope_blocks), dim3(kHeadGemvThreads), 0, stream, a,
                    lanes, gemv_blocks, rope != nullptr, rope != nullptr ? *rope : MlaRopeArgs{});
}

bool grouped_topk_args_ok(const GroupedTopkArgs& a) {
  const bool grouped = a.method != GroupedTopkMethod::kGreedy;
  const int groups = grouped ? a.num_groups : 1;
  return a.num_experts >= 1 && a.num_experts <= 32 * kGroupedTopkPerLane && a.top_k >= 1 &&
         a.top_k <= 32 && groups >= 1 && groups <= 32 && a.num_experts % groups == 0 &&
         (!grouped || (a.topk_groups >= 1 && a.topk_groups <= groups &&
                       a.top_k <= a.topk_groups * (a.num_experts / groups))) &&
         a.top_k <= a.num_experts && (a.method != GroupedTopkMethod::kNoauxTc || a.bias != nullptr);
}

cudaError_t grouped_topk(const GroupedTopkArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (!grouped_topk_args_ok(a)) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(kWarps) * 2 * a.num_experts * sizeof(float);
  grouped_topk_kernel<<<(a.num_tokens + kWarps - 1) / kWarps, kWarps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace flexpert::cuda
