// SPDX-License-Identifier: Apache-2.0
// Grouped expert GEMMs (grouped_gemm.h).
// NOTE: the mma.sync tiles use ldmatrix and a 4-stage cp.async pipeline; rows of a
// shared-memory tile are padded by 16 bytes so ldmatrix reads are free of bank
// conflicts. The Hopper tiles (wgmma_gemm.cu) serve sm_90a: kWgmmaWs64 from a quarter
// row per expert up, kWgmmaWs128 above 48.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <vector>

#include "cuda/device_util.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/mma_sync.cuh"

namespace flexpert::cuda {
namespace {

__device__ __forceinline__ void store2(bf16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
struct MmaConfig {
  static constexpr int kBM = BM, kBN = BN, kBK = BK, kStages = STAGES;
  static constexpr int kWarpsM = WARPS_M, kWarpsN = WARPS_N;
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kLds = BK + 8;  // Padded smem row, in elements.
  static constexpr size_t kSmemBytes = static_cast<size_t>(STAGES) * (BM + BN) * kLds * 2;
};

using Mma16 = MmaConfig<16, 64, 64, 1, 4, 6>;  // Deep pipeline: decode is bandwidth-bound.
using Mma64 = MmaConfig<64, 128, 32, 2, 2, 4>;
using Mma128 = MmaConfig<128, 128, 32, 2, 4, 4>;
using Mma16N32 = MmaConfig<16, 32, 64, 1, 2, 6>;
using Mma16K128 = MmaConfig<16, 64, 128, 1, 4, 4>;

template <typename C>
__global__ void __launch_bounds__(C::kThreads) mma_gemm_kernel(const GroupedGemmArgs g) {
  constexpr int BM = C::kBM, BN = C::kBN, BK = C::kBK, STAGES = C::kStages, LDS = C::kLds;
  constexpr int kThreads = C::kThreads;
  constexpr int WM = BM / C::kWarpsM, WN = BN / C::kWarpsN;
  constexpr int MI = WM / 16, NI = WN / 8;
  constexpr int kChunks = BK / 8;  // 16-byte chunks per tile row.
  constexpr int kAPer = BM * kChunks / kThreads;
  constexpr int kBPer = BN * kChunks / kThreads;
  static_assert(BM * kChunks % kThreads == 0 && BN * kChunks % kThreads == 0, "load split");
  static_assert(NI % 2 == 0 && WM % 16 == 0 && BK % 16 == 0, "warp tile");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sa = reinterpret_cast<bf16*>(smem_raw);
  bf16* sb = sa + STAGES * BM * LDS;

  const int tile = blockIdx.x;
  if (tile >= *g.num_tiles) return;
  const int slot = g.tile_slot[tile];
  const int row0 = g.tile_row0[tile];
  const int row_end = g.offsets[slot + 1];
  const int n0 = blockIdx.y * BN;
  const int K = g.k;
  const int tid = threadIdx.x;
  const bf16* A = static_cast<const bf16*>(g.a);
  const bf16* B = static_cast<const bf16*>(g.weights) + slot * g.slot_stride + g.weight_offset +
                  static_cast<int64_t>(n0) * K;

  // Each thread copies fixed 16-byte chunks of every stage; rows past the slot's
  // end re-read its last row (their results are never stored).
  const bf16* a_src[kAPer];
  int a_dst[kAPer];
#pragma unroll
  for (int i = 0; i < kAPer; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunks, col = (c % kChunks) * 8;
    const int r = min(row0 + row, row_end - 1);
    const int src = g.gather != nullptr ? g.gather[r] / g.gather_div : r;
    a_src[i] = A + static_cast<int64_t>(src) * K + col;
    a_dst[i] = row * LDS + col;
  }
  const bf16* b_src[kBPer];
  int b_dst[kBPer];
#pragma unroll
  for (int i = 0; i < kBPer; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunks, col = (c % kChunks) * 8;
    b_src[i] = B + static_cast<int64_t>(row) * K + col;
    b_dst[i] = row * LDS + col;
  }
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * BK;
    bf16* a_s = sa + stage * BM * LDS;
    bf16* b_s = sb + stage * BN * LDS;
#pragma unroll
    for (int i = 0; i < kAPer; ++i) cp_async16(a_s + a_dst[i], a_src[i] + k0);
#pragma unroll
    for (int i = 0; i < kBPer; ++i) cp_async16(b_s + b_dst[i], b_src[i] + k0);
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

  const int num_k_tiles = K / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / C::kWarpsN, wn = warp % C::kWarpsN;
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // Stage kt landed for all; stage kt - 1 is free to refill.
    const int next = kt + STAGES - 1;
    if (next < num_k_tiles) load_stage(next % STAGES, next);
    cp_async_commit();
    const bf16* a_s = sa + (kt % STAGES) * BM * LDS;
    const bf16* b_s = sb + (kt % STAGES) * BN * LDS;
    warp_tile_mma<MI, NI, BK>(acc, a_s, b_s, LDS, wm * WM, wn * WN, lane);
  }
  cp_async_wait<0>();

  // Accumulator layout of m16n8: c0, c1 at (row g, cols 2q, 2q + 1); c2, c3 at row g + 8.
  const int g8 = lane / 4, q = lane % 4;
  bf16* out = static_cast<bf16*>(g.out);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + wm * WM + mi * 16 + g8 + half * 8;
      if (r >= row_end) continue;
      if (g.swiglu) {
        bf16* o = out + static_cast<int64_t>(r) * (g.n / 2);
#pragma unroll
        for (int nj = 0; nj < NI; nj += 2) {
          const int gn = n0 + wn * WN + nj * 8;  // A multiple of 16: gate block, then up block.
          const int i = (gn / 16) * 8 + 2 * q;
          const float* gate = &acc[mi][nj][half * 2];
          const float* up = &acc[mi][nj + 1][half * 2];
          store2(o + i, silu(gate[0]) * up[0], silu(gate[1]) * up[1]);
        }
      } else {
        bf16* o = out + static_cast<int64_t>(r) * g.n;
#pragma unroll
        for (int nj = 0; nj < NI; ++nj) {
          store2(o + n0 + wn * WN + nj * 8 + 2 * q, acc[mi][nj][half * 2],
                 acc[mi][nj][half * 2 + 1]);
        }
      }
    }
  }
}

