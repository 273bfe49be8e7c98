// SPDX-License-Identifier: Apache-2.0
// CPU kernels for every op of the model, on f32 activations.
//
// Weights may be F32, BF16 or F16 (converted panel by panel inside matmul_nt;
// never a full f32 copy). Functions taking a ThreadPool split their work over
// it; called from inside a pool task they run inline on that thread. Outputs
// never alias inputs unless a parameter says so. Thread-safe: no global state
// beyond per-thread scratch.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <cstdint>

#include "flexpert/tensor.h"
#include "flexpert/thread_pool.h"

namespace flexpert::kernels {

// y[m, n] = x[m, k] @ w[n, k]^T. `w` is a contiguous 2-D tensor of any dtype.
void matmul_nt(const float* x, int64_t m, int64_t k, const Tensor& w, float* y, ThreadPool& pool);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight. May run in place (out == x).
void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
              float* out);

// Rotary embedding in the "rotate half" layout of Hugging Face Llama/Qwen:
// x[t, h, :] of head_dim D pairs element i with i + D/2, angle = pos[t] * theta^(-2i/D).
// In place. Angles are computed in double precision.
void rope_rotate_half(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                      const int32_t* positions, double theta);

// Rotary embedding with given frequencies on the first `rope_dim` elements of each head
// vector x + (t * num_heads + h) * head_stride, in place; angle = pos[t] * inv_freq[i]
// (rope_dim / 2 values, double precision), cos and sin multiplied by `scale` (YaRN's
// attention factor; 1 otherwise). Plain: pairs (i, i + rope_dim/2) as rope_rotate_half.
// `interleaved`: pairs (2i, 2i + 1), written de-interleaved to (i, i + rope_dim/2), as
// transformers' apply_rotary_pos_emb_interleave (DeepSeek-V3, rope_interleave=true) does.
void rope(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_stride, int64_t rope_dim,
          const int32_t* positions, const double* inv_freq, double scale, bool interleaved);

// Per-head products: y[t, h, :n] = x[t, h, :k] @ w[h]^T for t < m, h < num_heads, with
// w an f32 [num_heads, n, k] array. Row t, head h of x starts at x + t * x_row_stride +
// h * x_head_stride; likewise y.
void matmul_nt_heads(const float* x, int64_t m, int64_t x_row_stride, int64_t x_head_stride,
                     const float* w, int64_t num_heads, int64_t n, int64_t k, float* y,
                     int64_t y_row_stride, int64_t y_head_stride, ThreadPool& pool);

// Multi-head latent attention (DeepSeek MLA) in the absorbed form, for `num_tokens` new
// query tokens of one sequence. All heads attend to the same cached rows [latent
// (latent_dim) | rotated rope key (rope_dim)]. q: [num_tokens, num_heads, latent_dim +
// rope_dim], each head's q_nope already mapped into the latent space (through kv_b's key
// part), then its rotated q_pe. cache: [>= first_pos + num_tokens, latent_dim + rope_dim],
// the new tokens' rows already written; token i attends to [0, first_pos + i].
// out: [num_tokens, num_heads, latent_dim], the softmax(scale * q.row)-weighted sum of
// latents (to be mapped out through kv_b's value part).
void mla_attention(const float* q, const float* cache, int64_t num_tokens, int64_t first_pos,
                   int64_t num_heads, int64_t latent_dim, int64_t rope_dim, float scale, float* out,
                   ThreadPool& pool);

// Causal attention of `num_tokens` new query tokens of one sequence against its KV cache.
// q: [num_tokens, num_q_heads, D]; k_cache/v_cache: [>= first_pos + num_tokens, num_kv_heads, D]
// (the new tokens' keys and values already written). Token i attends to positions
// [0, first_pos + i]. out: [num_tokens, num_q_heads, D]. Grouped-query: q head h uses kv head
// h / (num_q_heads / num_kv_heads).
void attention(const float* q, const float* k_cache, const float* v_cache, int64_t num_tokens,
               int64_t first_pos, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
               float scale, float* out, ThreadPool& pool);

// out[i] = silu(gate[i]) * up[i] for n elements.
void silu_mul(const float* gate, const float* up, int64_t n, float* out);

// Router: softmax over `num_experts` logits per token (f32), then the top-k experts by
// probability (ties: lower index first), optionally renormalised to sum to 1.
// ids/weights: [num_tokens, k], in descending weight order.
void router_topk(const float* logits, int64_t num_tokens, int64_t num_experts, int64_t k,
                 bool norm_topk_prob, int32_t* ids, float* weights);

// out[t, :] = table[ids[t], :] converted to f32. `table` is [vocab, dim] of any dtype.
void embedding(const Tensor& table, const int32_t* ids, int64_t num_tokens, float* out);

// Index of the largest value (lowest index on ties; NaN never wins; 0 when all are NaN).
int64_t argmax(const float* x, int64_t n);

// A draw from softmax(logits / temperature) by inverse transform at u01 in [0, 1): the
// first id, in id order, whose cumulative weight exp((logit - max) / temperature)
// (summed in double; 0 for NaN) exceeds u01 times the total; the last id if rounding
// leaves none.
int32_t sample_softmax(const float* logits, int64_t vocab, float temperature, double u01);

// A draw from softmax(logits / temperature) cut to top_k (0: no limit) and top_p (1: no
// limit), at u01 in [0, 1). Candidates rank by (logit descending, id ascending); NaN ranks
// last with weight 0, -0 ties with +0. The top-k set K is the first top_k of them; the
// top-p set P the shortest prefix of K whose weight w = exp((logit - max) / temperature)
// (double) reaches top_p times K's total (an element is in while the weight before it is
// below that). The draw is sample_softmax's inverse transform over P's members in id
// order. Without a cut it is sample_softmax. `scratch` is reused across calls.
int32_t sample_truncated(const float* logits, int64_t vocab, float temperature, int top_k,
                         float top_p, double u01,
                         std::vector<std::pair<uint32_t, int32_t>>* scratch = nullptr);

}  // namespace flexpert::kernels
