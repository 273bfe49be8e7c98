// SPDX-License-Identifier: Apache-2.0
// The Hopper tensor-core path of the grouped expert GEMM (grouped_gemm.h):
// wgmma.mma_async m64n128k16 / m64n256k16 (bf16 in, f32 accumulators in registers)
// on tiles of 64 x 128, 128 x 128 or 128 x 256, K in steps of 64, 4 or 5 stages;
// below, the warp-specialised kernel (tiles ws128 / ws64), which the layer uses.
// NOTE: A rows are gathered (token rows of each (token, k) pair), which the bulk
// tensor copy engine cannot do on sm_90, so every thread copies 16-byte chunks
// with cp.async straight into the 128-byte swizzled layout wgmma reads: row r,
// chunk c lands at r * 128 + ((c ^ (r % 8)) * 16), 8-row groups 1024 bytes apart.
// Compiled only for sm_90a (arch-specific wgmma); elsewhere the kernel is empty
// and wgmma_available() says so, so the mma.sync tiles are used instead.
// The FP8 kernel is in fp8_wgmma_gemm.cu; what both share, in wgmma_common.cuh.
// NOTE: over 800 lines: the three bf16 kernels (tiles, warp-specialised, ping-pong) share
// produce_unit, the epilogues and each other's fallbacks in their launchers.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "cuda/device_util.cuh"
#include "cuda/driver_api.h"
#include "cuda/grouped_gemm.h"
#include "cuda/knobs.h"
#include "cuda/mma_sync.cuh"
#include "cuda/wgmma_common.cuh"

namespace flexpert::cuda {
namespace {

constexpr int kWgBK = 64;
// Shared-memory stages: 64 x 128 tiles run two blocks per SM, larger ones one.
template <int WG, int BN>
__host__ __device__ constexpr int wg_stages() {
  return WG == 2 && BN == 128 ? 5 : 4;
}

__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}

template <int WG, int BN>
__global__ void __launch_bounds__(WG * 128, 1) wgmma_gemm_kernel(const GroupedGemmArgs g) {
#if FLEX_HAS_WGMMA
  constexpr int BM = 64 * WG, kThreads = WG * 128;
  constexpr int kABytes = BM * 128, kBBytes = BN * 128, kStageBytes = kABytes + kBBytes;
  constexpr int kAPer = BM * 8 / kThreads, kBPer = BN * 8 / kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t smem = raw + ((1024 - (raw & 1023)) & 1023);  // Swizzle atoms: 1024-aligned.

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
  const bf16* a_src[kAPer];
  uint32_t a_dst[kAPer];
#pragma unroll
  for (int i = 0; i < kAPer; ++i) {
    const int c = tid + i * kThreads, row = c / 8, ch = c % 8;
    const int r = min(row0 + row, row_end - 1);
    const int src = g.gather != nullptr ? g.gather[r] / g.gather_div : r;
    a_src[i] = A + static_cast<int64_t>(src) * K + ch * 8;
    a_dst[i] = row * 128 + ((ch ^ (row & 7)) << 4);
  }
  const bf16* b_src[kBPer];
  uint32_t b_dst[kBPer];
#pragma unroll
  for (int i = 0; i < kBPer; ++i) {
    const int c = tid + i * kThreads, row = c / 8, ch = c % 8;
    b_src[i] = B + static_cast<int64_t>(row) * K + ch * 8;
    b_dst[i] = kABytes + row * 128 + ((ch ^ (row & 7)) << 4);
  }
  auto load_stage = [&](int stage, int kt) {
    const uint32_t base = smem + stage * kStageBytes;
    const int k0 = kt * kWgBK;
#pragma unroll
    for (int i = 0; i < kAPer; ++i) cp_async16(base + a_dst[i], a_src[i] + k0);
#pragma unroll
    for (int i = 0; i < kBPer; ++i) cp_async16(base + b_dst[i], b_src[i] + k0);
  };

  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  constexpr int S = wg_stages<WG, BN>();
  const int num_k_tiles = K / kWgBK;
  // Loads run S - 2 tiles ahead: the stage refilled at step kt was read by the
  // wgmma group of step kt - 2, which wait_group 1 at the end of step kt - 1 retired.
#pragma unroll
  for (int s = 0; s < S - 2; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  const int wg = tid / 128;
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 3));
    // cp.async wrote through the generic proxy; wgmma reads through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const int next = kt + S - 2;
    if (next < num_k_tiles) load_stage(next % S, next);
    asm volatile("cp.async.commit_group;\n" ::);
    const uint32_t base = smem + (kt % S) * kStageBytes;
    const uint64_t da = smem_desc(base + wg * 64 * 128);
    const uint64_t db = smem_desc(base + kABytes);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kWgBK / 16; ++kk) {
      // +32 bytes per 16 elements of K inside the swizzled 128-byte rows.
      wgmma_tile<BN>(d, da + 2 * kk, db + 2 * kk);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  asm volatile("cp.async.wait_group 0;\n" ::);

  store_block<BN>(g, d, row0 + wg * 64, row_end, n0, (tid % 128) / 32, tid % 32);
#endif
}

