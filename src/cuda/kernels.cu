// SPDX-License-Identifier: Apache-2.0
// Element-wise, normalisation, routing and permutation kernels (see kernels.h).
// NOTE: simple one-pass kernels; the time of a step is in the GEMMs.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "cuda/device_util.cuh"
#include "cuda/kernels.h"
#include "cuda/knobs.h"
#include "cuda/pdl.cuh"
#include "cuda/topk.cuh"

namespace flexpert::cuda {
namespace {

namespace cg = cooperative_groups;

template <typename T>
__global__ void embedding_kernel(const T* table, const int32_t* ids, int dim, float* out) {
  const int t = blockIdx.x;
  const T* row = table + static_cast<int64_t>(ids[t]) * dim;
  float* o = out + static_cast<int64_t>(t) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = to_f32(row[i]);
}

template <typename T>
__global__ void rms_norm_kernel(const float* x, int64_t x_stride, const int32_t* row_index,
                                const float* weight, int dim, float eps, T* out) {
  const int r = blockIdx.x;
  const int src = row_index != nullptr ? row_index[r] : r;
  const float* xr = x + static_cast<int64_t>(src) * x_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  T* o = out + static_cast<int64_t>(r) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = from_f32<T>(xr[i] * inv * weight[i]);
}

// rms_norm_kernel for rows that rms_vec_fits: a thread keeps its float4s of the row in
// registers, all its loads in flight at once, and reads the row once (device_util.cuh).
// Source rows are x_stride floats apart (a multiple of 4).
template <typename T>
__global__ void __launch_bounds__(kRmsThreads)
    rms_norm_vec_kernel(const float* x, int64_t x_stride, const int32_t* row_index,
                        const float* weight, int dim, float eps, T* out) {
  grid_dep_wait();
  grid_dep_launch();
  const int r = blockIdx.x;
  const int src = row_index != nullptr ? row_index[r] : r;
  float4 v[kRmsVec];
  const float inv = block_inv_rms(x + static_cast<int64_t>(src) * x_stride, dim, eps, v);
  block_rms_store(v, inv, weight, dim, out + static_cast<int64_t>(r) * dim);
}

// gemv_nt: warp (block b, warp v) computes column c = b * kGemvWarps + v for all M rows.
// Lane l takes the 16-byte chunks l, l + 32, ... of the column's weight row, kGemvLoads
// of them a pass, loaded before their FMAs (rows over 4096: a pass ahead, kAhead); the rows of x (a
// few KB) come through L1. With a prologue (gemv_norm_nt, gemv_swiglu_nt) the block first
// makes its M bf16 rows of x in shared memory from f32 rows, as rms_norm or silu_mul would
// (bit for bit), and takes x from there.
constexpr int kGemvWarps = 8, kGemvLoads = 8;
static_assert(kGemvWarps * 32 == kRmsThreads, "a GEMV block normalises its rows itself");
struct GemvIo {
  enum Prologue : int {
    kNone,
    kNorm,    // x[r] = rms_norm(src + r * src_stride) with weight, eps.
    kSwiglu,  // x[r, i] = silu(src[r, i]) * src[r, k + i] (src rows 2k apart).
  };
  Prologue prologue = kNone;
  const float* src = nullptr;
  int64_t src_stride = 0;
  const float* weight = nullptr;
  float eps = 0.f;
  bool y_bf16 = false;  // y is bf16 (rounded once, no accumulation), else f32.
};
template <int M, bool kAhead, bool kLoop>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_nt_kernel(const bf16* x, int k, const bf16* w, int n, void* y, bool accumulate,
                   GemvIo io) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  const int lane = threadIdx.x % 32;
  const int chunks = k / 8;
  // kLoop: block b takes column blocks b, b + gridDim.x, ... (a grid smaller than the
  // columns makes the prologue's rows once per block, not once per 8 columns:
  // launch_gemv); else column block b only.
  const int col_blocks = (n + kGemvWarps - 1) / kGemvWarps;
  for (int cb = blockIdx.x; cb < col_blocks; cb += gridDim.x) {  // Uniform over the block.
    const bool first = cb == static_cast<int>(blockIdx.x);
    // A warp past the last column streams the last one's weights and stores nothing: it
    // must still wait (pdl.cuh).
    const int warp_col = cb * kGemvWarps + threadIdx.x / 32;
    const int col = min(warp_col, n - 1);
    const uint4* wr = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(col) * k);
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.f;
    // kAhead: the next pass's loads are issued before this pass's FMAs (two passes in
    // flight), for long rows (k = 10944 took five round trips one after the other).
    uint4 raw[kGemvLoads], next[kGemvLoads];
#pragma unroll
    for (int u = 0; u < kGemvLoads; ++u) {
      const int c = lane + 32 * u;
      if (kAhead && c < chunks) next[u] = ld_stream(wr + c);
    }
    if (first && io.prologue == GemvIo::kNorm) block_rms_prefetch(io.weight, k);  // As w.
    for (int c0 = 0; c0 < chunks; c0 += 32 * kGemvLoads) {
#pragma unroll
      for (int u = 0; u < kGemvLoads; ++u) {
        if (kAhead) {
          raw[u] = next[u];
          const int c = c0 + 32 * kGemvLoads + lane + 32 * u;
          if (c < chunks) next[u] = ld_stream(wr + c);
        } else {
          const int c = c0 + lane + 32 * u;
          if (c < chunks) raw[u] = ld_stream(wr + c);
        }
      }
      // The weights are constant: the first column's first loads go before the wait for x.
      if (first && c0 == 0) {
        grid_dep_wait();
        grid_dep_launch();
        if (io.prologue != GemvIo::kNone) {  // Uniform over the block: all meet the barriers.
          bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
#pragma unroll
          for (int r = 0; r < M; ++r) {
            if (io.prologue == GemvIo::kNorm) {
              float4 v[kRmsVec];
              const float inv = block_inv_rms(io.src + r * io.src_stride, k, io.eps, v);
              block_rms_store(v, inv, io.weight, k, xs + r * k);
            } else {
              const float4* g =
                  reinterpret_cast<const float4*>(io.src + static_cast<int64_t>(r) * 2 * k);
              const float4* u = g + k / 4;
              for (int i = threadIdx.x; i < k / 4; i += blockDim.x) {
                const float4 gv = g[i], uv = u[i];
                bf16* o = xs + r * k + 4 * i;
                o[0] = from_f32<bf16>(silu(gv.x) * uv.x);
                o[1] = from_f32<bf16>(silu(gv.y) * uv.y);
                o[2] = from_f32<bf16>(silu(gv.z) * uv.z);
                o[3] = from_f32<bf16>(silu(gv.w) * uv.w);
              }
            }
          }
          __syncthreads();
          x = xs;
        }
      }
#pragma unroll
      for (int u = 0; u < kGemvLoads; ++u) {
        const int c = c0 + lane + 32 * u;
        if (c >= chunks) break;
        float wv[8];
        bf16x8(raw[u], wv);
#pragma unroll
        for (int r = 0; r < M; ++r) {
          float xv[8];
          load8(x + static_cast<int64_t>(r) * k + 8 * c, xv);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r] += xv[i] * wv[i];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const float v = warp_sum(acc[r]);
      if (warp_col < n && lane == r) {
        const int64_t i = static_cast<int64_t>(r) * n + col;
        if (io.y_bf16) {
          static_cast<bf16*>(y)[i] = from_f32<bf16>(v);
        } else {
          float* o = static_cast<float*>(y) + i;
          *o = accumulate ? *o + v : v;
        }
      }
    }
    if constexpr (!kLoop) break;  // (The registers of one column block.)
  }
}

// One warp per (token, head). NOTE: head_dim <= 256 (the smem row). The step's inputs
// (positions, KV slots: written before its first kernel), the norm weights and the rotary
// rows are loaded before the wait, so that after it only the qkv row is a round trip.
template <typename T>
__global__ void qk_norm_rope_kernel(QkvArgs a) {
  constexpr int kPer = 256 / 32;
  __shared__ float v[256];
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  const int D = a.head_dim, nq = a.num_q_heads, nkv = a.num_kv_heads, half = D / 2;
  const int pos = a.positions[t];
  const int64_t cache_row =
      (static_cast<int64_t>(a.kv_slots[t]) * a.max_seq_len + pos) * nkv;  // In heads.
  const bool is_v = h >= nq + nkv;
  float w[kPer], cs[kPer / 2], sn[kPer / 2];
  if (!is_v) {
    const float* wp = h < nq ? a.q_norm : a.k_norm;
    const float* cp = a.rope_cos + static_cast<int64_t>(pos) * half;
    const float* sp = a.rope_sin + static_cast<int64_t>(pos) * half;
#pragma unroll
    for (int k = 0; k < kPer; ++k) w[k] = lane + 32 * k < D ? wp[lane + 32 * k] : 0.f;
#pragma unroll
    for (int k = 0; k < kPer / 2; ++k) {
      const bool in = lane + 32 * k < half;
      cs[k] = in ? cp[lane + 32 * k] : 0.f;
      sn[k] = in ? sp[lane + 32 * k] : 0.f;
    }
  }
  grid_dep_wait();
  grid_dep_launch();
  const int64_t row_len = static_cast<int64_t>(nq + 2 * nkv) * D;
  const float* src = a.qkv + t * row_len + static_cast<int64_t>(h) * D;
  if (is_v) {
    T* dst = static_cast<T*>(a.v_cache) + (cache_row + (h - nq - nkv)) * D;
    for (int i = lane; i < D; i += 32) dst[i] = from_f32<T>(src[i]);
    return;
  }
  float x[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) x[k] = lane + 32 * k < D ? src[lane + 32 * k] : 0.f;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (lane + 32 * k < D) ss += x[k] * x[k];
  }
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + a.eps);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (lane + 32 * k < D) v[lane + 32 * k] = x[k] * inv * w[k];
  }
  __syncwarp();
  T* dst = h < nq ? static_cast<T*>(a.q_out) + (static_cast<int64_t>(t) * nq + h) * D
                  : static_cast<T*>(a.k_cache) + (cache_row + (h - nq)) * D;
