// SPDX-License-Identifier: Apache-2.0
// The FP8 expert kernels (fp8_experts.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/device_util.cuh"
#include "cuda/fp8_experts.h"
#include "cuda/mma_sync.cuh"

namespace flexpert::cuda {
namespace {

// 8 e4m3 values (little-endian bytes of v, element 0 first) as f32.
__device__ __forceinline__ void e4m3x8(const uint2& v, float (&f)[8]) {
  const uint32_t words[2] = {v.x, v.y};
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((words[w] >> (16 * j)) & 0xffffu);
      const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
      const float2 x = __half22float2(h);
      f[4 * w + 2 * j] = x.x;
      f[4 * w + 2 * j + 1] = x.y;
    }
  }
}

__device__ __forceinline__ const uint8_t* slot_base(const Fp8Weights& w, int slot) {
  return static_cast<const uint8_t*>(w.slots) + static_cast<int64_t>(slot) * w.slot_bytes;
}

// The scale row of weight row `row` (interleaved gate/up rows map back to their gate or up row).
__device__ __forceinline__ int scale_row(const Fp8Weights& w, int row) {
  if (w.up_scale_row0 == 0) return row / kFp8BlockSize;
  const int b = row / 16, r = row % 16;
  const int orig = 8 * b + (r & 7);
  return (r < 8 ? 0 : w.up_scale_row0) + orig / kFp8BlockSize;
}

// One lane's 8 columns of a 128-column block (16 lanes a block, lanes 16-aligned in their
// warp) quantized to e4m3 with the block's scale (absmax / 448): both kernels below.
__device__ __forceinline__ float quantize8(const float f[8], uint32_t words[2]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int off = 8; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float inv = amax > 0.f ? 448.f / amax : 0.f;
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * w] * inv, f[4 * w + 1] * inv),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(f[4 * w + 2] * inv, f[4 * w + 3] * inv), __NV_SATFINITE, __NV_E4M3);
    words[w] = lo | (hi << 16);
  }
  return amax / 448.f;
}

// This lane's 8 columns at c of bf16 x (zeros past k), quantized as fp8_quantize_rows does
// (the 16 lanes of a half-warp hold one 128-column block), as their values code *
// scale in f32: the decode kernels compute on the activations FP8 wgmma sees.
__device__ __forceinline__ void quantized8(const bf16* x, int c, int k, float (&xf)[8]) {
  float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (c < k) bf16x8(*reinterpret_cast<const uint4*>(x + c), f);
  uint32_t words[2];
  const float scale = quantize8(f, words);
  e4m3x8(make_uint2(words[0], words[1]), xf);
#pragma unroll
  for (int i = 0; i < 8; ++i) xf[i] *= scale;
}

// sum over columns of row w_row (e4m3, scales per 128 columns of scale_row) times x (bf16,
// quantized by quantized8), this lane's share (columns 8 lane + 256 j); reduce over the warp
// afterwards. Every lane runs every iteration (quantized8's shuffles).
__device__ __forceinline__ float lane_dot(const uint8_t* w_row, const float* scales, const bf16* x,
                                          int k, int lane) {
  float acc = 0.f;
  for (int c0 = 0; c0 < k; c0 += 256) {
    const int c = c0 + lane * 8;
    float xf[8];
    quantized8(x, c, k, xf);
    if (c < k) {
      float wf[8];
      e4m3x8(*reinterpret_cast<const uint2*>(w_row + c), wf);
      acc += scales[c / kFp8BlockSize] * dot8(wf, xf);
    }
  }
  return acc;
}

constexpr int kDecodeWarps = 4;

