// SPDX-License-Identifier: Apache-2.0
// The MoE block on one GPU: router GEMM -> softmax top-k with replica choice ->
// permutation by slot -> grouped gate/up GEMM with SwiGLU -> grouped down GEMM
// -> weighted combine (summed in k order), as src/moe/moe_layer.h on the CPU.
//
// Every step is a kernel on one stream with no host synchronisation, so a
// captured graph stays valid while routing tables (logical expert -> replica
// slots) are rewritten in place. Slot weights of a layer are one buffer
// [num_slots][gate/up (2I x H, interleaved by 8 rows, see grouped_gemm.h) | down (H x I)].
// A MoeScratch is sized once for a token capacity; run_moe never allocates.
// Not thread-safe: one stream, one driver thread.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/blas.h"
#include "cuda/device.h"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels.h"
#include "cuda/mla_kernels.h"
#include "flexpert/dtype.h"
#include "flexpert/status.h"

namespace flexpert::cuda {

struct MoeDims {
  DType dtype = DType::kBF16;  // Weights and GEMM inputs (F32 or BF16).
  int hidden = 0;
  int intermediate = 0;
  int num_experts = 0;
  int top_k = 0;
  int num_slots = 0;
  bool norm_topk_prob = true;
  // Routed expert weights kept in FP8 (e4m3 with 128 x 128 block scales, slots laid out as
  // fp8_experts.h says); dtype stays kBF16 for activations and the router.
  bool fp8 = false;

  int64_t slot_elems() const { return 3 * static_cast<int64_t>(hidden) * intermediate; }
  // Bytes of one slot: slot_elems() elements of dtype, or the FP8 layout.
  int64_t slot_bytes() const;
  Status validate() const;
};

// Device pointers of one layer (owned elsewhere).
struct MoeLayerWeights {
  const void* router = nullptr;        // [E, H]
  const void* slots = nullptr;         // [num_slots][slot_elems]
  const int32_t* rep_start = nullptr;  // [E] first entry of expert e in rep_slots
  const int32_t* rep_count = nullptr;  // [E] replicas of e (>= 1)
  const int32_t* rep_slots = nullptr;  // [num_slots] slots, grouped by expert
  int64_t* slot_stats = nullptr;       // [num_slots] rows per slot, accumulated; may be null
};

// Routing tables of one layer in the layout MoeLayerWeights reads, from a slot -> expert
// map (kFreeSlot = -1 entries are skipped). Sizes: start/count [E], slots [num_slots].
struct RoutingTables {
  std::vector<int32_t> rep_start, rep_count, rep_slots;
};
RoutingTables build_routing_tables(const std::vector<int>& slot_to_expert, int num_experts);

// Host-side packing of one expert into a slot image (f32 inputs, converted to `dtype`
// bits): gate/up [I, H] interleaved by 8 rows, then down [H, I].
void pack_expert(const float* gate, const float* up, const float* down, int hidden,
                 int intermediate, DType dtype, void* slot_image);

// Host-side packing of one FP8 expert into a slot image (Fp8SlotLayout), from the
// checkpoint's own bytes, not dequantized: gate and up e4m3 [I, H] with f32 scales
// [blocks(I), blocks(H)], down e4m3 [H, I] with [blocks(H), blocks(I)] (w = e4m3 * scale).
struct Fp8Expert {
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down = nullptr;
  const float* gate_scale = nullptr;
  const float* up_scale = nullptr;
  const float* down_scale = nullptr;
};
void pack_expert_fp8(const Fp8Expert& expert, int hidden, int intermediate, void* slot_image);

// Step scratch sized once for max_tokens (all device buffers; contents are per step).
struct MoeScratch {
  static Result<MoeScratch> create(const MoeDims& dims, int max_tokens);

