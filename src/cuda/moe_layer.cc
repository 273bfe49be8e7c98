// SPDX-License-Identifier: Apache-2.0
#include "cuda/moe_layer.h"
#include "cuda/knobs.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/decode_moe.h"
#include "cuda/fp8_experts.h"
#include "cuda/kernels.h"

namespace flexpert::cuda {
namespace {

// The smallest tile height any GemmTile uses (kGemv): it bounds the tile table.
constexpr int kMinTileRows = 4;

void store_as(DType dtype, float v, void* dst, int64_t index) {
  if (dtype == DType::kBF16) {
    static_cast<uint16_t*>(dst)[index] = f32_to_bf16(v);
  } else {
    static_cast<float*>(dst)[index] = v;
  }
}

// The FP8 grouped GEMMs' A: e4m3 rows and their scales, at the scratch's capacity.
Status allocate_fp8_acts(const MoeDims& dims, MoeScratch& s) {
  const int64_t rows = std::max<int64_t>(static_cast<int64_t>(s.max_tokens) * dims.top_k, 1);
  const int64_t k = std::max(dims.hidden, dims.intermediate);
  FLEX_ASSIGN_OR_RETURN(s.act_codes, DeviceBuffer::create(rows * k));
  FLEX_ASSIGN_OR_RETURN(s.act_scales,
                        DeviceBuffer::create(fp8_blocks(k) * fp8_round_up(rows, 4) * 4));
  return Status();
}

}  // namespace

Status MoeDims::validate() const {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return invalid_argument("MoE on CUDA computes in f32 or bf16");
  }
  if (hidden <= 0 || hidden % 8 != 0 || intermediate <= 0 || intermediate % 8 != 0) {
    return unimplemented("MoE on CUDA needs hidden and intermediate sizes divisible by 8 (got " +
                         std::to_string(hidden) + ", " + std::to_string(intermediate) + ")");
  }
  if (num_experts < 1 || num_experts > 512 || top_k < 1 || top_k > 32 || top_k > num_experts) {
    return unimplemented("MoE on CUDA supports up to 512 experts and top-k up to 32");
  }
  if (fp8 && dtype != DType::kBF16) {
    return invalid_argument("FP8 experts on CUDA take bf16 activations");
  }
  if (num_slots < 1 || num_slots > kMaxPermuteSlots) {
    return unimplemented("MoE on CUDA supports up to " + std::to_string(kMaxPermuteSlots) +
                         " slots per layer");
  }
  return Status();
}

int64_t MoeDims::slot_bytes() const {
  if (fp8) return fp8_slot_layout(hidden, intermediate).slot_bytes();
  return slot_elems() * static_cast<int64_t>(dtype_size(dtype));
}

RoutingTables build_routing_tables(const std::vector<int>& slot_to_expert, int num_experts) {
  RoutingTables t;
  t.rep_start.assign(static_cast<size_t>(num_experts), 0);
  t.rep_count.assign(static_cast<size_t>(num_experts), 0);
  t.rep_slots.assign(slot_to_expert.size(), 0);
  for (int e : slot_to_expert) {
    if (e >= 0) ++t.rep_count[e];
  }
  int start = 0;
  for (int e = 0; e < num_experts; ++e) {
    t.rep_start[e] = start;
    start += t.rep_count[e];
  }
  std::vector<int32_t> cursor = t.rep_start;
  for (size_t s = 0; s < slot_to_expert.size(); ++s) {  // Ascending slots per expert.
    const int e = slot_to_expert[s];
    if (e >= 0) t.rep_slots[cursor[e]++] = static_cast<int32_t>(s);
  }
  return t;
}

void pack_expert(const float* gate, const float* up, const float* down, int hidden,
                 int intermediate, DType dtype, void* slot_image) {
  const int64_t H = hidden, I = intermediate;
  for (int64_t b = 0; b < I / 8; ++b) {
    for (int64_t r = 0; r < 8; ++r) {
      const float* g = gate + (b * 8 + r) * H;
      const float* u = up + (b * 8 + r) * H;
      const int64_t gate_row = 16 * b + r, up_row = 16 * b + 8 + r;
      for (int64_t c = 0; c < H; ++c) {
        store_as(dtype, g[c], slot_image, gate_row * H + c);
        store_as(dtype, u[c], slot_image, up_row * H + c);
      }
    }
  }
  const int64_t down_at = 2 * I * H;
  for (int64_t i = 0; i < H * I; ++i) store_as(dtype, down[i], slot_image, down_at + i);
}