__global__ void __launch_bounds__(kDecodeWarps * 32) fp8_gate_up_kernel(const Fp8DecodeArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i = blockIdx.x * kDecodeWarps + warp;
  const int p = blockIdx.y;
  if (i >= a.inter) return;
  const int t = p / a.top_k, H = a.hidden;
  const Fp8Weights& w = a.gate_up;
  const uint8_t* base = slot_base(w, a.slot[p]);
  const int gate_row = 16 * (i / 8) + i % 8, up_row = gate_row + 8;
  const float* scales = reinterpret_cast<const float*>(base + w.scale_at);
  const float* gate_scales = scales + scale_row(w, gate_row) * w.scale_cols;
  const float* up_scales = scales + scale_row(w, up_row) * w.scale_cols;
  const uint8_t* gate_w = base + w.weight_at + static_cast<int64_t>(gate_row) * H;
  const uint8_t* up_w = base + w.weight_at + static_cast<int64_t>(up_row) * H;
  const bf16* x = static_cast<const bf16*>(a.h) + static_cast<int64_t>(t) * H;
  float g = 0.f, u = 0.f;
  for (int c0 = 0; c0 < H; c0 += 256) {  // lane_dot for both rows, x quantized once.
    const int c = c0 + lane * 8;
    float xf[8];
    quantized8(x, c, H, xf);
    if (c < H) {
      float wf[8];
      e4m3x8(*reinterpret_cast<const uint2*>(gate_w + c), wf);
      g += gate_scales[c / kFp8BlockSize] * dot8(wf, xf);
      e4m3x8(*reinterpret_cast<const uint2*>(up_w + c), wf);
      u += up_scales[c / kFp8BlockSize] * dot8(wf, xf);
    }
  }
  g = warp_sum(g);
  u = warp_sum(u);
  if (lane == 0) {
    static_cast<bf16*>(a.act)[static_cast<int64_t>(p) * a.inter + i] =
        __float2bfloat16(silu(g) * u);
  }
}

__global__ void __launch_bounds__(kDecodeWarps * 32)
    fp8_down_combine_kernel(const Fp8DecodeArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = blockIdx.x * kDecodeWarps + warp;
  const int t = blockIdx.y;
  if (c >= a.hidden) return;
  const int I = a.inter;
  const Fp8Weights& w = a.down;
  float acc = 0.f;
  for (int k = 0; k < a.top_k; ++k) {
    const int p = t * a.top_k + k;
    const uint8_t* base = slot_base(w, a.slot[p]);
    const float* scales =
        reinterpret_cast<const float*>(base + w.scale_at) + (c / kFp8BlockSize) * w.scale_cols;
    const bf16* x = static_cast<const bf16*>(a.act) + static_cast<int64_t>(p) * I;
    acc += a.weight[p] *
           lane_dot(base + w.weight_at + static_cast<int64_t>(c) * I, scales, x, I, lane);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    float* o = a.out + static_cast<int64_t>(t) * a.hidden + c;
    *o = a.accumulate ? *o + acc : acc;
  }
}

// The grouped tile: BM x BN over BK columns a step, 2 x 2 warps (as grouped_gemm.cu's
// Mma64), one stage. A (the rows' e4m3 codes, fp8_quantize_rows) and B (e4m3 weights)
// enter the bf16 MMA as their codes, which bf16 holds exactly; each 128-column block's
// sums are promoted as FP8 wgmma's are, acc += block * (a_scale * b_scale), so the tile
// computes what FP8 wgmma computes (docs/cuda.md, "FP8 experts").
constexpr int kBM = kFp8GemmRows, kBN = 128, kBK = 32, kWarpsM = 2, kWarpsN = 2;
constexpr int kThreads = kWarpsM * kWarpsN * 32;
constexpr int kLds = kBK + 8;  // Padded smem row (elements): 80 bytes, 16-aligned rows.
constexpr int kChunks = kBK / 8;
static_assert(kFp8BlockSize % kBK == 0, "a step never straddles a scale block");