#pragma unroll
  for (int k = 0; k < kPer / 2; ++k) {
    const int i = lane + 32 * k;
    if (i >= half) break;
    const float x0 = v[i], x1 = v[i + half];
    dst[i] = from_f32<T>(x0 * cs[k] - x1 * sn[k]);
    dst[i + half] = from_f32<T>(x1 * cs[k] + x0 * sn[k]);
  }
}

// Block (r, y): row r, columns [y * kSiluCols, (y + 1) * kSiluCols), four per thread
// (one block a row looping over 10944 columns took 37 us at one row on the H200).
constexpr int kSiluThreads = 256, kSiluCols = 4 * kSiluThreads;
template <typename T>
__global__ void __launch_bounds__(kSiluThreads)
    silu_mul_kernel(const float* gu, int inter, T* out) {
  const int r = blockIdx.x;
  const float* g = gu + static_cast<int64_t>(r) * 2 * inter;
  T* o = out + static_cast<int64_t>(r) * inter;
  const int end = min(inter, static_cast<int>(blockIdx.y + 1) * kSiluCols);
#pragma unroll
  for (int i = blockIdx.y * kSiluCols + threadIdx.x; i < end; i += kSiluThreads)
    o[i] = from_f32<T>(silu(g[i]) * g[inter + i]);
}

template <int PER>
__global__ void router_topk_kernel(TopkArgs a) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (t < a.num_tokens) topk_token<PER>(a, t, threadIdx.x % 32);
}

constexpr int kPermuteThreads = 1024;

// Given rows `count` and valid rows `valid` per slot (shared memory), writes offsets,
// the tile table, *num_tiles and slot statistics, and each slot's first row to
// `first` (shared memory). All kPermuteThreads threads of the block call it.
__device__ void lay_out_slots(const PermuteArgs& a, const int* count, const int* valid,
                              int* first) {
  __shared__ int scan_rows[kPermuteThreads], scan_tiles[kPermuteThreads];
  const int tid = threadIdx.x;
  // Each thread owns a contiguous range of slots; a block scan gives its first row and tile.
  const int per = (a.num_slots + kPermuteThreads - 1) / kPermuteThreads;
  const int s0 = min(tid * per, a.num_slots), s1 = min(s0 + per, a.num_slots);
  int rows = 0, tiles = 0;
  for (int s = s0; s < s1; ++s) {
    rows += count[s];
    tiles += (count[s] + a.block_m - 1) / a.block_m;
  }
  scan_rows[tid] = rows;
  scan_tiles[tid] = tiles;
  __syncthreads();
  for (int o = 1; o < kPermuteThreads; o <<= 1) {
    const int r = tid >= o ? scan_rows[tid - o] : 0;
    const int tl = tid >= o ? scan_tiles[tid - o] : 0;
    __syncthreads();
    scan_rows[tid] += r;
    scan_tiles[tid] += tl;
    __syncthreads();
  }
  int row = scan_rows[tid] - rows, tile = scan_tiles[tid] - tiles;
  for (int s = s0; s < s1; ++s) {
    first[s] = row;
    a.offsets[s] = row;
    for (int r0 = 0; r0 < count[s]; r0 += a.block_m) {
      a.tile_slot[tile] = s;
      a.tile_row0[tile] = row + r0;
      ++tile;
    }
    row += count[s];
    if (a.slot_stats != nullptr) a.slot_stats[s] += valid[s];
  }
  if (tid == kPermuteThreads - 1) {
    a.offsets[a.num_slots] = scan_rows[tid];
    *a.num_tiles = scan_tiles[tid];
  }
  __syncthreads();
}

