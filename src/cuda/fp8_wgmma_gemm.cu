// SPDX-License-Identifier: Apache-2.0
// The FP8 grouped expert GEMM on Hopper's tensor cores (fp8_wgmma_gemm, fp8_experts.h): e4m3
// operands with 128 x 128 block scales, on the warp-specialised pipeline of wgmma_gemm.cu
// (wgmma_common.cuh). Compiled only for sm_90a (arch-specific wgmma); elsewhere the kernel is
// empty and fp8_wgmma_gemm refuses (wgmma_available()).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/device_util.cuh"
#include "cuda/fp8_experts.h"
#include "cuda/grouped_gemm.h"
#include "cuda/knobs.h"
#include "cuda/wgmma_common.cuh"

namespace flexpert::cuda {
namespace {

// The FP8 kernel (fp8_wgmma_gemm, fp8_experts.h): wgmma_ws_kernel's producer / consumer
// split, ring, unit queue and 64-row tiles (BM = 64, both consumers on the tile's rows,
// consumer c on columns 128c.. of a 256-column unit), with e4m3 operands. A 128-byte
// swizzled row holds 128 e4m3, so a ring stage is one 128-wide K block: one scale block
// of the weights and of the activations. Per stage the producer's thread 0 loads A (the
// quantized rows, contiguous) and B (the slot's e4m3 rows, through a 3D map
// [slots][rows][k]) by tensor copies; a consumer reads its rows' activation scales and the
// block's weight scales from global memory (L2) ahead of the stage, issues four
// wgmma m64n128k32 e4m3 into a fresh f32 fragment, waits for them and adds
// frag * (a_scale[row] * b_scale) into its f32 accumulators (DeepGEMM's promotion: the
// block scales applied once per 128 K, the sums in f32 registers, never in the tensor
// core's own accumulation across blocks). The stage is freed once its wgmma are done.
// BM = 128 (a unit of 128 rows x 256 columns, consumer c on rows 64c.. and all 256
// columns, two m64n128 halves a K block, each promoted as above) reads half the operand
// bytes per FLOP, which is what bounds the kernel on large batches (L2 to shared memory).
constexpr int kF8BN = 256;
template <int BM>
__host__ __device__ constexpr int f8_stages() {
  return BM == 128 ? 4 : 5;
}
// NOTE: the activation scales once came by a tensor copy too (f32 [blocks, rows], boxes
// of 64 x 1, no swizzle): that load raised "illegal instruction" on the H200, so they are
// plain loads now.
constexpr int kF8BBytes = kF8BN * 128;
template <int BM>
constexpr size_t f8_smem_bytes() {  // Stages of a multiple of 1024 bytes (swizzle atoms).
  return static_cast<size_t>(f8_stages<BM>()) * (BM * 128 + kF8BBytes) + 2048;
}

// 3D tensor copy of box (x, y, z) into shared memory, completing on mbarrier `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap& map, int x, int y,
                                            int z, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

template <int BM>
__global__ void __launch_bounds__(kWsThreads, 1)
    fp8_wgmma_kernel(const GroupedGemmArgs g, const Fp8Weights w, const float* a_scales,
                     int rows_pad, const __grid_constant__ CUtensorMap tmap_b,
                     const __grid_constant__ CUtensorMap tmap_a, int group, int flags) {
#if FLEX_HAS_WGMMA
  constexpr int S = f8_stages<BM>(), kF8ABytes = BM * 128, kStageBytes = kF8ABytes + kF8BBytes;
  constexpr int NH = BM == 128 ? 2 : 1;  // m64n128 halves per consumer.
  // full: thread 0's expect_tx; empty: lane 0 of each consumer warp. Unit queue readers:
  // the 8 consumer warps and the producer's thread 0.
  const Ring ring = setup_ring<S, kStageBytes>(1, 8, tmap_b, 9);
  const uint32_t smem = ring.smem, full_bar = ring.full_bar, empty_bar = ring.empty_bar;
  const UnitQueue queue{empty_bar + 8 * S, empty_bar + 8 * S + 8 * kUnitSlots,
                        empty_bar + 8 * S + 16 * kUnitSlots};
  int32_t* const counter = (flags & kWsDynamic) != 0 ? g.sched : nullptr;
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int nb = (g.n + kF8BN - 1) / kF8BN;
  const int num_tiles = *g.num_tiles;
  const int total = num_tiles * nb;
  const int num_k_tiles = (g.k + kFp8BlockSize - 1) / kFp8BlockSize;

  static_assert(40 + 2 * 232 <= 3 * 168, "setmaxnreg budget (see wgmma_ws_kernel)");
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    int next = counter != nullptr ? atomicAdd(counter, 1) : blockIdx.x;
    for (int n = 0;; ++n) {
      const int u = take_unit(queue, n, true, next, true);
      if (u >= total) break;
      if (counter == nullptr) next = u + gridDim.x;
      int tile, nblk;
      ws_unit(u, num_tiles, nb, group, tile, nblk);
      const int slot = g.tile_slot[tile];
      const int row0 = g.tile_row0[tile];
      for (int kt = 0; kt < num_k_tiles; ++kt) {
        if (counter != nullptr && kt == num_k_tiles - 1) next = atomicAdd(counter, 1);
        mbar_wait(empty_bar + 8 * stage, phase ^ 1);
        const uint32_t base = smem + stage * kStageBytes;
        const uint32_t fb = full_bar + 8 * stage;
        // Boxes past the tensors' ends (rows, k) count in full and read as zeros.
        mbar_expect_tx(fb, kF8ABytes + kF8BBytes);
        tma_load_2d(base, tmap_a, kt * kFp8BlockSize, row0, fb);
        tma_load_3d(base + kF8ABytes, tmap_b, kt * kFp8BlockSize, nblk * kF8BN, slot, fb);
        if (++stage == S) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    if (counter != nullptr) {  // As in wgmma_ws_kernel: the last CTA resets the counter.
      __threadfence();
      if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        __threadfence();
        atomicExch(counter, 0);
        atomicExch(counter + 1, 0);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int c = wg - 1;
    const int warp = (tid % 128) / 32, lane = tid % 32;
    const int r0 = warp * 16 + lane / 4;  // The thread's accumulator rows: r0, r0 + 8.
    int stage = 0;
    uint32_t phase = 0;
    for (int n = 0;; ++n) {
      const int u = take_unit(queue, n, false, 0, false);
      if (u >= total) break;
      int tile, nblk;
      ws_unit(u, num_tiles, nb, group, tile, nblk);
      const int n0 = nblk * kF8BN + (BM == 128 ? 0 : c * 128);
      const int slot = g.tile_slot[tile];
      const int row0 = g.tile_row0[tile] + (BM == 128 ? c * 64 : 0);
      const int row_end = g.offsets[slot + 1];
      // No columns here (n % 256 == 128, BM = 64) or no rows (BM = 128, a slot's last tile
      // of at most 64 rows): only pass the stages on.
      if (n0 >= g.n || row0 >= row_end) {
        for (int kt = 0; kt < num_k_tiles; ++kt) {
          mbar_wait(full_bar + 8 * stage, phase);
          if (lane == 0) mbar_arrive(empty_bar + 8 * stage);
          if (++stage == S) {
            stage = 0;
            phase ^= 1;
          }
        }
        continue;
      }
      // The weights' scale rows of these 128 columns: gate/up (interleaved by 8) hold 64
      // gate rows from 64 (n0 / 128) and the up rows alike, column block j (8 columns)
      // gate for even j, up for odd; plain rows, one scale row for all.
      const float* scales =
          reinterpret_cast<const float*>(static_cast<const uint8_t*>(w.slots) +
                                         static_cast<int64_t>(slot) * w.slot_bytes + w.scale_at);
      // BM = 128: half h on columns n0 + 128h (n is a multiple of 256 there).
      const float* s_even[NH];
      const float* s_odd[NH];
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        const int m = (n0 + 128 * h) / kFp8BlockSize;
        s_even[h] = scales + static_cast<int64_t>(w.up_scale_row0 > 0 ? m / 2 : m) * w.scale_cols;
        s_odd[h] = w.up_scale_row0 > 0
                       ? scales + static_cast<int64_t>(w.up_scale_row0 + m / 2) * w.scale_cols
                       : s_even[h];
      }
      // This thread's rows' activation scales (rows past the buffer read its last row:
      // they lie past the slot's end and are never stored).
      const float* sa_lo = a_scales + min(row0 + r0, rows_pad - 1);
      const float* sa_hi = a_scales + min(row0 + r0 + 8, rows_pad - 1);
      // acc[64h + i] is what m64n256's accumulator i + 64h would be (column block 16h + i / 4).
      float acc[64 * NH], frag[64];
#pragma unroll
      for (int i = 0; i < 64 * NH; ++i) acc[i] = 0.f;
#pragma unroll
      for (int i = 0; i < 64; ++i) frag[i] = 0.f;
      for (int kt = 0; kt < num_k_tiles; ++kt) {
        float b_even[NH], b_odd[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          b_even[h] = __ldg(s_even[h] + kt);
          b_odd[h] = __ldg(s_odd[h] + kt);
        }
        const float a_lo = __ldg(sa_lo + static_cast<int64_t>(kt) * rows_pad);
        const float a_hi = __ldg(sa_hi + static_cast<int64_t>(kt) * rows_pad);
        mbar_wait(full_bar + 8 * stage, phase);
        const uint32_t base = smem + stage * kStageBytes;
        const uint64_t da = smem_desc(base + (BM == 128 ? c * 64 * 128 : 0));
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          const uint64_t db =
              smem_desc(base + kF8ABytes + (BM == 128 ? h * 128 * 128 : c * 128 * 128));
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            // +32 bytes (32 e4m3) per step inside the swizzled 128-byte rows.
            wgmma_m64n128k32_e4m3(frag, da + 2 * kk, db + 2 * kk, kk > 0 ? 1 : 0);
          }
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
          // Keep the compiler from reading the fragment before the wait.
#pragma unroll
          for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(frag[i])::"memory");
          if (h == NH - 1) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_bar + 8 * stage);
          }
          const float s[4] = {a_lo * b_even[h], a_hi * b_even[h], a_lo * b_odd[h], a_hi * b_odd[h]};
#pragma unroll
          for (int i = 0; i < 64; ++i) {
            // Accumulator i: row r0 + 8 ((i / 2) % 2), column block i / 4.
            acc[64 * h + i] += frag[i] * s[((i / 2) % 2) + 2 * ((i / 4) % 2)];
          }
        }
        if (++stage == S) {
          stage = 0;
          phase ^= 1;
        }
      }
      store_block<128 * NH>(g, acc, row0, row_end, n0, warp, lane);
    }
  }