// The decode kernel: tiles of at most kGemvRows rows (tokens) of one slot; each
// warp owns a pair of weight rows (swiglu: a gate row and its up row; plain: rows
// 2p, 2p + 1) and streams them whole, kGemvChunks 16-byte loads per lane per row in
// flight, with the tile's token rows read through L1. No shared memory: occupancy,
// hence bytes in flight per SM, is bounded by registers alone.
constexpr int kGemvRows = 4, kGemvWarps = 4, kGemvChunks = 8;

__global__ void __launch_bounds__(kGemvWarps * 32) gemv_gemm_kernel(const GroupedGemmArgs g) {
  const int tile = blockIdx.x;
  if (tile >= *g.num_tiles) return;
  const int slot = g.tile_slot[tile];
  const int row0 = g.tile_row0[tile];
  const int nrows = min(kGemvRows, g.offsets[slot + 1] - row0);
  const int K = g.k, kc = K / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int p = blockIdx.y * kGemvWarps + warp;
  const int w_row0 = g.swiglu ? (p / 8) * 16 + p % 8 : 2 * p;
  const int w_row1 = g.swiglu ? w_row0 + 8 : w_row0 + 1;
  const bf16* W = static_cast<const bf16*>(g.weights) + slot * g.slot_stride + g.weight_offset;
  const uint4* w0p = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(w_row0) * K);
  const uint4* w1p = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(w_row1) * K);
  const bf16* A = static_cast<const bf16*>(g.a);
  const uint4* a_rows[kGemvRows];
#pragma unroll
  for (int t = 0; t < kGemvRows; ++t) {
    const int r = row0 + min(t, nrows - 1);
    const int src = g.gather != nullptr ? g.gather[r] / g.gather_div : r;
    a_rows[t] = reinterpret_cast<const uint4*>(A + static_cast<int64_t>(src) * K);
  }
  float acc0[kGemvRows], acc1[kGemvRows];
