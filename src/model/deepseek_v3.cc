// SPDX-License-Identifier: Apache-2.0
#include "model/deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>

#include "flexpert/logging.h"
#include "kernels/cpu_ops.h"

namespace flexpert {
namespace {

// transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
// not config.rms_norm_eps.
constexpr float kLoraNormEps = 1e-6f;

Result<Tensor> load_f32(const Checkpoint& ckpt, const std::string& name, const Shape& shape) {
  FLEX_ASSIGN_OR_RETURN(Tensor t, ckpt.get(name, shape));
  return t.to(DType::kF32);
}

Result<ScoringFunc> scoring_func(const std::string& name) {
  if (name == "sigmoid") return ScoringFunc::kSigmoid;
  if (name == "softmax") return ScoringFunc::kSoftmax;
  return invalid_argument("scoring_func '" + name + "' is not supported");
}

Result<TopkMethod> topk_method(const std::string& name) {
  if (name == "noaux_tc") return TopkMethod::kNoauxTc;
  if (name == "group_limited_greedy") return TopkMethod::kGroupLimitedGreedy;
  if (name == "greedy") return TopkMethod::kGreedy;
  return invalid_argument("topk_method '" + name + "' is not supported");
}

// Checkpoints of DeepSeek-V3 carry multi-token-prediction layers after the decoder
// (model.layers.61 for 61 layers); the forward pass does not use them.
void log_skipped_layers(const Checkpoint& ck, int num_layers) {
  std::set<int> extra;
  const std::string prefix = "model.layers.";
  for (const std::string& name : ck.names()) {
    if (name.rfind(prefix, 0) != 0) continue;
    const int layer = std::atoi(name.c_str() + prefix.size());
    if (layer >= num_layers) extra.insert(layer);
  }
  if (!extra.empty()) {
    FLEX_LOG(INFO) << "skipping " << extra.size()
                   << " multi-token-prediction layer(s) of the checkpoint (model.layers."
                   << *extra.begin() << (extra.size() > 1 ? "+" : "") << ")";
  }
}

}  // namespace

Result<std::unique_ptr<DeepseekV3Model>> DeepseekV3Model::create(
    std::unique_ptr<Checkpoint> checkpoint, ModelConfig config, const ModelOptions& options) {
  std::unique_ptr<DeepseekV3Model> m(new DeepseekV3Model());
  m->checkpoint_ = std::move(checkpoint);
  m->config_ = std::move(config);
  m->pool_ = options.pool ? options.pool : &ThreadPool::global();
  m->max_sequences_ = std::max(1, options.max_sequences);
  m->max_seq_len_ = default_max_seq_len(m->config_, options);
  const ModelConfig& c = m->config_;
  if (c.attention_bias) return unimplemented("attention_bias=true is not supported");
  FLEX_RETURN_IF_ERROR(m->experts_.init(c, options, m->pool_));
  GroupedRouterParams& rp = m->router_params_;
  rp.num_experts = c.num_experts;
  rp.top_k = c.num_experts_per_tok;
  FLEX_ASSIGN_OR_RETURN(rp.scoring, scoring_func(c.scoring_func));
  FLEX_ASSIGN_OR_RETURN(rp.method, topk_method(c.topk_method));
  rp.num_groups = c.n_group;
  rp.topk_groups = c.topk_group;
  rp.norm_topk_prob = c.norm_topk_prob;
  rp.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  m->rope_ = rope_tables(c, c.qk_rope_head_dim);
  const double qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  m->softmax_scale_ = static_cast<float>(m->rope_.softmax_mscale / std::sqrt(qk_head_dim));

  const Checkpoint& ck = *m->checkpoint_;
  log_skipped_layers(ck, c.num_hidden_layers);
  FLEX_ASSIGN_OR_RETURN(m->embed_,
                        ck.get("model.embed_tokens.weight", {c.vocab_size, c.hidden_size}));
  if (c.tie_word_embeddings && !ck.contains("lm_head.weight")) {
    m->lm_head_ = m->embed_.view();
  } else {
    FLEX_ASSIGN_OR_RETURN(m->lm_head_, m->weight("lm_head.weight", {c.vocab_size, c.hidden_size}));
  }
  FLEX_ASSIGN_OR_RETURN(m->final_norm_, load_f32(ck, "model.norm.weight", {c.hidden_size}));
  m->layers_.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    FLEX_RETURN_IF_ERROR(m->load_layer(l, &m->layers_[l], options));
    if (options.progress) options.progress(l + 1, c.num_hidden_layers);
  }
  return m;
}

