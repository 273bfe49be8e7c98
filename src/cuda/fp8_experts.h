// SPDX-License-Identifier: Apache-2.0
// Routed experts kept in FP8 on the GPU: e4m3 weights with one f32 scale per 128 x 128
// block, as block-FP8 checkpoints store them (DeepSeek-V3: `weight_block_size` [128, 128],
// scales in `*.weight_scale_inv`; w = e4m3 * scale). One slot is one byte range (layout
// below) holding the weights and their scales, so a copy of a slot's bytes moves both.
// Every kernel computes on e4m3 activations, one scale per row and 128 columns (scale =
// absmax / 448), as FP8 wgmma takes them, so that a token's result depends on the path its
// batch takes only through the order of f32 sums (docs/cuda.md, "FP8 experts"); f32
// accumulation:
//   - decode: per (token, k) pair, a warp per gate/up row pair (SwiGLU into act), then a
//     warp per (token, output column) summing the top-k down rows, weighted, into out; each
//     quantizes its activations in registers;
//   - grouped on Hopper's FP8 tensor cores (fp8_wgmma_gemm): the rows quantized by
//     fp8_quantize_rows, e4m3 wgmma with the block scales applied per 128 K;
//   - grouped elsewhere (fp8_grouped_gemm): the same quantized rows and the weights' codes
//     through the mma.sync bf16 tile, the block scales applied per 128 K alike.
// Enqueue only, no host synchronisation; capturable in CUDA graphs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/grouped_gemm.h"

namespace flexpert::cuda {

constexpr int kFp8BlockSize = 128;  // Rows and columns of one scale block.
constexpr int kFp8GemmRows = 64;    // Rows per tile of fp8_grouped_gemm (permute's block_m).

constexpr int64_t fp8_blocks(int64_t n) { return (n + kFp8BlockSize - 1) / kFp8BlockSize; }
constexpr int64_t fp8_round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Byte layout of one FP8 expert slot (H hidden, I intermediate; both multiples of 8):
//   [0, 2 I H)          gate/up e4m3 [2I, H], interleaved by 8 rows as grouped_gemm.h's
//                       bf16 slots (rows 16b..16b+7 gate rows 8b.., 16b+8.. up rows 8b..)
//   [2 I H, 3 I H)      down e4m3 [H, I]
//   scales_at()         f32 gate scales [blocks(I), blocks(H)], then up scales (same shape)
//   down_scales_at()    f32 down scales [blocks(H), blocks(I)]
// A slot is slot_bytes() long (a multiple of 256), so slot starts keep cudaMalloc's alignment.
struct Fp8SlotLayout {
  int64_t hidden = 0, intermediate = 0;

