// SPDX-License-Identifier: Apache-2.0
// What the Hopper wgmma GEMMs share: the bf16 tiles (wgmma_gemm.cu, grouped_gemm.h) and the
// FP8 e4m3 GEMM (fp8_wgmma_gemm.cu, fp8_experts.h). Device code, header-only: the wgmma
// instructions, the shared-memory matrix descriptor and the accumulator store; for the
// warp-specialised kernels their constants, mbarrier and TMA load wrappers, the S-stage ring,
// the unit queue and the work-unit order. Host: tensor_map_source and sm_count, defined once
// in wgmma_gemm.cu; each kind of tensor map keeps its one cache in the .cu that uses it.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/device_util.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/mma_sync.cuh"

// Arch-specific wgmma (sm_90a): elsewhere the kernels compile empty.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLEX_HAS_WGMMA 1
#else
#define FLEX_HAS_WGMMA 0
#endif

namespace flexpert::cuda {

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(16 >> 4) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= uint64_t{1} << 62;
  return d;
}

#if FLEX_HAS_WGMMA
// The wgmma wrappers' PTX, #undef'd after them. FLEX_WGMMA issues one wgmma.mma_async on the
// descriptors desc_a, desc_b (zeroing the accumulators where scale_d == 0): `instr` its
// .shape.dtype.atype.btype, `acc` the accumulator operands, `ab` the descriptors' operands,
// `pred` scale_d's, `imm` the immediates (scale-a, scale-b, and for bf16 the transposes),
// then the accumulators' constraints. FLEX_WGMMA_D64_*: the operands of 64 f32 accumulators
// d[0..63] (%0..%63), all of an m64n128 and the first half of an m64n256.
#define FLEX_WGMMA(instr, acc, ab, pred, imm, ...)                        \
  asm volatile(                                                           \
      "{\n"                                                               \
      ".reg .pred p;\n"                                                   \
      "setp.ne.b32 p, " pred                                              \
      ", 0;\n"                                                            \
      "wgmma.mma_async.sync.aligned." instr " {" acc "}, " ab ", p, " imm \
      ";\n"                                                               \
      "}\n"                                                               \
      : __VA_ARGS__                                                       \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#define FLEX_WGMMA_D64_REGS                                                                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define FLEX_WGMMA_D64_OUTS(d)                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d = 1) {
  FLEX_WGMMA("m64n128k16.f32.bf16.bf16", FLEX_WGMMA_D64_REGS, "%64, %65", "%66", "1, 1, 0, 0",
             FLEX_WGMMA_D64_OUTS(d));
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d = 1) {
  FLEX_WGMMA(
      "m64n256k16.f32.bf16.bf16",
      FLEX_WGMMA_D64_REGS
      ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
      "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "
      "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, "
      "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127",
      "%128, %129", "%130", "1, 1, 0, 0", FLEX_WGMMA_D64_OUTS(d), "+f"(d[64]), "+f"(d[65]),
      "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),
      "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]),
      "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]),
      "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]),
      "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]),
      "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]),
      "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),
      "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]),
      "+f"(d[125]), "+f"(d[126]), "+f"(d[127]));
}

template <int BN>
__device__ __forceinline__ void wgmma_tile(float (&d)[BN / 2], uint64_t desc_a, uint64_t desc_b,
                                           int scale_d = 1) {
  if constexpr (BN == 256) {
    wgmma_m64n256k16(d, desc_a, desc_b, scale_d);
  } else {
    wgmma_m64n128k16(d, desc_a, desc_b, scale_d);
  }
}

__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d) {
  FLEX_WGMMA("m64n128k32.f32.e4m3.e4m3", FLEX_WGMMA_D64_REGS, "%64, %65", "%66", "1, 1",
             FLEX_WGMMA_D64_OUTS(d));
}

#undef FLEX_WGMMA
#undef FLEX_WGMMA_D64_REGS
#undef FLEX_WGMMA_D64_OUTS
#endif

