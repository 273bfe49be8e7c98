// SPDX-License-Identifier: Apache-2.0
// The tensor-core building blocks of the mma.sync kernels (grouped_gemm.cu's tiles, the
// prefill attention tiles): cp.async copies into shared memory, ldmatrix, and the bf16
// m16n8k16 product with f32 accumulation. Device code, header-only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flexpert::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, not through registers.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
// The same, reading src_bytes (0 or 16) of gmem and filling the rest with zeros.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 8 b16 matrices, thread i giving row i % 8 of matrix i / 8; thread t receives
// row t / 4, elements 2 (t % 4) and + 1 of each (.trans: of each transposed).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c (16 x 8, f32) += a (16 x 16, bf16, row-major) b (16 x 8, bf16, "col": b[k][n]).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One warp's share of a block tile over `bk` columns of k: rows a_row0 .. a_row0 + 16 MI of
// `a` (row-major, stride lds) times rows b_row0 .. b_row0 + 8 NI of `b` (n-major: b[n][k],
// stride lds), both bf16 in shared memory, accumulated into acc (f32, mma.sync fragments).
template <int MI, int NI, int BK>
__device__ __forceinline__ void warp_tile_mma(float (&acc)[MI][NI][4], const __nv_bfloat16* a,
                                              const __nv_bfloat16* b, int lds, int a_row0,
                                              int b_row0, int lane) {
  static_assert(NI % 2 == 0, "B fragments are loaded in pairs");
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    uint32_t af[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      ldmatrix_x4(af[mi], a + (a_row0 + mi * 16 + (lane % 16)) * lds + kk + (lane / 16) * 8);
    }
    uint32_t bfr[NI][2];
#pragma unroll
    for (int nj = 0; nj < NI; nj += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, b + (b_row0 + nj * 8 + (lane % 8) + (lane / 16) * 8) * lds + kk +
                         ((lane / 8) % 2) * 8);
      bfr[nj][0] = r[0];
      bfr[nj][1] = r[1];
      bfr[nj + 1][0] = r[2];
      bfr[nj + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) mma_bf16_16816(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
  }
}

}  // namespace flexpert::cuda