__device__ __forceinline__ int valid_pairs(const PermuteArgs& a) {
  return a.num_valid_tokens != nullptr ? *a.num_valid_tokens * a.top_k : a.num_pairs;
}

// With `topk` set (small steps), the block first runs the router top-k itself (one
// warp per token), saving a launch on the decode path.
__global__ void __launch_bounds__(kPermuteThreads)
    permute_kernel(PermuteArgs a, TopkArgs topk, bool with_topk) {
  if (with_topk) {
    for (int t = threadIdx.x / 32; t < topk.num_tokens; t += kPermuteThreads / 32) {
      topk_token(topk, t, threadIdx.x % 32);
    }
    __syncthreads();  // The block's global writes of slot[] are visible to it after this.
  }
  extern __shared__ int smem[];
  int* count = smem;                   // [num_slots] rows per slot
  int* valid = count + a.num_slots;    // [num_slots] rows of valid tokens
  int* cursor = valid + a.num_slots;   // [num_slots]
  int* offset = cursor + a.num_slots;  // [num_slots]
  const int tid = threadIdx.x;
  for (int s = tid; s < a.num_slots; s += kPermuteThreads) count[s] = valid[s] = cursor[s] = 0;
  __syncthreads();
  const int num_valid = valid_pairs(a);
  for (int p = tid; p < a.num_pairs; p += kPermuteThreads) {
    const int s = a.slot[p];
    if (s < 0) continue;  // No row (the EP exchange's rows past those received).
    atomicAdd(&count[s], 1);
    if (p < num_valid) atomicAdd(&valid[s], 1);
  }
  __syncthreads();
  lay_out_slots(a, count, valid, offset);
  for (int p = tid; p < a.num_pairs; p += kPermuteThreads) {
    const int s = a.slot[p];
    if (s < 0) continue;
    const int r = offset[s] + atomicAdd(&cursor[s], 1);
    a.row_of_pair[p] = r;
    a.pair_of_row[r] = p;
  }
}

// The many-block path: a.counts holds rows, valid rows and the next free row per slot.
constexpr int kScatterThreads = 256, kScatterPairs = 4;  // Pairs per thread.
constexpr int kScatterBlockPairs = kScatterThreads * kScatterPairs;

// 1. Rows and valid rows per slot: block histograms added to a.counts (zeroed before).
__global__ void __launch_bounds__(kScatterThreads) permute_count_kernel(PermuteArgs a) {
  extern __shared__ int smem[];
  int* count = smem;
  int* valid = smem + a.num_slots;
  for (int s = threadIdx.x; s < 2 * a.num_slots; s += kScatterThreads) smem[s] = 0;
  __syncthreads();
  const int num_valid = valid_pairs(a);
  const int end = min((blockIdx.x + 1) * kScatterBlockPairs, a.num_pairs);
  for (int p = blockIdx.x * kScatterBlockPairs + threadIdx.x; p < end; p += kScatterThreads) {
    const int s = a.slot[p];
    if (s < 0) continue;
    atomicAdd(&count[s], 1);
    if (p < num_valid) atomicAdd(&valid[s], 1);
  }
  __syncthreads();
  for (int s = threadIdx.x; s < a.num_slots; s += kScatterThreads) {
    if (count[s] > 0) atomicAdd(&a.counts[s], count[s]);
    if (valid[s] > 0) atomicAdd(&a.counts[a.num_slots + s], valid[s]);
  }
}

// 2. One block: offsets, tile table, statistics; the next free row of slot s := its first.
__global__ void __launch_bounds__(kPermuteThreads) permute_scan_kernel(PermuteArgs a) {
  extern __shared__ int smem[];
  int* count = smem;
  int* valid = count + a.num_slots;
  int* first = valid + a.num_slots;
  for (int s = threadIdx.x; s < 2 * a.num_slots; s += kPermuteThreads) smem[s] = a.counts[s];
  __syncthreads();
  lay_out_slots(a, count, valid, first);
  for (int s = threadIdx.x; s < a.num_slots; s += kPermuteThreads) {
    a.counts[2 * a.num_slots + s] = first[s];
  }
}

// 3. Rows: ranks within the block (shared atomics), then one reservation per (block,
// slot) from the next free rows. A row's place within its slot does not change any
// result (each GEMM row is computed alone), only which tile holds it.
__global__ void __launch_bounds__(kScatterThreads) permute_scatter_kernel(PermuteArgs a) {
  extern __shared__ int smem[];
  int* local = smem;               // [num_slots] rows of this block per slot
  int* base = smem + a.num_slots;  // [num_slots] their first row
  for (int s = threadIdx.x; s < a.num_slots; s += kScatterThreads) local[s] = 0;
  __syncthreads();
  const int p0 = blockIdx.x * kScatterBlockPairs + threadIdx.x;
  int slot[kScatterPairs], rank[kScatterPairs];
#pragma unroll
  for (int i = 0; i < kScatterPairs; ++i) {
    const int p = p0 + i * kScatterThreads;
    slot[i] = p < a.num_pairs ? a.slot[p] : -1;
    rank[i] = slot[i] >= 0 ? atomicAdd(&local[slot[i]], 1) : 0;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < a.num_slots; s += kScatterThreads) {
    base[s] = local[s] > 0 ? atomicAdd(&a.counts[2 * a.num_slots + s], local[s]) : 0;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kScatterPairs; ++i) {
    if (slot[i] < 0) continue;
    const int p = p0 + i * kScatterThreads;
    const int r = base[slot[i]] + rank[i];
    a.row_of_pair[p] = r;
    a.pair_of_row[r] = p;
  }
}

template <typename T>
__global__ void combine_kernel(const T* y, const float* weight, const int32_t* row_of_pair, int K,
                               int hidden, bool accumulate, float* out) {
  const int t = blockIdx.x;
  float* o = out + static_cast<int64_t>(t) * hidden;
  for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < K; ++k) {
      const float w = weight[t * K + k];
      float v[8];
      load8(y + static_cast<int64_t>(row_of_pair[t * K + k]) * hidden + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) o[c + i] = accumulate ? o[c + i] + acc[i] : acc[i];
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

template <typename T>
__global__ void fill_uniform_kernel(T* data, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + i);
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    data[i] = from_f32<T>((2.f * u - 1.f) * scale);
  }
}