Result<Tensor> DeepseekV3Model::weight(const std::string& name, const Shape& shape) const {
  return checkpoint_->get_weight(name, shape, config_.weight_block_size);
}

Status DeepseekV3Model::load_layer(int index, Layer* layer, const ModelOptions& options) {
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const std::string a = p + "self_attn.";
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t r = c.kv_lora_rank, qr = c.q_lora_rank;
  FLEX_ASSIGN_OR_RETURN(layer->input_norm, load_f32(ck, p + "input_layernorm.weight", {H}));
  FLEX_ASSIGN_OR_RETURN(layer->post_norm, load_f32(ck, p + "post_attention_layernorm.weight", {H}));
  if (qr > 0) {
    FLEX_ASSIGN_OR_RETURN(layer->q_a_proj, weight(a + "q_a_proj.weight", {qr, H}));
    FLEX_ASSIGN_OR_RETURN(layer->q_a_norm, load_f32(ck, a + "q_a_layernorm.weight", {qr}));
    FLEX_ASSIGN_OR_RETURN(layer->q_b_proj, weight(a + "q_b_proj.weight", {nh * (dn + dr), qr}));
  } else {
    FLEX_ASSIGN_OR_RETURN(layer->q_proj, weight(a + "q_proj.weight", {nh * (dn + dr), H}));
  }
  FLEX_ASSIGN_OR_RETURN(layer->kv_a_proj, weight(a + "kv_a_proj_with_mqa.weight", {r + dr, H}));
  FLEX_ASSIGN_OR_RETURN(layer->kv_a_norm, load_f32(ck, a + "kv_a_layernorm.weight", {r}));
  FLEX_ASSIGN_OR_RETURN(layer->o_proj, weight(a + "o_proj.weight", {H, nh * dv}));
  {
    // kv_b [heads, nope + v, r] split per head into the two absorbed factors.
    FLEX_ASSIGN_OR_RETURN(Tensor kv_b_raw, weight(a + "kv_b_proj.weight", {nh * (dn + dv), r}));
    const Tensor kv_b = kv_b_raw.to(DType::kF32);
    layer->w_uk_t = Tensor::empty(DType::kF32, {nh, r, dn});
    layer->w_uv = Tensor::empty(DType::kF32, {nh, dv, r});
    const float* src = kv_b.data<float>();
    float* uk = layer->w_uk_t.data<float>();
    float* uv = layer->w_uv.data<float>();
    for (int64_t h = 0; h < nh; ++h) {
      const float* head = src + h * (dn + dv) * r;
      for (int64_t i = 0; i < dn; ++i) {
        for (int64_t j = 0; j < r; ++j) uk[(h * r + j) * dn + i] = head[i * r + j];
      }
      std::memcpy(uv + h * dv * r, head + dn * r, static_cast<size_t>(dv * r) * sizeof(float));
    }
  }
  layer->is_moe = c.is_moe_layer(index);
  if (layer->is_moe) {
    const int64_t E = c.num_experts, I = c.moe_intermediate_size;
    FLEX_ASSIGN_OR_RETURN(layer->router, load_f32(ck, p + "mlp.gate.weight", {E, H}));
    if (router_params_.method == TopkMethod::kNoauxTc) {
      FLEX_ASSIGN_OR_RETURN(layer->score_bias,
                            load_f32(ck, p + "mlp.gate.e_score_correction_bias", {E}));
    }
    FLEX_RETURN_IF_ERROR(
        experts_.load_layer(ck, c, index, p + "mlp.experts.", H, I, options, &layer->experts));
    if (c.num_shared_experts > 0) {
      const int64_t S = I * c.num_shared_experts;
      const std::string s = p + "mlp.shared_experts.";
      FLEX_ASSIGN_OR_RETURN(layer->shared_gate, weight(s + "gate_proj.weight", {S, H}));
      FLEX_ASSIGN_OR_RETURN(layer->shared_up, weight(s + "up_proj.weight", {S, H}));
      FLEX_ASSIGN_OR_RETURN(layer->shared_down, weight(s + "down_proj.weight", {H, S}));
    }
  } else {
    const int64_t I = c.intermediate_size;
    FLEX_ASSIGN_OR_RETURN(layer->gate_proj, weight(p + "mlp.gate_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(layer->up_proj, weight(p + "mlp.up_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(layer->down_proj, weight(p + "mlp.down_proj.weight", {H, I}));
  }
  layer->kv_cache = Tensor::zeros(DType::kF32, {max_sequences_, max_seq_len_, r + dr});
  return Status();
}

ExpertSlots* DeepseekV3Model::local_slots(int layer) {
  return layers_[layer].is_moe ? &layers_[layer].experts : nullptr;
}

Status DeepseekV3Model::load_expert(int layer, int expert, int local_slot) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || !layers_[layer].is_moe) {
    return invalid_argument("layer " + std::to_string(layer) + " has no routed experts");
  }
  return experts_.load_expert(*checkpoint_, config_, expert, local_slot,
                              "model.layers." + std::to_string(layer) + ".mlp.experts.",
                              &layers_[layer].experts);
}

