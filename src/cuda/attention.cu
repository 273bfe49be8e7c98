// SPDX-License-Identifier: Apache-2.0
// Causal grouped-query attention over the paged-by-slot KV cache (kernels.h).
// Three kernels, all with an online softmax and splits merged by attention_merge_kernel:
// - attention_kernel: one warp per (token, query head, split) over chunks of 32 keys (a
//   lane scores one key, then the warp accumulates the 32 values with each lane owning
//   D / 32 output dims). Any dtype and head_dim; the fallback and the rows of prefill
//   steps that no tile takes.
// - attention_gqa_kernel: bf16 decode (steps without tiles, head_dim 64 / 128, up to 16
//   query heads a kv head): a warp per (token, kv head, split) on tensor cores, the
//   group's heads as rows, K and V chunks coalesced into shared memory.
// - attention_tile_kernel: prefill steps (AttentionArgs::tiles) first run tiles of 64
//   rows of one sequence on tensor cores (bf16, head_dim 64 / 128; mma.sync with
//   registers as FlashAttention-2 keeps them, not yet wgmma).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <type_traits>

#include "cuda/device_util.cuh"
#include "cuda/kernels.h"
#include "cuda/knobs.h"
#include "cuda/mma_sync.cuh"
#include "cuda/pdl.cuh"

