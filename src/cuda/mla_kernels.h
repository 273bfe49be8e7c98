// SPDX-License-Identifier: Apache-2.0
// CUDA kernels of DeepSeek-V2/V3 that the Qwen3 path has no use for: multi-head latent
// attention (MLA) in the absorbed form over a latent-only KV cache, and DeepSeek's
// grouped router (sigmoid or softmax scores, correction bias, group-limited top-k).
//
// Conventions as kernels.h: `dtype` (F32 or BF16) is that of weights, GEMM inputs and
// the KV cache; everything else named f32 is f32 and reductions accumulate in f32.
// Launchers only enqueue on `stream` and return the launch error, so they can be
// captured in CUDA graphs; per-token metadata (positions, KV slots) is read from
// device memory. Arithmetic follows the CPU model (src/model/deepseek_v3.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flexpert/dtype.h"

namespace flexpert::cuda {

// Per token t, the rotary and cache part of MLA:
//   kv row kv + t * kv_stride = [latent (kv_lora_rank) | key (rope_dim)] (f32):
//     cache[kv_slots[t], positions[t]] = [rms_norm(latent) * kv_norm | rope(key)];
//   each head h of q (dtype [T, heads, nope_dim + rope_dim]):
//     q_latent[t, h, kv_lora_rank:] = rope(q[t, h, nope_dim:]) (f32).
// rope: cos/sin tables [max_seq_len, rope_dim / 2] (attention factor included); pairs
// (i, i + rope_dim/2), or with `interleaved` pairs (2i, 2i + 1) written de-interleaved,
// as kernels::rope. cache: [kv slots, max_seq_len, kv_lora_rank + rope_dim] in dtype.
struct MlaRopeArgs {
  const float* kv;
  int64_t kv_stride;
  const float* kv_norm;
  float eps;
  const void* q;
  float* q_latent;
  const float* rope_cos;
  const float* rope_sin;
  bool interleaved;
  const int32_t* positions;
  const int32_t* kv_slots;
  int max_seq_len;
  void* cache;
  int num_tokens, num_heads, nope_dim, rope_dim, kv_lora_rank;
};
cudaError_t mla_rope_store(DType dtype, const MlaRopeArgs& args, cudaStream_t stream);

// Absorbed MLA: token t, head h scores q_latent[t, h] (f32 [latent | rope], kv_lora_rank +
// rope_dim) against rows [0, positions[t]] of cache slot kv_slots[t] (scale * dot),
// softmax, and writes the weighted sum of the latents to out[t, h, :kv_lora_rank] (dtype).
// kv_lora_rank 32, 64, 128, 256 or 512; rope_dim a multiple of 8.
// With split_scratch (split_capacity floats; mla_attention_split_floats(kv_lora_rank)
// suffice), steps of few (token, head) pairs split each one's rows over several blocks
// (their number depends on the step's tokens only: graph-safe) and a second kernel
// merges them (flash-decoding).
struct MlaAttentionArgs {
  const float* q_latent;
  const void* cache;
  const int32_t* positions;
  const int32_t* kv_slots;
  int num_tokens, num_heads, kv_lora_rank, rope_dim, max_seq_len;
  float scale;
  void* out;
  float* split_scratch = nullptr;
  int64_t split_capacity = 0;
  // Set for steps that are mostly prompt tokens (attention_tiles_wanted): the tensor-core
  // kernel then takes four consecutive tokens a block, which share the chunks of the
  // cache rows they read when they are in one KV slot.
  bool prompt_groups = false;
};
// bf16 steps with kv_lora_rank 128, 256 or 512 and rope_dim <= 64 run on tensor cores (a
// block per token, 16 heads and split; FLEXPERT_NO_MLA_MMA=1 turns it off), others a
// block per (token, head, split) on the CUDA cores.
cudaError_t mla_attention(DType dtype, const MlaAttentionArgs& args, cudaStream_t stream);
int64_t mla_attention_split_floats(int kv_lora_rank);
// The split count mla_attention uses for this step (1: no merge).
int mla_attention_splits(DType dtype, const MlaAttentionArgs& args);

// Per-head products of decode steps (MLA's absorbed kv_b parts, HeadGemm's bf16 rows of
// few tokens): y[t, h, :n] = x[t, h, :k] @ w[h]^T for t < num_tokens <= kHeadGemvMaxRows,
// w bf16 [num_heads, n, k]; x bf16 at x + t * x_row_stride + h * x_head_stride, y (f32,
// or bf16 rounded once) likewise; f32 sums. A group of min(32, k / 8) lanes per weight
// row (16-byte loads issued before the wait for x: programmatic dependent launch, as
// the decode GEMVs). k % 8 == 0, k <= 1024, strides multiples of 8.
struct HeadGemvArgs {
  const void* x;
  int64_t x_row_stride, x_head_stride;
  const void* w;
  int num_tokens, num_heads, n, k;
  void* y;
  bool y_bf16;
  int64_t y_row_stride, y_head_stride;
};
inline constexpr int kHeadGemvMaxRows = 2;
bool head_gemv_fits(const HeadGemvArgs& args);
// With rope (bf16, the same tokens): mla_rope_store's work in the same launch (blocks of
// their own), so the absorbed query and the rotary parts of a decode step are one kernel.
cudaError_t head_gemv(const HeadGemvArgs& args, cudaStream_t stream,
                      const MlaRopeArgs* rope = nullptr);

// DeepSeek's router on f32 logits [T, E], as select_experts_grouped (moe/moe_layer.h):
// scores = sigmoid or softmax; choice = scores + bias (method kNoauxTc) else scores;
// group-limited methods keep the topk_groups groups ranked highest (max choice, or sum of
// the two highest for noaux_tc) and pick top_k among their experts (ties: lower index),
// in descending choice order; weight = score (/ sum of the picked + 1e-20 when norm) *
// routed_scaling_factor. Pair (t, k) uses replica (t + k) mod count of its expert.
// num_experts <= 512, top_k <= 32, num_groups <= 32.
enum class GroupedTopkMethod : int { kGreedy = 0, kGroupLimitedGreedy = 1, kNoauxTc = 2 };
struct GroupedTopkArgs {
  const float* logits;
  const float* bias;  // [E]; only kNoauxTc reads it.
  int num_tokens, num_experts, top_k;
  bool sigmoid;  // Else softmax.
  GroupedTopkMethod method;
  int num_groups, topk_groups;
  bool norm_topk_prob;
  float routed_scaling_factor;
  const int32_t* rep_start;
  const int32_t* rep_count;
  const int32_t* rep_slots;
  int32_t* expert;  // [T * K]
  float* weight;    // [T * K]
  int32_t* slot;    // [T * K]
};
cudaError_t grouped_topk(const GroupedTopkArgs& args, cudaStream_t stream);
// Whether grouped_topk takes these arguments (experts, top-k and groups within the
// limits above, a bias for kNoauxTc).
bool grouped_topk_args_ok(const GroupedTopkArgs& args);

}  // namespace flexpert::cuda