#endif
}

// A tensor map for fp8_wgmma_gemm, encoded once per key and kept (as rows_tensor_map):
// kind 0 (2), A: e4m3 [rows, k] at ptr, boxes 128 x 64 (128) rows, 128-byte swizzle; kind 1, B: the
// e4m3 [n, k] matrix of every slot from ptr (slots `stride` bytes apart, as many as the
// allocation holds), boxes 128 x 256 x 1, 128-byte swizzle. nullptr if it cannot be made.
const CUtensorMap* fp8_tensor_map(int kind, const void* ptr, int k, int64_t rows, int64_t stride) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int64_t, int64_t, uint64_t, size_t>,
                  CUtensorMap>
      cache;
  const auto [encode, p, base, size] = tensor_map_source(ptr);
  if (encode == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(kind, ptr, k, rows, stride, static_cast<uint64_t>(base), size);
  auto it = cache.find(key);
  if (it != cache.end()) return &it->second;
  const uint64_t end = base + size;
  CUtensorMap map;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUresult res = CUDA_ERROR_INVALID_VALUE;
  if (kind != 1) {
    if (p + static_cast<uint64_t>(rows) * k > end) return nullptr;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
    const cuuint32_t box[2] = {kFp8BlockSize, kind == 2 ? 128u : 64u};
    res = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box,
                 elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                 CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else {
    const uint64_t matrix = static_cast<uint64_t>(rows) * k;
    if (stride <= 0 || stride % 16 != 0 || p + matrix > end) return nullptr;
    const uint64_t slots = (end - p - matrix) / static_cast<uint64_t>(stride) + 1;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows), slots};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(stride)};
    const cuuint32_t box[3] = {kFp8BlockSize, kF8BN, 1};
    res = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(ptr), dims, strides, box,
                 elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  if (res != CUDA_SUCCESS) return nullptr;
  return &cache.emplace(key, map).first->second;
}