namespace flexpert::cuda {
namespace {

constexpr int kWarps = 4;
// Split steps of few (token, head) pairs until about this many warps run.
constexpr int kSplitTargetWarps = 2048;
constexpr int kMaxSplits = 64;
// attention_tile_kernel: query rows and key positions per block and chunk.
constexpr int kFaRows = kAttentionTileRows, kFaCols = 64, kFaWarps = kFaRows / 16;

// One warp: pair idx = (token, head), split sp of `splits`: the chunks sp, sp + splits,
// ... of 32 positions; with splits > 1 it leaves (m, l, unnormalised acc) for the merge
// in task's place. sq: the warp's D floats of shared memory.
template <typename T, int D>
__device__ __forceinline__ void attend(const AttentionArgs& a, int64_t idx, int sp, int splits,
                                       int64_t task, float* sq, int lane) {
  constexpr int kPerLane = D / 32;
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
  for (int d = lane; d < D; d += 32) sq[d] = to_f32(q[d]);
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
        for (int i = 0; i < 8; ++i) dot += sq[d + i] * kv[i];
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

// A warp per (token, head, split).
// A warp per (token, head, split); with tile_done, not the tokens of tiles of kFaRows
// tokens that attention_tile_kernel computed.
template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attention_kernel(AttentionArgs a, int splits, const float* tile_done) {
  __shared__ __align__(16) float sq[kWarps][D];
  grid_dep_wait();
  grid_dep_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t idx = task / splits;
  const int sp = static_cast<int>(task % splits);
  if (idx >= static_cast<int64_t>(a.num_tokens) * a.num_q_heads) return;
  if (tile_done != nullptr && tile_done[idx / a.num_q_heads / kFaRows] != 0.f) return;
  attend<T, D>(a, idx, sp, splits, task, sq[warp], lane);
}

// One warp per (token, head): the splits' softmaxes rescaled to their common maximum.
// Lane i holds (m, l) of splits i and i + 32 (a warp reduction gives the maximum and the
// sum), then the warp adds up the values of the non-empty splits (l > 0) in split order,
// four splits' loads in flight at a time. (Split by split, one load after the other, the
// merge of a batch-1 step took ~32 us: 64 splits of ~3 non-empty ones, latency-bound.
// Sixteen in flight changed nothing at contexts that fill all 64: batch 1, context 2048
// and 8192, 12 layers, 0.98 / 1.03-1.04 ms a step either way, H200.)
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

// Prefill on tensor cores (bf16, head_dim 64 or 128). The rows come in tiles of kFaRows
// (64) query rows; a tile is computed here when its rows are one sequence's consecutive
// positions in one KV slot, and says so in split_scratch[tile] (1, else 0: the kernel
// launched next with those flags, attention_gqa_kernel or attention_kernel, takes the
// rows of other tiles). A block of kFaWarps warps takes a pair of tiles of one head: both as one
// job of 128 rows when all of them are one sequence's consecutive positions, else each
// tile that is, one after the other. Per chunk of kFaCols positions (up to the job's
// last row, causal) K and V rows go to shared memory (double-buffered by cp.async); warp
// w takes the job's rows 32w .. 32w + 31 as two blocks of 16 (rb), and keeps their
// scores S = Q K^T of the chunk and the output O in registers (mma.sync m16n8k16, bf16
// in, f32 accumulation; the layout of FlashAttention-2): a lane holds rows g = lane / 4
// and g + 8 of each block, columns 2t, 2t + 1 (t = lane % 4) of each 8-column block.
// Q's fragments come from shared memory at each k-step, each K fragment serves both row
// blocks. The online softmax runs on those registers (a row's four lanes reduce by
// shuffles); P, rounded to bf16, is the next product's A operand as it lies; V comes by
// ldmatrix.trans. Scores and sums are f32.
constexpr int kFaJobRows = 2 * kFaRows, kFaRb = 2;
static_assert(kFaJobRows == kFaWarps * 16 * kFaRb, "a warp takes kFaRb blocks of 16 rows");
template <int D>
constexpr size_t fa_smem_bytes() {  // Q's rows, then K and V twice (double-buffered).
  return static_cast<size_t>(kFaJobRows + 4 * kFaCols) * (D + 8) * sizeof(bf16);
}

// 2^x by the MUFU unit alone (denormal results flushed to zero: softmax weights below
// 2^-126 of the row's maximum), without exp2f's range fix-up around it.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// One job of the tile kernel: query rows t0 .. t0 + rows - 1 (rows <= kFaJobRows) of head
// h, one sequence's consecutive positions in one KV slot. Every thread of the block calls
// it (barriers inside); it ends with one.
template <int D>
__device__ __forceinline__ void fa_job(const AttentionArgs& a, int t0, int rows, int h, bf16* sQ,
                                       bf16* sK0, bf16* sV0) {
  constexpr int LQ = D + 8;  // Row stride in shared memory: ldmatrix rows hit all banks.
  constexpr int kKSteps = D / 16, kSTiles = kFaCols / 8, kOTiles = D / 8;
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nq = a.num_q_heads;
  const int p0 = a.positions[t0], slot = a.kv_slots[t0];
  const int kvh = h / (nq / a.num_kv_heads);
  const int64_t pos_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const bf16* kc = static_cast<const bf16*>(a.k_cache) +
                   static_cast<int64_t>(slot) * a.max_seq_len * pos_stride + kvh * D;
  const bf16* vc = static_cast<const bf16*>(a.v_cache) +
                   static_cast<int64_t>(slot) * a.max_seq_len * pos_stride + kvh * D;
  // Q's rows (zeros past the job's end); the first chunk's barrier orders them before
  // their reads.
  for (int c = threadIdx.x; c < kFaJobRows * kChunks; c += kFaWarps * 32) {
    const int r = c / kChunks, k = c % kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows) {
      v = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.q) +
                                          (static_cast<int64_t>(t0 + r) * nq + h) * D + 8 * k);
    }
    *reinterpret_cast<uint4*>(sQ + r * LQ + 8 * k) = v;
  }
  const int g = lane / 4, t = lane % 4;
  const int mi = lane / 8, ri = lane % 8;  // ldmatrix: this lane's matrix and row.
  const int wr0 = warp * 16 * kFaRb;       // The warp's first row in the job.
  float o[kFaRb][kOTiles][4];
#pragma unroll
  for (int rb = 0; rb < kFaRb; ++rb) {
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) o[rb][n][0] = o[rb][n][1] = o[rb][n][2] = o[rb][n][3] = 0.f;
  }
  // Rows g and g + 8 of each block: running maxima (raw scores) and sums (this lane's
  // columns only, summed over the row's lanes at the end). Exponents base 2 with the
  // scale folded in (one FMA and one MUFU op an element). Every row sees position 0 in
  // the first chunk, so the maxima are finite from then on, and masked scores (-inf)
  // give exp2 = 0.
  float m[kFaRb][2], l[kFaRb][2];