// ---------------------------------------------------------------------------
// The warp-specialised persistent kernel (tiles kWgmmaWs128 / kWgmmaWs64):
// 3 warpgroups. Warpgroup 0 (producer, registers lowered by setmaxnreg) fills a ring
// of S stages: B (weights, contiguous rows of one slot) by the bulk tensor copy engine
// from a tensor map over the weights buffer viewed as [rows, k], 128-byte swizzle;
// A (gathered token rows) by cp.async from all 128 producer threads into the same
// swizzled layout, completing on the stage's `full` mbarrier (cp.async.mbarrier.arrive
// .noinc). Warpgroups 1 and 2 (consumers) wait on `full`, issue wgmma and free the
// stage on its `empty` mbarrier once the next step's wgmma group has been issued and
// the previous one retired (one group in flight). No __syncthreads in the K loop.
// BM = 128: consumer c computes rows 64c..64c+63 x 256 columns (m64n256); a consumer
// whose 64 rows all lie past the slot's end skips its wgmma (the other then has the
// tensor cores to itself). BM = 64: both consumers share the 64 rows, consumer c takes
// columns 128c..128c+127 (m64n128).
// Work units u < *num_tiles * (n / 256) = (tile, column block) by ws_unit, so that
// concurrent CTAs share A rows and a slot's B in L2. Persistent: grid = min(#SMs,
// max_tiles * n / 256); with GroupedGemmArgs::sched each CTA takes the next unit from
// the counter when its producer gets to it (as the block scheduler would hand out
// CTAs, so the units in flight stay together), else CTA b walks b, b + grid, ....
// The producer posts each unit in the CTA's UnitQueue and runs ahead into the next
// one while the consumers store the last (BM = 128: by TMA, store_block_tma).
// store_block_tma's buffer: two 64 x 64 bf16 boxes.
constexpr int kEpiBoxBytes = 64 * 128, kEpiBufBytes = 2 * kEpiBoxBytes;
template <int BM>
__host__ __device__ constexpr int ws_stages() {
  return BM == 128 ? 4 : 5;
}
// The ring, 1024 bytes of alignment slack, 1024 for the mbarriers and the unit queue,
// and for BM = 128 the consumers' epilogue buffers (store_block_tma), 1024-aligned
// (swizzle atoms): 231424 of the 232448 bytes a block may have.
template <int BM>
constexpr size_t ws_smem_bytes() {
  return static_cast<size_t>(ws_stages<BM>()) * (BM + kWsBN) * 128 + 2048 +
         (BM == 128 ? 2 * kEpiBufBytes : 0);
}

__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The bulk tensor copy engine's stores (TMA, shared -> global): a 2D box from shared
// memory, a commit of the thread's stores so far as one group, and waits until the
// groups' reads of shared memory (the buffer may be refilled) or the whole stores are
// done.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap& map, uint32_t src, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(src), "r"(x), "r"(y)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// The epilogue of a consumer whose 64 rows all lie inside the slot, through shared
// memory and TMA, so that the tensor cores go on with the next unit while the copy
// engine writes this one: the block (accumulator layout as in store_block) is written
// in 64 x 128 output pieces (SwiGLU: its one piece) into the consumer's 16 KB buffer
// `buf` as two 64 x 64 boxes in the 128-byte swizzled layout of the tensor map `map`
// over the output rows, then stored from one thread. Before a piece refills the
// buffer, that thread waits until the previous stores have read it; named barrier
// `bar` (the consumer's 128 threads) orders both. Rows past the slot's end would be
// overwritten by a box, so a partial block goes through store_block instead.
template <int CN>
__device__ __forceinline__ void store_block_tma(const GroupedGemmArgs& g, const float (&d)[CN / 2],
                                                const CUtensorMap& map, uint32_t buf, int m0,
                                                int n0, int warp, int lane, int bar) {
  const int q = lane % 4;
  const bool leader = warp == 0 && lane == 0;
  // Output column block cb (8 columns) of the piece, local row r: the thread's pair.
  auto put = [&](int r, int cb, uint32_t v) {
    st_shared_u32(buf + (cb / 8) * kEpiBoxBytes + r * 128 + (((cb % 8) ^ (r % 8)) << 4) + 4 * q, v);
  };
  auto refill = [&] {
    if (leader) bulk_wait_read();
    named_bar_sync(bar, 128);
  };
  auto flush = [&](int col0) {
    // st.shared wrote through the generic proxy; the copy engine reads through the async.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_bar_sync(bar, 128);
    if (leader) {
      tma_store_2d(map, buf, col0, m0);
      tma_store_2d(map, buf + kEpiBoxBytes, col0 + 64, m0);
      bulk_commit();
    }
  };
  if (g.swiglu) {
    refill();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp * 16 + lane / 4 + half * 8;
#pragma unroll
      for (int j = 0; j < CN / 8; j += 2) {  // Gate block j, up block j + 1.
        const float* gate = &d[4 * j + 2 * half];
        const float* up = &d[4 * (j + 1) + 2 * half];
        put(r, j / 2, pack_bf16x2(silu(gate[0]) * up[0], silu(gate[1]) * up[1]));
      }
    }
    flush(n0 / 2);
  } else {
#pragma unroll
    for (int p = 0; p < CN / 128; ++p) {
      refill();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + half * 8;
#pragma unroll
        for (int cb = 0; cb < 16; ++cb) {
          const int j = 16 * p + cb;
          put(r, cb, pack_bf16x2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]));
        }
      }
      flush(n0 + 128 * p);
    }
  }
}