__global__ void copy_kernel(const uint4* src, uint4* dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

// Order-preserving map of a float's bits to an unsigned int (larger float, larger key).
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxPerThread = 16;  // A block covers 4096 values of its row.

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* logits, int vocab, unsigned long long* keys) {
  const float* row = logits + static_cast<size_t>(blockIdx.y) * vocab;
  const int begin = blockIdx.x * kArgmaxThreads * kArgmaxPerThread;
  const int end = min(vocab, begin + kArgmaxThreads * kArgmaxPerThread);
  unsigned long long best = 0;
  for (int i = begin + threadIdx.x; i < end; i += kArgmaxThreads) {
    const float v = row[i] == 0.f ? 0.f : row[i];  // -0 ties with +0, as on the host.
    const unsigned long long key =
        isnan(v) ? 0ull
                 : (static_cast<unsigned long long>(ordered_bits(v)) << 32) | (0xffffffffu - i);
    best = key > best ? key : best;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  __shared__ unsigned long long warp_best[kArgmaxThreads / 32];
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    if (best != 0) atomicMax(&keys[blockIdx.y], best);
  }
}

// The float whose ordered_bits are the high half of an argmax_rows key.
__device__ __forceinline__ float key_value(unsigned long long key) {
  const uint32_t o = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

constexpr int kSampleChunk = kArgmaxThreads * kArgmaxPerThread;  // 4096 ids per partial sum.

__device__ __forceinline__ double sample_weight(float logit, float mx, double inv_t) {
  return isnan(logit) ? 0.0 : exp(static_cast<double>(logit - mx) * inv_t);  // As the host.
}

// Block (chunk c, draw i): the sum of the weights of ids [4096 c, 4096 (c + 1)).
__global__ void __launch_bounds__(kArgmaxThreads) sample_partials_kernel(SampleRowsArgs a) {
  const int i = blockIdx.y, c = blockIdx.x;
  const float* row = a.logits + static_cast<size_t>(a.rows[i]) * a.vocab;
  const float mx = key_value(a.keys[a.rows[i]]);
  const double inv_t = a.inv_temperature[i];
  const int end = min(a.vocab, (c + 1) * kSampleChunk);
  double s = 0.0;
  for (int id = c * kSampleChunk + threadIdx.x; id < end; id += kArgmaxThreads) {
    s += sample_weight(row[id], mx, inv_t);
  }
  const double total = block_sum(s);
  if (threadIdx.x == 0) a.partials[static_cast<size_t>(i) * gridDim.x + c] = total;
}

// Scan of one double per thread in thread order: this thread's [lower, upper), where a
// thread's upper is bitwise its successor's lower (no gap, no overlap: exactly one
// thread holds any point below the total). *total gets the sum. blockDim.x: a multiple of
// 32; every thread calls it.
struct ScanRange {
  double lower, upper;
};
__device__ ScanRange block_scan(double v, double* total) {
  __shared__ double warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  double excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.0;
  __syncthreads();  // warp_sums may still be read by a previous call.
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  double base = 0.0, all = 0.0;  // base: the sum before this warp, as `all` passes it.
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) {
    if (w == warp) base = all;
    all += warp_sums[w];
  }
  *total = all;
  return {base + excl, base + incl};
}

// Block i: the chunk where the cumulative sum crosses u01 x total (thread 0 walks the
// partials), then the id inside it: each thread owns 16 consecutive ids, an exclusive
// scan of the threads' sums finds the one whose range holds the target, and it walks
// its ids.
__global__ void __launch_bounds__(kArgmaxThreads) sample_pick_kernel(SampleRowsArgs a, int chunks) {
  const int i = blockIdx.x;
  const int r = a.rows[i];
  const float* row = a.logits + static_cast<size_t>(r) * a.vocab;
  const float mx = key_value(a.keys[r]);
  const double inv_t = a.inv_temperature[i];
  const double* part = a.partials + static_cast<size_t>(i) * chunks;
  __shared__ int chunk;
  __shared__ double rem;
  __shared__ int token;
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int c = 0; c < chunks; ++c) total += part[c];
    const double target = a.u01[i] * total;
    double acc = 0.0;
    chunk = -1;
    for (int c = 0; c < chunks && chunk < 0; ++c) {
      if (target < acc + part[c]) {
        chunk = c;
        rem = target - acc;
      }
      acc += part[c];
    }
    token = argmax_key_index(a.keys[r]);  // Rounding left no chunk: the argmax.
  }
  __syncthreads();
  if (chunk < 0) {
    if (threadIdx.x == 0) a.tokens[i] = token;
    return;
  }
  const int first = chunk * kSampleChunk + threadIdx.x * kArgmaxPerThread;
  const int last = min(a.vocab, first + kArgmaxPerThread);
  double mine = 0.0;
  for (int id = first; id < last; ++id) mine += sample_weight(row[id], mx, inv_t);
  double sum;
  const ScanRange range = block_scan(mine, &sum);
  const double lower = range.lower, upper = range.upper;
  if (rem >= lower && rem < upper) {
    double acc = lower;
    int pick = last - 1;
    for (int id = first; id < last; ++id) {
      acc += sample_weight(row[id], mx, inv_t);
      if (rem < acc) {
        pick = id;
        break;
      }
    }
    token = pick;
  }
  __syncthreads();
  if (threadIdx.x == 0) a.tokens[i] = token;
}

// Truncated sampling (kernels::sample_truncated): a group of CS blocks of kTruncThreads
// per draw, CS = 1 or a thread block cluster of 2, 4 or 8 (few draws: one block per draw
// left all but a few SMs idle, ~1.2 ms for a top-p draw over a flat 152 k row). The
// blocks of a cluster split the row, add their histograms up through distributed shared
// memory and take the same decisions from the same sums.
constexpr int kTruncThreads = 1024;

// The group's barrier (the cluster's, which orders its shared memory, or the block's),
// this block's rank in it, and a pointer to the same shared variable in block `rank`.
// Clusters need sm_90; code compiled for less (and run there or JIT-compiled) only runs
// CS = 1: sample_rows checks the device and the kernel's PTX version, and the helpers
// trap should a cluster instance run anyway.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FLEX_TRUNC_CLUSTERS 0
#else
#define FLEX_TRUNC_CLUSTERS 1
#endif
template <int CS>
__device__ __forceinline__ void group_sync() {
  if constexpr (CS > 1) {
#if FLEX_TRUNC_CLUSTERS
    cg::this_cluster().sync();
#else
    __trap();
#endif
  } else {
    __syncthreads();
  }
}
template <int CS>
__device__ __forceinline__ int group_rank() {
  if constexpr (CS > 1) {
#if FLEX_TRUNC_CLUSTERS
    return static_cast<int>(cg::this_cluster().block_rank());
#else
    __trap();
    return 0;
#endif
  } else {
    return 0;
  }
}
template <int CS, typename T>
__device__ __forceinline__ T* at_rank(T* p, int rank) {
  if constexpr (CS > 1) {
#if FLEX_TRUNC_CLUSTERS
    return cg::this_cluster().map_shared_rank(p, rank);
#else
    __trap();
    return p;
#endif
  } else {
    return p;
  }
}