// Stores a warpgroup's 64 x CN accumulator block at rows m0.. (below row_end) and
// columns n0..: accumulator i of a thread is row 16 * warp + lane / 4 + 8 * ((i / 2) % 2),
// column 8 * (i / 4) + 2 * (lane % 4) + i % 2; SwiGLU pairs gate block j with up block
// j + 1 (grouped_gemm.h's interleave) into one output block of 8 columns.
template <int CN>
__device__ __forceinline__ void store_block(const GroupedGemmArgs& g, const float (&d)[CN / 2],
                                            int m0, int row_end, int n0, int warp, int lane) {
  const int q = lane % 4;
  bf16* out = static_cast<bf16*>(g.out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = m0 + warp * 16 + lane / 4 + half * 8;
    if (r >= row_end) continue;
    if (g.swiglu) {
      bf16* o = out + static_cast<int64_t>(r) * (g.n / 2);
#pragma unroll
      for (int j = 0; j < CN / 8; j += 2) {
        const int gn = n0 + 8 * j;  // Gate block; j + 1 holds the up block.
        const float* gate = &d[4 * j + 2 * half];
        const float* up = &d[4 * (j + 1) + 2 * half];
        *reinterpret_cast<__nv_bfloat162*>(o + (gn / 16) * 8 + 2 * q) =
            __floats2bfloat162_rn(silu(gate[0]) * up[0], silu(gate[1]) * up[1]);
      }
    } else {
      bf16* o = out + static_cast<int64_t>(r) * g.n;
#pragma unroll
      for (int j = 0; j < CN / 8; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(o + n0 + 8 * j + 2 * q) =
            __floats2bfloat162_rn(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
      }
    }
  }
}

// wgmma_ws_kernel's tile columns; the threads of every warp-specialised kernel (a producer
// and two consumer warpgroups: wgmma_gemm.cu describes the pipeline).
constexpr int kWsBN = 256, kWsThreads = 384;
// wgmma_ws_kernel's flags: the epilogue by TMA (store_block_tma), units handed out by
// GroupedGemmArgs::sched.
// A tile of at most 64 rows (a slot's last) split between the consumers by columns.
constexpr int kWsTmaStore = 1, kWsDynamic = 2, kWsSplitTail = 4;

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "WS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra WS_DONE;\n"
      "bra WS_WAIT;\n"
      "WS_DONE:\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile(
      "{\n"
      ".reg .b64 st;\n"
      "mbarrier.arrive.shared::cta.b64 st, [%0];\n"
      "}\n" ::"r"(bar)
      : "memory");
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Work unit u -> (tile, column block): tiles in groups of `group` (the last one may be
// shorter), column-block-major inside a group, so that the tiles of one slot reading
// the same B block run side by side and a tile's A rows stay in L2 across its blocks.
__device__ __forceinline__ void ws_unit(int u, int num_tiles, int nb, int group, int& tile,
                                        int& nblk) {
  const int gi = u / (group * nb), r = u - gi * group * nb;
  const int t0 = gi * group, gsz = min(group, num_tiles - t0);
  nblk = r / gsz;
  tile = t0 + (r - nblk * gsz);
}

// The CTA's unit queue (wgmma_ws_kernel): producer thread 0 posts the CTA's n-th work
// unit `unit` (taken from GroupedGemmArgs::sched, or the fixed walk) in slot
// n % kUnitSlots (`full`, one arrival); each reader warp frees the slot (`empty`, lane 0
// after the warp's reads), or a lone reader thread. 12 bytes per slot after the ring's
// mbarriers.
constexpr int kUnitSlots = 2;
struct UnitQueue {
  uint32_t full, empty, val;  // kUnitSlots mbarriers, kUnitSlots mbarriers, kUnitSlots ints.
};
__device__ __forceinline__ int take_unit(const UnitQueue& q, int n, bool poster, int unit,
                                         bool lone) {
  const int i = n % kUnitSlots;
  const uint32_t parity = (n / kUnitSlots) & 1;
  if (poster) {
    mbar_wait(q.empty + 8 * i, parity ^ 1);
    st_shared_u32(q.val + 4 * i, static_cast<uint32_t>(unit));
    mbar_arrive(q.full + 8 * i);
  }
  mbar_wait(q.full + 8 * i, parity);
  int u;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(u) : "r"(q.val + 4 * i) : "memory");
  if (lone) {
    mbar_arrive(q.empty + 8 * i);
  } else {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(q.empty + 8 * i);
  }
  return u;
}

// Shared by the warp-specialised kernels: the S-stage ring in shared memory, and the
// producer's part of one unit.
struct Ring {
  uint32_t smem;       // Stage s at smem + s * stage bytes.
  uint32_t full_bar;   // S mbarriers: the stage holds data (producer arrivals + tx bytes).
  uint32_t empty_bar;  // S mbarriers: the consumers are done with the stage.
};
// The dynamic shared memory of a warp-specialised kernel: S stages of kStageBytes
// (1024-aligned: swizzle atoms), then the 2 S mbarriers, initialised by thread 0. Every
// thread calls it (it ends with __syncthreads).
template <int S, int kStageBytes>
__device__ __forceinline__ Ring setup_ring(int full_count, int empty_count,
                                           const CUtensorMap& tmap_b, int unit_readers = 0) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  Ring r;
  r.smem = raw + ((1024 - (raw & 1023)) & 1023);
  r.full_bar = r.smem + S * kStageBytes;
  r.empty_bar = r.full_bar + S * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(r.full_bar + 8 * s, full_count);
      mbar_init(r.empty_bar + 8 * s, empty_count);
    }
    // The unit queue (UnitQueue) after the ring's mbarriers.
    for (int i = 0; i < (unit_readers > 0 ? kUnitSlots : 0); ++i) {
      mbar_init(r.empty_bar + 8 * S + 8 * i, 1);
      mbar_init(r.empty_bar + 8 * S + 8 * kUnitSlots + 8 * i, unit_readers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmap_b))
                 : "memory");
  }
  __syncthreads();
  return r;
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// 2D tensor copy of box (x, y) into shared memory, completing on mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap& map, int x, int y,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The driver's cuTensorMapEncodeTiled (driver_fn).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// What a tensor map over memory from `p` is made from: the driver's encoder and the allocation
// [base, base + size) holding p. encode is nullptr where no map can be made (the driver lacks
// an entry point, p is not device memory or not 16-byte aligned). Each kind of map keeps its
// own cache of maps (rows_tensor_map, fp8_tensor_map), keyed by the allocation too.
struct TensorMapSource {
  EncodeTiledFn encode = nullptr;
  CUdeviceptr p = 0;
  CUdeviceptr base = 0;
  size_t size = 0;
};
// Defined in wgmma_gemm.cu (the driver's entry points looked up once).
TensorMapSource tensor_map_source(const void* ptr);

// The persistent grids' CTA count: the current device's SMs (132 if it cannot say), capped
// by FLEXPERT_GEMM_MAX_CTAS.
int sm_count();

}  // namespace flexpert::cuda
