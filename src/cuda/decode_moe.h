// SPDX-License-Identifier: Apache-2.0
// The MoE block for steps of a few tokens (decode) in three launches, bf16 only:
//   1. decode_route: router GEMV (one or two expert rows a warp, f32 logits), then one
//      block runs the softmax top-k with replica choice for every token (topk.cuh, as
//      router_topk; or DeepSeek's grouped router, grouped_topk.cuh), with the routing
//      tables copied into shared memory before the wait. Up to 128 experts the blocks
//      are one cluster and send their logits to rank 0's shared memory; more experts
//      take an atomic ticket (reset for the next launch) and the last block reads them
//      back from L2. No permutation: the next two kernels work per (token, k) pair.
//   2. decode_gate_up: act[p, :] = SwiGLU of pair p's token row through its slot's
//      gate/up rows (a warp per gate/up row pair, as the kGemv tile); and the slot
//      statistics (one thread per pair).
//   3. decode_down_combine: each block owns a token and 8 output columns; warp k
//      computes pair k's down outputs for them (rounded to the element type, as the
//      unfused y), then out[t, c] (+)= sum_k weight * y, summed in k order in f32.
// The arithmetic per output is that of the kGemv tile and combine() (same per-lane
// order and warp reduction), so only the router logits differ from the unfused path
// (cuBLAS there), by rounding.
// Launches use programmatic dependent launch (sm_90, also inside CUDA graphs): each
// kernel waits (griddepcontrol.wait) before it reads its predecessor's outputs and
// only then lets its successor start, so the successor may load weights early: the
// router its weights and tables, the down kernel its first rows (slot[] is final by
// then) and the old values of `out` it adds to. Hence, with `accumulate`, the down
// kernel must directly follow this call's gate/up kernel, and `out` must not be written
// by the two kernels before it (route and gate/up write only h, logits, the top-k
// arrays, act and the statistics).
// FLEXPERT_NO_PDL=1 in the environment launches them plainly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/mla_kernels.h"

namespace flexpert::cuda {

constexpr int kDecodeMaxTokens = 8;
constexpr int kDecodeDownWarps = 8;  // Warps of the down + combine kernel's blocks.

struct DecodeMoeArgs {
  const void* h = nullptr;        // bf16 [T, H]
  const void* router = nullptr;   // bf16 [E, H]
  const void* weights = nullptr;  // slots, as GroupedGemmArgs::weights
  int64_t slot_stride = 0;        // elements per slot (3 H I)
  int num_tokens = 0, hidden = 0, inter = 0;
  int num_slots = 0;          // entries of topk.rep_slots (0: the route kernel reads them in place)
  TopkArgs topk;              // logits (f32 [T, E], written here) .. slot
  int32_t* ticket = nullptr;  // zeroed i32; the route kernel leaves it 0
  int64_t* slot_stats = nullptr;              // may be null
  const int32_t* num_valid_tokens = nullptr;  // may be null (all tokens count)
  void* act = nullptr;                        // bf16 [T * K, I]
  float* out = nullptr;                       // f32 [T, H]
  bool accumulate = false;
  // With norm_x (f32 [T, H]): h = rms_norm(norm_x) with norm_weight, computed by the
  // route kernel (every block for its router rows, bit for bit as rms_norm) and written
  // by its block 0 to norm_out (bf16 [T, H], the h of the next two kernels), so the
  // RMSNorm before the MoE is not a kernel of its own. decode_route_norm_fits.
  const float* norm_x = nullptr;
  const float* norm_weight = nullptr;
  float norm_eps = 0.f;
  void* norm_out = nullptr;
  // With use_grouped: DeepSeek's router (grouped_topk's arithmetic, per token by a warp
  // of the last block) in place of the softmax top-k; its logits, expert, weight and
  // slot arrays must be topk's.
  bool use_grouped = false;
  GroupedTopkArgs grouped{};
  // With shared_inter > 0: each token's shared experts (DeepSeek) in the same two
  // kernels, as shared_pieces(shared_inter, inter) more pairs a token, piece s taking
  // intermediate columns [s * inter, (s + 1) * inter): gate/up rows of shared_gu (bf16
  // [2 Is, H], gate rows then up rows, the dense MLP's layout) into shared_act (bf16 [T,
  // Is]), then shared_down (bf16 [H, Is]) added to the token's combine unweighted, in f32.
  const void* shared_gu = nullptr;
  const void* shared_down = nullptr;
  int shared_inter = 0;
  int shared_pieces = 0;  // shared_pieces(shared_inter, inter)
  void* shared_act = nullptr;
};

// The pieces of `inter` columns (the routed experts') a token's shared experts of
// shared_inter columns take in the decode kernels.
constexpr int shared_pieces(int shared_inter, int inter) {
  return shared_inter > 0 ? (shared_inter + inter - 1) / inter : 0;
}

// Whether the three kernels take this shape (bf16; T <= kDecodeMaxTokens, H and I
// multiples of 8, top-k and experts as router_topk; shared experts of shared_inter
// columns, a multiple of 8, only where their pieces take warps of the down kernel that
// the routed pairs leave idle: top-k + pieces <= kDecodeDownWarps. H200, DeepSeek-V3
// shapes (top-8 and one piece: a second pass for one warp of every block) at batch 2:
// 2.12 ms a step against 2.05 with the shared experts after the MoE; V2-Lite (top-6, two
// pieces) at batch 1: 0.83 against 0.88).
bool decode_moe_supported(int num_tokens, int hidden, int inter, int num_experts, int top_k,
                          int shared_inter = 0);

// Whether decode_route can normalise h itself (H % 4 == 0, H <= 8192, T x H bf16 within
// kGemvNormSmemBytes of shared memory).
bool decode_route_norm_fits(int num_tokens, int hidden);

// The blocks of the cluster the route kernel runs as for num_experts (up to 128: one or
// two experts a warp), or 0 where it takes the ticket: more experts,
// FLEXPERT_NO_ROUTE_CLUSTER=1, or a device that cannot hold such a cluster (asked once
// per device, cudaOccupancyMaxActiveClusters).
int decode_route_cluster_blocks(int num_experts);
cudaError_t decode_route(const DecodeMoeArgs& args, cudaStream_t stream);
cudaError_t decode_gate_up(const DecodeMoeArgs& args, cudaStream_t stream);
cudaError_t decode_down_combine(const DecodeMoeArgs& args, cudaStream_t stream);

}  // namespace flexpert::cuda
