// SPDX-License-Identifier: Apache-2.0
// The grouped expert GEMM: one launch computes every slot's rows of one projection.
//
// Rows are grouped by slot (permute() in kernels.h builds offsets and a tile table
// on the device), so the launch needs no host-side sizes: its grid is an upper
// bound on tiles (max_tiles) times N / BN, and blocks past *num_tiles exit. For
// slot s, rows [offsets[s], offsets[s + 1]) are multiplied by that slot's weight
// matrix B_s [n, k] (row-major, at weights + s * slot_stride + weight_offset):
//   out[r, :] = A[r] @ B_s^T                  (plain; out [rows, n])
//   out[r, i] = silu(g_i) * u_i               (swiglu; out [rows, n / 2])
// where for swiglu B_s interleaves gate and up rows in blocks of 8: rows
// 16b..16b+7 are gate rows 8b..8b+7 and rows 16b+8..16b+15 the up rows 8b..8b+7
// (so one thread holds a gate and its up in registers). A[r] is a[gather[r] /
// gather_div] when gather is set (token rows read in place), else a[r].
// BF16 runs on tensor cores (mma.sync m16n8k16, or Hopper wgmma on sm_90a, f32
// accumulation); F32 (verification) and shapes the tensor-core tiles do not divide
// run a plain f32 kernel. Enqueue only; capturable in CUDA graphs (the wgmma_ws tiles
// encode a tensor map per weight / activation buffer on the host at launch and keep
// it, keyed by the buffer's address and allocation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flexpert/dtype.h"

namespace flexpert::cuda {

// Tile shapes (rows per tile BM x columns BN). kSimt: f32 / fallback (64 x 64);
// kMma*: mma.sync, 16 x 64, 64 x 128, 128 x 128, 16 x 32 (decode: more, smaller blocks),
// 16 x 64 with K steps of 128 (longer runs per weight row);
// kWgmma*: Hopper wgmma, 64 x 128, 128 x 128 and 128 x 256 (sm_90a builds only);
// kWgmmaWs*: Hopper wgmma, warp-specialised and persistent (a producer warpgroup
// loading B by tensor copies and A by cp.async into an mbarrier ring, two consumer
// warpgroups), 128 x 256 and 64 x 256;
// kWgmmaPp128: the same producer, consumers in ping-pong (each warpgroup on its own
// 128 x 128 unit, one's epilogue under the other's mainloop);
// kWgmmaWs128Pp: kWgmmaWs128 where A is gathered (gate/up), kWgmmaPp128 where A is
// contiguous and comes by tensor copies (down); same 128-row tile table;
// kGemv: 4 rows per tile, one warp per pair of weight rows streaming whole rows with
// 16-byte loads (decode: few rows per expert, bandwidth from many loads in flight).
enum class GemmTile : int {
  kSimt = 0,
  kMma16 = 1,
  kMma64 = 2,
  kMma128 = 3,
  kMma16N32 = 4,
  kWgmma64 = 5,
  kWgmma128 = 6,
  kMma16K128 = 7,
  kGemv = 8,
  kWgmma128N256 = 9,
  kWgmmaWs128 = 10,
  kWgmmaWs64 = 11,
  kWgmmaPp128 = 12,
  kWgmmaWs128Pp = 13,
};
constexpr int kNumGemmTiles = 14;
const char* tile_name(GemmTile tile);

struct GroupedGemmArgs {
  const void* a = nullptr;
  const int32_t* gather = nullptr;
  int gather_div = 1;
  const void* weights = nullptr;
  int64_t slot_stride = 0;    // Elements between consecutive slots' weights.
  int64_t weight_offset = 0;  // Elements from a slot's start to this projection's B.
  int n = 0, k = 0;
  bool swiglu = false;
  const int32_t* offsets = nullptr;  // [num_slots + 1]
  const int32_t* tile_slot = nullptr;
  const int32_t* tile_row0 = nullptr;
  const int32_t* num_tiles = nullptr;
  int max_tiles = 0;
  void* out = nullptr;
  // Two ints, zero between launches (null: none). The persistent warp-specialised tiles
  // then hand out work units from a counter instead of a fixed walk; launches sharing
  // it must not overlap (one stream, no programmatic dependent launch).
  int32_t* sched = nullptr;
};

int tile_rows(GemmTile tile);
// Whether `tile` can run a GEMM of this dtype and shape.
bool tile_supports(GemmTile tile, DType dtype, int n, int k);
// Picks the tile for both expert GEMMs of a layer (gate/up: n = 2 * inter, k = hidden;
// down: n = hidden, k = inter) from the expected rows per expert.
GemmTile choose_tile(DType dtype, int64_t num_pairs, int num_experts, int hidden, int inter);
// Upper bound of the tile count for num_pairs rows over num_slots slots.
int max_tiles(int64_t num_pairs, int num_slots, int block_m);

cudaError_t grouped_gemm(DType dtype, GemmTile tile, const GroupedGemmArgs& args,
                         cudaStream_t stream);

// Whether this build and device run the wgmma tiles (probed once; call it outside
// graph capture first, e.g. at load).
bool wgmma_available();
// wgmma_gemm.cu: the wgmma tiles (warpgroups 1 or 2 = 64 or 128 rows).
bool wgmma_fits(int n, int k, int bn);
cudaError_t launch_wgmma_gemm(int warpgroups, int bn, const GroupedGemmArgs& args,
                              cudaStream_t stream);
// The warp-specialised persistent tiles (bm = 128 or 64 rows, 256 columns).
cudaError_t launch_wgmma_ws_gemm(int bm, const GroupedGemmArgs& args, cudaStream_t stream);
// The ping-pong tile (128 x 128 units, one per consumer warpgroup).
cudaError_t launch_wgmma_pp_gemm(const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace flexpert::cuda