// 8 e4m3 codes as 8 bf16 (exact).
__device__ __forceinline__ uint4 e4m3x8_to_bf16(const uint2& codes) {
  float f[8];
  e4m3x8(codes, f);
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

__global__ void __launch_bounds__(kThreads)
    fp8_grouped_gemm_kernel(const GroupedGemmArgs g, const Fp8Weights w, const Fp8Acts acts,
                            int rows_pad) {
  constexpr int WM = kBM / kWarpsM, WN = kBN / kWarpsN;
  constexpr int MI = WM / 16, NI = WN / 8;
  constexpr int kAPer = kBM * kChunks / kThreads, kBPer = kBN * kChunks / kThreads;
  static_assert(kBM * kChunks % kThreads == 0 && kBN * kChunks % kThreads == 0, "load split");
  __shared__ __align__(16) bf16 sa[kBM * kLds];
  __shared__ __align__(16) bf16 sb[kBN * kLds];

  const int tile = blockIdx.x;
  if (tile >= *g.num_tiles) return;
  const int slot = g.tile_slot[tile];
  const int row0 = g.tile_row0[tile];
  const int row_end = g.offsets[slot + 1];
  const int n0 = blockIdx.y * kBN;
  const int K = g.k, N = g.n;
  const int tid = threadIdx.x;
  const uint8_t* A = static_cast<const uint8_t*>(acts.codes);
  const uint8_t* base = slot_base(w, slot);
  const uint8_t* B = base + w.weight_at;
  const float* scales = reinterpret_cast<const float*>(base + w.scale_at);

  // Rows past the slot's end re-read its last row (their results are never stored).
  const uint8_t* a_src[kAPer];
  int a_dst[kAPer], a_col[kAPer];
#pragma unroll
  for (int i = 0; i < kAPer; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunks;
    a_col[i] = (c % kChunks) * 8;
    a_src[i] = A + static_cast<int64_t>(min(row0 + row, row_end - 1)) * K;
    a_dst[i] = row * kLds + a_col[i];
  }

  float acc[MI][NI][4], blk[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = blk[mi][ni][e] = 0.f;

  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int g8 = lane / 4, q = lane % 4;
  for (int k0 = 0; k0 < K; k0 += kBK) {
#pragma unroll
    for (int i = 0; i < kAPer; ++i) {
      const int col = k0 + a_col[i];  // K is a multiple of 8: a chunk is whole or out.
      *reinterpret_cast<uint4*>(sa + a_dst[i]) =
          col < K ? e4m3x8_to_bf16(*reinterpret_cast<const uint2*>(a_src[i] + col))
                  : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kBPer; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / kChunks, col = (c % kChunks) * 8;
      const int n = n0 + row, k = k0 + col;
      *reinterpret_cast<uint4*>(sb + row * kLds + col) =
          n < N && k < K
              ? e4m3x8_to_bf16(*reinterpret_cast<const uint2*>(B + static_cast<int64_t>(n) * K + k))
              : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    warp_tile_mma<MI, NI, kBK>(blk, sa, sb, kLds, wm * WM, wn * WN, lane);
    __syncthreads();  // The tiles are refilled next step.
    if ((k0 + kBK) % kFp8BlockSize != 0 && k0 + kBK < K) continue;
    // The end of a scale block: promote its sums.
    const int kb = k0 / kFp8BlockSize;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = min(row0 + wm * WM + mi * 16 + g8 + half * 8, row_end - 1);
        const float a_scale = acts.scales[static_cast<int64_t>(kb) * rows_pad + r];
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int n = min(n0 + wn * WN + ni * 8 + 2 * q + j, N - 1);
            const float b_scale = scales[scale_row(w, n) * w.scale_cols + kb];
            float& b = blk[mi][ni][half * 2 + j];
            acc[mi][ni][half * 2 + j] += b * (a_scale * b_scale);
            b = 0.f;
          }
        }
      }
    }
  }

  // Accumulator layout of m16n8: c0, c1 at (row g, cols 2q, 2q + 1); c2, c3 at row g + 8.
  bf16* out = static_cast<bf16*>(g.out);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + wm * WM + mi * 16 + g8 + half * 8;
      if (r >= row_end) continue;
      if (g.swiglu) {
        bf16* o = out + static_cast<int64_t>(r) * (N / 2);
#pragma unroll
        for (int nj = 0; nj < NI; nj += 2) {
          const int gn = n0 + wn * WN + nj * 8;  // A multiple of 16: gate block, then up block.
          if (gn >= N) continue;
          const int i = (gn / 16) * 8 + 2 * q;
          const float* gate = &acc[mi][nj][half * 2];
          const float* up = &acc[mi][nj + 1][half * 2];
          *reinterpret_cast<__nv_bfloat162*>(o + i) =
              __floats2bfloat162_rn(silu(gate[0]) * up[0], silu(gate[1]) * up[1]);
        }
      } else {
        bf16* o = out + static_cast<int64_t>(r) * N;
#pragma unroll
        for (int nj = 0; nj < NI; ++nj) {
          const int col = n0 + wn * WN + nj * 8 + 2 * q;
          if (col >= N) continue;
          *reinterpret_cast<__nv_bfloat162*>(o + col) =
              __floats2bfloat162_rn(acc[mi][nj][half * 2], acc[mi][nj][half * 2 + 1]);
        }
      }
    }
  }
}

// A block of 256 threads per row and 16 blocks of 128 columns: 16 lanes a block, 8
// columns a lane.
constexpr int kQuantThreads = 256, kQuantBlocks = kQuantThreads / 16;

