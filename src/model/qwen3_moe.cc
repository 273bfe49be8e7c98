// SPDX-License-Identifier: Apache-2.0
#include "model/qwen3_moe.h"
#include "model/routed_experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "flexpert/logging.h"
#include "kernels/cpu_ops.h"

namespace flexpert {
namespace {

// Small vectors are kept as owned f32 copies: they are read on every row.
Result<Tensor> load_f32(const Checkpoint& ckpt, const std::string& name, const Shape& shape) {
  FLEX_ASSIGN_OR_RETURN(Tensor t, ckpt.get(name, shape));
  return t.to(DType::kF32);
}

}  // namespace

Result<std::unique_ptr<Qwen3MoeModel>> Qwen3MoeModel::create(std::unique_ptr<Checkpoint> checkpoint,
                                                             ModelConfig config,
                                                             const ModelOptions& options) {
  std::unique_ptr<Qwen3MoeModel> m(new Qwen3MoeModel());
  m->checkpoint_ = std::move(checkpoint);
  m->config_ = std::move(config);
  m->pool_ = options.pool ? options.pool : &ThreadPool::global();
  m->max_sequences_ = std::max(1, options.max_sequences);
  m->max_seq_len_ = options.max_seq_len > 0
                        ? options.max_seq_len
                        : std::min(std::max(m->config_.max_position_embeddings, 1), 4096);
  const ModelConfig& c = m->config_;
  FLEX_RETURN_IF_ERROR(m->experts_.init(c, options, m->pool_));
  const Checkpoint& ck = *m->checkpoint_;
  FLEX_ASSIGN_OR_RETURN(m->embed_,
                        ck.get("model.embed_tokens.weight", {c.vocab_size, c.hidden_size}));
  if (c.tie_word_embeddings && !ck.contains("lm_head.weight")) {
    m->lm_head_ = m->embed_.view();
  } else {
    FLEX_ASSIGN_OR_RETURN(m->lm_head_, ck.get("lm_head.weight", {c.vocab_size, c.hidden_size}));
  }
  FLEX_ASSIGN_OR_RETURN(m->final_norm_, load_f32(ck, "model.norm.weight", {c.hidden_size}));
  m->layers_.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    FLEX_RETURN_IF_ERROR(m->load_layer(l, &m->layers_[l], options));
    if (options.progress) options.progress(l + 1, c.num_hidden_layers);
  }
  return m;
}

Result<Tensor> Qwen3MoeModel::weight(const std::string& name, const Shape& shape) const {
  return checkpoint_->get_weight(name, shape, config_.weight_block_size);
}