// block_scan over the group's threads in (block rank, thread) order, with the same
// property: a thread's upper is bitwise its successor's lower (block offsets are one
// running sum in rank order, computed alike by every block).
template <int CS>
__device__ ScanRange group_scan(double v, double* total) {
  double all;
  const ScanRange r = block_scan(v, &all);
  if constexpr (CS == 1) {
    *total = all;
    return r;
  } else {
    __shared__ double block_total;
    if (threadIdx.x == 0) block_total = all;
    group_sync<CS>();
    const int me = group_rank<CS>();
    double base = 0.0, sum = 0.0;
    for (int b = 0; b < CS; ++b) {
      if (b == me) base = sum;
      sum += *at_rank<CS>(&block_total, b);
    }
    group_sync<CS>();  // block_total is rewritten by the next call.
    *total = sum;
    return {base + r.lower, base + r.upper};
  }
}

// Rank order of a logit: a larger key ranks first; NaN last (0), -0 as +0.
__device__ __forceinline__ uint32_t rank_key(float v) {
  return isnan(v) ? 0u : ordered_bits(v == 0.f ? 0.f : v);
}

// A cut: the members are the candidates ranking up to (key, id) (key descending, then id).
struct Cut {
  uint32_t key;
  int id;
  __device__ bool has(uint32_t k, int i) const { return k > key || (k == key && i <= id); }
};

// A draw's row, seen by thread `gtid` of the group's `threads`.
struct TruncRow {
  const float* logits;
  int vocab;
  float mx;
  double inv_t;
  int gtid, threads;
  __device__ double weight(int i) const { return sample_weight(logits[i], mx, inv_t); }
  // This thread's contiguous ids (group thread order is id order).
  __device__ int seg_begin() const {
    const int per = (vocab + threads - 1) / threads;
    return min(vocab, gtid * per);
  }
  __device__ int seg_end() const {
    const int per = (vocab + threads - 1) / threads;
    return min(vocab, (gtid + 1) * per);
  }
};

// The cut at the candidate (in rank order, among the members of `within`) at which the
// running count (by_mass false) or weight reaches `target`: radix selection of its key,
// 8 bits a pass, then the ties of that key in id order. Rounding that never reaches the
// target keeps every member. All threads of the group call it; all get the same cut.
template <int CS>
__device__ Cut select_cut(const TruncRow& row, Cut within, bool by_mass, double target) {
  if (by_mass && !(target > 0.0)) {
    by_mass = false;  // No weight to reach (all NaN): the first candidate, as the host.
    target = 1.0;
  }
  __shared__ unsigned int hist_n[256];
  __shared__ double hist_w[256];
  // The group's sums (a cluster adds its blocks' histograms up in rank order).
  __shared__ unsigned int sum_n[CS > 1 ? 256 : 1];
  __shared__ double sum_w[CS > 1 ? 256 : 1];
  __shared__ uint32_t s_prefix;
  __shared__ double s_above;
  __shared__ int s_id;
  const int tid = threadIdx.x;
  uint32_t prefix = 0, mask = 0;
  double above = 0.0;  // Count or weight of the members ranking above the prefix's keys.
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kTruncThreads) hist_n[b] = 0, hist_w[b] = 0.0;
    __syncthreads();
    // Counts: one shared atomic per element. Weights: lanes of a warp that hit one bin add
    // up first (__match_any_sync): logits crowd into few bins on the first passes, and a
    // double atomic per lane there serialises (H200: a top-p draw 1.9 -> 1.2 ms); for the
    // counts the matching cost more than it saved (top-k 50: 0.19 -> 0.7 ms).
    for (int i = row.gtid; !by_mass && i < row.vocab; i += row.threads) {
      const uint32_t k = rank_key(row.logits[i]);
      if ((k & mask) == prefix && within.has(k, i)) atomicAdd(&hist_n[(k >> shift) & 255], 1u);
    }
    for (int i0 = row.gtid - tid % 32; by_mass && i0 < row.vocab; i0 += row.threads) {
      const int i = i0 + tid % 32;
      int bin = 256 + tid % 32;  // Unique: no bin.
      if (i < row.vocab) {
        const uint32_t k = rank_key(row.logits[i]);
        if ((k & mask) == prefix && within.has(k, i)) bin = (k >> shift) & 255;
      }
      const unsigned same = __match_any_sync(0xffffffffu, bin);
      const double w = bin < 256 ? row.weight(i) : 0.0;
      double sum = 0.0;
      for (int l = 0; l < 32; ++l) {  // The lanes of `same`, in lane order.
        const double x = __shfl_sync(0xffffffffu, w, l);
        if ((same >> l) & 1) sum += x;
      }
      if (bin < 256 && tid % 32 == __ffs(same) - 1) {
        atomicAdd(&hist_n[bin], static_cast<unsigned>(__popc(same)));
        atomicAdd(&hist_w[bin], sum);
      }
    }
    const unsigned int* cnt = hist_n;
    const double* wsum = hist_w;
    if constexpr (CS > 1) {
      group_sync<CS>();  // Every block's histogram is complete.
      for (int b = tid; b < 256; b += kTruncThreads) {
        unsigned int n = 0;
        double w = 0.0;
#pragma unroll 2
        for (int r = 0; r < CS; ++r) {
          n += *at_rank<CS>(&hist_n[b], r);
          w += *at_rank<CS>(&hist_w[b], r);
        }
        sum_n[b] = n;
        sum_w[b] = w;
      }
      cnt = sum_n;
      wsum = sum_w;
    }
    __syncthreads();
    if (tid == 0) {
      double cum = above, last_before = above;
      int chosen = -1, lowest = -1;
      for (int b = 255; b >= 0 && chosen < 0; --b) {
        if (cnt[b] == 0) continue;
        const double h = by_mass ? wsum[b] : static_cast<double>(cnt[b]);
        lowest = b;
        last_before = cum;
        if (cum + h >= target) chosen = b;
        cum += h;
      }
      if (chosen < 0) chosen = lowest;  // Rounding: everything down to the last bin.
      s_prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
      s_above = last_before;
    }
    // (A cluster: also every block is done reading the others' histograms.)
    group_sync<CS>();
    prefix = s_prefix;
    above = s_above;
    mask |= 255u << shift;
  }
  // Ties of key `prefix` in id order: the one at which above + running reaches target.
  const int b = row.seg_begin(), e = row.seg_end();
  double mine = 0.0;
  for (int i = b; i < e; ++i) {
    const uint32_t k = rank_key(row.logits[i]);
    if (k == prefix && within.has(k, i)) mine += by_mass ? row.weight(i) : 1.0;
  }
  double total;
  const ScanRange range = group_scan<CS>(mine, &total);
  const double lower = above + range.lower, upper = above + range.upper;
  // Not reached (rounding): every tie that `within` has.
  if (tid == 0) s_id = prefix == within.key ? within.id : row.vocab;
  group_sync<CS>();
  // above < target holds (every pass chose the first bin reaching it), so exactly one
  // thread's (lower, upper] holds the crossing, unless rounding left it unreached.
  if (lower < target && upper >= target) {
    double acc = lower;
    int id = -1;
    for (int i = b; i < e; ++i) {
      const uint32_t k = rank_key(row.logits[i]);
      if (k != prefix || !within.has(k, i)) continue;
      acc += by_mass ? row.weight(i) : 1.0;
      id = i;
      if (acc >= target) break;  // Else (the walk's rounding): its last tie.
    }
    for (int r = 0; r < CS; ++r) *at_rank<CS>(&s_id, r) = id;
  }
  group_sync<CS>();
  const Cut cut{prefix, s_id};
  group_sync<CS>();  // s_id is rewritten by the next call.
  return cut;
}