#pragma unroll
  for (int rb = 0; rb < kFaRb; ++rb) m[rb][0] = m[rb][1] = -INFINITY, l[rb][0] = l[rb][1] = 0.f;
  const float scale_log2 = a.scale * 1.4426950408889634f;
  const int len = p0 + rows;                             // Positions the last row sees.
  const int warp_len = min(len, p0 + wr0 + 16 * kFaRb);  // Those this warp's rows see.
  const int diag_c0 = p0 + wr0 - kFaCols + 1;  // Chunks from here on need the causal mask.
  // K and V of chunk c0 into buffer `buf` (positions past len as zeros), one commit group.
  auto load_chunk = [&](int c0, int buf) {
    for (int c = threadIdx.x; c < kFaCols * kChunks; c += kFaWarps * 32) {
      const int j = c / kChunks, k = c % kChunks;
      const int pos = min(c0 + j, len - 1);
      const int bytes = c0 + j < len ? 16 : 0;
      cp_async16_zfill(sK0 + (buf * kFaCols + j) * LQ + 8 * k, kc + pos * pos_stride + 8 * k,
                       bytes);
      cp_async16_zfill(sV0 + (buf * kFaCols + j) * LQ + 8 * k, vc + pos * pos_stride + 8 * k,
                       bytes);
    }
    cp_async_commit();
  };
  load_chunk(0, 0);
  for (int c0 = 0, buf = 0; c0 < len; c0 += kFaCols, buf ^= 1) {
    // The next chunk streams in while this one is computed; its buffer was last read in
    // the previous iteration, which the barrier at its end closed.
    if (c0 + kFaCols < len) {
      load_chunk(c0 + kFaCols, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* sK = sK0 + buf * kFaCols * LQ;
    const bf16* sV = sV0 + buf * kFaCols * LQ;
    // Warps whose rows all lie before this chunk (causal) or past the job's end skip it;
    // every thread still meets the one barrier below (a barrier inside the condition
    // would be divergent: compute-sanitizer's synccheck flags it).
    if (c0 < warp_len && wr0 < rows) {
      // S = Q K^T over the chunk: 8 blocks of 8 positions per row block.
      float sc[kFaRb][kSTiles][4];
#pragma unroll
      for (int rb = 0; rb < kFaRb; ++rb) {
#pragma unroll
        for (int j = 0; j < kSTiles; ++j)
          sc[rb][j][0] = sc[rb][j][1] = sc[rb][j][2] = sc[rb][j][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        // Q: rows (g, g + 8) x dims 16 kk + (2t, 2t + 8) of each row block.
        uint32_t qa[kFaRb][4];
#pragma unroll
        for (int rb = 0; rb < kFaRb; ++rb) {
          ldmatrix_x4(qa[rb],
                      sQ + (wr0 + 16 * rb + ri + 8 * (mi % 2)) * LQ + 16 * kk + 8 * (mi / 2));
        }
#pragma unroll
        for (int j = 0; j < kSTiles; j += 2) {
          // Matrices: positions 8j.., then 8(j + 1).. x dims 16 kk + (0, 8).
          uint32_t b[4];
          ldmatrix_x4(b, sK + (8 * (j + mi / 2) + ri) * LQ + 16 * kk + 8 * (mi % 2));
#pragma unroll
          for (int rb = 0; rb < kFaRb; ++rb) {
            mma_bf16_16816(sc[rb][j], qa[rb], b[0], b[1]);
            mma_bf16_16816(sc[rb][j + 1], qa[rb], b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int rb = 0; rb < kFaRb; ++rb) {
        // Online softmax on rows g (elements 0, 1) and g + 8 (2, 3) of block rb.
        const int prow0 = p0 + wr0 + 16 * rb + g, prow1 = prow0 + 8;
        if (c0 >= diag_c0) {
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
            const int col = c0 + 8 * j + 2 * t;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (col + e > prow0) sc[rb][j][e] = -INFINITY;
              if (col + e > prow1) sc[rb][j][2 + e] = -INFINITY;
            }
          }
        }
        // Maxima and sums as trees (four partial values a row), not one long chain.
        float pm0[4], pm1[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) pm0[q] = pm1[q] = -INFINITY;
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          pm0[j % 4] = fmaxf(pm0[j % 4], fmaxf(sc[rb][j][0], sc[rb][j][1]));
          pm1[j % 4] = fmaxf(pm1[j % 4], fmaxf(sc[rb][j][2], sc[rb][j][3]));
        }
        float mx0 = fmaxf(fmaxf(m[rb][0], fmaxf(pm0[0], pm0[1])), fmaxf(pm0[2], pm0[3]));
        float mx1 = fmaxf(fmaxf(m[rb][1], fmaxf(pm1[0], pm1[1])), fmaxf(pm1[2], pm1[3]));
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 *= 2) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        const float corr0 = fast_exp2((m[rb][0] - mx0) * scale_log2);  // 0 on the first chunk.
        const float corr1 = fast_exp2((m[rb][1] - mx1) * scale_log2);
        m[rb][0] = mx0, m[rb][1] = mx1;
        const float off0 = mx0 * scale_log2, off1 = mx1 * scale_log2;
        float ps0[4] = {0.f, 0.f, 0.f, 0.f}, ps1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            sc[rb][j][e] = fast_exp2(fmaf(sc[rb][j][e], scale_log2, -off0));
            sc[rb][j][2 + e] = fast_exp2(fmaf(sc[rb][j][2 + e], scale_log2, -off1));
            ps0[j % 4] += sc[rb][j][e];
            ps1[j % 4] += sc[rb][j][2 + e];
          }
        }
        l[rb][0] = l[rb][0] * corr0 + ((ps0[0] + ps0[1]) + (ps0[2] + ps0[3]));
        l[rb][1] = l[rb][1] * corr1 + ((ps1[0] + ps1[1]) + (ps1[2] + ps1[3]));
#pragma unroll
        for (int n = 0; n < kOTiles; ++n) {
          o[rb][n][0] *= corr0, o[rb][n][1] *= corr0;
          o[rb][n][2] *= corr1, o[rb][n][3] *= corr1;
        }
      }
      // O += P V: P's k-step kk is S blocks 2kk, 2kk + 1 as they lie in the registers.
#pragma unroll
      for (int kk = 0; kk < kFaCols / 16; ++kk) {
        uint32_t pf[kFaRb][4];
#pragma unroll
        for (int rb = 0; rb < kFaRb; ++rb) {
          pf[rb][0] = pack_bf16x2(sc[rb][2 * kk][0], sc[rb][2 * kk][1]);
          pf[rb][1] = pack_bf16x2(sc[rb][2 * kk][2], sc[rb][2 * kk][3]);
          pf[rb][2] = pack_bf16x2(sc[rb][2 * kk + 1][0], sc[rb][2 * kk + 1][1]);
          pf[rb][3] = pack_bf16x2(sc[rb][2 * kk + 1][2], sc[rb][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < kOTiles; n += 2) {
          // Matrices: positions 16 kk + (0, 8) x dims 8n, then 8(n + 1); transposed.
          uint32_t b[4];
          ldmatrix_x4_trans(b, sV + (16 * kk + ri + 8 * (mi % 2)) * LQ + 8 * n + 8 * (mi / 2));
#pragma unroll
          for (int rb = 0; rb < kFaRb; ++rb) {
            mma_bf16_16816(o[rb][n], pf[rb], b[0], b[1]);
            mma_bf16_16816(o[rb][n + 1], pf[rb], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // Every warp is done with buf (and Q) before they are refilled.
  }
  bf16* out = static_cast<bf16*>(a.out);
#pragma unroll
  for (int rb = 0; rb < kFaRb; ++rb) {
    float l0 = l[rb][0], l1 = l[rb][1];
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 *= 2) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
      l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
    }
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    const int r0 = wr0 + 16 * rb + g, r1 = r0 + 8;
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
      const int d = 8 * n + 2 * t;
      if (r0 < rows) {
        *reinterpret_cast<__nv_bfloat162*>(out + (static_cast<int64_t>(t0 + r0) * nq + h) * D + d) =
            __floats2bfloat162_rn(o[rb][n][0] * inv0, o[rb][n][1] * inv0);
      }
      if (r1 < rows) {
        *reinterpret_cast<__nv_bfloat162*>(out + (static_cast<int64_t>(t0 + r1) * nq + h) * D + d) =
            __floats2bfloat162_rn(o[rb][n][2] * inv1, o[rb][n][3] * inv1);
      }
    }
  }
}

// Block (pair of tiles, head): see fa_job. Thread i checks row i of the pair.
template <int D>
__global__ void __launch_bounds__(kFaWarps * 32, 2) attention_tile_kernel(AttentionArgs a) {
  constexpr int LQ = D + 8;
  extern __shared__ __align__(128) unsigned char fa_smem[];
  bf16* const sQ = reinterpret_cast<bf16*>(fa_smem);  // [kFaJobRows][LQ]
  bf16* const sK0 = sQ + kFaJobRows * LQ;             // [2][kFaCols][LQ]
  bf16* const sV0 = sK0 + 2 * kFaCols * LQ;           // [2][kFaCols][LQ]
  grid_dep_wait();
  grid_dep_launch();
  // Last pairs first: within a sequence they see the most positions (causal).
  const int pair = gridDim.x - 1 - blockIdx.x, h = blockIdx.y;
  const int t0 = pair * kFaJobRows, rows = min(kFaJobRows, a.num_tokens - t0);
  const int lo_rows = min(kFaRows, rows), hi_rows = rows - lo_rows;
  const int i = threadIdx.x;
  static_assert(kFaWarps * 32 == kFaJobRows, "a thread per row of the pair");
  // Whether row i of the pair continues the sequence of row `first` (0, or 64 for the
  // second tile) position by position, in the same KV slot.
  auto continues = [&](int first) {
    return i >= rows || (a.kv_slots[t0 + i] == a.kv_slots[t0 + first] &&
                         a.positions[t0 + i] == a.positions[t0 + first] + i - first);
  };
  const bool all = __syncthreads_and(continues(0));
  const bool lo = __syncthreads_and(i >= lo_rows || continues(0));
  const bool hi = hi_rows > 0 && __syncthreads_and(i < kFaRows || continues(kFaRows));
  if (h == 0 && threadIdx.x == 0) {
    a.split_scratch[2 * pair] = lo ? 1.f : 0.f;
    if (hi_rows > 0) a.split_scratch[2 * pair + 1] = hi ? 1.f : 0.f;
  }
  // Jobs: the whole pair, else each tile that is one sequence's (the second after the
  // first: one call site, one copy of the job's code).
  const int jobs = all ? 1 : static_cast<int>(lo) + static_cast<int>(hi);
  for (int jb = 0; jb < jobs; ++jb) {
    const bool second = jb == 1 || (!all && !lo);
    fa_job<D>(a, second ? t0 + kFaRows : t0,
              all      ? rows
              : second ? hi_rows
                       : lo_rows,
              h, sQ, sK0, sV0);
  }
}

// Decode on tensor cores (bf16, head_dim 64 or 128, up to 16 query heads a kv head; in
// prefill steps the rows no tile took: tile_done, split 1). A warp per (token, kv head,
// split): the kv head's query
// heads are the rows of one 16-row block (rows past the group zero), so each K and V
// row is read once for all of them, and read coalesced: the warp copies chunks of
// kGqaCols positions into its own two shared-memory buffers by cp.async (the next chunk
// in flight while this one is computed) and takes them by ldmatrix, S = Q K^T and
// O += P V on mma.sync as the prefill tiles do. Q's fragments stay in registers. Split sp
// takes chunks sp, sp + splits, ... and leaves (m, l, unnormalised O) of each head for
// attention_merge_kernel, as attention_kernel does; the split count is fixed by the
// token and head counts and the GPU (gqa_splits). kTwoRows: more than 8 heads a group (rows g + 8
// carry heads too).
constexpr int kGqaWarps = 2, kGqaCols = 32, kGqaMaxGroup = 16;
// The most warps a split step runs (the scratch it needs: attention_split_floats).
constexpr int64_t kGqaMaxWarps = 2048;
template <int D>
constexpr size_t gqa_smem_bytes() {  // Per warp: K and V, two buffers each.
  return static_cast<size_t>(kGqaWarps) * 4 * kGqaCols * (D + 8) * sizeof(bf16);
}

template <int D, bool kTwoRows>
__global__ void __launch_bounds__(kGqaWarps * 32)
    attention_gqa_kernel(AttentionArgs a, int splits, const float* tile_done) {
  constexpr int LQ = D + 8, kKSteps = D / 16, kSTiles = kGqaCols / 8, kOTiles = D / 8;
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row.
  extern __shared__ __align__(128) unsigned char gqa_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bf16* const sK0 = reinterpret_cast<bf16*>(gqa_smem) + warp * 4 * kGqaCols * LQ;  // [2][C][LQ]
  bf16* const sV0 = sK0 + 2 * kGqaCols * LQ;                                       // [2][C][LQ]
  const int nkv = a.num_kv_heads, group = a.num_q_heads / nkv;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kGqaWarps + warp;
  const int64_t kv_pair = task / splits;
  const int sp = static_cast<int>(task % splits);
  const bool active = kv_pair < static_cast<int64_t>(a.num_tokens) * nkv;
  const int t = active ? static_cast<int>(kv_pair / nkv) : 0;
  const int kvh = static_cast<int>(kv_pair % nkv);
  // The step's inputs before the wait (written before its first kernel).
  const int len = active ? a.positions[t] + 1 : 0;
  const int64_t kv_slot = active ? a.kv_slots[t] : 0;
  grid_dep_wait();
  grid_dep_launch();
  if (!active) return;
  if (tile_done != nullptr && tile_done[t / kFaRows] != 0.f) return;  // A tile's row.
  // Row r of the block is (token, head) pair row0 + r of q, out and the merge's scratch.
  const int64_t row0 = static_cast<int64_t>(t) * a.num_q_heads + static_cast<int64_t>(kvh) * group;
  if (splits > 1 && sp * kGqaCols >= len) {
    if (lane < group) {  // No positions in this split: the merge skips it.
      float* part = a.split_scratch + ((row0 + lane) * splits + sp) * (D + 2);
      part[0] = -FLT_MAX, part[1] = 0.f;
    }
    return;
  }
  const int g = lane / 4, tq = lane % 4;
  const int mi = lane / 8, ri = lane % 8;  // ldmatrix: this lane's matrix and row.
  // Q: rows (g, g + 8) x dims 16 kk + (2 tq, 2 tq + 8), straight from global memory.
  const bf16* q = static_cast<const bf16*>(a.q) + row0 * D;
  auto q2 = [&](int r, int d) {
    return r < group ? *reinterpret_cast<const uint32_t*>(q + r * D + d) : 0u;
  };
  uint32_t qa[kKSteps][4];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const int d = 16 * kk + 2 * tq;
    qa[kk][0] = q2(g, d);
    qa[kk][2] = q2(g, d + 8);
    qa[kk][1] = kTwoRows ? q2(g + 8, d) : 0u;
    qa[kk][3] = kTwoRows ? q2(g + 8, d + 8) : 0u;
  }
  const int64_t pos_stride = static_cast<int64_t>(nkv) * D;
  const int64_t base = kv_slot * a.max_seq_len * pos_stride + static_cast<int64_t>(kvh) * D;
  const bf16* kc = static_cast<const bf16*>(a.k_cache) + base;
  const bf16* vc = static_cast<const bf16*>(a.v_cache) + base;
  // K and V of chunk c0 into buffer `buf` (positions past len as zeros), one commit group.
  auto load_chunk = [&](int c0, int buf) {
#pragma unroll 4
    for (int c = lane; c < kGqaCols * kChunks; c += 32) {
      const int j = c / kChunks, k = c % kChunks;
      const int pos = min(c0 + j, len - 1);
      const int bytes = c0 + j < len ? 16 : 0;
      cp_async16_zfill(sK0 + (buf * kGqaCols + j) * LQ + 8 * k, kc + pos * pos_stride + 8 * k,
                       bytes);
      cp_async16_zfill(sV0 + (buf * kGqaCols + j) * LQ + 8 * k, vc + pos * pos_stride + 8 * k,
                       bytes);
    }
    cp_async_commit();
  };
  float o[kOTiles][4];
#pragma unroll
  for (int n = 0; n < kOTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // Rows g and g + 8: running maxima (raw scores) and this lane's part of the sums. Every
  // chunk a split takes has a position, so the maxima are finite after the first.
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  const float scale_log2 = a.scale * 1.4426950408889634f;
  const int stride = splits * kGqaCols;
  int c0 = sp * kGqaCols;
  load_chunk(c0, 0);
  for (int buf = 0; c0 < len; c0 += stride, buf ^= 1) {
    if (c0 + stride < len) {
      load_chunk(c0 + stride, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const bf16* sK = sK0 + buf * kGqaCols * LQ;
    const bf16* sV = sV0 + buf * kGqaCols * LQ;
    float sc[kSTiles][4];
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int j = 0; j < kSTiles; j += 2) {
        // Matrices: positions 8j.., then 8(j + 1).. x dims 16 kk + (0, 8).
        uint32_t b[4];
        ldmatrix_x4(b, sK + (8 * (j + mi / 2) + ri) * LQ + 16 * kk + 8 * (mi % 2));
        mma_bf16_16816(sc[j], qa[kk], b[0], b[1]);
        mma_bf16_16816(sc[j + 1], qa[kk], b[2], b[3]);
      }
    }
    if (c0 + kGqaCols > len) {  // The context's last chunk: positions past it masked.
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (c0 + 8 * j + 2 * tq + e >= len) sc[j][e] = sc[j][2 + e] = -INFINITY;
        }
      }
    }
    // Online softmax of row g (elements 0, 1) and, with kTwoRows, g + 8 (2, 3); a row's
    // four lanes reduce by shuffles.
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
      mx0 = fmaxf(mx0, fmaxf(sc[j][0], sc[j][1]));
      if (kTwoRows) mx1 = fmaxf(mx1, fmaxf(sc[j][2], sc[j][3]));
    }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 *= 2) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
      if (kTwoRows) mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
    }
    const float corr0 = fast_exp2((m0 - mx0) * scale_log2);  // 0 on the first chunk.
    const float corr1 = kTwoRows ? fast_exp2((m1 - mx1) * scale_log2) : 0.f;
    m0 = mx0, m1 = mx1;
    const float off0 = mx0 * scale_log2, off1 = mx1 * scale_log2;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[j][e] = fast_exp2(fmaf(sc[j][e], scale_log2, -off0));
        ps0 += sc[j][e];
        sc[j][2 + e] = kTwoRows ? fast_exp2(fmaf(sc[j][2 + e], scale_log2, -off1)) : 0.f;
        ps1 += sc[j][2 + e];
      }
    }
    l0 = l0 * corr0 + ps0;
    l1 = l1 * corr1 + ps1;
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
      o[n][0] *= corr0, o[n][1] *= corr0;
      o[n][2] *= corr1, o[n][3] *= corr1;
    }
    // O += P V: P's k-step kk is S blocks 2kk, 2kk + 1 as they lie in the registers.
