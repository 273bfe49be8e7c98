// SPDX-License-Identifier: Apache-2.0
#include "cuda/cuda_deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "cuda/kernels.h"
#include "cuda/mla_kernels.h"
#include "flexpert/logging.h"
#include "flexpert/thread_pool.h"

namespace flexpert::cuda {
namespace {

// transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps.
constexpr float kLoraNormEps = 1e-6f;

}  // namespace

Result<std::unique_ptr<Model>> load_cuda_deepseek_model(const std::string& dir,
                                                        const ModelOptions& options,
                                                        const RopeTables& rope) {
  FLEX_ASSIGN_OR_RETURN(int device, parse_device(options.device));
  FLEX_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::open(dir));
  FLEX_ASSIGN_OR_RETURN(auto model, CudaDeepseekV3Model::create(std::move(ckpt), std::move(config),
                                                                options, rope, device));
  return std::unique_ptr<Model>(std::move(model));
}

Result<std::unique_ptr<CudaDeepseekV3Model>> CudaDeepseekV3Model::create(
    std::unique_ptr<Checkpoint> checkpoint, ModelConfig config, const ModelOptions& options,
    const RopeTables& rope, int device) {
  std::unique_ptr<CudaDeepseekV3Model> m(
      new CudaDeepseekV3Model(std::move(checkpoint), std::move(config), options, device));
  FLEX_RETURN_IF_ERROR(m->init_placement(options));
  FLEX_RETURN_IF_ERROR(m->check_config());
  FLEX_RETURN_IF_ERROR(m->init_fp8_experts(options));
  const ModelConfig& c = m->config_;
  m->softmax_scale_ =
      static_cast<float>(rope.softmax_mscale /
                         std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim)));
  FLEX_RETURN_IF_ERROR(m->create_streams());
  FLEX_ASSIGN_OR_RETURN(m->head_gemm_, HeadGemm::create(m->stream_.get()));
  FLEX_RETURN_IF_ERROR(m->load_weights(options, rope));
  FLEX_RETURN_IF_ERROR(m->allocate_scratch());
  FLEX_RETURN_IF_ERROR(m->finish_create(options));
  return m;
}

CudaDeepseekV3Model::~CudaDeepseekV3Model() { release_device(); }

// After init_placement (moe_dims_ set).
Status CudaDeepseekV3Model::check_config() {
  const ModelConfig& c = config_;
  if (!c.is_deepseek()) {
    return unimplemented("model_type '" + c.model_type + "' is not a DeepSeek model");
  }
  if (c.attention_bias) return unimplemented("attention_bias=true is not supported");
  const int r = c.kv_lora_rank;
  if (r != 32 && r != 64 && r != 128 && r != 256 && r != 512) {
    return unimplemented("kv_lora_rank " + std::to_string(r) + " is not supported on CUDA");
  }
  if (c.qk_rope_head_dim <= 0 || c.qk_rope_head_dim % 8 != 0) {
    return unimplemented("qk_rope_head_dim must be a multiple of 8 on CUDA");
  }
  if (c.scoring_func == "sigmoid") {
    router_.sigmoid = true;
  } else if (c.scoring_func == "softmax") {
    router_.sigmoid = false;
  } else {
    return invalid_argument("scoring_func '" + c.scoring_func + "' is not supported");
  }
  if (c.topk_method == "noaux_tc") {
    router_.method = GroupedTopkMethod::kNoauxTc;
  } else if (c.topk_method == "group_limited_greedy") {
    router_.method = GroupedTopkMethod::kGroupLimitedGreedy;
  } else if (c.topk_method == "greedy") {
    router_.method = GroupedTopkMethod::kGreedy;
  } else {
    return invalid_argument("topk_method '" + c.topk_method + "' is not supported");
  }
  router_.num_groups = c.n_group;
  router_.topk_groups = c.topk_group;
  router_.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  bool any_moe = false;
  for (int l = 0; l < c.num_hidden_layers; ++l) any_moe = any_moe || c.is_moe_layer(l);
  if (any_moe) {
    if (router_.method != GroupedTopkMethod::kGreedy &&
        (c.n_group < 1 || c.n_group > 32 || c.num_experts % c.n_group != 0 || c.topk_group < 1 ||
         c.topk_group > c.n_group)) {
      return unimplemented("the CUDA router supports up to 32 expert groups (n_group " +
                           std::to_string(c.n_group) + ", topk_group " +
                           std::to_string(c.topk_group) + ")");
    }
  }
  return Status();
}