#pragma unroll
  for (int t = 0; t < kGemvRows; ++t) acc0[t] = acc1[t] = 0.f;
  for (int c0 = 0; c0 < kc; c0 += 32 * kGemvChunks) {
    uint4 w0[kGemvChunks], w1[kGemvChunks];
#pragma unroll
    for (int u = 0; u < kGemvChunks; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < kc) {
        w0[u] = __ldg(w0p + c);
        w1[u] = __ldg(w1p + c);
      } else {
        w0[u] = w1[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kGemvChunks; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < kc) {
        float f0[8], f1[8];
        bf16x8(w0[u], f0);
        bf16x8(w1[u], f1);
#pragma unroll
        for (int t = 0; t < kGemvRows; ++t) {
          if (t < nrows) {
            float a[8];
            bf16x8(__ldg(a_rows[t] + c), a);
            acc0[t] += dot8(f0, a);
            acc1[t] += dot8(f1, a);
          }
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kGemvRows; ++t) {
    acc0[t] = warp_sum(acc0[t]);
    acc1[t] = warp_sum(acc1[t]);
  }
  if (lane != 0) return;
  bf16* out = static_cast<bf16*>(g.out);
#pragma unroll
  for (int t = 0; t < kGemvRows; ++t) {
    if (t >= nrows) break;
    const int64_t r = row0 + t;
    if (g.swiglu) {
      out[r * (g.n / 2) + p] = __float2bfloat16_rn(silu(acc0[t]) * acc1[t]);
    } else {
      store2(out + r * g.n + 2 * p, acc0[t], acc1[t]);
    }
  }
}

// The plain f32-accumulating kernel: 64 x 64 tiles, 4 x 4 outputs per thread.
// A thread's columns are {c, c + 1, c + 8, c + 9} within a 16-column block, so a
// swiglu gate and its up land in the same thread.
constexpr int kSimtBM = 64, kSimtBN = 64, kSimtBK = 16;

template <typename T>
__global__ void __launch_bounds__(256) simt_gemm_kernel(const GroupedGemmArgs g) {
  __shared__ float sa[kSimtBK][kSimtBM + 1];
  __shared__ float sb[kSimtBK][kSimtBN + 1];
  const int tile = blockIdx.x;
  if (tile >= *g.num_tiles) return;
  const int slot = g.tile_slot[tile];
  const int row0 = g.tile_row0[tile];
  const int row_end = g.offsets[slot + 1];
  const int n0 = blockIdx.y * kSimtBN;
  const int N = g.n, K = g.k;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const T* A = static_cast<const T*>(g.a);
  const T* B = static_cast<const T*>(g.weights) + slot * g.slot_stride + g.weight_offset;
  const int base = (tx / 4) * 16 + (tx % 4) * 2;
  const int cols[4] = {base, base + 1, base + 8, base + 9};
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += kSimtBK) {
    for (int e = tid; e < kSimtBM * kSimtBK; e += 256) {
      const int row = e / kSimtBK, kk = e % kSimtBK, k = k0 + kk;
      const int r = min(row0 + row, row_end - 1);
      const int src = g.gather != nullptr ? g.gather[r] / g.gather_div : r;
      sa[kk][row] = k < K ? to_f32(A[static_cast<int64_t>(src) * K + k]) : 0.f;
    }
    for (int e = tid; e < kSimtBN * kSimtBK; e += 256) {
      const int n = e / kSimtBK, kk = e % kSimtBK, k = k0 + kk, gn = n0 + n;
      sb[kk][n] = (gn < N && k < K) ? to_f32(B[static_cast<int64_t>(gn) * K + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtBK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = sa[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = sb[kk][cols[j]];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
  T* out = static_cast<T*>(g.out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + ty * 4 + i;
    if (r >= row_end) continue;
    if (g.swiglu) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int gc = n0 + cols[j];
        if (gc < N) {
          out[static_cast<int64_t>(r) * (N / 2) + (gc / 16) * 8 + gc % 16] =
              from_f32<T>(silu(acc[i][j]) * acc[i][j + 2]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int gc = n0 + cols[j];
        if (gc < N) out[static_cast<int64_t>(r) * N + gc] = from_f32<T>(acc[i][j]);
      }
    }
  }
}

template <typename C>
cudaError_t launch_mma(const GroupedGemmArgs& g, cudaStream_t stream) {
  const cudaError_t err = ensure_smem_limit<mma_gemm_kernel<C>>(C::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(g.max_tiles, g.n / C::kBN);
  mma_gemm_kernel<C><<<grid, C::kThreads, C::kSmemBytes, stream>>>(g);
  return cudaGetLastError();
}

template <typename C>
bool mma_fits(int n, int k) {
  return n % C::kBN == 0 && k % C::kBK == 0;
}

}  // namespace

const char* tile_name(GemmTile tile) {
  switch (tile) {
    case GemmTile::kSimt:
      return "simt";
    case GemmTile::kMma16:
      return "mma16";
    case GemmTile::kMma64:
      return "mma64";
    case GemmTile::kMma128:
      return "mma128";
    case GemmTile::kMma16N32:
      return "mma16n32";
    case GemmTile::kWgmma64:
      return "wgmma64";
    case GemmTile::kWgmma128:
      return "wgmma128";
    case GemmTile::kMma16K128:
      return "mma16k128";
    case GemmTile::kGemv:
      return "gemv";
    case GemmTile::kWgmma128N256:
      return "wgmma128n256";
    case GemmTile::kWgmmaWs128:
      return "ws128";
    case GemmTile::kWgmmaWs64:
      return "ws64";
    case GemmTile::kWgmmaPp128:
      return "pp128";
    case GemmTile::kWgmmaWs128Pp:
      return "ws128pp";
  }
  return "?";
}

int tile_rows(GemmTile tile) {
  switch (tile) {
    case GemmTile::kGemv:
      return kGemvRows;
    case GemmTile::kMma16:
    case GemmTile::kMma16N32:
    case GemmTile::kMma16K128:
      return 16;
    case GemmTile::kMma64:
    case GemmTile::kWgmma64:
    case GemmTile::kWgmmaWs64:
      return 64;
    case GemmTile::kMma128:
    case GemmTile::kWgmma128:
    case GemmTile::kWgmma128N256:
    case GemmTile::kWgmmaWs128:
    case GemmTile::kWgmmaPp128:
    case GemmTile::kWgmmaWs128Pp:
      return 128;
    case GemmTile::kSimt:
      break;
  }
  return kSimtBM;
}

bool tile_supports(GemmTile tile, DType dtype, int n, int k) {
  if (tile == GemmTile::kSimt) return dtype == DType::kF32 || dtype == DType::kBF16;
  if (dtype != DType::kBF16) return false;
  switch (tile) {
    case GemmTile::kMma16:
      return mma_fits<Mma16>(n, k);
    case GemmTile::kMma64:
      return mma_fits<Mma64>(n, k);
    case GemmTile::kMma128:
      return mma_fits<Mma128>(n, k);
    case GemmTile::kMma16N32:
      return mma_fits<Mma16N32>(n, k);
    case GemmTile::kMma16K128:
      return mma_fits<Mma16K128>(n, k);
    case GemmTile::kWgmma64:
    case GemmTile::kWgmma128:
    case GemmTile::kWgmmaPp128:
      return wgmma_fits(n, k, 128) && wgmma_available();
    case GemmTile::kWgmma128N256:
    case GemmTile::kWgmmaWs128:
    case GemmTile::kWgmmaWs64:
    case GemmTile::kWgmmaWs128Pp:
      return wgmma_fits(n, k, 256) && wgmma_available();
    case GemmTile::kGemv:
      return n % (2 * kGemvWarps) == 0 && n % 16 == 0 && k % 8 == 0;
    case GemmTile::kSimt:
      break;
  }
  return false;
}

namespace {

bool fits_both(GemmTile tile, DType dtype, int hidden, int inter) {
  return tile_supports(tile, dtype, 2 * inter, hidden) && tile_supports(tile, dtype, hidden, inter);
}

}  // namespace

GemmTile choose_tile(DType dtype, int64_t num_pairs, int num_experts, int hidden, int inter) {
  if (dtype != DType::kBF16) return GemmTile::kSimt;
  const double rows_per_expert =
      static_cast<double>(num_pairs) / static_cast<double>(num_experts > 0 ? num_experts : 1);
  // Preference order by expected rows per expert (from the tile sweep of
  // bench/moe_layer_bench on an H200); the first tile that fits the shapes wins.
  std::vector<GemmTile> order;
  if (rows_per_expert <= 0.25) {
    order = {GemmTile::kGemv, GemmTile::kMma16K128, GemmTile::kMma16, GemmTile::kMma64};
  } else if (rows_per_expert <= 48) {
    // From a quarter row per expert up (H200: Qwen3 16 tokens 213 vs 231 us for
    // wgmma64, DeepSeek-V3 16 tokens 2077 vs 2194 us).
    order = {GemmTile::kWgmmaWs64, GemmTile::kWgmma64, GemmTile::kMma16K128, GemmTile::kMma16,
             GemmTile::kMma64};
  } else {
    // ws128 for both projections: since its epilogue overlaps the next unit (TMA
    // stores, dynamic units) it also beats the ping-pong down projection, which won
    // before for Qwen3 (H200 down: 2048 tokens 150 against 172 us, 4096 228 against
    // 278, 16384 774 against 888).
    order = {GemmTile::kWgmmaWs128, GemmTile::kWgmma128N256, GemmTile::kWgmma128,
             GemmTile::kWgmma64,    GemmTile::kMma128,       GemmTile::kMma64,
             GemmTile::kMma16};
  }
  for (GemmTile t : order) {
    if (fits_both(t, dtype, hidden, inter)) return t;
  }
  return GemmTile::kSimt;
}

int max_tiles(int64_t num_pairs, int num_slots, int block_m) {
  const int64_t bound =
      (num_pairs + block_m - 1) / block_m + (num_pairs < num_slots ? num_pairs : num_slots);
  return static_cast<int>(bound);
}

cudaError_t grouped_gemm(DType dtype, GemmTile tile, const GroupedGemmArgs& args,
                         cudaStream_t stream) {
  if (args.max_tiles == 0) return cudaSuccess;
  if (!tile_supports(tile, dtype, args.n, args.k) || (args.swiglu && args.n % 16 != 0)) {
    return cudaErrorInvalidValue;
  }
  switch (tile) {
    case GemmTile::kMma16:
      return launch_mma<Mma16>(args, stream);
    case GemmTile::kMma64:
      return launch_mma<Mma64>(args, stream);
    case GemmTile::kMma128:
      return launch_mma<Mma128>(args, stream);
    case GemmTile::kMma16N32:
      return launch_mma<Mma16N32>(args, stream);
    case GemmTile::kMma16K128:
      return launch_mma<Mma16K128>(args, stream);
    case GemmTile::kWgmma64:
      return launch_wgmma_gemm(1, 128, args, stream);
    case GemmTile::kWgmma128:
      return launch_wgmma_gemm(2, 128, args, stream);
    case GemmTile::kWgmma128N256:
      return launch_wgmma_gemm(2, 256, args, stream);
    case GemmTile::kWgmmaWs128:
      return launch_wgmma_ws_gemm(128, args, stream);
    case GemmTile::kWgmmaWs64:
      return launch_wgmma_ws_gemm(64, args, stream);
    case GemmTile::kWgmmaPp128:
      return launch_wgmma_pp_gemm(args, stream);
    case GemmTile::kWgmmaWs128Pp:
      return args.gather != nullptr ? launch_wgmma_ws_gemm(128, args, stream)
                                    : launch_wgmma_pp_gemm(args, stream);
    case GemmTile::kGemv: {
      const dim3 grid(args.max_tiles, args.n / (2 * kGemvWarps));
      gemv_gemm_kernel<<<grid, kGemvWarps * 32, 0, stream>>>(args);
      return cudaGetLastError();
    }
    case GemmTile::kSimt:
      break;
  }
  const dim3 grid(args.max_tiles, (args.n + kSimtBN - 1) / kSimtBN);
  FLEX_DISPATCH_DTYPE(dtype, simt_gemm_kernel<T><<<grid, 256, 0, stream>>>(args));
  return cudaGetLastError();
}

}  // namespace flexpert::cuda