#pragma unroll
    for (int kk = 0; kk < kGqaCols / 16; ++kk) {
      uint32_t pf[4];
      pf[0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
      pf[1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
      pf[2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pf[3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < kOTiles; n += 2) {
        // Matrices: positions 16 kk + (0, 8) x dims 8n, then 8(n + 1); transposed.
        uint32_t b[4];
        ldmatrix_x4_trans(b, sV + (16 * kk + ri + 8 * (mi % 2)) * LQ + 8 * n + 8 * (mi / 2));
        mma_bf16_16816(o[n], pf, b[0], b[1]);
        mma_bf16_16816(o[n + 1], pf, b[2], b[3]);
      }
    }
    __syncwarp();  // Every lane is done with buf before it is refilled.
  }
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
  }
  // Row r's results (its m, l and O elements e, e + 1 of each 8-column block).
  auto store_row = [&](int r, float m, float l, int e) {
    if (r >= group) return;
    if (splits > 1) {
      // The merge's softmax is base e over scaled scores: m raw times the scale.
      float* part = a.split_scratch + ((row0 + r) * splits + sp) * (D + 2);
      if (tq == 0) part[0] = m * a.scale, part[1] = l;
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) {
        *reinterpret_cast<float2*>(part + 2 + 8 * n + 2 * tq) = make_float2(o[n][e], o[n][e + 1]);
      }
      return;
    }
    bf16* out = static_cast<bf16*>(a.out) + (row0 + r) * D;
    const float inv = 1.0f / l;
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
      *reinterpret_cast<__nv_bfloat162*>(out + 8 * n + 2 * tq) =
          __floats2bfloat162_rn(o[n][e] * inv, o[n][e + 1] * inv);
    }
  };
  store_row(g, m0, l0, 0);
  if (kTwoRows) store_row(g + 8, m1, l1, 2);
}