  int max_tokens = 0;
  DeviceBuffer logits;                           // f32 [T, E]
  DeviceBuffer expert, weight, slot;             // [T * K] i32, f32, i32
  DeviceBuffer row_of_pair, pair_of_row;         // i32 [T * K]
  DeviceBuffer offsets;                          // i32 [num_slots + 1]
  DeviceBuffer permute_counts;                   // i32 [kPermuteCountInts * num_slots]
  DeviceBuffer tile_slot, tile_row0, num_tiles;  // i32 [max tiles], [max tiles], [1]
  DeviceBuffer act;                              // dtype [T * K, I]
  DeviceBuffer y;                                // dtype [T * K, H]
  DeviceBuffer ticket;                           // i32 [1], zero between launches (decode)
  DeviceBuffer gemm_sched;                       // i32 [2], GroupedGemmArgs::sched
  // dims.fp8 (fp8_experts.h's Fp8Acts): e4m3 [T * K, max(H, I)] and their f32 scales
  // [blocks(max(H, I)), round_up(T * K, 4)], the FP8 grouped GEMMs' A.
  DeviceBuffer act_codes, act_scales;
};

// The kernels of run_moe, as a mask (profiling runs one stage on the previous run's data).
enum MoeStage : unsigned {
  kMoeRouter = 1,
  kMoeTopk = 2,
  kMoePermute = 4,
  kMoeGateUp = 8,
  kMoeDown = 16,
  kMoeCombine = 32,
  kMoeAllStages = 63,
};

// out[t] (+)= MoE(h[t]) for t < num_tokens (h: [T, H] in dims.dtype; out: [T, H] f32).
// num_valid_tokens (device, may be null): only pairs of tokens below it count in
// slot_stats (padding rows of a captured batch do not). force_tile >= 0 picks a
// GemmTile (tests, benchmarks); -1 chooses by size. `stages` selects kernels (profiling).
// With dims.fp8: the router GEMM and top-k with permutation, then run_fp8_experts
// (fp8_path below: FP8 wgmma at every size where it runs, else the FP8 decode kernels up
// to kDecodeMaxTokens tokens and the mma.sync tile above; docs/cuda.md, "FP8 experts");
// `stages` is ignored.
Status run_moe(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch, const void* h,
               int num_tokens, const int32_t* num_valid_tokens, float* out, bool accumulate,
               Blas& blas, cudaStream_t stream, int force_tile = -1,
               unsigned stages = kMoeAllStages);

// The RMSNorm before a MoE block: h = rms_norm(x) (f32 [T, H]) with weight and eps.
struct MoeInputNorm {
  const float* x = nullptr;
  const float* weight = nullptr;
  float eps = 0.f;
};
// run_moe of h = rms_norm(norm.x), h ([T, H] in dims.dtype) written here. On the decode
// path (decode_moe.h) of one or two tokens its route kernel normalises (the same values
// as rms_norm), so no RMSNorm kernel runs; FLEXPERT_NO_NORM_FUSION=1: always rms_norm
// first (comparisons).
Status run_moe_norm(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                    const MoeInputNorm& norm, void* h, int num_tokens,
                    const int32_t* num_valid_tokens, float* out, bool accumulate, Blas& blas,
                    cudaStream_t stream);

// The parts of run_moe after the routing (scratch.expert / weight / slot of num_tokens *
// top_k pairs), shared with the DeepSeek routing (grouped_moe.h): the permutation of the
// pairs by slot for tiles of block_m rows, and the two grouped expert GEMMs (gate/up
// with SwiGLU over rows gathered from h; down) plus the weighted combine into out, as
// `stages` selects (kMoeGateUp, kMoeDown, kMoeCombine).
PermuteArgs permute_args(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                         int num_tokens, int block_m, const int32_t* num_valid_tokens);
Status run_expert_gemms(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                        const void* h, int num_tokens, GemmTile tile, float* out, bool accumulate,
                        cudaStream_t stream, unsigned stages = kMoeAllStages);

// Whether the FP8 wgmma GEMMs run for these dims on this device (sm_90a, H a multiple of
// 128 and I of 64).
bool fp8_wgmma_runs(const MoeDims& dims);

// The FP8 experts' kernels (fp8_experts.h), all on e4m3 activations: FP8 wgmma for every
// row count where it runs (the same sums for a row whatever its batch, so one process and
// expert-parallel ranks agree), unless FLEXPERT_NO_FP8_WGMMA; else the decode kernels up
// to kDecodeMaxTokens tokens (only when combining) and the mma.sync tile above
// (docs/cuda.md, "FP8 experts").
enum class Fp8Path { kDecode, kTile, kWgmma };
Fp8Path fp8_path(const MoeDims& dims, int num_tokens, bool combine_rows);

// With dims.fp8, the parts of run_moe after the routing (scratch.expert / weight / slot):
// permutation by slot (with slot statistics), then fp8_path's kernels (force_tile -1;
// kGemv: the decode kernels, kMma64: the tile, kWgmmaWs64: FP8 wgmma), then combine.
// `combine` false (the device exchange of ep_moe.h, whose peers read the rows): never the
// decode kernels, the rows left in scratch.y (row_of_pair says where), `out` unused.
// `expected_tokens` (>= 0): the tokens a step is expected to bring where num_tokens is only a
// bound (the device exchange's owners, as the bf16 tile choice takes bound / members); FP8
// wgmma's tile rows (fp8_wgmma_rows) follow it, the same sums either way. -1: num_tokens.
Status run_fp8_experts(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                       const void* h, int num_tokens, const int32_t* num_valid_tokens, float* out,
                       bool accumulate, cudaStream_t stream, int force_tile = -1,
                       bool combine = true, int expected_tokens = -1);

// Whether run_moe (force_tile -1, router given) takes the decode path for this step:
// bf16 steps where choose_tile picks kGemv (under a quarter row per expert) and
// num_tokens <= kDecodeMaxTokens run three kernels (decode_moe.h) instead of the
// router GEMM, top-k/permute, two grouped GEMMs and combine. Stage bits there:
// kMoeRouter = router GEMV + top-k, kMoeGateUp (+ slot statistics with kMoePermute),
// kMoeDown = down + combine (accumulating only right after this call's kMoeGateUp:
// decode_moe.h); kMoeTopk, kMoePermute or kMoeCombine alone run nothing.
bool uses_decode_path(const MoeDims& dims, int num_tokens);

// A MoE layer's shared experts (DeepSeek): weights, and the model's scratch for the steps
// that run them as a dense MLP.
struct SharedExperts {
  const void* gate_up = nullptr;  // [2 inter, H] in dims.dtype: gate rows, then up rows.
  const void* down = nullptr;     // [H, inter]
  int inter = 0;
  float* gu = nullptr;  // f32 [T, 2 inter]
  void* act = nullptr;  // [T, inter] in dims.dtype
};

// Whether run_moe_norm (and run_grouped_moe_norm) normalise in the decode route kernel
// for this step: the decode path of one or two tokens whose rows fit its shared memory.
bool route_norm_fuses(const MoeDims& dims, const MoeScratch& scratch, int num_tokens);

// The decode path with DeepSeek's router: `grouped` (mla_kernels.h) in place of the
// softmax top-k; its logits, expert, weight and slot arrays must be scratch's.
// uses_decode_path(dims, num_tokens) must hold. With norm (route_norm_fuses must hold):
// h = rms_norm(norm->x), made by the route kernel and written to h. With shared
// (decode_moe_supported with its inter must hold): the shared experts in the same
// kernels (decode_moe.h), added to out.
Status run_decode_grouped(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                          const GroupedTopkArgs& grouped, const void* h, int num_tokens,
                          const int32_t* num_valid_tokens, float* out, bool accumulate,
                          cudaStream_t stream, const MoeInputNorm* norm = nullptr,
                          const SharedExperts* shared = nullptr);

// Copies the last run's per-pair logical experts and slots to the host (tests,
// benchmarks); synchronises `stream`.
Status read_routing(const MoeScratch& scratch, int num_pairs, cudaStream_t stream,
                    std::vector<int32_t>* experts, std::vector<int32_t>* slots);

}  // namespace flexpert::cuda