void pack_expert_fp8(const Fp8Expert& e, int hidden, int intermediate, void* slot_image) {
  const Fp8SlotLayout l = fp8_slot_layout(hidden, intermediate);
  const int64_t H = hidden, I = intermediate;
  auto* bytes = static_cast<uint8_t*>(slot_image);
  std::memset(bytes, 0, static_cast<size_t>(l.slot_bytes()));
  for (int64_t b = 0; b < I / 8; ++b) {
    for (int64_t r = 0; r < 8; ++r) {
      std::memcpy(bytes + (16 * b + r) * H, e.gate + (8 * b + r) * H, static_cast<size_t>(H));
      std::memcpy(bytes + (16 * b + 8 + r) * H, e.up + (8 * b + r) * H, static_cast<size_t>(H));
    }
  }
  std::memcpy(bytes + l.down_at(), e.down, static_cast<size_t>(H * I));
  const size_t gu_scales = static_cast<size_t>(l.gate_up_scale_rows() * l.gate_up_scale_cols());
  float* scales = reinterpret_cast<float*>(bytes + l.scales_at());
  std::memcpy(scales, e.gate_scale, gu_scales * sizeof(float));
  std::memcpy(scales + gu_scales, e.up_scale, gu_scales * sizeof(float));
  std::memcpy(bytes + l.down_scales_at(), e.down_scale,
              static_cast<size_t>(l.down_scale_rows() * l.down_scale_cols()) * sizeof(float));
}