// Splits of attention_kernel: steps of few (token, head) pairs until about
// kSplitTargetWarps warps run, as scratch allows.
int warp_splits(const AttentionArgs& a) {
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  if (a.split_scratch == nullptr || pairs <= 0 || pairs >= kSplitTargetWarps) return 1;
  int splits =
      static_cast<int>(std::min<int64_t>(kMaxSplits, (kSplitTargetWarps + pairs - 1) / pairs));
  while (splits > 1 && pairs * splits * (a.head_dim + 2) > a.split_capacity) --splits;
  return splits;
}

// Whether a bf16 step of head_dim 64 / 128 runs attention_gqa_kernel (for every row, or
// the rows no prefill tile took): up to kGqaMaxGroup query heads a kv head.
// FLEXPERT_NO_GQA_ATTENTION=1: a warp per (token, head) instead (for comparisons).
bool gqa_ok(const AttentionArgs& a) {
  const bool off = knobs().no_gqa_attention;
  return !off && a.num_q_heads / a.num_kv_heads <= kGqaMaxGroup;
}

// Warps of attention_gqa_kernel<D, kTwoRows> the GPU holds at once (blocks an SM by
// registers and shared memory, times the SMs). Asked once per process: the processes of
// a group each drive GPUs of one kind.
template <int D, bool kTwoRows>
int64_t gqa_resident_warps() {
  static const int64_t warps = [] {
    int device = 0, sms = 0, blocks = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        ensure_smem_limit<attention_gqa_kernel<D, kTwoRows>>(gqa_smem_bytes<D>()) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, attention_gqa_kernel<D, kTwoRows>,
                                                      kGqaWarps * 32,
                                                      gqa_smem_bytes<D>()) != cudaSuccess ||
        blocks < 1) {
      (void)cudaGetLastError();
      return int64_t{1024};
    }
    return int64_t{sms} * blocks * kGqaWarps;
  }();
  return warps;
}