template <int CS>
__global__ void __launch_bounds__(kTruncThreads, 1) sample_truncated_kernel(SampleRowsArgs a) {
  const int d = blockIdx.x / CS;  // A cluster's blocks are consecutive.
  const int me = group_rank<CS>();
  const int top_k = a.top_k[d];
  const float top_p = a.top_p[d];
  const bool cut_k = top_k > 0 && top_k < a.vocab;
  if (!cut_k && !(top_p < 1.0f)) return;  // A plain draw: sample_pick_kernel's (whole group).
  const int r = a.rows[d];
  TruncRow row{a.logits + static_cast<size_t>(r) * a.vocab,
               a.vocab,
               key_value(a.keys[r]),
               a.inv_temperature[d],
               me * kTruncThreads + static_cast<int>(threadIdx.x),
               CS * kTruncThreads};
  Cut cut{0u, a.vocab};  // Everything.
  if (cut_k) cut = select_cut<CS>(row, cut, /*by_mass=*/false, static_cast<double>(top_k));
  const int b = row.seg_begin(), e = row.seg_end();
  double total;
  if (top_p < 1.0f) {
    double mine = 0.0;
    for (int i = b; i < e; ++i) {
      if (cut.has(rank_key(row.logits[i]), i)) mine += row.weight(i);
    }
    (void)group_scan<CS>(mine, &total);
    cut = select_cut<CS>(row, cut, /*by_mass=*/true, static_cast<double>(top_p) * total);
  }
  // The draw: inverse transform over the members in id order.
  double mine = 0.0;
  int last = -1;
  for (int i = b; i < e; ++i) {
    if (!cut.has(rank_key(row.logits[i]), i)) continue;
    mine += row.weight(i);
    last = i;
  }
  const ScanRange range = group_scan<CS>(mine, &total);
  // In block 0 of the group.
  __shared__ int pick, last_member;
  if (threadIdx.x == 0 && me == 0) pick = -1, last_member = -1;
  group_sync<CS>();
  // One atomic per warp (a cluster's go to block 0).
  const int warp_last = __reduce_max_sync(0xffffffffu, last);
  if (threadIdx.x % 32 == 0) atomicMax(at_rank<CS>(&last_member, 0), warp_last);
  const double target = a.u01[d] * total;
  if (last >= 0 && target >= range.lower && target < range.upper) {
    double acc = range.lower;
    int p = last;
    for (int i = b; i < e; ++i) {
      if (!cut.has(rank_key(row.logits[i]), i)) continue;
      acc += row.weight(i);
      if (target < acc) {
        p = i;
        break;
      }
    }
    *at_rank<CS>(&pick, 0) = p;
  }
  group_sync<CS>();
  if (threadIdx.x == 0 && me == 0) a.tokens[d] = pick >= 0 ? pick : last_member;
}

template <int CS>
cudaError_t launch_truncated(const SampleRowsArgs& a, cudaStream_t stream) {
  if constexpr (CS == 1) {
    sample_truncated_kernel<1><<<a.n, kTruncThreads, 0, stream>>>(a);
  } else {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(a.n * CS);
    cfg.blockDim = dim3(kTruncThreads);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CS;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, sample_truncated_kernel<CS>, a) != cudaSuccess) {
      // No room for the cluster (e.g. SMs limited by MPS): a block per draw.
      (void)cudaGetLastError();
      return launch_truncated<1>(a, stream);
    }
  }
  return cudaGetLastError();
}

int blocks_for(size_t n, int threads) {
  const size_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65536 ? (b == 0 ? 1 : b) : 65536);
}

// The SMs of this device (asked once per process), for the GEMV's grid.
int gemv_sms() {
  static const int sms = [] {
    int device = 0, count = 0;
    const bool ok =
        cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess;
    (void)cudaGetLastError();
    return ok ? count : 0;
  }();
  return sms;
}

cudaError_t launch_gemv(const bf16* x, int m, int k, const void* w, int n, void* y, bool accumulate,
                        const GemvIo& io, cudaStream_t stream) {
  unsigned blocks = static_cast<unsigned>((n + kGemvWarps - 1) / kGemvWarps);
  const bf16* wb = static_cast<const bf16*>(w);
  using Kernel = void (*)(const bf16*, int, const bf16*, int, void*, bool, GemvIo);
  static constexpr Kernel kKernels[2][2][kGemvMaxRows] = {
      {{gemv_nt_kernel<1, false, false>, gemv_nt_kernel<2, false, false>,
        gemv_nt_kernel<3, false, false>, gemv_nt_kernel<4, false, false>,
        gemv_nt_kernel<5, false, false>, gemv_nt_kernel<6, false, false>,
        gemv_nt_kernel<7, false, false>, gemv_nt_kernel<8, false, false>},
       {gemv_nt_kernel<1, true, false>, gemv_nt_kernel<2, true, false>,
        gemv_nt_kernel<3, true, false>, gemv_nt_kernel<4, true, false>,
        gemv_nt_kernel<5, true, false>, gemv_nt_kernel<6, true, false>,
        gemv_nt_kernel<7, true, false>, gemv_nt_kernel<8, true, false>}},
      {{nullptr, gemv_nt_kernel<2, false, true>, gemv_nt_kernel<3, false, true>,
        gemv_nt_kernel<4, false, true>, gemv_nt_kernel<5, false, true>,
        gemv_nt_kernel<6, false, true>, gemv_nt_kernel<7, false, true>,
        gemv_nt_kernel<8, false, true>},
       {}}};  // Rows a pass ahead do not loop.
  static_assert(kGemvMaxRows == 8);
  // Rows of more than two passes load a pass ahead (H200: with k = 4096 too, Qwen3's
  // o_proj, a batch-1 step of 12 layers went 0.89 -> 0.91 ms).
  const bool ahead = k > 2 * 32 * kGemvLoads * 8;
  const size_t smem = io.prologue != GemvIo::kNone ? static_cast<size_t>(m) * k * sizeof(bf16) : 0;
  // A prologue of more than one row: no more blocks than the GPU holds at once, each
  // looping over column blocks, so that the rows are made once per block rather than once
  // per 8 columns (H200, gemv_bench in a chain of calls: Qwen3-30B-A3B's qkv with its
  // RMSNorm at 2 / 4 / 8 rows 11.6 / 18.1 / 32.2 -> 9.5 / 13.2 / 21.7 us, DeepSeek-V2-Lite's
  // dense gate/up 37.6 / 63.0 / 120 -> 27.0 / 37.6 / 63.9). Not for rows loaded a pass
  // ahead: their loop takes more registers, a block an SM (DeepSeek-V3's q_a + kv_a at 2
  // rows 11.6 -> 12.6 us).
  bool loop = false;
  if (m >= 2 && io.prologue != GemvIo::kNone && !ahead) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernels[1][0][m - 1],
                                                      kGemvWarps * 32, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      per_sm = 0;
    }
    const unsigned resident = static_cast<unsigned>(per_sm) * static_cast<unsigned>(gemv_sms());
    loop = resident > 0 && blocks > resident;
    if (loop) blocks = resident;
  }
  return launch_pdl(kKernels[loop][ahead][m - 1], dim3(blocks), dim3(kGemvWarps * 32), smem, stream,
                    x, k, wb, n, y, accumulate, io);
}

}  // namespace