// The producer warpgroup's loads of one unit (rows of `tile` x columns n0 .. n0 + BN):
// per K step, once the stage is free, B (and A when contiguous) by TMA from thread 0,
// gathered A rows by cp.async from all 128 threads. cp.async copies of ring step j are
// fenced (generic -> async proxy) and signalled on full[j % S] by the copying thread
// kLag = S - 2 steps later, once they have landed, so the consumers need no proxy
// fence (one would also wait for their wgmma in flight); produce_done() signals the
// last ones. With TMA_A only thread 0 calls these. With `counter`, thread 0 takes the
// CTA's next unit into `next` at the last K step: the atomic's latency hides behind
// the step's loads instead of delaying the lagged signals of this unit's last stages.
template <int S, int BM, int BN, bool TMA_A>
__device__ __forceinline__ void produce_unit(const GroupedGemmArgs& g, const CUtensorMap& tmap_a,
                                             const CUtensorMap& tmap_b, int tile, int n0,
                                             uint32_t smem, uint32_t full_bar, uint32_t empty_bar,
                                             int& stage, uint32_t& phase, int& j,
                                             int32_t* counter = nullptr, int* next = nullptr,
                                             bool split_tail = false) {
  constexpr int kABytes = BM * 128, kBBytes = BN * 128, kStageBytes = kABytes + kBBytes;
  constexpr int kARows = BM / 16;  // A rows per producer thread per stage.
  constexpr int kLag = S - 2;
  const int tid = threadIdx.x;
  const int K = g.k, num_k_tiles = K / kWgBK;
  const int ch = tid % 8, rbase = tid / 8;  // Rows rbase + 16 i, 16-byte chunk ch.
  const uint32_t a_dst0 = rbase * 128 + ((ch ^ (rbase & 7)) << 4);
  const int slot = g.tile_slot[tile];
  const int row0 = g.tile_row0[tile];
  const int row_end = g.offsets[slot + 1];
  // A tile the consumers split by columns reads A rows 0..63 only.
  const bool half_a = split_tail && BM == 128 && row_end - row0 <= 64;
  const int b_row = static_cast<int>(slot * (g.slot_stride / K) + g.weight_offset / K) + n0;
  const bf16* A = static_cast<const bf16*>(g.a);
  const bf16* a_src[kARows];
#pragma unroll
  for (int i = 0; i < (TMA_A ? 0 : kARows); ++i) {
    const int r = min(row0 + rbase + 16 * i, row_end - 1);
    const int src = g.gather != nullptr ? g.gather[r] / g.gather_div : r;
    a_src[i] = A + static_cast<int64_t>(src) * K + ch * 8;
  }
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    if (counter != nullptr && tid == 0 && kt == num_k_tiles - 1) *next = atomicAdd(counter, 1);
    mbar_wait(empty_bar + 8 * stage, phase ^ 1);
    const uint32_t base = smem + stage * kStageBytes;
    const uint32_t fb = full_bar + 8 * stage;
    if (TMA_A) {
      mbar_expect_tx(fb, kABytes + kBBytes);
      tma_load_2d(base, tmap_a, kt * kWgBK, row0, fb);
    } else if (tid == 0) {
      mbar_expect_tx(fb, kBBytes);
    }
    if (tid == 0) tma_load_2d(base + kABytes, tmap_b, kt * kWgBK, b_row, fb);
    if (!TMA_A) {
#pragma unroll
      for (int i = 0; i < kARows; ++i) {
        if (i < kARows / 2 || !half_a)
          cp_async16(base + a_dst0 + i * 16 * 128, a_src[i] + kt * kWgBK);
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      if (j >= kLag) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kLag) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(full_bar + 8 * ((j - kLag) % S));
      }
    }
    ++j;
    if (++stage == S) {
      stage = 0;
      phase ^= 1;
    }
  }
}

// After the producer's last unit: signal the cp.async steps not signalled yet.
template <int S, bool TMA_A>
__device__ __forceinline__ void produce_done(uint32_t full_bar, int j) {
  if (TMA_A) return;
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  for (int i = max(j - (S - 2), 0); i < j; ++i) mbar_arrive(full_bar + 8 * (i % S));
}