Status Qwen3MoeModel::load_layer(int index, Layer* layer, const ModelOptions& options) {
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t q_dim = c.num_attention_heads * D, kv_dim = c.num_key_value_heads * D;
  FLEX_ASSIGN_OR_RETURN(layer->input_norm, load_f32(ck, p + "input_layernorm.weight", {H}));
  FLEX_ASSIGN_OR_RETURN(layer->post_norm, load_f32(ck, p + "post_attention_layernorm.weight", {H}));
  FLEX_ASSIGN_OR_RETURN(layer->q_norm, load_f32(ck, p + "self_attn.q_norm.weight", {D}));
  FLEX_ASSIGN_OR_RETURN(layer->k_norm, load_f32(ck, p + "self_attn.k_norm.weight", {D}));
  FLEX_ASSIGN_OR_RETURN(layer->q_proj, weight(p + "self_attn.q_proj.weight", {q_dim, H}));
  FLEX_ASSIGN_OR_RETURN(layer->k_proj, weight(p + "self_attn.k_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(layer->v_proj, weight(p + "self_attn.v_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(layer->o_proj, weight(p + "self_attn.o_proj.weight", {H, q_dim}));
  if (c.attention_bias) return unimplemented("attention_bias=true is not supported");
  layer->is_moe = c.is_moe_layer(index);
  if (layer->is_moe) {
    const int64_t E = c.num_experts, I = c.moe_intermediate_size;
    FLEX_ASSIGN_OR_RETURN(layer->router, load_f32(ck, p + "mlp.gate.weight", {E, H}));
    FLEX_RETURN_IF_ERROR(
        experts_.load_layer(ck, c, index, p + "mlp.experts.", H, I, options, &layer->experts));
  } else {
    const int64_t I = c.intermediate_size;
    FLEX_ASSIGN_OR_RETURN(layer->gate_proj, weight(p + "mlp.gate_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(layer->up_proj, weight(p + "mlp.up_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(layer->down_proj, weight(p + "mlp.down_proj.weight", {H, I}));
  }
  const Shape cache_shape = {max_sequences_, max_seq_len_, c.num_key_value_heads, D};
  layer->k_cache = Tensor::zeros(DType::kF32, cache_shape);
  layer->v_cache = Tensor::zeros(DType::kF32, cache_shape);
  return Status();
}

Status Qwen3MoeModel::load_expert(int layer, int expert, int local_slot) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || !layers_[layer].is_moe) {
    return invalid_argument("layer " + std::to_string(layer) + " has no routed experts");
  }
  return experts_.load_expert(*checkpoint_, config_, expert, local_slot,
                              "model.layers." + std::to_string(layer) + ".mlp.experts.",
                              &layers_[layer].experts);
}

ExpertSlots* Qwen3MoeModel::local_slots(int layer) {
  return layers_[layer].is_moe ? &layers_[layer].experts : nullptr;
}

Status Qwen3MoeModel::validate(const std::vector<SequenceChunk>& batch) const {
  std::vector<bool> used(static_cast<size_t>(max_sequences_), false);
  for (const SequenceChunk& chunk : batch) {
    if (chunk.kv_slot < 0 || chunk.kv_slot >= max_sequences_) {
      return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " out of range [0, " +
                              std::to_string(max_sequences_) + ")");
    }
    if (used[chunk.kv_slot]) {
      return invalid_argument("kv slot " + std::to_string(chunk.kv_slot) + " used twice in a step");
    }
    used[chunk.kv_slot] = true;
    if (chunk.tokens.empty()) return invalid_argument("a sequence chunk has no tokens");
    if (chunk.start_pos < 0 ||
        chunk.start_pos + static_cast<int64_t>(chunk.tokens.size()) > max_seq_len_) {
      return invalid_argument("positions " + std::to_string(chunk.start_pos) + ".." +
                              std::to_string(chunk.start_pos + chunk.tokens.size()) +
                              " exceed the context length " + std::to_string(max_seq_len_));
    }
    for (int32_t id : chunk.tokens) {
      if (id < 0 || id >= config_.vocab_size) {
        return invalid_argument("token id " + std::to_string(id) + " outside the vocabulary [0, " +
                                std::to_string(config_.vocab_size) + ")");
      }
    }
  }
  return Status();
}

void Qwen3MoeModel::attention_block(Layer& layer, const std::vector<SequenceChunk>& batch,
                                    int64_t num_tokens) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  float* h = h_.data<float>();
  kernels::rms_norm(x_.data<float>(), layer.input_norm.data<float>(), num_tokens, H,
                    static_cast<float>(c.rms_norm_eps), h);
  kernels::matmul_nt(h, num_tokens, H, layer.q_proj, q_.data<float>(), *pool_);
  kernels::matmul_nt(h, num_tokens, H, layer.k_proj, k_.data<float>(), *pool_);
  kernels::matmul_nt(h, num_tokens, H, layer.v_proj, v_.data<float>(), *pool_);
  const float eps = static_cast<float>(c.rms_norm_eps);
  kernels::rms_norm(q_.data<float>(), layer.q_norm.data<float>(), num_tokens * nq, D, eps,
                    q_.data<float>());
  kernels::rms_norm(k_.data<float>(), layer.k_norm.data<float>(), num_tokens * nkv, D, eps,
                    k_.data<float>());
  kernels::rope_rotate_half(q_.data<float>(), num_tokens, nq, D, positions_.data(), c.rope_theta);
  kernels::rope_rotate_half(k_.data<float>(), num_tokens, nkv, D, positions_.data(), c.rope_theta);
  const int64_t kv_row = nkv * D;
  const int64_t slot_stride = static_cast<int64_t>(max_seq_len_) * kv_row;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  int64_t t0 = 0;
  for (const SequenceChunk& chunk : batch) {
    const int64_t n = static_cast<int64_t>(chunk.tokens.size());
    float* kc = layer.k_cache.data<float>() + chunk.kv_slot * slot_stride;
    float* vc = layer.v_cache.data<float>() + chunk.kv_slot * slot_stride;
    std::memcpy(kc + chunk.start_pos * kv_row, k_.data<float>() + t0 * kv_row,
                n * kv_row * sizeof(float));
    std::memcpy(vc + chunk.start_pos * kv_row, v_.data<float>() + t0 * kv_row,
                n * kv_row * sizeof(float));
    kernels::attention(q_.data<float>() + t0 * nq * D, kc, vc, n, chunk.start_pos, nq, nkv, D,
                       scale, attn_.data<float>() + t0 * nq * D, *pool_);
    t0 += n;
  }
  kernels::matmul_nt(attn_.data<float>(), num_tokens, nq * D, layer.o_proj, h, *pool_);
  float* x = x_.data<float>();
  for (int64_t i = 0; i < num_tokens * H; ++i) x[i] += h[i];
}