  int64_t down_at() const { return 2 * intermediate * hidden; }
  int64_t gate_up_scale_rows() const { return fp8_blocks(intermediate); }  // Each of gate, up.
  int64_t gate_up_scale_cols() const { return fp8_blocks(hidden); }
  int64_t down_scale_rows() const { return fp8_blocks(hidden); }
  int64_t down_scale_cols() const { return fp8_blocks(intermediate); }
  int64_t scales_at() const { return fp8_round_up(3 * intermediate * hidden, 16); }
  int64_t down_scales_at() const {
    return scales_at() + 2 * gate_up_scale_rows() * gate_up_scale_cols() * 4;
  }
  int64_t slot_bytes() const {
    return fp8_round_up(down_scales_at() + down_scale_rows() * down_scale_cols() * 4, 256);
  }
};
inline Fp8SlotLayout fp8_slot_layout(int hidden, int intermediate) {
  return Fp8SlotLayout{hidden, intermediate};
}

// The FP8 weights of one projection in every slot (device pointers).
struct Fp8Weights {
  const void* slots = nullptr;  // [num_slots][slot_bytes]
  int64_t slot_bytes = 0;
  int64_t weight_at = 0;  // Bytes from a slot's start to the e4m3 [n, k] matrix.
  int64_t scale_at = 0;   // Bytes from a slot's start to its f32 scales.
  int scale_cols = 0;     // blocks(k)
  // > 0: the gate/up projection, rows interleaved by 8 (above); its up scales start at
  // this scale row (blocks(I)). 0: plain rows, scale row = row / 128.
  int up_scale_row0 = 0;
};
Fp8Weights fp8_gate_up_weights(const void* slots, const Fp8SlotLayout& layout);
Fp8Weights fp8_down_weights(const void* slots, const Fp8SlotLayout& layout);

struct Fp8DecodeArgs {
  const void* h = nullptr;  // bf16 [T, H]
  int num_tokens = 0, hidden = 0, inter = 0, top_k = 0;
  const int32_t* slot = nullptr;  // [T * K] slot of pair t * K + k
  const float* weight = nullptr;  // [T * K] routing weight of each pair
  Fp8Weights gate_up, down;
  void* act = nullptr;   // bf16 [T * K, I], by pair
  float* out = nullptr;  // f32 [T, H]
  bool accumulate = false;
};
// act[p, i] = silu(gate_i . h[p / K]) * (up_i . h[p / K]) through pair p's slot.
cudaError_t fp8_decode_gate_up(const Fp8DecodeArgs& args, cudaStream_t stream);
// out[t, c] (+)= sum_k weight[t K + k] * (down_c . act[t K + k]), summed in f32.
cudaError_t fp8_decode_down_combine(const Fp8DecodeArgs& args, cudaStream_t stream);

// The FP8 activations of the grouped GEMMs: rows quantized to e4m3 with one f32 scale
// per row and 128 columns (scale = absmax / 448, so a = code * scale), as DeepSeek-V3's
// FP8 inference (and DeepGEMM) take them.
struct Fp8Acts {
  void* codes = nullptr;    // e4m3 [rows_cap, k]
  float* scales = nullptr;  // f32 [blocks(k), round_up(rows_cap, 4)]
  int rows_cap = 0;
};
// Quantizes rows r < *num_rows (device) of bf16 x into `out`: row r is x[gather[r] /
// gather_div] (gather set) or x[r]; max_rows >= *num_rows bounds the grid. k % 8 == 0.
cudaError_t fp8_quantize_rows(const void* x, const int32_t* gather, int gather_div,
                              const int32_t* num_rows, int max_rows, int k, const Fp8Acts& out,
                              cudaStream_t stream);

// grouped_gemm (grouped_gemm.h) over FP8 slots, A the rows fp8_quantize_rows made (g.a
// and g.gather ignored), B the e4m3 weights `w` says where (g's slot_stride and
// weight_offset ignored), through the mma.sync bf16 tile: the same sums as
// fp8_wgmma_gemm's, on any GPU. The tile table must come from permute() with block_m =
// kFp8GemmRows and g.max_tiles = max_tiles(.., kFp8GemmRows). Needs n and k multiples of 8
// (k need not be one of 128: the last scale block is partial).
cudaError_t fp8_grouped_gemm(const GroupedGemmArgs& g, const Fp8Weights& w, const Fp8Acts& a,
                             cudaStream_t stream);

// grouped_gemm over FP8 slots on Hopper's FP8 tensor cores (fp8_wgmma_gemm.cu, sm_90a): A the
// rows fp8_quantize_rows made (g.a and g.gather ignored), B the e4m3 weights `w` says
// where, f32 accumulation with both block scales applied per 128 K (docs/cuda.md, "FP8
// experts"). The tile table from permute() with block_m = `block_m` (64, or 128 with n a
// multiple of 256) and g.max_tiles = max_tiles(.., block_m); g.sched as grouped_gemm.h
// says. Needs fp8_wgmma_fits(n, k) and wgmma_available(), else cudaErrorInvalidValue.
bool fp8_wgmma_fits(int n, int k);
cudaError_t fp8_wgmma_gemm(const GroupedGemmArgs& g, const Fp8Weights& w, const Fp8Acts& a,
                           int block_m, cudaStream_t stream);

// The tile rows fp8_wgmma_gemm takes for `num_pairs` rows over `num_slots` slots of an
// [n, k] = [2 I, H] and [H, I] pair of GEMMs: 128 where the slots average at least 64
// rows and both n are multiples of 256, else 64 (FLEXPERT_FP8_WGMMA_ROWS=64|128 forces).
int fp8_wgmma_rows(int64_t num_pairs, int num_slots, int hidden, int inter);

// Whether `device` keeps FP8 weights: compute capability 8.9 or newer (Ada, Hopper), the
// GPUs with e4m3 arithmetic.
bool fp8_device_supported(int device);

}  // namespace flexpert::cuda