template <int BM>
cudaError_t launch_fp8(const GroupedGemmArgs& g, const Fp8Weights& w, const Fp8Acts& a,
                       cudaStream_t stream) {
  const CUtensorMap* map_a = fp8_tensor_map(BM == 128 ? 2 : 0, a.codes, g.k, a.rows_cap, 0);
  const CUtensorMap* map_b =
      fp8_tensor_map(1, static_cast<const uint8_t*>(w.slots) + w.weight_at, g.k, g.n, w.slot_bytes);
  if (map_a == nullptr || map_b == nullptr) return cudaErrorInvalidValue;
  if (const cudaError_t err = ensure_smem_limit<fp8_wgmma_kernel<BM>>(f8_smem_bytes<BM>());
      err != cudaSuccess) {
    return err;
  }
  const int nb = (g.n + kF8BN - 1) / kF8BN;
  const int64_t units = static_cast<int64_t>(g.max_tiles) * nb;
  // Persistent with the unit counter (as wgmma_ws), else a CTA per unit.
  const bool dynamic = g.sched != nullptr;
  const int grid = static_cast<int>(dynamic ? std::min<int64_t>(units, sm_count()) : units);
  const int group = std::max(1, std::min(grid, sm_count()) / nb);
  fp8_wgmma_kernel<BM><<<grid, kWsThreads, f8_smem_bytes<BM>(), stream>>>(
      g, w, a.scales, static_cast<int>(fp8_round_up(a.rows_cap, 4)), *map_b, *map_a, group,
      dynamic ? kWsDynamic : 0);
  return cudaGetLastError();
}

}  // namespace