// Splits of attention_gqa_kernel. A warp's work shrinks as 1 / splits and the warps run
// in waves of the resident count R, so the step takes about ceil(pairs x splits / R) /
// splits; each split also writes its partial softmaxes for the merge. So: the fewest
// splits within 5 % of the least of that, up to kMaxSplits and 2R warps, as scratch
// allows. (On the H200, context 2048: a fixed target of 1024 warps ran batch 64 as 1.3
// waves of 792, 84 us at 68 % of the HBM bandwidth, one wave of 768 takes 75 us; the
// least cost alone split batch 16 37 ways in 3 waves, slower than 16 in 1.3.)
int gqa_splits(const AttentionArgs& a) {
  const int64_t kv_pairs = static_cast<int64_t>(a.num_tokens) * a.num_kv_heads;
  const int64_t q_pairs = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  if (a.split_scratch == nullptr || kv_pairs <= 0) return 1;
  const bool two_rows = a.num_q_heads / a.num_kv_heads > 8;
  const int64_t r =
      a.head_dim == 64
          ? (two_rows ? gqa_resident_warps<64, true>() : gqa_resident_warps<64, false>())
          : (two_rows ? gqa_resident_warps<128, true>() : gqa_resident_warps<128, false>());
  double cost[kMaxSplits + 1];
  int most = 1;
  cost[1] = static_cast<double>((kv_pairs + r - 1) / r);
  double least = cost[1];
  for (int splits = 2; splits <= kMaxSplits; ++splits) {
    const int64_t warps = kv_pairs * splits;
    if (warps > std::min(2 * r, kGqaMaxWarps) ||
        q_pairs * splits * (a.head_dim + 2) > a.split_capacity) {
      break;
    }
    cost[splits] = static_cast<double>((warps + r - 1) / r) / splits;
    least = std::min(least, cost[splits]);
    most = splits;
  }
  int splits = 1;
  while (splits < most && cost[splits] > 1.05 * least) ++splits;
  return splits;
}