cudaError_t embedding(DType dtype, const void* table, const int32_t* ids, int num_tokens, int dim,
                      float* out, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  FLEX_DISPATCH_DTYPE(dtype, embedding_kernel<T><<<num_tokens, 256, 0, stream>>>(
                                 static_cast<const T*>(table), ids, dim, out));
  return cudaGetLastError();
}

namespace {

cudaError_t launch_rms_norm(DType dtype, const float* x, int64_t x_stride, const int32_t* row_index,
                            const float* weight, int rows, int dim, float eps, void* out,
                            cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rms_vec_fits(dim) && x_stride % 4 == 0) {
    FLEX_DISPATCH_DTYPE(
        dtype, return launch_pdl(rms_norm_vec_kernel<T>, dim3(rows), dim3(kRmsThreads), 0, stream,
                                 x, x_stride, row_index, weight, dim, eps, static_cast<T*>(out)));
  }
  FLEX_DISPATCH_DTYPE(dtype, rms_norm_kernel<T><<<rows, 256, 0, stream>>>(
                                 x, x_stride, row_index, weight, dim, eps, static_cast<T*>(out)));
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(DType dtype, const float* x, const int32_t* row_index, const float* weight,
                     int rows, int dim, float eps, void* out, cudaStream_t stream) {
  return launch_rms_norm(dtype, x, dim, row_index, weight, rows, dim, eps, out, stream);
}

cudaError_t rms_norm_rows(DType dtype, const float* x, int64_t x_stride, const float* weight,
                          int rows, int dim, float eps, void* out, cudaStream_t stream) {
  return launch_rms_norm(dtype, x, x_stride, nullptr, weight, rows, dim, eps, out, stream);
}

cudaError_t qk_norm_rope_store(DType dtype, const QkvArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.head_dim > 256 || args.head_dim % 2 != 0) return cudaErrorInvalidValue;
  const dim3 grid(args.num_tokens, args.num_q_heads + 2 * args.num_kv_heads);
  FLEX_DISPATCH_DTYPE(dtype,
                      return launch_pdl(qk_norm_rope_kernel<T>, grid, dim3(32), 0, stream, args));
  return cudaErrorInvalidValue;
}

bool gemv_nt_fits(DType dtype, int64_t m, int64_t k) {
  return dtype == DType::kBF16 && m >= 1 && m <= kGemvMaxRows && k >= 8 && k % 8 == 0;
}

cudaError_t gemv_nt(const void* x, int m, int k, const void* w, int n, float* y, bool accumulate,
                    cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (m > kGemvMaxRows || k < 8 || k % 8 != 0) return cudaErrorInvalidValue;
  return launch_gemv(static_cast<const bf16*>(x), m, k, w, n, y, accumulate, GemvIo{}, stream);
}

bool gemv_norm_nt_fits(int64_t m, int64_t k) {
  return gemv_nt_fits(DType::kBF16, m, k) && rms_vec_fits(k) &&
         m * k * static_cast<int64_t>(sizeof(bf16)) <= kGemvNormSmemBytes;
}

namespace {

// The GEMV of rows of x (x_stride floats apart) normalised with weight and eps.
cudaError_t launch_norm_gemv(const float* x, int64_t x_stride, const float* weight, float eps,
                             int m, int k, const void* w, int n, void* y, bool y_bf16,
                             bool accumulate, cudaStream_t stream) {
  GemvIo io;
  io.prologue = GemvIo::kNorm;
  io.src = x;
  io.src_stride = x_stride;
  io.weight = weight;
  io.eps = eps;
  io.y_bf16 = y_bf16;
  return launch_gemv(nullptr, m, k, w, n, y, accumulate, io, stream);
}

}  // namespace

cudaError_t gemv_norm_nt(const float* x, const float* norm_weight, float eps, int m, int k,
                         const void* w, int n, float* y, bool accumulate, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (!gemv_norm_nt_fits(m, k)) return cudaErrorInvalidValue;
  return launch_norm_gemv(x, k, norm_weight, eps, m, k, w, n, y, false, accumulate, stream);
}

cudaError_t gemv_norm_nt_rows(const float* x, int64_t x_stride, const float* norm_weight, float eps,
                              int m, int k, const void* w, int n, DType y_dtype, void* y,
                              cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (!gemv_norm_nt_fits(m, k) || x_stride < k || x_stride % 4 != 0 ||
      (y_dtype != DType::kF32 && y_dtype != DType::kBF16)) {
    return cudaErrorInvalidValue;
  }
  return launch_norm_gemv(x, x_stride, norm_weight, eps, m, k, w, n, y, y_dtype == DType::kBF16,
                          /*accumulate=*/false, stream);
}

bool gemv_swiglu_nt_fits(int64_t m, int64_t inter) {
  return gemv_nt_fits(DType::kBF16, m, inter) &&
         m * inter * static_cast<int64_t>(sizeof(bf16)) <= kGemvNormSmemBytes;
}

cudaError_t gemv_swiglu_nt(const float* gu, int m, int inter, const void* w, int n, float* y,
                           bool accumulate, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (!gemv_swiglu_nt_fits(m, inter)) return cudaErrorInvalidValue;
  GemvIo io;
  io.prologue = GemvIo::kSwiglu;
  io.src = gu;
  return launch_gemv(nullptr, m, inter, w, n, y, accumulate, io, stream);
}