#if FLEX_HAS_WGMMA
// A consumer warpgroup's mainloop over one unit: per K step, wait for the stage, issue
// its wgmma (A at a_off, B at b_off in the stage) and free the previous stage once this
// step's group is issued and the previous one retired (one group in flight).
template <int CN, int S, int kStageBytes>
__device__ __forceinline__ void consume_unit(float (&d)[CN / 2], uint32_t smem, uint32_t a_off,
                                             uint32_t b_off, uint32_t full_bar, uint32_t empty_bar,
                                             int num_k_tiles, int lane, int& stage,
                                             uint32_t& phase) {
  int prev = 0;
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    mbar_wait(full_bar + 8 * stage, phase);
    const uint32_t base = smem + stage * kStageBytes;
    const uint64_t da = smem_desc(base + a_off);
    const uint64_t db = smem_desc(base + b_off);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kWgBK / 16; ++kk) {
      wgmma_tile<CN>(d, da + 2 * kk, db + 2 * kk, kt > 0 || kk > 0 ? 1 : 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    if (kt > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev);
    prev = stage;
    if (++stage == S) {
      stage = 0;
      phase ^= 1;
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if (lane == 0) mbar_arrive(empty_bar + 8 * prev);
}
#endif

template <int BM, bool TMA_A>
__global__ void __launch_bounds__(kWsThreads, 1)
    wgmma_ws_kernel(const GroupedGemmArgs g, const __grid_constant__ CUtensorMap tmap_b,
                    const __grid_constant__ CUtensorMap tmap_a,
                    const __grid_constant__ CUtensorMap tmap_out, int group, int flags) {
#if FLEX_HAS_WGMMA
  constexpr int S = ws_stages<BM>();
  constexpr int kABytes = BM * 128, kBBytes = kWsBN * 128, kStageBytes = kABytes + kBBytes;
  // full: 128 producer arrivals (A by cp.async) + the expect_tx of the tensor copies;
  // empty: lane 0 of each consumer warp.
  // Unit queue readers: the 8 consumer warps and the producer's (with TMA_A its thread 0).
  const Ring ring = setup_ring<S, kStageBytes>(TMA_A ? 1 : 128 + 1, 8, tmap_b, TMA_A ? 9 : 12);
  const uint32_t smem = ring.smem, full_bar = ring.full_bar, empty_bar = ring.empty_bar;
  const UnitQueue queue{empty_bar + 8 * S, empty_bar + 8 * S + 8 * kUnitSlots,
                        empty_bar + 8 * S + 16 * kUnitSlots};
  const bool tma_store = (flags & kWsTmaStore) != 0;
  const bool split_tail = (flags & kWsSplitTail) != 0;
  int32_t* const counter = (flags & kWsDynamic) != 0 ? g.sched : nullptr;
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  const int nb = g.n / kWsBN;
  const int num_tiles = *g.num_tiles;
  const int total = num_tiles * nb;
  const int K = g.k, num_k_tiles = K / kWgBK;

  // setmaxnreg: the consumers' increase must be covered by what the producer releases
  // from the 168 registers a thread starts with (P + 2 C <= 3 x 168), else it waits
  // forever (a 96 / 208 split hung a GPU run). 40 / 232 (as CUTLASS): with 56 / 224 the
  // BM = 128 consumers spilled 60 bytes (ptxas -v; 24 now, outside the K loop) and ran
  // 2-3 % slower (H200, interleaved: Qwen3 4096 tokens 838 -> 813 us a layer, 16384
  // 2646 -> 2600; DeepSeek-V3 4096 8536 -> 8249).
  static_assert(40 + 2 * 232 <= 3 * 168, "setmaxnreg budget");
  if (wg == 0) {
    // Producer.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    int stage = 0, j = 0;
    uint32_t phase = 0;
    int next = tid == 0 && counter != nullptr ? atomicAdd(counter, 1) : blockIdx.x;
    for (int n = 0; !TMA_A || tid == 0; ++n) {
      const int u = take_unit(queue, n, tid == 0, next, TMA_A);
      if (u >= total) break;
      if (counter == nullptr) next = u + gridDim.x;
      int tile, nblk;
      ws_unit(u, num_tiles, nb, group, tile, nblk);
      produce_unit<S, BM, kWsBN, TMA_A>(g, tmap_a, tmap_b, tile, nblk * kWsBN, smem, full_bar,
                                        empty_bar, stage, phase, j, counter, &next, split_tail);
    }
    produce_done<S, TMA_A>(full_bar, j);
    if (counter != nullptr && tid == 0) {
      // The last CTA past the end zeroes the counter for the next launch: every other
      // CTA's last take came before its ticket. (Launches sharing the counter must not
      // overlap: no programmatic dependent launch here.)
      __threadfence();
      if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        __threadfence();
        atomicExch(counter, 0);
        atomicExch(counter + 1, 0);
      }
    }
  } else {
    // Consumers.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    constexpr int CN = BM == 128 ? 256 : 128;  // Columns per consumer.
    const int c = wg - 1;
    const int warp = (tid % 128) / 32, lane = tid % 32;
    const uint32_t a_off = BM == 128 ? c * 64 * 128 : 0;
    const uint32_t b_off = kABytes + (BM == 128 ? 0 : c * 128 * 128);
    const uint32_t epi_buf = smem + S * kStageBytes + 1024 + c * kEpiBufBytes;  // BM = 128.
    int stage = 0;
    uint32_t phase = 0;
    for (int n = 0;; ++n) {
      const int u = take_unit(queue, n, false, 0, false);
      if (u >= total) break;
      int tile, nblk;
      ws_unit(u, num_tiles, nb, group, tile, nblk);
      const int n0 = nblk * kWsBN + (BM == 128 ? 0 : c * 128);
      const int slot = g.tile_slot[tile];
      const int m0 = g.tile_row0[tile] + (BM == 128 ? c * 64 : 0);
      const int row_end = g.offsets[slot + 1];
      if (BM == 128 && split_tail && row_end - g.tile_row0[tile] <= 64) {
        // A slot's last tile of at most 64 rows: both consumers on its rows, consumer c on
        // columns 128c.. (m64n128), as in BM = 64, instead of one on all 256 columns.
        float e[64];
        consume_unit<128, S, kStageBytes>(e, smem, 0, kABytes + c * 128 * 128, full_bar, empty_bar,
                                          num_k_tiles, lane, stage, phase);
        store_block<128>(g, e, g.tile_row0[tile], row_end, nblk * kWsBN + c * 128, warp, lane);
        continue;
      }
      if (m0 >= row_end) {
        // No rows here: only pass the stages on.
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
      float d[CN / 2];
      consume_unit<CN, S, kStageBytes>(d, smem, a_off, b_off, full_bar, empty_bar, num_k_tiles,
                                       lane, stage, phase);
      if (BM == 128 && tma_store && m0 + 64 <= row_end) {
        store_block_tma<CN>(g, d, tmap_out, epi_buf, m0, n0, warp, lane, 1 + c);
      } else {
        store_block<CN>(g, d, m0, row_end, n0, warp, lane);
      }
    }
    // The shared memory must outlive the copy engine's reads, and the stores must be
    // done when the kernel is.
    if (BM == 128 && tma_store && warp == 0 && lane == 0) bulk_wait_all();
  }
#endif
}

// ---------------------------------------------------------------------------
// The ping-pong kernel (tile kWgmmaPp128): the same producer warpgroup and ring as
// wgmma_ws_kernel, but each consumer warpgroup owns whole units of 128 x 128 (two
// m64n128 accumulator blocks, 128 registers) and the two consumers alternate: the
// CTA walks unit pairs p = blockIdx.x, + gridDim.x, ... (units 2p, 2p + 1: adjacent
// tiles of one column block, so they share B in L2); consumer c takes unit 2p + c.
// The producer fills the ring in unit order, so while one consumer stores its unit
// (epilogue) the other one's stages are already there and the tensor cores keep
// running. Named barriers order the mainloops (consumer 0, 1, 0, ...): a consumer
// starts waiting on its stages only after the other has passed all of its own, which
// keeps every `full` wait within one phase of the barrier (the parity rule). A unit
// whose rows 64..127 lie past the slot's end issues only its first block.
constexpr int kPpBM = 128, kPpBN = 128, kPpStages = 6;
constexpr size_t pp_smem_bytes() {
  return static_cast<size_t>(kPpStages) * (kPpBM + kPpBN) * 128 + 1024 + 2 * kPpStages * 8;
}

template <bool TMA_A>
__global__ void __launch_bounds__(kWsThreads, 1)
    wgmma_pp_kernel(const GroupedGemmArgs g, const __grid_constant__ CUtensorMap tmap_b,
                    const __grid_constant__ CUtensorMap tmap_a, int group) {
#if FLEX_HAS_WGMMA
  constexpr int S = kPpStages, BM = kPpBM, BN = kPpBN;
  constexpr int kABytes = BM * 128, kBBytes = BN * 128, kStageBytes = kABytes + kBBytes;
  // empty: lane 0 of each warp of the consumer using the stage.
  const Ring ring = setup_ring<S, kStageBytes>(TMA_A ? 1 : 128 + 1, 4, tmap_b);
  const uint32_t smem = ring.smem, full_bar = ring.full_bar, empty_bar = ring.empty_bar;
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  const int nb = g.n / BN;
  const int num_tiles = *g.num_tiles;
  const int total = num_tiles * nb;
  const int K = g.k, num_k_tiles = K / kWgBK;

  static_assert(40 + 2 * 232 <= 3 * 168, "setmaxnreg budget (see wgmma_ws_kernel)");
  if (wg == 0) {
    // Producer (as in wgmma_ws_kernel), units in pair order.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    int stage = 0, j = 0;
    uint32_t phase = 0;
    if (!TMA_A || tid == 0) {
      for (int u = 2 * blockIdx.x; u < total; u += (u & 1) ? 2 * gridDim.x - 1 : 1) {
        int tile, nblk;
        ws_unit(u, num_tiles, nb, group, tile, nblk);
        produce_unit<S, BM, BN, TMA_A>(g, tmap_a, tmap_b, tile, nblk * BN, smem, full_bar,
                                       empty_bar, stage, phase, j);
      }
    }
    produce_done<S, TMA_A>(full_bar, j);
  } else {
    // Consumers.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int c = wg - 1;
    const int warp = (tid % 128) / 32, lane = tid % 32;
    int it = 0;
    for (int p = blockIdx.x; 2 * p < total; p += gridDim.x, ++it) {
      const int u = 2 * p + c;
      if (u >= total) break;
      int tile, nblk;
      ws_unit(u, num_tiles, nb, group, tile, nblk);
      const int n0 = nblk * BN;
      const int slot = g.tile_slot[tile];
      const int m0 = g.tile_row0[tile];
      const int row_end = g.offsets[slot + 1];
      const bool two = m0 + 64 < row_end;
      // This consumer's first ring position: units 0 .. 2 it + c - 1 of this CTA came first.
      const int j0 = (2 * it + c) * num_k_tiles;
      int stage = j0 % S;
      uint32_t phase = (j0 / S) & 1;
      // Wait for the other consumer to pass its mainloop (consumer 0's first unit: none).
      if (c == 1) {
        named_bar_sync(1, 256);
      } else if (it > 0) {
        named_bar_sync(2, 256);
      }
      float d0[64], d1[64];
      int prev = 0;
      auto mainloop = [&](auto two_c) {
        constexpr bool kTwo = decltype(two_c)::value;
        for (int kt = 0; kt < num_k_tiles; ++kt) {
          mbar_wait(full_bar + 8 * stage, phase);
          const uint32_t base = smem + stage * kStageBytes;
          const uint64_t da = smem_desc(base);
          const uint64_t db = smem_desc(base + kABytes);
          asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
          for (int kk = 0; kk < kWgBK / 16; ++kk) {
            const int sc = kt > 0 || kk > 0 ? 1 : 0;
            wgmma_m64n128k16(d0, da + 2 * kk, db + 2 * kk, sc);
            // Rows 64..127: 64 * 128 bytes further (>> 4 in the descriptor).
            if (kTwo) wgmma_m64n128k16(d1, da + 2 * kk + (64 * 128 >> 4), db + 2 * kk, sc);
          }
          asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
          asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
          if (kt > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev);
          prev = stage;
          if (++stage == S) {
            stage = 0;
            phase ^= 1;
          }
        }
      };
      if (two) {
        mainloop(std::true_type{});
      } else {
        mainloop(std::false_type{});
      }
      // Let the other consumer's mainloop start while these wgmma drain and store.
      if (c == 0) {
        if (u + 1 < total) named_bar_arrive(1, 256);
      } else if (2 * (p + static_cast<int>(gridDim.x)) < total) {
        named_bar_arrive(2, 256);
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      if (lane == 0) mbar_arrive(empty_bar + 8 * prev);
      store_block<kPpBN>(g, d0, m0, row_end, n0, warp, lane);
      if (two) store_block<kPpBN>(g, d1, m0 + 64, row_end, n0, warp, lane);
    }
  }
#endif
}

__global__ void wgmma_probe_kernel(int* out) { *out = FLEX_HAS_WGMMA; }

template <int WG, int BN>
constexpr size_t wgmma_smem_bytes() {
  return static_cast<size_t>(wg_stages<WG, BN>()) * (64 * WG + BN) * 128 + 1024;
}

template <int WG, int BN>
cudaError_t launch(const GroupedGemmArgs& g, cudaStream_t stream) {
  if (const cudaError_t err =
          ensure_smem_limit<wgmma_gemm_kernel<WG, BN>>(wgmma_smem_bytes<WG, BN>());
      err != cudaSuccess) {
    return err;
  }
  const dim3 grid(g.max_tiles, g.n / BN);
  wgmma_gemm_kernel<WG, BN><<<grid, WG * 128, wgmma_smem_bytes<WG, BN>(), stream>>>(g);
  return cudaGetLastError();
}

// The driver's cuMemGetAddressRange (driver_fn; tensor_map_source below).
using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// Tensor maps over weight buffers, encoded once per (buffer, k) and kept: weights
// never move, and launches captured into graphs copy the map into the graph node.
// A map over the rows of k bf16 elements from `ptr` to the end of its allocation,
// boxes of 64 x box_rows, 128-byte swizzle, L2 fetching `promotion` bytes (0, 64, 128 or
// 256) for each 128-byte box row; nullptr if it cannot be made. Keyed by the allocation
// too, so that a buffer freed and another allocated at the same address never reuse a
// stale map.
const CUtensorMap* rows_tensor_map(const void* ptr, int k, int box_rows, int promotion = 256) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, uint64_t, size_t, int>, CUtensorMap> cache;
  const auto [encode, p, base, size] = tensor_map_source(ptr);
  if (encode == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(ptr, k, box_rows, static_cast<uint64_t>(base), size, promotion);
  auto it = cache.find(key);
  if (it != cache.end()) return &it->second;
  const uint64_t row_bytes = static_cast<uint64_t>(k) * 2;
  const uint64_t rows = (base + size - p) / row_bytes;
  if (rows == 0 || rows > (uint64_t{1} << 31)) return nullptr;
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kWgBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapL2promotion l2 = promotion == 0     ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                                    : promotion == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                                    : promotion == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                       : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, l2,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return nullptr;
  }
  return &cache.emplace(key, map).first->second;
}

// FLEXPERT_GEMM_MAX_CTAS caps the persistent grid (tests: several units per CTA).
int max_ctas_env() { return knobs().gemm_max_ctas; }

}  // namespace

TensorMapSource tensor_map_source(const void* ptr) {
  static const EncodeTiledFn encode = driver_fn<EncodeTiledFn>("cuTensorMapEncodeTiled");
  static const AddressRangeFn range = driver_fn<AddressRangeFn>("cuMemGetAddressRange");
  TensorMapSource src;
  if (encode == nullptr || range == nullptr) return src;
  src.p = reinterpret_cast<CUdeviceptr>(ptr);
  if (range(&src.base, &src.size, src.p) != CUDA_SUCCESS || src.p % 16 != 0) return src;
  src.encode = encode;
  return src;
}

int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 132;
  }
  const int cap = max_ctas_env();
  return cap > 0 && cap < count ? cap : count;
}