template <int D, bool kTwoRows>
cudaError_t launch_gqa(const AttentionArgs& a, int splits, const float* tile_done,
                       cudaStream_t stream) {
  if (const cudaError_t e =
          ensure_smem_limit<attention_gqa_kernel<D, kTwoRows>>(gqa_smem_bytes<D>());
      e != cudaSuccess) {
    return e;
  }
  const int64_t warps = static_cast<int64_t>(a.num_tokens) * a.num_kv_heads * splits;
  const unsigned blocks = static_cast<unsigned>((warps + kGqaWarps - 1) / kGqaWarps);
  return launch_pdl(attention_gqa_kernel<D, kTwoRows>, dim3(blocks), dim3(kGqaWarps * 32),
                    gqa_smem_bytes<D>(), stream, a, splits, tile_done);
}

// What a step runs: prefill tiles first (bf16, head_dim 64 / 128, AttentionArgs::tiles,
// steps of enough (token, head) pairs for one warp each; the tile flags take the
// scratch, so no splits), then the GQA kernel or a warp per (token, head) for the rest.
struct Plan {
  bool tiles = false, gqa = false;
  int splits = 1;
};
Plan plan(DType dtype, const AttentionArgs& a) {
  const bool no_tiles = knobs().no_attention_tiles;
  const bool tensor_cores = dtype == DType::kBF16 && (a.head_dim == 64 || a.head_dim == 128);
  const int64_t tiles = (a.num_tokens + kFaRows - 1) / kFaRows;
  const int warp_split = warp_splits(a);
  Plan p;
  p.tiles = tensor_cores && a.tiles && !no_tiles && warp_split == 1 && a.split_scratch != nullptr &&
            tiles <= a.split_capacity;
  p.gqa = tensor_cores && gqa_ok(a);
  p.splits = p.tiles ? 1 : p.gqa ? gqa_splits(a) : warp_split;
  return p;
}

