// SPDX-License-Identifier: Apache-2.0
#include "cuda/cuda_qwen3_moe.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#include "cuda/kernels.h"
#include "flexpert/logging.h"
#include "flexpert/thread_pool.h"

namespace flexpert::cuda {

Result<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create(
    std::unique_ptr<Checkpoint> checkpoint, ModelConfig config, const ModelOptions& options,
    int device) {
  std::unique_ptr<CudaQwen3MoeModel> m(
      new CudaQwen3MoeModel(std::move(checkpoint), std::move(config), options, device));
  FLEX_RETURN_IF_ERROR(m->check_config());
  FLEX_RETURN_IF_ERROR(m->init_placement(options));
  FLEX_RETURN_IF_ERROR(m->init_fp8_experts(options));
  FLEX_RETURN_IF_ERROR(m->create_streams());
  FLEX_RETURN_IF_ERROR(m->load_weights(options));
  FLEX_RETURN_IF_ERROR(m->allocate_scratch());
  FLEX_RETURN_IF_ERROR(m->finish_create(options));
  return m;
}

CudaQwen3MoeModel::~CudaQwen3MoeModel() { release_device(); }

Status CudaQwen3MoeModel::check_config() const {
  const ModelConfig& c = config_;
  if (c.model_type != "qwen3_moe") {
    return unimplemented("model_type '" + c.model_type + "' has no CUDA implementation");
  }
  if (c.attention_bias) return unimplemented("attention_bias=true is not supported");
  if (c.rope_scaling.type != "default") {
    return unimplemented("RoPE scaling '" + c.rope_scaling.type + "' is not supported on CUDA");
  }
  if (c.head_dim != 32 && c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256) {
    return unimplemented("head_dim " + std::to_string(c.head_dim) + " is not supported on CUDA");
  }
  if (c.num_key_value_heads < 1 || c.num_attention_heads % c.num_key_value_heads != 0) {
    return invalid_argument("num_attention_heads must be a multiple of num_key_value_heads");
  }
  return Status();
}

Status CudaQwen3MoeModel::load_weights(const ModelOptions& options) {
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const int64_t H = c.hidden_size, D = c.head_dim;
  FLEX_ASSIGN_OR_RETURN(Tensor embed, ck.get("model.embed_tokens.weight", {c.vocab_size, H}));
  FLEX_ASSIGN_OR_RETURN(embed_, upload_tensor(embed, dtype_));
  if (c.tie_word_embeddings && !ck.contains("lm_head.weight")) {
    FLEX_ASSIGN_OR_RETURN(lm_head_, upload_tensor(embed, dtype_));
  } else {
    FLEX_ASSIGN_OR_RETURN(Tensor head, ck.get("lm_head.weight", {c.vocab_size, H}));
    FLEX_ASSIGN_OR_RETURN(lm_head_, upload_tensor(head, dtype_));
  }
  FLEX_ASSIGN_OR_RETURN(Tensor norm, ck.get("model.norm.weight", {H}));
  FLEX_ASSIGN_OR_RETURN(final_norm_, upload_tensor(norm, DType::kF32));
  // RoPE tables in the CPU kernel's arithmetic (double angles, rounded once).
  const int64_t half = D / 2;
  std::vector<float> cosv(static_cast<size_t>(max_seq_len_ * half));
  std::vector<float> sinv(cosv.size());
  for (int64_t pos = 0; pos < max_seq_len_; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / D);
      const double angle = static_cast<double>(pos) * inv_freq;
      cosv[pos * half + i] = static_cast<float>(std::cos(angle));
      sinv[pos * half + i] = static_cast<float>(std::sin(angle));
    }
  }
  FLEX_ASSIGN_OR_RETURN(rope_cos_, upload(cosv.data(), cosv.size() * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(rope_sin_, upload(sinv.data(), sinv.size() * sizeof(float)));
  layers_.resize(c.num_hidden_layers);
  return load_layers(options);
}

Status CudaQwen3MoeModel::load_layer(int index) {
  Layer* layer = &layers_[index];
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t q_dim = c.num_attention_heads * D, kv_dim = c.num_key_value_heads * D;
  auto f32 = [&](const std::string& name, int64_t n, DeviceBuffer* out) -> Status {
    FLEX_ASSIGN_OR_RETURN(Tensor t, ck.get(name, {n}));
    FLEX_ASSIGN_OR_RETURN(*out, upload_tensor(t, DType::kF32));
    return Status();
  };
  FLEX_RETURN_IF_ERROR(f32(p + "input_layernorm.weight", H, &layer->input_norm));
  FLEX_RETURN_IF_ERROR(f32(p + "post_attention_layernorm.weight", H, &layer->post_norm));
  FLEX_RETURN_IF_ERROR(f32(p + "self_attn.q_norm.weight", D, &layer->q_norm));
  FLEX_RETURN_IF_ERROR(f32(p + "self_attn.k_norm.weight", D, &layer->k_norm));
  FLEX_ASSIGN_OR_RETURN(Tensor q, weight(p + "self_attn.q_proj.weight", {q_dim, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor k, weight(p + "self_attn.k_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor v, weight(p + "self_attn.v_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor o, weight(p + "self_attn.o_proj.weight", {H, q_dim}));
  FLEX_ASSIGN_OR_RETURN(layer->w_qkv, upload_rows({&q, &k, &v}, dtype_));
  FLEX_ASSIGN_OR_RETURN(layer->w_o, upload_tensor(o, dtype_));
  layer->is_moe = c.is_moe_layer(index);
  if (layer->is_moe) {
    const int64_t E = c.num_experts;
    FLEX_ASSIGN_OR_RETURN(Tensor router, ck.get(p + "mlp.gate.weight", {E, H}));
    FLEX_ASSIGN_OR_RETURN(layer->router, upload_tensor(router, dtype_));
    FLEX_RETURN_IF_ERROR(load_moe_state(index, layer));
  } else {
    const int64_t I = c.intermediate_size;
    FLEX_ASSIGN_OR_RETURN(Tensor gate, weight(p + "mlp.gate_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor up, weight(p + "mlp.up_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor down, weight(p + "mlp.down_proj.weight", {H, I}));
    FLEX_ASSIGN_OR_RETURN(layer->w_gu, upload_rows({&gate, &up}, dtype_));
    FLEX_ASSIGN_OR_RETURN(layer->w_down, upload_tensor(down, dtype_));
  }
  const size_t cache_bytes =
      static_cast<size_t>(max_sequences_ + 1) * max_seq_len_ * kv_dim * dtype_size(dtype_);
  FLEX_ASSIGN_OR_RETURN(layer->k_cache, DeviceBuffer::create_zeroed(cache_bytes));
  FLEX_ASSIGN_OR_RETURN(layer->v_cache, DeviceBuffer::create_zeroed(cache_bytes));
  return Status();
}

Status CudaQwen3MoeModel::allocate_scratch() {
  const ModelConfig& c = config_;
  const size_t esize = dtype_size(dtype_);
  FLEX_RETURN_IF_ERROR(allocate_io());
  const size_t T = static_cast<size_t>(max_step_tokens_);
  const size_t H = c.hidden_size;
  const size_t q_dim = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(c.num_key_value_heads) * c.head_dim;
  FLEX_ASSIGN_OR_RETURN(x_, DeviceBuffer::create(T * H * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(h_, DeviceBuffer::create(T * H * esize));
  FLEX_ASSIGN_OR_RETURN(qkv_, DeviceBuffer::create(T * qkv_dim * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(q_, DeviceBuffer::create(T * q_dim * esize));
  FLEX_ASSIGN_OR_RETURN(attn_, DeviceBuffer::create(T * q_dim * esize));
  FLEX_ASSIGN_OR_RETURN(
      attn_split_, DeviceBuffer::create(attention_split_floats(c.head_dim, c.num_attention_heads,
                                                               c.num_key_value_heads) *
                                        sizeof(float)));
  bool any_moe = false, any_dense = false;
  for (const Layer& l : layers_) (l.is_moe ? any_moe : any_dense) = true;
  if (any_dense) {
    const size_t I = c.intermediate_size;
    FLEX_ASSIGN_OR_RETURN(gu_, DeviceBuffer::create(T * 2 * I * sizeof(float)));
    FLEX_ASSIGN_OR_RETURN(act_, DeviceBuffer::create(T * I * esize));
  }
  if (any_moe) {
    FLEX_ASSIGN_OR_RETURN(moe_, MoeScratch::create(moe_dims_, max_step_tokens_));
  }
  return Status();
}

Status CudaQwen3MoeModel::enqueue_attention(Layer& L, int n) {
  const ModelConfig& c = config_;
  cudaStream_t s = stream_.get();
  const int H = c.hidden_size, D = c.head_dim;
  const int nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  const int q_dim = nq * D, qkv_dim = (nq + 2 * nkv) * D;
  const float eps = static_cast<float>(c.rms_norm_eps);
  float* x = x_.as<float>();
  FLEX_RETURN_IF_ERROR(blas_.linear_norm(dtype_, x, L.input_norm.as<float>(), eps, n, H,
                                         L.w_qkv.data(), qkv_dim, qkv_.as<float>(), h_.data()));
  host_mark("qkv");
  QkvArgs qa{qkv_.as<float>(),
             n,
             nq,
             nkv,
             D,
             L.q_norm.as<float>(),
             L.k_norm.as<float>(),
             eps,
             rope_cos_.as<float>(),
             rope_sin_.as<float>(),
             in_.positions,
             in_.kv_slots,
             max_seq_len_,
             q_.data(),
             L.k_cache.data(),
             L.v_cache.data()};
  FLEX_CUDA_TRY(qk_norm_rope_store(dtype_, qa, s));
  host_mark("rope");
  AttentionArgs aa{q_.data(),
                   L.k_cache.data(),
                   L.v_cache.data(),
                   in_.positions,
                   in_.kv_slots,
                   n,
                   nq,
                   nkv,
                   D,
                   max_seq_len_,
                   static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))),
                   attn_.data(),
                   attn_split_.as<float>(),
                   static_cast<int64_t>(attn_split_.num_bytes() / sizeof(float))};
  aa.tiles = attention_tiles_;
  FLEX_CUDA_TRY(attention(dtype_, aa, s));
  host_mark(aa.tiles ? "attention (tiles)" : "attention");
  // x += attn @ o_proj^T.
  FLEX_RETURN_IF_ERROR(
      blas_.linear(dtype_, attn_.data(), n, q_dim, L.w_o.data(), H, x, /*accumulate=*/true));
  host_mark("o_proj");
  return Status();
}

Status CudaQwen3MoeModel::enqueue_mlp(Layer& L, int n) {
  const ModelConfig& c = config_;
  cudaStream_t s = stream_.get();
  const int H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  float* x = x_.as<float>();
  // The post-attention RMSNorm goes with the first kernel that reads it (the decode
  // route kernel, the GEMV) where it can.
  if (L.is_moe) {
    return run_moe_norm(moe_dims_, L.weights(), moe_, MoeInputNorm{x, L.post_norm.as<float>(), eps},
                        h_.data(), n, in_.num_valid, x, /*accumulate=*/true, blas_, s);
  }
  const int I = c.intermediate_size;
  FLEX_RETURN_IF_ERROR(blas_.linear_norm(dtype_, x, L.post_norm.as<float>(), eps, n, H,
                                         L.w_gu.data(), 2 * I, gu_.as<float>(), h_.data()));
  return blas_.linear_swiglu(dtype_, gu_.as<float>(), n, I, L.w_down.data(), H, x,
                             /*accumulate=*/true, act_.data());
}

Status CudaQwen3MoeModel::enqueue_step(int n, int num_rows) {
  attention_tiles_ = attention_tiles_wanted(n, num_rows);
  FLEX_CUDA_TRY(embedding(dtype_, embed_.data(), in_.ids, n, config_.hidden_size, x_.as<float>(),
                          stream_.get()));
  for (Layer& L : layers_) {
    FLEX_RETURN_IF_ERROR(enqueue_attention(L, n));
    FLEX_RETURN_IF_ERROR(enqueue_mlp(L, n));
  }
  return enqueue_head(num_rows);
}

}  // namespace flexpert::cuda