Status Qwen3MoeModel::mlp_block(int index, Layer& layer, int64_t num_tokens) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  float* h = h_.data<float>();
  kernels::rms_norm(x_.data<float>(), layer.post_norm.data<float>(), num_tokens, H,
                    static_cast<float>(c.rms_norm_eps), h);
  float* out = mlp_out_.data<float>();
  if (layer.is_moe) {
    const RouterParams params{c.num_experts, c.num_experts_per_tok, c.norm_topk_prob};
    route(h, num_tokens, H, layer.router, params, experts_.replicas(index), &moe_ws_.logits,
          &moe_ws_.routing, *pool_);
    FLEX_RETURN_IF_ERROR(experts_.execute(index, h, moe_ws_.routing, layer.experts, out));
  } else {
    const int64_t I = c.intermediate_size;
    ensure_f32_rows(&gate_, num_tokens, I);
    ensure_f32_rows(&up_, num_tokens, I);
    kernels::matmul_nt(h, num_tokens, H, layer.gate_proj, gate_.data<float>(), *pool_);
    kernels::matmul_nt(h, num_tokens, H, layer.up_proj, up_.data<float>(), *pool_);
    kernels::silu_mul(gate_.data<float>(), up_.data<float>(), num_tokens * I, gate_.data<float>());
    kernels::matmul_nt(gate_.data<float>(), num_tokens, I, layer.down_proj, out, *pool_);
  }
  float* x = x_.data<float>();
  for (int64_t i = 0; i < num_tokens * H; ++i) x[i] += out[i];
  return Status();
}

Status Qwen3MoeModel::forward(const std::vector<SequenceChunk>& batch, Tensor* logits) {
  FLEX_RETURN_IF_ERROR(validate(batch));
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim;
  int64_t num_tokens = 0;
  for (const SequenceChunk& chunk : batch) num_tokens += static_cast<int64_t>(chunk.tokens.size());
  ensure_f32_rows(&x_, num_tokens, H);
  ensure_f32_rows(&h_, num_tokens, H);
  ensure_f32_rows(&mlp_out_, num_tokens, H);
  ensure_f32_rows(&q_, num_tokens, c.num_attention_heads * D);
  ensure_f32_rows(&attn_, num_tokens, c.num_attention_heads * D);
  ensure_f32_rows(&k_, num_tokens, c.num_key_value_heads * D);
  ensure_f32_rows(&v_, num_tokens, c.num_key_value_heads * D);
  std::vector<int32_t> ids;
  flatten_batch(batch, &ids, &positions_);
  kernels::embedding(embed_, ids.data(), num_tokens, x_.data<float>());
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    attention_block(layers_[l], batch, num_tokens);
    FLEX_RETURN_IF_ERROR(mlp_block(l, layers_[l], num_tokens));
  }
  // Only the last token of each chunk needs logits.
  last_token_logits(x_, batch, final_norm_, c.rms_norm_eps, lm_head_, c.vocab_size, *pool_, logits);
  return Status();
}

}  // namespace flexpert