template <typename T, int D>
cudaError_t launch_dim(const AttentionArgs& a, cudaStream_t stream) {
  const Plan p = plan(std::is_same_v<T, bf16> ? DType::kBF16 : DType::kF32, a);
  const int64_t pairs = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  const unsigned merge_blocks = static_cast<unsigned>((pairs + kWarps - 1) / kWarps);
  const float* tile_done = nullptr;
  cudaError_t err = cudaSuccess;
  if constexpr (std::is_same_v<T, bf16> && (D == 64 || D == 128)) {
    if (p.tiles) {
      if (const cudaError_t e = ensure_smem_limit<attention_tile_kernel<D>>(fa_smem_bytes<D>());
          e != cudaSuccess) {
        return e;
      }
      const int tile_pairs = (a.num_tokens + kFaJobRows - 1) / kFaJobRows;
      err = launch_pdl(attention_tile_kernel<D>, dim3(tile_pairs, a.num_q_heads),
                       dim3(kFaWarps * 32), fa_smem_bytes<D>(), stream, a);
      if (err != cudaSuccess) return err;
      tile_done = a.split_scratch;
    }
    if (p.gqa) {
      err = a.num_q_heads / a.num_kv_heads > 8
                ? launch_gqa<D, true>(a, p.splits, tile_done, stream)
                : launch_gqa<D, false>(a, p.splits, tile_done, stream);
    }
  }
  if (!p.gqa) {
    const unsigned blocks = static_cast<unsigned>((pairs * p.splits + kWarps - 1) / kWarps);
    err = launch_pdl(attention_kernel<T, D>, dim3(blocks), dim3(kWarps * 32), 0, stream, a,
                     p.splits, tile_done);
  }
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_pdl(attention_merge_kernel<T, D>, dim3(merge_blocks), dim3(kWarps * 32), 0, stream,
                    a, p.splits);
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

int64_t attention_split_floats(int head_dim, int num_q_heads, int num_kv_heads) {
  // attention_kernel: splits > 1 only below its target, so pairs * splits < 2 * target;
  // the GQA kernel: at most kGqaMaxWarps (token, kv head, split) warps of `group` heads.
  const int64_t group = num_q_heads / std::max(1, num_kv_heads);
  return std::max<int64_t>(2 * kSplitTargetWarps, kGqaMaxWarps * group) * (head_dim + 2);
}

int attention_splits(DType dtype, const AttentionArgs& a) { return plan(dtype, a).splits; }

cudaError_t attention(DType dtype, const AttentionArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  if (args.num_kv_heads < 1 || args.num_q_heads % args.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  FLEX_DISPATCH_DTYPE(dtype, return launch<T>(args, stream));
  return cudaSuccess;
}

}  // namespace flexpert::cuda