void DeepseekV3Model::attention_block(Layer& layer, const std::vector<SequenceChunk>& batch,
                                      int64_t num_tokens) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t r = c.kv_lora_rank, qr = c.q_lora_rank;
  const int64_t q_head = dn + dr;  // One head of q: [nope | rope].
  const int64_t row = r + dr;      // One cached token: [latent | rope key].
  float* h = h_.data<float>();
  kernels::rms_norm(x_.data<float>(), layer.input_norm.data<float>(), num_tokens, H,
                    static_cast<float>(c.rms_norm_eps), h);
  float* q = q_.data<float>();
  if (qr > 0) {
    kernels::matmul_nt(h, num_tokens, H, layer.q_a_proj, q_a_.data<float>(), *pool_);
    kernels::rms_norm(q_a_.data<float>(), layer.q_a_norm.data<float>(), num_tokens, qr,
                      kLoraNormEps, q_a_.data<float>());
    kernels::matmul_nt(q_a_.data<float>(), num_tokens, qr, layer.q_b_proj, q, *pool_);
  } else {
    kernels::matmul_nt(h, num_tokens, H, layer.q_proj, q, *pool_);
  }
  float* kv = kv_a_.data<float>();
  kernels::matmul_nt(h, num_tokens, H, layer.kv_a_proj, kv, *pool_);
  for (int64_t t = 0; t < num_tokens; ++t) {
    kernels::rms_norm(kv + t * row, layer.kv_a_norm.data<float>(), 1, r, kLoraNormEps,
                      kv + t * row);
  }
  kernels::rope(q + dn, num_tokens, nh, q_head, dr, positions_.data(), rope_.inv_freq.data(),
                rope_.attention_factor, c.rope_interleave);
  kernels::rope(kv + r, num_tokens, 1, row, dr, positions_.data(), rope_.inv_freq.data(),
                rope_.attention_factor, c.rope_interleave);
  // Absorb: q_latent[t, h] = [W_uk[h]^T q_nope[t, h] | q_pe[t, h]].
  float* ql = q_latent_.data<float>();
  kernels::matmul_nt_heads(q, num_tokens, nh * q_head, q_head, layer.w_uk_t.data<float>(), nh, r,
                           dn, ql, nh * row, row, *pool_);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t hd = 0; hd < nh; ++hd) {
      std::memcpy(ql + (t * nh + hd) * row + r, q + (t * nh + hd) * q_head + dn,
                  static_cast<size_t>(dr) * sizeof(float));
    }
  }
  const int64_t slot_stride = static_cast<int64_t>(max_seq_len_) * row;
  float* latent_out = attn_latent_.data<float>();
  int64_t t0 = 0;
  for (const SequenceChunk& chunk : batch) {
    const int64_t n = static_cast<int64_t>(chunk.tokens.size());
    float* cache = layer.kv_cache.data<float>() + chunk.kv_slot * slot_stride;
    std::memcpy(cache + chunk.start_pos * row, kv + t0 * row,
                static_cast<size_t>(n * row) * sizeof(float));
    kernels::mla_attention(ql + t0 * nh * row, cache, n, chunk.start_pos, nh, r, dr, softmax_scale_,
                           latent_out + t0 * nh * r, *pool_);
    t0 += n;
  }
  // Out of the latent space: attn[t, h] = W_uv[h] latent_out[t, h].
  float* attn = attn_.data<float>();
  kernels::matmul_nt_heads(latent_out, num_tokens, nh * r, r, layer.w_uv.data<float>(), nh, dv, r,
                           attn, nh * dv, dv, *pool_);
  kernels::matmul_nt(attn, num_tokens, nh * dv, layer.o_proj, h, *pool_);
  float* x = x_.data<float>();
  for (int64_t i = 0; i < num_tokens * H; ++i) x[i] += h[i];
}

