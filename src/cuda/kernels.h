// SPDX-License-Identifier: Apache-2.0
// CUDA kernels for every op of the Qwen3-MoE forward pass (the GEMMs apart:
// cuBLAS for dense ones, grouped_gemm.h for the experts).
//
// Element type `dtype` (F32 or BF16) is that of weights and of the activations
// that feed GEMMs; the residual stream, GEMM outputs, norm weights and router
// logits are f32, and every reduction accumulates in f32. Each launcher only
// enqueues on `stream` and returns the launch error (cudaGetLastError), so all
// of them can be captured in a CUDA graph. Per-token metadata (positions, KV
// slots) is read from device memory, so a captured graph serves any values.
// Launchers are thread-safe; kernels never synchronise with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "flexpert/dtype.h"

namespace flexpert::cuda {

// out[t, :] = f32(table[ids[t], :]).
cudaError_t embedding(DType dtype, const void* table, const int32_t* ids, int num_tokens, int dim,
                      float* out, cudaStream_t stream);

// out[r, :] = x[src, :] / sqrt(mean(x[src, :]^2) + eps) * weight in `dtype`, with
// src = row_index ? row_index[r] : r.
// y[m, n] = x[m, k] w[n, k]^T, plus y when `accumulate`: bf16 x and w, f32 y and
// accumulation; the dense projections of decode steps (m <= kGemvMaxRows, k % 8 == 0, k > 0),
// where cuBLAS's kernels read the weights at ~2 TB/s and split K for some shapes (a
// second kernel). A warp per output column streams its weight row with 16-byte loads,
// eight in flight per lane.
inline constexpr int kGemvMaxRows = 8;
bool gemv_nt_fits(DType dtype, int64_t m, int64_t k);
cudaError_t gemv_nt(const void* x, int m, int k, const void* w, int n, float* y, bool accumulate,
                    cudaStream_t stream);
// gemv_nt of rms_norm(x): x f32 [m, k], each row normalised with norm_weight as
// rms_norm(kBF16, ...) does (bit for bit) by every block into shared memory, so a decode
// step's RMSNorm is not a kernel of its own. Fits: gemv_nt's shapes with k % 4 == 0,
// k <= 8192 and m * k bf16 within kGemvNormSmemBytes.
// Shared memory for the normalised rows of the GEMV and the decode route kernel: the 48 KB
// a kernel gets without opting in, less 1 KB for their static shared memory (block_sum's
// partials, the route kernel's flag).
inline constexpr int64_t kGemvNormSmemBytes = 47 * 1024;
bool gemv_norm_nt_fits(int64_t m, int64_t k);
cudaError_t gemv_norm_nt(const float* x, const float* norm_weight, float eps, int m, int k,
                         const void* w, int n, float* y, bool accumulate, cudaStream_t stream);
// gemv_norm_nt over rows x_stride floats apart (x_stride % 4 == 0, >= k; as rms_norm_rows)
// into y of y_dtype (bf16: each output rounded once, as gemm_nt's bf16 output), no
// accumulation: DeepSeek's q projections of decode steps.
cudaError_t gemv_norm_nt_rows(const float* x, int64_t x_stride, const float* norm_weight, float eps,
                              int m, int k, const void* w, int n, DType y_dtype, void* y,
                              cudaStream_t stream);
// gemv_nt of silu_mul(gu): gu f32 [m, 2 * inter] (gate | up), each block making the m bf16
// rows silu(gate) * up in shared memory as silu_mul(kBF16, ...) does (bit for bit), so the
// SwiGLU of a decode step's dense MLP is not a kernel of its own. Fits: gemv_nt's shapes
// with k = inter and m * inter bf16 within kGemvNormSmemBytes.
bool gemv_swiglu_nt_fits(int64_t m, int64_t inter);
cudaError_t gemv_swiglu_nt(const float* gu, int m, int inter, const void* w, int n, float* y,
                           bool accumulate, cudaStream_t stream);

cudaError_t rms_norm(DType dtype, const float* x, const int32_t* row_index, const float* weight,
                     int rows, int dim, float eps, void* out, cudaStream_t stream);
// out[r, :dim] = rms_norm(x + r * x_stride)[:dim], as rms_norm (the same bits for rows that
// rms_vec_fits with x_stride % 4 == 0): DeepSeek's LoRA norms over part of a row.
cudaError_t rms_norm_rows(DType dtype, const float* x, int64_t x_stride, const float* weight,
                          int rows, int dim, float eps, void* out, cudaStream_t stream);

// Per token t of qkv [T, (nq + 2 nkv) * D] (q heads, k heads, v heads; f32): RMSNorm of
// each q and k head (q_norm / k_norm weights), rotate-half RoPE at positions[t] with the
// precomputed tables cos/sin [max_seq_len, D / 2], then q -> q_out [T, nq, D] and
// k, v -> the caches [kv slots, max_seq_len, nkv, D] at (kv_slots[t], positions[t]).
struct QkvArgs {
  const float* qkv;
  int num_tokens, num_q_heads, num_kv_heads, head_dim;
  const float* q_norm;
  const float* k_norm;
  float eps;
  const float* rope_cos;
  const float* rope_sin;
  const int32_t* positions;
  const int32_t* kv_slots;
  int max_seq_len;
  void* q_out;
  void* k_cache;
  void* v_cache;
};
cudaError_t qk_norm_rope_store(DType dtype, const QkvArgs& args, cudaStream_t stream);

// Causal grouped-query attention: token t (query heads [nq, D] in q) attends to
// positions [0, positions[t]] of KV slot kv_slots[t]. out: [T, nq, D] in `dtype`.
// head_dim must be 32, 64, 128 or 256 (else cudaErrorInvalidValue).
// With split_scratch (split_capacity floats, attention_split_floats suffice), steps of
// few (token, head) pairs split each one's positions over several warps (interleaved
// chunks of 32; their number depends on num_tokens and the heads only, so a captured
// graph stays right as the context grows) and a second kernel merges the partial
// softmaxes (flash-decoding); else one warp per (token, head). bf16 steps without tiles
// (head_dim 64 / 128, up to 16 query heads a kv head) run a warp per (token, kv head,
// split) on tensor cores instead: each K and V row read once for the group's heads.
struct AttentionArgs {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* positions;
  const int32_t* kv_slots;
  int num_tokens, num_q_heads, num_kv_heads, head_dim, max_seq_len;
  float scale;
  void* out;
  float* split_scratch = nullptr;
  int64_t split_capacity = 0;
  // Prefill: bf16 steps of head_dim 64 or 128 (and scratch) run tiles of
  // kAttentionTileRows query rows of one sequence on tensor cores (the decode kernel
  // takes the rest: the GQA kernel, else a warp per (row, head)). The models set it when
  // the step has chunks of many tokens.
  bool tiles = false;
};
inline constexpr int kAttentionTileRows = 64;
// AttentionArgs::tiles for a step of num_tokens rows and num_rows logits rows (one per
// chunk): chunks of many tokens, not decode steps (a logits row per token).
inline bool attention_tiles_wanted(int num_tokens, int num_rows) {
  return num_tokens - num_rows >= kAttentionTileRows / 2;
}
cudaError_t attention(DType dtype, const AttentionArgs& args, cudaStream_t stream);
int64_t attention_split_floats(int head_dim, int num_q_heads, int num_kv_heads);
// The number of splits of each (token, head) pair's positions (1 without scratch).
int attention_splits(DType dtype, const AttentionArgs& args);

// out[r, i] = silu(gu[r, i]) * gu[r, inter + i] in `dtype` (dense MLP layers).
cudaError_t silu_mul(DType dtype, const float* gu, int rows, int inter, void* out,
                     cudaStream_t stream);

// Router: softmax over num_experts f32 logits per token, the top_k experts (ties: lower
// index), weights optionally renormalised; pair (t, k) uses replica (t + k) mod count of
// its expert: rep_slots[rep_start[e] + (t + k) % rep_count[e]]. top_k <= 32, num_experts <= 512.
struct TopkArgs {
  const float* logits;
  int num_tokens, num_experts, top_k;
  bool norm_topk_prob;
  const int32_t* rep_start;
  const int32_t* rep_count;
  const int32_t* rep_slots;
  int32_t* expert;  // [T * K]
  float* weight;    // [T * K]
  int32_t* slot;    // [T * K]
};
cudaError_t router_topk(const TopkArgs& args, cudaStream_t stream);

// Groups the T * K pairs by slot: offsets [num_slots + 1], row_of_pair / pair_of_row
// (rows of a slot are contiguous, in no particular order), and the tile table of the
// grouped GEMM: tile i covers rows [tile_row0[i], min(+block_m, end of tile_slot[i])),
// *num_tiles of them. slot_stats[s] (if given) += pairs of slot s among the first
// *num_valid_tokens tokens (all tokens when num_valid_tokens is null). A pair of slot -1
// gets no row (its row_of_pair entry is left as it was). num_slots <= kMaxPermuteSlots. One block,
// or with `counts` (device scratch of kPermuteCountInts * num_slots) and more than
// kPermuteMultiBlockPairs pairs, three launches over many blocks (count, scan, scatter; large
// prefill steps).
constexpr int kMaxPermuteSlots = 2048;
constexpr int kPermuteCountInts = 3;
constexpr int kPermuteMultiBlockPairs = 8192;
struct PermuteArgs {
  const int32_t* slot;
  int num_pairs, top_k, num_slots, block_m;
  const int32_t* num_valid_tokens;
  int32_t* offsets;
  int32_t* tile_slot;
  int32_t* tile_row0;
  int32_t* num_tiles;
  int32_t* row_of_pair;
  int32_t* pair_of_row;
  int64_t* slot_stats;
  int32_t* counts = nullptr;  // Scratch of the many-block path (see above).
};
cudaError_t permute(const PermuteArgs& args, cudaStream_t stream);
// router_topk then permute in one single-block launch (steps of a few tokens: decode).
cudaError_t router_topk_permute(const TopkArgs& topk, const PermuteArgs& args, cudaStream_t stream);

// out[t, :] (+)= sum_k weight[t * K + k] * y[row_of_pair[t * K + k], :], summed in k order
// in f32. y: [pairs, hidden] in `dtype`; hidden % 8 == 0.
cudaError_t combine(DType dtype, const void* y, const float* weight, const int32_t* row_of_pair,
                    int num_tokens, int top_k, int hidden, bool accumulate, float* out,
                    cudaStream_t stream);

// Greedy sampling on the device: keys[r] = the row's largest (value, -index) pair of
// f32 logits row r (r < rows, `vocab` values per row) packed in 64 bits, so one
// atomicMax per block reduces a row split over many blocks; NaN never wins (the key
// of an all-NaN row is 0). keys (rows entries) is zeroed here first. argmax_key_index
// decodes the token id: the lowest index among equal maxima, 0 for an all-NaN row,
// as kernels::argmax on the host.
cudaError_t argmax_rows(const float* logits, int rows, int vocab, unsigned long long* keys,
                        cudaStream_t stream);
#ifdef __CUDACC__
__host__ __device__
#endif
    inline int32_t
    argmax_key_index(unsigned long long key) {
  return key == 0 ? 0 : static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key));
}