Status CudaDeepseekV3Model::load_weights(const ModelOptions& options, const RopeTables& rope) {
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const int64_t H = c.hidden_size;
  FLEX_ASSIGN_OR_RETURN(Tensor embed, ck.get("model.embed_tokens.weight", {c.vocab_size, H}));
  FLEX_ASSIGN_OR_RETURN(embed_, upload_tensor(embed, dtype_));
  if (c.tie_word_embeddings && !ck.contains("lm_head.weight")) {
    FLEX_ASSIGN_OR_RETURN(lm_head_, upload_tensor(embed, dtype_));
  } else {
    FLEX_ASSIGN_OR_RETURN(Tensor head, weight("lm_head.weight", {c.vocab_size, H}));
    FLEX_ASSIGN_OR_RETURN(lm_head_, upload_tensor(head, dtype_));
  }
  FLEX_ASSIGN_OR_RETURN(Tensor norm, ck.get("model.norm.weight", {H}));
  FLEX_ASSIGN_OR_RETURN(final_norm_, upload_tensor(norm, DType::kF32));
  // RoPE tables in the CPU kernel's arithmetic: double angles, times the attention
  // factor, rounded once.
  const int64_t half = c.qk_rope_head_dim / 2;
  if (static_cast<int64_t>(rope.inv_freq.size()) != half) {
    return invalid_argument("RoPE tables of " + std::to_string(rope.inv_freq.size()) +
                            " frequencies for qk_rope_head_dim " +
                            std::to_string(c.qk_rope_head_dim));
  }
  std::vector<float> cosv(static_cast<size_t>(max_seq_len_ * half));
  std::vector<float> sinv(cosv.size());
  for (int64_t pos = 0; pos < max_seq_len_; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos) * rope.inv_freq[i];
      cosv[pos * half + i] = static_cast<float>(std::cos(angle) * rope.attention_factor);
      sinv[pos * half + i] = static_cast<float>(std::sin(angle) * rope.attention_factor);
    }
  }
  FLEX_ASSIGN_OR_RETURN(rope_cos_, upload(cosv.data(), cosv.size() * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(rope_sin_, upload(sinv.data(), sinv.size() * sizeof(float)));
  layers_.resize(c.num_hidden_layers);
  return load_layers(options);
}

Status CudaDeepseekV3Model::load_layer(int index) {
  Layer* layer = &layers_[index];
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const std::string a = p + "self_attn.";
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t r = c.kv_lora_rank, qr = c.q_lora_rank;
  auto f32 = [&](const std::string& name, int64_t n, DeviceBuffer* out) -> Status {
    FLEX_ASSIGN_OR_RETURN(Tensor t, ck.get(name, {n}));
    FLEX_ASSIGN_OR_RETURN(*out, upload_tensor(t, DType::kF32));
    return Status();
  };
  FLEX_RETURN_IF_ERROR(f32(p + "input_layernorm.weight", H, &layer->input_norm));
  FLEX_RETURN_IF_ERROR(f32(p + "post_attention_layernorm.weight", H, &layer->post_norm));
  FLEX_ASSIGN_OR_RETURN(Tensor kv_a, weight(a + "kv_a_proj_with_mqa.weight", {r + dr, H}));
  if (qr > 0) {
    FLEX_ASSIGN_OR_RETURN(Tensor q_a, weight(a + "q_a_proj.weight", {qr, H}));
    FLEX_ASSIGN_OR_RETURN(layer->w_a, upload_rows({&q_a, &kv_a}, dtype_));
    FLEX_RETURN_IF_ERROR(f32(a + "q_a_layernorm.weight", qr, &layer->q_a_norm));
    FLEX_ASSIGN_OR_RETURN(Tensor q_b, weight(a + "q_b_proj.weight", {nh * (dn + dr), qr}));
    FLEX_ASSIGN_OR_RETURN(layer->w_q, upload_tensor(q_b, dtype_));
  } else {
    FLEX_ASSIGN_OR_RETURN(layer->w_a, upload_tensor(kv_a, dtype_));
    FLEX_ASSIGN_OR_RETURN(Tensor q, weight(a + "q_proj.weight", {nh * (dn + dr), H}));
    FLEX_ASSIGN_OR_RETURN(layer->w_q, upload_tensor(q, dtype_));
  }
  FLEX_RETURN_IF_ERROR(f32(a + "kv_a_layernorm.weight", r, &layer->kv_a_norm));
  FLEX_ASSIGN_OR_RETURN(Tensor o, weight(a + "o_proj.weight", {H, nh * dv}));
  FLEX_ASSIGN_OR_RETURN(layer->w_o, upload_tensor(o, dtype_));
  {
    // kv_b [heads, nope + v, r] split per head into the two absorbed factors (as the CPU).
    FLEX_ASSIGN_OR_RETURN(Tensor kv_b_raw, weight(a + "kv_b_proj.weight", {nh * (dn + dv), r}));
    const Tensor kv_b = kv_b_raw.to(DType::kF32);
    Tensor uk_t = Tensor::empty(DType::kF32, {nh, r, dn});
    Tensor uv = Tensor::empty(DType::kF32, {nh, dv, r});
    const float* src = kv_b.data<float>();
    float* uk = uk_t.data<float>();
    float* v = uv.data<float>();
    for (int64_t h = 0; h < nh; ++h) {
      const float* head = src + h * (dn + dv) * r;
      for (int64_t i = 0; i < dn; ++i) {
        for (int64_t j = 0; j < r; ++j) uk[(h * r + j) * dn + i] = head[i * r + j];
      }
      std::memcpy(v + h * dv * r, head + dn * r, static_cast<size_t>(dv * r) * sizeof(float));
    }
    FLEX_ASSIGN_OR_RETURN(layer->w_uk_t, upload_tensor(uk_t, dtype_));
    FLEX_ASSIGN_OR_RETURN(layer->w_uv, upload_tensor(uv, dtype_));
  }
  layer->is_moe = c.is_moe_layer(index);
  int64_t I = c.intermediate_size;
  std::string mlp = p + "mlp.";
  if (layer->is_moe) {
    const int64_t E = c.num_experts;
    FLEX_ASSIGN_OR_RETURN(Tensor router, ck.get(p + "mlp.gate.weight", {E, H}));
    FLEX_ASSIGN_OR_RETURN(layer->router, upload_tensor(router, dtype_));
    if (router_.method == GroupedTopkMethod::kNoauxTc) {
      FLEX_RETURN_IF_ERROR(f32(p + "mlp.gate.e_score_correction_bias", E, &layer->score_bias));
    }
    FLEX_RETURN_IF_ERROR(load_moe_state(index, layer));
    I = static_cast<int64_t>(c.moe_intermediate_size) * c.num_shared_experts;
    mlp += "shared_experts.";
  }
  if (I > 0) {
    FLEX_ASSIGN_OR_RETURN(Tensor gate, weight(mlp + "gate_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor up, weight(mlp + "up_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor down, weight(mlp + "down_proj.weight", {H, I}));
    FLEX_ASSIGN_OR_RETURN(layer->w_gu, upload_rows({&gate, &up}, dtype_));
    FLEX_ASSIGN_OR_RETURN(layer->w_down, upload_tensor(down, dtype_));
    layer->mlp_inter = static_cast<int>(I);
  }
  const size_t cache_bytes =
      static_cast<size_t>(max_sequences_ + 1) * max_seq_len_ * (r + dr) * dtype_size(dtype_);
  FLEX_ASSIGN_OR_RETURN(layer->kv_cache, DeviceBuffer::create_zeroed(cache_bytes));
  return Status();
}

Status CudaDeepseekV3Model::allocate_scratch() {
  const ModelConfig& c = config_;
  const size_t esize = dtype_size(dtype_);
  FLEX_RETURN_IF_ERROR(allocate_io());
  const size_t T = static_cast<size_t>(max_step_tokens_);
  const size_t H = c.hidden_size, nh = c.num_attention_heads;
  const size_t r = c.kv_lora_rank, dr = c.qk_rope_head_dim;
  const size_t qr = std::max(c.q_lora_rank, 0);
  FLEX_ASSIGN_OR_RETURN(x_, DeviceBuffer::create(T * H * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(h_, DeviceBuffer::create(T * H * esize));
  FLEX_ASSIGN_OR_RETURN(a_, DeviceBuffer::create(T * (qr + r + dr) * sizeof(float)));
  if (qr > 0) {
    FLEX_ASSIGN_OR_RETURN(qa_, DeviceBuffer::create(T * qr * esize));
  }
  FLEX_ASSIGN_OR_RETURN(q_, DeviceBuffer::create(T * nh * (c.qk_nope_head_dim + dr) * esize));
  FLEX_ASSIGN_OR_RETURN(q_latent_, DeviceBuffer::create(T * nh * (r + dr) * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(latent_, DeviceBuffer::create(T * nh * r * esize));
  FLEX_ASSIGN_OR_RETURN(latent_split_,
                        DeviceBuffer::create(mla_attention_split_floats(r) * sizeof(float)));
  FLEX_ASSIGN_OR_RETURN(attn_, DeviceBuffer::create(T * nh * c.v_head_dim * esize));
  size_t inter = 0;
  bool any_moe = false;
  for (const Layer& l : layers_) {
    inter = std::max(inter, static_cast<size_t>(l.mlp_inter));
    any_moe = any_moe || l.is_moe;
  }
  if (inter > 0) {
    FLEX_ASSIGN_OR_RETURN(gu_, DeviceBuffer::create(T * 2 * inter * sizeof(float)));
    FLEX_ASSIGN_OR_RETURN(act_, DeviceBuffer::create(T * inter * esize));
  }
  if (any_moe) {
    FLEX_ASSIGN_OR_RETURN(moe_, MoeScratch::create(moe_dims_, max_step_tokens_));
  }
  return Status();
}

Status CudaDeepseekV3Model::enqueue_attention(Layer& L, int n) {
  const ModelConfig& c = config_;
  cudaStream_t s = stream_.get();
  const int H = c.hidden_size, nh = c.num_attention_heads;
  const int dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int r = c.kv_lora_rank, qr = std::max(c.q_lora_rank, 0);
  const int q_head = dn + dr, row = r + dr, a_dim = qr + r + dr;
  const float eps = static_cast<float>(c.rms_norm_eps);
  float* x = x_.as<float>();
  // a = h @ [q_a; kv_a]^T (f32) with h = rms_norm(x), then q (dtype) through q LoRA or
  // q_proj. Decode steps normalise inside the GEMVs (Blas::norm_fuses): h is never stored.
  const bool fused = Blas::norm_fuses(dtype_, n, H, a_dim) &&
                     (qr > 0 || Blas::norm_fuses(dtype_, n, H, int64_t{nh} * q_head));
  if (fused) {
    FLEX_RETURN_IF_ERROR(blas_.linear_norm(dtype_, x, L.input_norm.as<float>(), eps, n, H,
                                           L.w_a.data(), a_dim, a_.as<float>(), h_.data()));
  } else {
    FLEX_CUDA_TRY(rms_norm(dtype_, x, nullptr, L.input_norm.as<float>(), n, H, eps, h_.data(), s));
    FLEX_RETURN_IF_ERROR(
        blas_.linear(dtype_, h_.data(), n, H, L.w_a.data(), a_dim, a_.as<float>(), false));
  }
  if (qr > 0) {
    FLEX_RETURN_IF_ERROR(
        blas_.linear_norm_rows(dtype_, a_.as<float>(), a_dim, L.q_a_norm.as<float>(), kLoraNormEps,
                               n, qr, L.w_q.data(), nh * q_head, dtype_, q_.data(), qa_.data()));
  } else if (fused) {
    FLEX_RETURN_IF_ERROR(blas_.linear_norm_rows(dtype_, x, H, L.input_norm.as<float>(), eps, n, H,
                                                L.w_q.data(), nh * q_head, dtype_, q_.data(),
                                                h_.data()));
  } else {
    FLEX_RETURN_IF_ERROR(
        blas_.gemm_nt(dtype_, h_.data(), n, H, L.w_q.data(), nh * q_head, dtype_, q_.data()));
  }
  MlaRopeArgs ra{a_.as<float>() + qr,
                 a_dim,
                 L.kv_a_norm.as<float>(),
                 kLoraNormEps,
                 q_.data(),
                 q_latent_.as<float>(),
                 rope_cos_.as<float>(),
                 rope_sin_.as<float>(),
                 c.rope_interleave,
                 in_.positions,
                 in_.kv_slots,
                 max_seq_len_,
                 L.kv_cache.data(),
                 n,
                 nh,
                 dn,
                 dr,
                 r};
  // Absorb: q_latent[t, h, :r] = W_uk[h]^T q_nope[t, h]; with the rotary parts and the
  // cache row (one launch in decode steps).
  FLEX_RETURN_IF_ERROR(head_gemm_.run(dtype_, q_.data(), n, nh * q_head, q_head, L.w_uk_t.data(),
                                      nh, r, dn, DType::kF32, q_latent_.data(), nh * row, row,
                                      &ra));
  MlaAttentionArgs aa{q_latent_.as<float>(),
                      L.kv_cache.data(),
                      in_.positions,
                      in_.kv_slots,
                      n,
                      nh,
                      r,
                      dr,
                      max_seq_len_,
                      softmax_scale_,
                      latent_.data(),
                      latent_split_.as<float>(),
                      static_cast<int64_t>(latent_split_.num_bytes() / sizeof(float)),
                      mla_prompt_groups_};
  FLEX_CUDA_TRY(mla_attention(dtype_, aa, s));
  // Out of the latent space: attn[t, h] = W_uv[h] latent[t, h]; then x += attn @ o_proj^T.
  FLEX_RETURN_IF_ERROR(head_gemm_.run(dtype_, latent_.data(), n, nh * r, r, L.w_uv.data(), nh, dv,
                                      r, dtype_, attn_.data(), nh * dv, dv));
  return blas_.linear(dtype_, attn_.data(), n, nh * dv, L.w_o.data(), H, x, /*accumulate=*/true);
}

Status CudaDeepseekV3Model::enqueue_swiglu(Layer& L, int n) {
  const int H = config_.hidden_size, I = L.mlp_inter;
  FLEX_RETURN_IF_ERROR(
      blas_.linear(dtype_, h_.data(), n, H, L.w_gu.data(), 2 * I, gu_.as<float>(), false));
  return blas_.linear_swiglu(dtype_, gu_.as<float>(), n, I, L.w_down.data(), H, x_.as<float>(),
                             /*accumulate=*/true, act_.data());
}

Status CudaDeepseekV3Model::enqueue_mlp(Layer& L, int n) {
  const ModelConfig& c = config_;
  const int H = c.hidden_size, I = L.mlp_inter;
  const float eps = static_cast<float>(c.rms_norm_eps);
  float* x = x_.as<float>();
  if (L.is_moe) {
    // h = rms_norm(x), made by the MoE (its decode route kernel, or an RMSNorm first),
    // serves the routed and the shared experts.
    const SharedExperts shared{L.w_gu.data(), L.w_down.data(), I, gu_.as<float>(), act_.data()};
    return run_grouped_moe_norm(
        moe_dims_, router_, L.score_bias.as<float>(), L.weights(), moe_,
        MoeInputNorm{x, L.post_norm.as<float>(), eps}, h_.data(), n, in_.num_valid, x,
        /*accumulate=*/true, blas_, stream_.get(), I > 0 ? &shared : nullptr);
  }
  // A dense layer: its gate/up GEMV normalises x itself where it can.
  FLEX_RETURN_IF_ERROR(blas_.linear_norm(dtype_, x, L.post_norm.as<float>(), eps, n, H,
                                         L.w_gu.data(), 2 * I, gu_.as<float>(), h_.data()));
  return blas_.linear_swiglu(dtype_, gu_.as<float>(), n, I, L.w_down.data(), H, x,
                             /*accumulate=*/true, act_.data());
}

Status CudaDeepseekV3Model::enqueue_step(int n, int num_rows) {
  mla_prompt_groups_ = attention_tiles_wanted(n, num_rows);
  FLEX_CUDA_TRY(embedding(dtype_, embed_.data(), in_.ids, n, config_.hidden_size, x_.as<float>(),
                          stream_.get()));
  for (Layer& L : layers_) {
    FLEX_RETURN_IF_ERROR(enqueue_attention(L, n));
    FLEX_RETURN_IF_ERROR(enqueue_mlp(L, n));
  }
  return enqueue_head(num_rows);
}

}  // namespace flexpert::cuda