Result<MoeScratch> MoeScratch::create(const MoeDims& dims, int max_tokens) {
  FLEX_RETURN_IF_ERROR(dims.validate());
  if (dims.fp8) {
    int device = 0;
    FLEX_CUDA_TRY(cudaGetDevice(&device));
    if (!fp8_device_supported(device)) {
      return failed_precondition(
          "FP8 experts need a GPU of compute capability 8.9 or newer (Ada, Hopper); use "
          "--quantization bf16 on this one");
    }
  }
  (void)wgmma_available();  // Probe now: never inside a graph capture.
  MoeScratch s;
  s.max_tokens = max_tokens;
  if (dims.fp8) FLEX_RETURN_IF_ERROR(allocate_fp8_acts(dims, s));
  const size_t T = static_cast<size_t>(max_tokens);
  const size_t P = T * static_cast<size_t>(dims.top_k);
  const size_t esize = dtype_size(dims.dtype);
  const size_t tiles =
      static_cast<size_t>(max_tiles(static_cast<int64_t>(P), dims.num_slots, kMinTileRows));
  FLEX_ASSIGN_OR_RETURN(s.logits, DeviceBuffer::create(T * dims.num_experts * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(s.expert, DeviceBuffer::create(P * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.weight, DeviceBuffer::create(P * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(s.slot, DeviceBuffer::create(P * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.row_of_pair, DeviceBuffer::create(P * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.pair_of_row, DeviceBuffer::create(P * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.offsets, DeviceBuffer::create((dims.num_slots + 1) * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.permute_counts,
                        DeviceBuffer::create(kPermuteCountInts * dims.num_slots * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.tile_slot, DeviceBuffer::create(tiles * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.tile_row0, DeviceBuffer::create(tiles * sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.num_tiles, DeviceBuffer::create_zeroed(sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.act, DeviceBuffer::create(P * dims.intermediate * esize));
  FLEX_ASSIGN_OR_RETURN(s.y, DeviceBuffer::create(P * dims.hidden * esize));
  FLEX_ASSIGN_OR_RETURN(s.ticket, DeviceBuffer::create_zeroed(sizeof(int32_t)));
  FLEX_ASSIGN_OR_RETURN(s.gemm_sched, DeviceBuffer::create_zeroed(2 * sizeof(int32_t)));
  return s;
}

bool uses_decode_path(const MoeDims& dims, int num_tokens) {
  if (dims.dtype != DType::kBF16 || dims.fp8 ||
      !decode_moe_supported(num_tokens, dims.hidden, dims.intermediate, dims.num_experts,
                            dims.top_k)) {
    return false;
  }
  const int64_t pairs = static_cast<int64_t>(num_tokens) * dims.top_k;
  return choose_tile(dims.dtype, pairs, dims.num_experts, dims.hidden, dims.intermediate) ==
         GemmTile::kGemv;
}

namespace {

// Softmax top-k over scratch.logits with replica choice into scratch.expert/weight/slot.
TopkArgs topk_args(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                   int num_tokens) {
  return TopkArgs{scratch.logits.as<float>(),
                  num_tokens,
                  dims.num_experts,
                  dims.top_k,
                  dims.norm_topk_prob,
                  w.rep_start,
                  w.rep_count,
                  w.rep_slots,
                  scratch.expert.as<int32_t>(),
                  scratch.weight.as<float>(),
                  scratch.slot.as<int32_t>()};
}

// With norm: h = rms_norm(norm->x), by the route kernel, into h_out (== h).
Status run_decode(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch, const void* h,
                  int num_tokens, const int32_t* num_valid_tokens, float* out, bool accumulate,
                  cudaStream_t stream, unsigned stages, const MoeInputNorm* norm = nullptr,
                  void* h_out = nullptr, const GroupedTopkArgs* grouped = nullptr,
                  const SharedExperts* shared = nullptr) {
  DecodeMoeArgs d;
  d.h = h;
  if (norm != nullptr) {
    d.norm_x = norm->x;
    d.norm_weight = norm->weight;
    d.norm_eps = norm->eps;
    d.norm_out = h_out;
  }
  d.router = w.router;
  d.weights = w.slots;
  d.slot_stride = dims.slot_elems();
  d.num_tokens = num_tokens;
  d.hidden = dims.hidden;
  d.inter = dims.intermediate;
  d.topk = topk_args(dims, w, scratch, num_tokens);
  d.num_slots = dims.num_slots;
  d.ticket = scratch.ticket.as<int32_t>();
  d.slot_stats = (stages & kMoePermute) ? w.slot_stats : nullptr;
  d.num_valid_tokens = num_valid_tokens;
  d.act = scratch.act.data();
  d.out = out;
  d.accumulate = accumulate;
  if (grouped != nullptr) {
    d.use_grouped = true;
    d.grouped = *grouped;
  }
  if (shared != nullptr) {
    d.shared_gu = shared->gate_up;
    d.shared_down = shared->down;
    d.shared_inter = shared->inter;
    d.shared_pieces = shared_pieces(shared->inter, dims.intermediate);
    d.shared_act = shared->act;
  }
  if (stages & kMoeRouter) FLEX_CUDA_TRY(decode_route(d, stream));
  if (stages & kMoeGateUp) FLEX_CUDA_TRY(decode_gate_up(d, stream));
  if (stages & kMoeDown) FLEX_CUDA_TRY(decode_down_combine(d, stream));
  return Status();
}

}  // namespace

Status run_decode_grouped(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                          const GroupedTopkArgs& grouped, const void* h, int num_tokens,
                          const int32_t* num_valid_tokens, float* out, bool accumulate,
                          cudaStream_t stream, const MoeInputNorm* norm,
                          const SharedExperts* shared) {
  if (num_tokens == 0) return Status();
  if (num_tokens > scratch.max_tokens || !uses_decode_path(dims, num_tokens) ||
      (norm != nullptr && !route_norm_fuses(dims, scratch, num_tokens)) ||
      (shared != nullptr && !decode_moe_supported(num_tokens, dims.hidden, dims.intermediate,
                                                  dims.num_experts, dims.top_k, shared->inter))) {
    return internal_error("decode MoE step of " + std::to_string(num_tokens) +
                          " tokens: not a decode step or over the scratch capacity");
  }
  return run_decode(dims, w, scratch, h, num_tokens, num_valid_tokens, out, accumulate, stream,
                    kMoeAllStages, norm, norm != nullptr ? const_cast<void*>(h) : nullptr, &grouped,
                    shared);
}

PermuteArgs permute_args(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                         int num_tokens, int block_m, const int32_t* num_valid_tokens) {
  return PermuteArgs{scratch.slot.as<int32_t>(),
                     num_tokens * dims.top_k,
                     dims.top_k,
                     dims.num_slots,
                     block_m,
                     num_valid_tokens,
                     scratch.offsets.as<int32_t>(),
                     scratch.tile_slot.as<int32_t>(),
                     scratch.tile_row0.as<int32_t>(),
                     scratch.num_tiles.as<int32_t>(),
                     scratch.row_of_pair.as<int32_t>(),
                     scratch.pair_of_row.as<int32_t>(),
                     w.slot_stats,
                     scratch.permute_counts.as<int32_t>()};
}

Status run_expert_gemms(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                        const void* h, int num_tokens, GemmTile tile, float* out, bool accumulate,
                        cudaStream_t stream, unsigned stages) {
  const int H = dims.hidden, I = dims.intermediate, K = dims.top_k;
  const int64_t P = static_cast<int64_t>(num_tokens) * K;
  GroupedGemmArgs g;
  g.offsets = scratch.offsets.as<int32_t>();
  g.tile_slot = scratch.tile_slot.as<int32_t>();
  g.tile_row0 = scratch.tile_row0.as<int32_t>();
  g.num_tiles = scratch.num_tiles.as<int32_t>();
  g.max_tiles = max_tiles(P, dims.num_slots, tile_rows(tile));
  g.sched = scratch.gemm_sched.as<int32_t>();
  g.weights = w.slots;
  g.slot_stride = dims.slot_elems();
  // gate/up with SwiGLU, rows gathered from h in place.
  g.a = h;
  g.gather = scratch.pair_of_row.as<int32_t>();
  g.gather_div = K;
  g.weight_offset = 0;
  g.n = 2 * I;
  g.k = H;
  g.swiglu = true;
  g.out = scratch.act.data();
  if (stages & kMoeGateUp) FLEX_CUDA_TRY(grouped_gemm(dims.dtype, tile, g, stream));
  // down, over the contiguous SwiGLU output.
  g.a = scratch.act.data();
  g.gather = nullptr;
  g.gather_div = 1;
  g.weight_offset = 2 * static_cast<int64_t>(I) * H;
  g.n = H;
  g.k = I;
  g.swiglu = false;
  g.out = scratch.y.data();
  if (stages & kMoeDown) FLEX_CUDA_TRY(grouped_gemm(dims.dtype, tile, g, stream));
  if (!(stages & kMoeCombine)) return Status();
  FLEX_CUDA_TRY(combine(dims.dtype, scratch.y.data(), scratch.weight.as<float>(),
                        scratch.row_of_pair.as<int32_t>(), num_tokens, K, H, accumulate, out,
                        stream));
  return Status();
}

bool fp8_wgmma_runs(const MoeDims& dims) {
  return dims.fp8 && wgmma_available() && fp8_wgmma_fits(2 * dims.intermediate, dims.hidden) &&
         fp8_wgmma_fits(dims.hidden, dims.intermediate);
}

Fp8Path fp8_path(const MoeDims& dims, int num_tokens, bool combine_rows) {
  if (!knobs().no_fp8_wgmma && fp8_wgmma_runs(dims)) return Fp8Path::kWgmma;
  return combine_rows && num_tokens <= kDecodeMaxTokens ? Fp8Path::kDecode : Fp8Path::kTile;
}

Status run_fp8_experts(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                       const void* h, int num_tokens, const int32_t* num_valid_tokens, float* out,
                       bool accumulate, cudaStream_t stream, int force_tile, bool combine_rows,
                       int expected_tokens) {
  const int H = dims.hidden, I = dims.intermediate, K = dims.top_k;
  const int64_t P = static_cast<int64_t>(num_tokens) * K;
  const Fp8SlotLayout layout = fp8_slot_layout(H, I);
  const Fp8Path path = force_tile < 0 ? fp8_path(dims, num_tokens, combine_rows)
                       : force_tile == static_cast<int>(GemmTile::kGemv) && combine_rows
                           ? Fp8Path::kDecode
                       : force_tile == static_cast<int>(GemmTile::kWgmmaWs64) ? Fp8Path::kWgmma
                                                                              : Fp8Path::kTile;
  if (path == Fp8Path::kWgmma && !fp8_wgmma_runs(dims)) {
    return invalid_argument("FP8 wgmma needs sm_90a, H a multiple of 128 and I of 64");
  }
  // Tile rows: FP8 wgmma's 128 on large batches, else kFp8GemmRows (the tile's, the decode
  // kernels' slot statistics).
  const int64_t expected_pairs =
      expected_tokens >= 0 ? std::min<int64_t>(static_cast<int64_t>(expected_tokens) * K, P) : P;
  const int block_m =
      path == Fp8Path::kWgmma ? fp8_wgmma_rows(expected_pairs, dims.num_slots, H, I) : kFp8GemmRows;
  // The permutation also counts rows per slot (slot_stats), on the decode kernels too.
  FLEX_CUDA_TRY(
      permute(permute_args(dims, w, scratch, num_tokens, block_m, num_valid_tokens), stream));
  // Every FP8 path computes on e4m3 activations (a scale per row and 128 columns, exact
  // values), so one process and the ranks of expert parallelism, whose row counts pick
  // different paths, agree up to the order of f32 sums (docs/cuda.md, "FP8 experts").
  if (path == Fp8Path::kDecode) {  // They quantize in registers and combine as they go.
    Fp8DecodeArgs d;
    d.h = h;
    d.num_tokens = num_tokens;
    d.hidden = H;
    d.inter = I;
    d.top_k = K;
    d.slot = scratch.slot.as<int32_t>();
    d.weight = scratch.weight.as<float>();
    d.gate_up = fp8_gate_up_weights(w.slots, layout);
    d.down = fp8_down_weights(w.slots, layout);
    d.act = scratch.act.data();
    d.out = out;
    d.accumulate = accumulate;
    FLEX_CUDA_TRY(fp8_decode_gate_up(d, stream));
    FLEX_CUDA_TRY(fp8_decode_down_combine(d, stream));
    return Status();
  }
  GroupedGemmArgs g;
  g.offsets = scratch.offsets.as<int32_t>();
  g.tile_slot = scratch.tile_slot.as<int32_t>();
  g.tile_row0 = scratch.tile_row0.as<int32_t>();
  g.num_tiles = scratch.num_tiles.as<int32_t>();
  g.max_tiles = max_tiles(P, dims.num_slots, block_m);
  g.sched = scratch.gemm_sched.as<int32_t>();
  const auto gemm = [&](const Fp8Weights& fw, const Fp8Acts& a) {
    return path == Fp8Path::kWgmma ? fp8_wgmma_gemm(g, fw, a, block_m, stream)
                                   : fp8_grouped_gemm(g, fw, a, stream);
  };
  // Rows quantized to e4m3, then the GEMM: gate/up over the rows of h gathered by pair,
  // down over the SwiGLU rows. The quantized rows are allocated by MoeScratch::create.
  const Fp8Acts acts{scratch.act_codes.data(), scratch.act_scales.as<float>(),
                     scratch.max_tokens * K};
  const int32_t* num_rows = g.offsets + dims.num_slots;
  g.n = 2 * I;
  g.k = H;
  g.swiglu = true;
  g.out = scratch.act.data();
  FLEX_CUDA_TRY(fp8_quantize_rows(h, scratch.pair_of_row.as<int32_t>(), K, num_rows,
                                  static_cast<int>(P), H, acts, stream));
  FLEX_CUDA_TRY(gemm(fp8_gate_up_weights(w.slots, layout), acts));
  g.n = H;
  g.k = I;
  g.swiglu = false;
  g.out = scratch.y.data();
  FLEX_CUDA_TRY(fp8_quantize_rows(scratch.act.data(), nullptr, 1, num_rows, static_cast<int>(P), I,
                                  acts, stream));
  FLEX_CUDA_TRY(gemm(fp8_down_weights(w.slots, layout), acts));
  if (!combine_rows) return Status();
  FLEX_CUDA_TRY(combine(dims.dtype, scratch.y.data(), scratch.weight.as<float>(),
                        scratch.row_of_pair.as<int32_t>(), num_tokens, K, H, accumulate, out,
                        stream));
  return Status();
}

Status run_moe(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch, const void* h,
               int num_tokens, const int32_t* num_valid_tokens, float* out, bool accumulate,
               Blas& blas, cudaStream_t stream, int force_tile, unsigned stages) {
  if (num_tokens == 0) return Status();
  if (num_tokens > scratch.max_tokens) {
    return internal_error("MoE step of " + std::to_string(num_tokens) +
                          " tokens over the scratch capacity " +
                          std::to_string(scratch.max_tokens));
  }
  if (dims.fp8) {
    FLEX_RETURN_IF_ERROR(blas.gemm_nt(dims.dtype, h, num_tokens, dims.hidden, w.router,
                                      dims.num_experts, DType::kF32, scratch.logits.data()));
    FLEX_CUDA_TRY(router_topk(topk_args(dims, w, scratch, num_tokens), stream));
    return run_fp8_experts(dims, w, scratch, h, num_tokens, num_valid_tokens, out, accumulate,
                           stream, force_tile);
  }
  if (force_tile < 0 && w.router != nullptr && uses_decode_path(dims, num_tokens)) {
    return run_decode(dims, w, scratch, h, num_tokens, num_valid_tokens, out, accumulate, stream,
                      stages);
  }
  const int H = dims.hidden, I = dims.intermediate, K = dims.top_k;
  const int64_t P = static_cast<int64_t>(num_tokens) * K;
  const GemmTile tile = force_tile >= 0 ? static_cast<GemmTile>(force_tile)
                                        : choose_tile(dims.dtype, P, dims.num_experts, H, I);
  if (!tile_supports(tile, dims.dtype, 2 * I, H) || !tile_supports(tile, dims.dtype, H, I)) {
    return invalid_argument("GEMM tile " + std::to_string(static_cast<int>(tile)) +
                            " does not fit the expert shapes");
  }
  const int block_m = tile_rows(tile);
  if (stages & kMoeRouter) {
    FLEX_RETURN_IF_ERROR(blas.gemm_nt(dims.dtype, h, num_tokens, H, w.router, dims.num_experts,
                                      DType::kF32, scratch.logits.data()));
  }
  const TopkArgs topk = topk_args(dims, w, scratch, num_tokens);
  // Up to this many tokens, top-k runs inside the (single-block) permutation launch.
  constexpr int kFusedTopkTokens = 64;
  const bool fuse = num_tokens <= kFusedTopkTokens && (stages & kMoeTopk) && (stages & kMoePermute);
  if ((stages & kMoeTopk) && !fuse) FLEX_CUDA_TRY(router_topk(topk, stream));
  const PermuteArgs perm = permute_args(dims, w, scratch, num_tokens, block_m, num_valid_tokens);
  if (fuse) {
    FLEX_CUDA_TRY(router_topk_permute(topk, perm, stream));
  } else if (stages & kMoePermute) {
    FLEX_CUDA_TRY(permute(perm, stream));
  }

  return run_expert_gemms(dims, w, scratch, h, num_tokens, tile, out, accumulate, stream, stages);
}

// Up to this many tokens the route kernel normalises h itself. H200, 12-layer Qwen3-30B-A3B,
// ms a step, rms_norm first against fused (the qkv GEMV's norm fused too up to 2 rows),
// three runs each: batch 1 0.90 / 0.90 / 0.91 against 0.89 / 0.88 / 0.88, batch 2 1.18 /
// 1.18 / 1.19 against 1.20 / 1.18 / 1.19, batch 4 (route only) 1.72 / 1.71 / 1.74
// against 1.75 / 1.74 / 1.75: each block reduces the rows one after the other.
constexpr int kRouteNormMaxTokens = 2;

bool route_norm_fuses(const MoeDims& dims, const MoeScratch& scratch, int num_tokens) {
  const bool no_fusion = knobs().no_norm_fusion;
  return !no_fusion && num_tokens >= 1 && num_tokens <= kRouteNormMaxTokens &&
         num_tokens <= scratch.max_tokens && uses_decode_path(dims, num_tokens) &&
         decode_route_norm_fits(num_tokens, dims.hidden);
}

Status run_moe_norm(const MoeDims& dims, const MoeLayerWeights& w, MoeScratch& scratch,
                    const MoeInputNorm& norm, void* h, int num_tokens,
                    const int32_t* num_valid_tokens, float* out, bool accumulate, Blas& blas,
                    cudaStream_t stream) {
  if (num_tokens == 0) return Status();
  if (w.router != nullptr && route_norm_fuses(dims, scratch, num_tokens)) {
    return run_decode(dims, w, scratch, h, num_tokens, num_valid_tokens, out, accumulate, stream,
                      kMoeAllStages, &norm, h);
  }
  FLEX_CUDA_TRY(rms_norm(dims.dtype, norm.x, nullptr, norm.weight, num_tokens, dims.hidden,
                         norm.eps, h, stream));
  return run_moe(dims, w, scratch, h, num_tokens, num_valid_tokens, out, accumulate, blas, stream);
}

Status read_routing(const MoeScratch& scratch, int num_pairs, cudaStream_t stream,
                    std::vector<int32_t>* experts, std::vector<int32_t>* slots) {
  const size_t n = static_cast<size_t>(num_pairs);
  if (experts != nullptr) {
    experts->resize(n);
    FLEX_CUDA_TRY(cudaMemcpyAsync(experts->data(), scratch.expert.data(), n * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
  }
  if (slots != nullptr) {
    slots->resize(n);
    FLEX_CUDA_TRY(cudaMemcpyAsync(slots->data(), scratch.slot.data(), n * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
  }
  FLEX_CUDA_TRY(cudaStreamSynchronize(stream));
  return Status();
}

}  // namespace flexpert::cuda