// Softmax sampling on the device, after argmax_rows on the same logits (its keys give
// each row's maximum): for i < n, tokens[i] = kernels::sample_softmax(logits row
// rows[i], 1 / inv_temperature[i], u01[i]) (the first id whose cumulative weight
// exp((logit - max) * inv_temperature) exceeds u01 times the total; partial sums per
// 4096 ids in double, so a draw within rounding of a boundary may pick the neighbour
// the host would not; the row's argmax if rounding leaves none). `partials` holds n x
// ceil(vocab / 4096) doubles. Draws with a top-k or top-p cut (top_k / top_p given, and
// 0 < top_k[i] < vocab or top_p[i] < 1) are kernels::sample_truncated instead: one block
// per draw (few draws: a cluster of 2-8 blocks splitting the row) finds the cut's
// last candidate by radix selection over the ordered logit bits (8 bits a pass; counts
// for top-k, weights in double for top-p), ties in id order, then draws over the members
// in id order; the weights' sums differ from the host's order (and
// the top-p histograms' atomic sums from run to run), so again only a draw within
// rounding of a boundary may differ.
struct SampleRowsArgs {
  const float* logits;
  int vocab;
  const unsigned long long* keys;  // argmax_rows' output for the logits rows.
  const int32_t* rows;             // [n] logits row of each draw.
  const double* inv_temperature;   // [n]
  const double* u01;               // [n]
  int n;
  double* partials;
  int32_t* tokens;                 // [n]
  const int32_t* top_k = nullptr;  // [n] 0: no limit (null: none for every draw).
  const float* top_p = nullptr;    // [n] 1: no limit.
};
cudaError_t sample_rows(const SampleRowsArgs& args, cudaStream_t stream);
inline int sample_rows_chunks(int vocab) { return (vocab + 4095) / 4096; }

// Fills n elements with deterministic pseudo-random values uniform in [-scale, scale].
cudaError_t fill_uniform(DType dtype, void* data, size_t n, uint64_t seed, float scale,
                         cudaStream_t stream);

// dst[i] = src[i] for num_bytes (a multiple of 16): the bandwidth probe of the benchmark.
cudaError_t copy_bytes(const void* src, void* dst, size_t num_bytes, cudaStream_t stream);

}  // namespace flexpert::cuda