void DeepseekV3Model::swiglu(const float* h, int64_t num_tokens, const Tensor& gate,
                             const Tensor& up, const Tensor& down, float* out) {
  const int64_t H = config_.hidden_size, I = gate.size(0);
  ensure_f32_rows(&gate_, num_tokens, I);
  ensure_f32_rows(&up_, num_tokens, I);
  kernels::matmul_nt(h, num_tokens, H, gate, gate_.data<float>(), *pool_);
  kernels::matmul_nt(h, num_tokens, H, up, up_.data<float>(), *pool_);
  kernels::silu_mul(gate_.data<float>(), up_.data<float>(), num_tokens * I, gate_.data<float>());
  kernels::matmul_nt(gate_.data<float>(), num_tokens, I, down, out, *pool_);
}

Status DeepseekV3Model::mlp_block(int index, Layer& layer, int64_t num_tokens) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  float* h = h_.data<float>();
  kernels::rms_norm(x_.data<float>(), layer.post_norm.data<float>(), num_tokens, H,
                    static_cast<float>(c.rms_norm_eps), h);
  float* out = mlp_out_.data<float>();
  if (layer.is_moe) {
    const float* bias = layer.score_bias.data<float>();  // nullptr unless noaux_tc.
    route_grouped(h, num_tokens, H, layer.router, bias, router_params_, experts_.replicas(index),
                  &moe_ws_.logits, &moe_ws_.routing, *pool_);
    FLEX_RETURN_IF_ERROR(experts_.execute(index, h, moe_ws_.routing, layer.experts, out));
    if (c.num_shared_experts > 0) {
      // Shared experts see every token of this rank; no exchange needed.
      float* shared = shared_out_.data<float>();
      swiglu(h, num_tokens, layer.shared_gate, layer.shared_up, layer.shared_down, shared);
      for (int64_t i = 0; i < num_tokens * H; ++i) out[i] += shared[i];
    }
  } else {
    swiglu(h, num_tokens, layer.gate_proj, layer.up_proj, layer.down_proj, out);
  }
  float* x = x_.data<float>();
  for (int64_t i = 0; i < num_tokens * H; ++i) x[i] += out[i];
  return Status();
}

Status DeepseekV3Model::forward(const std::vector<SequenceChunk>& batch, Tensor* logits) {
  FLEX_RETURN_IF_ERROR(validate_batch(batch, max_sequences_, max_seq_len_, config_.vocab_size));
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t r = c.kv_lora_rank, dr = c.qk_rope_head_dim;
  int64_t num_tokens = 0;
  for (const SequenceChunk& chunk : batch) num_tokens += static_cast<int64_t>(chunk.tokens.size());
  ensure_f32_rows(&x_, num_tokens, H);
  ensure_f32_rows(&h_, num_tokens, H);
  ensure_f32_rows(&mlp_out_, num_tokens, H);
  ensure_f32_rows(&shared_out_, num_tokens, H);
  ensure_f32_rows(&q_a_, num_tokens, std::max(c.q_lora_rank, 1));
  ensure_f32_rows(&q_, num_tokens, nh * (c.qk_nope_head_dim + dr));
  ensure_f32_rows(&kv_a_, num_tokens, r + dr);
  ensure_f32_rows(&q_latent_, num_tokens, nh * (r + dr));
  ensure_f32_rows(&attn_latent_, num_tokens, nh * r);
  ensure_f32_rows(&attn_, num_tokens, nh * c.v_head_dim);
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
