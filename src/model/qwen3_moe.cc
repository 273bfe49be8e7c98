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
  FLEX_ASSIGN_OR_RETURN(
      m->placement_,
      ExpertPlacement::parse(options.placement, c.num_hidden_layers, std::max(c.num_experts, 1)));
  const Checkpoint& ck = *m->checkpoint_;
  FLEX_ASSIGN_OR_RETURN(m->embed_,
                        ck.get("model.embed_tokens.weight", {c.vocab_size, c.hidden_size}));
  if (c.tie_word_embeddings && !ck.contains("lm_head.weight")) {
    m->lm_head_ = m->embed_.view();
  } else {
    FLEX_ASSIGN_OR_RETURN(m->lm_head_, ck.get("lm_head.weight", {c.vocab_size, c.hidden_size}));
  }
  FLEX_ASSIGN_OR_RETURN(m->final_norm_, load_f32(ck, "model.norm.weight", {c.hidden_size}));
  m->first_slot_ = options.first_slot;
  m->num_local_slots_ =
      options.num_local_slots < 0 ? m->placement_.num_slots() : options.num_local_slots;
  if (m->first_slot_ < 0 || m->first_slot_ + m->num_local_slots_ > m->placement_.num_slots()) {
    return invalid_argument("local slots [" + std::to_string(m->first_slot_) + ", " +
                            std::to_string(m->first_slot_ + m->num_local_slots_) +
                            ") outside the placement's " +
                            std::to_string(m->placement_.num_slots()) + " slots");
  }
  if (options.moe_executor != nullptr) {
    m->executor_ = options.moe_executor;
  } else {
    m->own_executor_ = std::make_unique<LocalMoeExecutor>(*m->pool_);
    m->executor_ = m->own_executor_.get();
  }
  m->rebuild_replicas();
  m->layers_.resize(c.num_hidden_layers);
  m->slot_counts_.assign(c.num_hidden_layers,
                         std::vector<int64_t>(static_cast<size_t>(m->placement_.num_slots()), 0));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    FLEX_RETURN_IF_ERROR(m->load_layer(l, &m->layers_[l], options));
    if (options.progress) options.progress(l + 1, c.num_hidden_layers);
  }
  return m;
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
  FLEX_ASSIGN_OR_RETURN(layer->q_proj, ck.get(p + "self_attn.q_proj.weight", {q_dim, H}));
  FLEX_ASSIGN_OR_RETURN(layer->k_proj, ck.get(p + "self_attn.k_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(layer->v_proj, ck.get(p + "self_attn.v_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(layer->o_proj, ck.get(p + "self_attn.o_proj.weight", {H, q_dim}));
  if (c.attention_bias) return unimplemented("attention_bias=true is not supported");
  layer->is_moe = c.is_moe_layer(index);
  if (layer->is_moe) {
    const int64_t E = c.num_experts, I = c.moe_intermediate_size;
    FLEX_ASSIGN_OR_RETURN(layer->router, load_f32(ck, p + "mlp.gate.weight", {E, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor probe, ck.get(p + "mlp.experts.0.gate_proj.weight", {I, H}));
    if (options.allocate_slots) {
      const size_t bytes = ExpertSlots::bytes_for(probe.dtype(), num_local_slots_,
                                                  static_cast<int>(H), static_cast<int>(I));
      FLEX_ASSIGN_OR_RETURN(void* storage, options.allocate_slots(index, bytes));
      layer->experts = ExpertSlots(probe.dtype(), num_local_slots_, static_cast<int>(H),
                                   static_cast<int>(I), storage);
    } else {
      layer->experts =
          ExpertSlots(probe.dtype(), num_local_slots_, static_cast<int>(H), static_cast<int>(I));
    }
    // Resolve every tensor first (errors name the tensor), then copy in parallel.
    std::vector<std::array<Tensor, 3>> w(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      FLEX_ASSIGN_OR_RETURN(w[e], expert_weights(index, static_cast<int>(e)));
    }
    const std::vector<int>& map = placement_.slot_map(index);
    std::vector<Status> errors(static_cast<size_t>(num_local_slots_));
    pool_->parallel_for(num_local_slots_, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int e = map[first_slot_ + s];
        if (e == ExpertPlacement::kFreeSlot) continue;
        errors[s] = layer->experts.load(static_cast<int>(s), w[e][0], w[e][1], w[e][2]);
      }
    });
    for (const Status& s : errors) FLEX_RETURN_IF_ERROR(s.annotate(p + "experts"));
  } else {
    const int64_t I = c.intermediate_size;
    FLEX_ASSIGN_OR_RETURN(layer->gate_proj, ck.get(p + "mlp.gate_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(layer->up_proj, ck.get(p + "mlp.up_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(layer->down_proj, ck.get(p + "mlp.down_proj.weight", {H, I}));
  }
  const Shape cache_shape = {max_sequences_, max_seq_len_, c.num_key_value_heads, D};
  layer->k_cache = Tensor::zeros(DType::kF32, cache_shape);
  layer->v_cache = Tensor::zeros(DType::kF32, cache_shape);
  return Status();
}

Result<std::array<Tensor, 3>> Qwen3MoeModel::expert_weights(int layer, int expert) const {
  const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size;
  const std::string ep =
      "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + ".";
  std::array<Tensor, 3> w;
  FLEX_ASSIGN_OR_RETURN(w[0], checkpoint_->get(ep + "gate_proj.weight", {I, H}));
  FLEX_ASSIGN_OR_RETURN(w[1], checkpoint_->get(ep + "up_proj.weight", {I, H}));
  FLEX_ASSIGN_OR_RETURN(w[2], checkpoint_->get(ep + "down_proj.weight", {H, I}));
  return w;
}

Status Qwen3MoeModel::load_expert(int layer, int expert, int local_slot) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || !layers_[layer].is_moe) {
    return invalid_argument("layer " + std::to_string(layer) + " has no routed experts");
  }
  if (expert < 0 || expert >= config_.num_experts || local_slot < 0 ||
      local_slot >= num_local_slots_) {
    return invalid_argument("expert " + std::to_string(expert) + " or local slot " +
                            std::to_string(local_slot) + " out of range");
  }
  FLEX_ASSIGN_OR_RETURN(auto w, expert_weights(layer, expert));
  return layers_[layer].experts.load(local_slot, w[0], w[1], w[2]);
}

void Qwen3MoeModel::rebuild_replicas() {
  replicas_.assign(placement_.num_layers(), {});
  for (int l = 0; l < placement_.num_layers(); ++l) {
    for (int e = 0; e < placement_.num_experts(); ++e)
      replicas_[l].push_back(placement_.replicas(l, e));
  }
}

ExpertSlots* Qwen3MoeModel::local_slots(int layer) {
  return layers_[layer].is_moe ? &layers_[layer].experts : nullptr;
}

Status Qwen3MoeModel::set_placement(ExpertPlacement placement) {
  if (placement.num_slots() != placement_.num_slots() ||
      placement.num_layers() != placement_.num_layers() ||
      placement.num_experts() != placement_.num_experts()) {
    return invalid_argument("new placement has a different shape");
  }
  placement_ = std::move(placement);
  rebuild_replicas();
  return Status();
}

void Qwen3MoeModel::reset_slot_counts() {
  for (auto& v : slot_counts_) std::fill(v.begin(), v.end(), 0);
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
    route(h, num_tokens, H, layer.router, params, replicas_[index], &moe_ws_.logits,
          &moe_ws_.routing, *pool_);
    FLEX_RETURN_IF_ERROR(executor_->execute(index, h, moe_ws_.routing, layer.experts, first_slot_,
                                            out, slot_counts_[index].data()));
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