__global__ void __launch_bounds__(kQuantThreads)
    fp8_quantize_rows_kernel(const bf16* x, const int32_t* gather, int gather_div,
                             const int32_t* num_rows, int k, Fp8Acts out, int rows_pad) {
  const int r = blockIdx.x;
  if (r >= *num_rows) return;
  const int lane16 = threadIdx.x % 16;
  const int kb = blockIdx.y * kQuantBlocks + threadIdx.x / 16;
  const int col = kb * kFp8BlockSize + lane16 * 8;
  const int64_t src = gather != nullptr ? gather[r] / gather_div : r;
  float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (col < k) bf16x8(*reinterpret_cast<const uint4*>(x + src * k + col), f);
  uint32_t words[2];
  const float scale = quantize8(f, words);
  if (col < k) {
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(out.codes) + static_cast<int64_t>(r) * k +
                              col) = make_uint2(words[0], words[1]);
  }
  if (lane16 == 0 && kb * kFp8BlockSize < k) {
    out.scales[static_cast<int64_t>(kb) * rows_pad + r] = scale;
  }
}

}  // namespace

cudaError_t fp8_quantize_rows(const void* x, const int32_t* gather, int gather_div,
                              const int32_t* num_rows, int max_rows, int k, const Fp8Acts& out,
                              cudaStream_t stream) {
  if (max_rows == 0) return cudaSuccess;
  if (k % 8 != 0 || max_rows > out.rows_cap) return cudaErrorInvalidValue;
  const int blocks = static_cast<int>(fp8_blocks(k));
  const dim3 grid(max_rows, (blocks + kQuantBlocks - 1) / kQuantBlocks);
  fp8_quantize_rows_kernel<<<grid, kQuantThreads, 0, stream>>>(
      static_cast<const bf16*>(x), gather, gather_div, num_rows, k, out,
      static_cast<int>(fp8_round_up(out.rows_cap, 4)));
  return cudaGetLastError();
}

Fp8Weights fp8_gate_up_weights(const void* slots, const Fp8SlotLayout& layout) {
  Fp8Weights w;
  w.slots = slots;
  w.slot_bytes = layout.slot_bytes();
  w.weight_at = 0;
  w.scale_at = layout.scales_at();
  w.scale_cols = static_cast<int>(layout.gate_up_scale_cols());
  w.up_scale_row0 = static_cast<int>(layout.gate_up_scale_rows());
  return w;
}

Fp8Weights fp8_down_weights(const void* slots, const Fp8SlotLayout& layout) {
  Fp8Weights w;
  w.slots = slots;
  w.slot_bytes = layout.slot_bytes();
  w.weight_at = layout.down_at();
  w.scale_at = layout.down_scales_at();
  w.scale_cols = static_cast<int>(layout.down_scale_cols());
  w.up_scale_row0 = 0;
  return w;
}

cudaError_t fp8_decode_gate_up(const Fp8DecodeArgs& a, cudaStream_t stream) {
  const int pairs = a.num_tokens * a.top_k;
  if (pairs == 0) return cudaSuccess;
  const dim3 grid((a.inter + kDecodeWarps - 1) / kDecodeWarps, pairs);
  fp8_gate_up_kernel<<<grid, kDecodeWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t fp8_decode_down_combine(const Fp8DecodeArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  const dim3 grid((a.hidden + kDecodeWarps - 1) / kDecodeWarps, a.num_tokens);
  fp8_down_combine_kernel<<<grid, kDecodeWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t fp8_grouped_gemm(const GroupedGemmArgs& g, const Fp8Weights& w, const Fp8Acts& a,
                             cudaStream_t stream) {
  if (g.max_tiles == 0) return cudaSuccess;
  if (g.n % 8 != 0 || g.k % 8 != 0 || (g.swiglu && g.n % 16 != 0)) return cudaErrorInvalidValue;
  const dim3 grid(g.max_tiles, (g.n + kBN - 1) / kBN);
  fp8_grouped_gemm_kernel<<<grid, kThreads, 0, stream>>>(
      g, w, a, static_cast<int>(fp8_round_up(a.rows_cap, 4)));
  return cudaGetLastError();
}

bool fp8_device_supported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major > 8 || (major == 8 && minor >= 9);
}

}  // namespace flexpert::cuda