bool fp8_wgmma_fits(int n, int k) { return n % 128 == 0 && k % 16 == 0; }

int fp8_wgmma_rows(int64_t num_pairs, int num_slots, int hidden, int inter) {
  if ((2 * inter) % kF8BN != 0 || hidden % kF8BN != 0) return 64;
  if (knobs().fp8_wgmma_rows == 64 || knobs().fp8_wgmma_rows == 128) {
    return knobs().fp8_wgmma_rows;
  }
  // H200, FP8 wgmma alone: 128 rows from 64 rows a slot on average (DeepSeek-V3 at 2048 tokens
  // 3.65 against 4.06 ms, Qwen3-30B-A3B at 1024 280 against 290 us), 64 below (DeepSeek-V3
  // at 1024 tokens 3.19 against 3.44 ms).
  return num_pairs >= 64 * static_cast<int64_t>(std::max(num_slots, 1)) ? 128 : 64;
}

cudaError_t fp8_wgmma_gemm(const GroupedGemmArgs& g, const Fp8Weights& w, const Fp8Acts& a,
                           int block_m, cudaStream_t stream) {
  if (g.max_tiles == 0) return cudaSuccess;
  if (!fp8_wgmma_fits(g.n, g.k) || !wgmma_available()) return cudaErrorInvalidValue;
  if (block_m == 128) {
    return g.n % kF8BN == 0 ? launch_fp8<128>(g, w, a, stream) : cudaErrorInvalidValue;
  }
  return block_m == 64 ? launch_fp8<64>(g, w, a, stream) : cudaErrorInvalidValue;
}

}  // namespace flexpert::cuda