cudaError_t silu_mul(DType dtype, const float* gu, int rows, int inter, void* out,
                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  FLEX_DISPATCH_DTYPE(
      dtype, silu_mul_kernel<T>
      <<<dim3(rows, (inter + kSiluCols - 1) / kSiluCols), kSiluThreads, 0, stream>>>(
          gu, inter, static_cast<T*>(out)));
  return cudaGetLastError();
}

bool topk_args_ok(const TopkArgs& args) {
  return args.top_k <= 32 && args.top_k >= 1 && args.num_experts <= 32 * kTopkMaxPerLane &&
         args.top_k <= args.num_experts;
}

cudaError_t router_topk(const TopkArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (!topk_args_ok(args)) return cudaErrorInvalidValue;
  constexpr int kWarps = 4;
  const int blocks = (args.num_tokens + kWarps - 1) / kWarps;
  if (args.num_experts <= 32) {
    router_topk_kernel<1><<<blocks, kWarps * 32, 0, stream>>>(args);
  } else if (args.num_experts <= 64) {
    router_topk_kernel<2><<<blocks, kWarps * 32, 0, stream>>>(args);
  } else if (args.num_experts <= 128) {
    router_topk_kernel<4><<<blocks, kWarps * 32, 0, stream>>>(args);
  } else if (args.num_experts <= 256) {
    router_topk_kernel<8><<<blocks, kWarps * 32, 0, stream>>>(args);
  } else {
    router_topk_kernel<kTopkMaxPerLane><<<blocks, kWarps * 32, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

cudaError_t permute(const PermuteArgs& args, cudaStream_t stream) {
  if (args.num_slots > kMaxPermuteSlots || args.num_slots < 1 || args.block_m < 1) {
    return cudaErrorInvalidValue;
  }
  const size_t slot_ints = static_cast<size_t>(args.num_slots) * sizeof(int);
  if (args.counts == nullptr || args.num_pairs <= kPermuteMultiBlockPairs) {
    permute_kernel<<<1, kPermuteThreads, 4 * slot_ints, stream>>>(args, TopkArgs{}, false);
    return cudaGetLastError();
  }
  const int blocks = (args.num_pairs + kScatterBlockPairs - 1) / kScatterBlockPairs;
  cudaError_t err = cudaMemsetAsync(args.counts, 0, 2 * slot_ints, stream);
  if (err != cudaSuccess) return err;
  permute_count_kernel<<<blocks, kScatterThreads, 2 * slot_ints, stream>>>(args);
  permute_scan_kernel<<<1, kPermuteThreads, 3 * slot_ints, stream>>>(args);
  permute_scatter_kernel<<<blocks, kScatterThreads, 2 * slot_ints, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t router_topk_permute(const TopkArgs& topk, const PermuteArgs& args,
                                cudaStream_t stream) {
  if (args.num_slots > kMaxPermuteSlots || args.num_slots < 1 || args.block_m < 1 ||
      !topk_args_ok(topk)) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = 4 * sizeof(int) * static_cast<size_t>(args.num_slots);
  permute_kernel<<<1, kPermuteThreads, smem, stream>>>(args, topk, true);
  return cudaGetLastError();
}

cudaError_t combine(DType dtype, const void* y, const float* weight, const int32_t* row_of_pair,
                    int num_tokens, int top_k, int hidden, bool accumulate, float* out,
                    cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  const int threads = hidden / 8 < 256 ? ((hidden / 8 + 31) / 32) * 32 : 256;
  FLEX_DISPATCH_DTYPE(
      dtype, combine_kernel<T><<<num_tokens, threads, 0, stream>>>(
                 static_cast<const T*>(y), weight, row_of_pair, top_k, hidden, accumulate, out));
  return cudaGetLastError();
}

cudaError_t argmax_rows(const float* logits, int rows, int vocab, unsigned long long* keys,
                        cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (vocab <= 0 || rows > 65535) return cudaErrorInvalidValue;
  const cudaError_t err = cudaMemsetAsync(keys, 0, rows * sizeof(unsigned long long), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(
      (vocab + kArgmaxThreads * kArgmaxPerThread - 1) / (kArgmaxThreads * kArgmaxPerThread), rows);
  argmax_rows_kernel<<<grid, kArgmaxThreads, 0, stream>>>(logits, vocab, keys);
  return cudaGetLastError();
}

cudaError_t sample_rows(const SampleRowsArgs& args, cudaStream_t stream) {
  if (args.n == 0) return cudaSuccess;
  if (args.vocab <= 0 || args.n > 65535) return cudaErrorInvalidValue;
  const int chunks = sample_rows_chunks(args.vocab);
  sample_partials_kernel<<<dim3(chunks, args.n), kArgmaxThreads, 0, stream>>>(args);
  sample_pick_kernel<<<args.n, kArgmaxThreads, 0, stream>>>(args, chunks);
  // Draws with a cut overwrite their token (the others return at once).
  if (args.top_k == nullptr || args.top_p == nullptr) return cudaGetLastError();
  // Few draws: a cluster of CS blocks each, the largest CS of 8, 4, 2 with n x CS blocks
  // within the SMs, else a block each.
  static const int sms = [] {
    int device = 0, ok = 0, count = 0;
    cudaFuncAttributes fa{};
    const bool usable =
        cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&ok, cudaDevAttrClusterLaunch, device) == cudaSuccess && ok != 0 &&
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaFuncGetAttributes(&fa, sample_truncated_kernel<2>) == cudaSuccess &&
        fa.ptxVersion >= 90;  // Compiled with clusters (not JIT-compiled from older PTX).
    (void)cudaGetLastError();
    return usable ? count : 0;
  }();
  const int fit = sms / args.n;
  if (fit >= 8) return launch_truncated<8>(args, stream);
  if (fit >= 4) return launch_truncated<4>(args, stream);
  if (fit >= 2) return launch_truncated<2>(args, stream);
  return launch_truncated<1>(args, stream);
}

cudaError_t fill_uniform(DType dtype, void* data, size_t n, uint64_t seed, float scale,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FLEX_DISPATCH_DTYPE(dtype, fill_uniform_kernel<T><<<blocks_for(n, 256), 256, 0, stream>>>(
                                 static_cast<T*>(data), n, seed, scale));
  return cudaGetLastError();
}

cudaError_t copy_bytes(const void* src, void* dst, size_t num_bytes, cudaStream_t stream) {
  if (num_bytes % 16 != 0) return cudaErrorInvalidValue;
  const size_t n = num_bytes / 16;
  copy_kernel<<<blocks_for(n, 512) < 132 * 16 ? blocks_for(n, 512) : 132 * 16, 512, 0, stream>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), n);
  return cudaGetLastError();
}

}  // namespace flexpert::cuda