namespace {

template <int BM, bool TMA_A>
cudaError_t launch_ws_kernel(const GroupedGemmArgs& g, const CUtensorMap& map_b,
                             const CUtensorMap& map_a, cudaStream_t stream) {
  // The epilogue by TMA (store_block_tma) needs a tensor map over the output rows.
  const CUtensorMap* map_out =
      BM == 128 ? rows_tensor_map(g.out, g.swiglu ? g.n / 2 : g.n, 64) : nullptr;
  if (const cudaError_t err = ensure_smem_limit<wgmma_ws_kernel<BM, TMA_A>>(ws_smem_bytes<BM>());
      err != cudaSuccess) {
    return err;
  }
  const int nb = g.n / kWsBN;
  const int64_t units = static_cast<int64_t>(g.max_tiles) * nb;
  // With a unit counter (GroupedGemmArgs::sched) the grid is persistent (#SMs CTAs) and
  // the CTAs take units in order as they get to them, like the block scheduler, so the
  // units in flight stay together and the epilogue overlaps the next unit everywhere
  // (H200, TMA stores on both, fixed walk against the counter: DeepSeek-V3 16384
  // tokens down 7215 -> 6830 us, layer 22527 -> 21774; Qwen3 1024 gate/up 222 -> 214).
  // Without one, the fixed walk b, b + grid, ...: persistent only while a slot's B is
  // small against L2, since above (DeepSeek-V3: 29-59 MB per slot and projection) the
  // CTAs sharing a B block drift apart (16384 tokens: 30.4 ms against 23.3 ms per layer
  // with a CTA per unit), and for ws128 with >= 32 units per SM, since with fewer the
  // fixed walk balances worse than in-order block launch (Qwen3 4096 tokens gate/up
  // 523 against 475 us).
  const bool dynamic = g.sched != nullptr;
  const bool persist =
      dynamic ||
      (static_cast<int64_t>(g.n) * g.k * 2 <= (int64_t{16} << 20) &&
       (BM != 128 || units >= 32 * static_cast<int64_t>(sm_count()) || max_ctas_env() > 0));
  const int grid = static_cast<int>(persist ? std::min<int64_t>(units, sm_count()) : units);
  const int group = std::max(1, std::min(grid, sm_count()) / nb);
  // A slot's last tile of <= 64 rows splits its 256 columns between the two consumers.
  const int flags = (map_out != nullptr ? kWsTmaStore : 0) | (dynamic ? kWsDynamic : 0) |
                    (BM == 128 ? kWsSplitTail : 0);
  wgmma_ws_kernel<BM, TMA_A><<<grid, kWsThreads, ws_smem_bytes<BM>(), stream>>>(
      g, map_b, map_a, map_out != nullptr ? *map_out : map_b, group, flags);
  return cudaGetLastError();
}

template <int BM>
cudaError_t launch_ws(const GroupedGemmArgs& g, cudaStream_t stream) {
  // L2 promotion of the operands' loads: 128 bytes (what a box row reads) for ws128, 256
  // otherwise. Two H200s, same-run A/B (docs/cuda.md): with 128, DeepSeek-V3's gate/up at
  // 4096 tokens (ws128, ~128 rows a slot, the weights streamed from DRAM) took 5-7 % less
  // on both (5.74 -> 5.45 ms, 5.97 -> 5.63); at 16384 ~1 % more on both; ws64 at 1024
  // tokens 1-2 % less on one, 2-3 % more on the other; Qwen3 within the spread.
  const int promotion = BM == 128 ? 128 : 256;
  const CUtensorMap* map_b = g.slot_stride % g.k == 0 && g.weight_offset % g.k == 0
                                 ? rows_tensor_map(g.weights, g.k, kWsBN, promotion)
                                 : nullptr;
  if (map_b == nullptr) {  // Same tile rows, no tensor map.
    return BM == 128 ? launch<2, 256>(g, stream) : launch<1, 128>(g, stream);
  }
  // Contiguous A rows (no gather) come by tensor copies too.
  const CUtensorMap* map_a =
      g.gather == nullptr ? rows_tensor_map(g.a, g.k, BM, promotion) : nullptr;
  // Gathered A is signalled S - 2 ring steps late, and the producer posts a unit only
  // once every warp has read the one two units back: units of fewer than (S - 2) / 2 K
  // steps would wait on each other (not at model shapes: the tiles want n % 256 == 0,
  // so K >= 256 on both projections). The same tile rows without the ring, then.
  if (map_a == nullptr && 2 * (g.k / kWgBK) < ws_stages<BM>() - 2) {
    return BM == 128 ? launch<2, 256>(g, stream) : launch<1, 128>(g, stream);
  }
  if (map_a != nullptr) return launch_ws_kernel<BM, true>(g, *map_b, *map_a, stream);
  return launch_ws_kernel<BM, false>(g, *map_b, *map_b, stream);
}

template <bool TMA_A>
cudaError_t launch_pp_kernel(const GroupedGemmArgs& g, const CUtensorMap& map_b,
                             const CUtensorMap& map_a, cudaStream_t stream) {
  if (const cudaError_t err = ensure_smem_limit<wgmma_pp_kernel<TMA_A>>(pp_smem_bytes());
      err != cudaSuccess) {
    return err;
  }
  const int nb = g.n / kPpBN;
  const int64_t pairs = (static_cast<int64_t>(g.max_tiles) * nb + 1) / 2;
  // Persistent under the same rule as wgmma_ws (a slot's B <= 16 MB); otherwise one
  // CTA per unit pair.
  const bool persist = static_cast<int64_t>(g.n) * g.k * 2 <= (int64_t{16} << 20);
  const int grid = static_cast<int>(persist ? std::min<int64_t>(pairs, sm_count()) : pairs);
  // About 2 units per CTA are in flight (one in its mainloop, one storing).
  const int group = std::max(1, 2 * std::min(grid, sm_count()) / nb);
  wgmma_pp_kernel<TMA_A><<<grid, kWsThreads, pp_smem_bytes(), stream>>>(g, map_b, map_a, group);
  return cudaGetLastError();
}

cudaError_t launch_pp(const GroupedGemmArgs& g, cudaStream_t stream) {
  const CUtensorMap* map_b = g.slot_stride % g.k == 0 && g.weight_offset % g.k == 0
                                 ? rows_tensor_map(g.weights, g.k, kPpBN)
                                 : nullptr;
  if (map_b == nullptr) return launch<2, 128>(g, stream);  // Same tile rows, no tensor map.
  const CUtensorMap* map_a = g.gather == nullptr ? rows_tensor_map(g.a, g.k, kPpBM) : nullptr;
  if (map_a != nullptr) return launch_pp_kernel<true>(g, *map_b, *map_a, stream);
  return launch_pp_kernel<false>(g, *map_b, *map_b, stream);
}

int probe() {
  int* flag = nullptr;
  int host = 0;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return 0;
  wgmma_probe_kernel<<<1, 1>>>(flag);
  const bool ok = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(flag);
  (void)cudaGetLastError();
  return ok ? host : 0;
}

}  // namespace

bool wgmma_available() {
  static const bool available = probe() == 1;
  return available;
}

bool wgmma_fits(int n, int k, int bn) { return n % bn == 0 && k % kWgBK == 0; }

cudaError_t launch_wgmma_ws_gemm(int bm, const GroupedGemmArgs& args, cudaStream_t stream) {
  return bm == 128 ? launch_ws<128>(args, stream) : launch_ws<64>(args, stream);
}

cudaError_t launch_wgmma_pp_gemm(const GroupedGemmArgs& args, cudaStream_t stream) {
  return launch_pp(args, stream);
}

cudaError_t launch_wgmma_gemm(int warpgroups, int bn, const GroupedGemmArgs& args,
                              cudaStream_t stream) {
  if (bn == 256) return launch<2, 256>(args, stream);
  return warpgroups == 2 ? launch<2, 128>(args, stream) : launch<1, 128>(args, stream);
}

}  // namespace flexpert::cuda
