// SPDX-License-Identifier: Apache-2.0
#include "cuda/cuda_qwen3_moe.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#include "cuda/kernels.h"
#include "cuda/step_driver.h"
#include "flexpert/logging.h"
#include "flexpert/thread_pool.h"

namespace flexpert::cuda {

Result<std::unique_ptr<CudaQwen3MoeModel>> CudaQwen3MoeModel::create(
    std::unique_ptr<Checkpoint> checkpoint, ModelConfig config, const ModelOptions& options,
    int device) {
  std::unique_ptr<CudaQwen3MoeModel> m(new CudaQwen3MoeModel());
  m->checkpoint_ = std::move(checkpoint);
  m->config_ = std::move(config);
  m->device_ = device;
  m->dtype_ = options.device_dtype;
  m->use_graphs_ = options.cuda_graphs;
  const ModelConfig& c = m->config_;
  if (m->dtype_ != DType::kF32 && m->dtype_ != DType::kBF16) {
    return invalid_argument("CUDA computes in f32 or bf16, not " +
                            std::string(dtype_name(m->dtype_)));
  }
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
  m->max_sequences_ = std::max(1, options.max_sequences);
  m->max_seq_len_ = options.max_seq_len > 0
                        ? options.max_seq_len
                        : std::min(std::max(c.max_position_embeddings, 1), 4096);
  FLEX_ASSIGN_OR_RETURN(
      m->placement_,
      ExpertPlacement::parse(options.placement, c.num_hidden_layers, std::max(c.num_experts, 1)));
  const int num_slots = m->placement_.num_slots();
  m->first_slot_ = options.first_slot;
  m->num_local_slots_ = options.num_local_slots < 0 ? num_slots : options.num_local_slots;
  if (m->first_slot_ < 0 || m->num_local_slots_ < 1 ||
      m->first_slot_ + m->num_local_slots_ > num_slots) {
    return invalid_argument("local slots [" + std::to_string(m->first_slot_) + ", +" +
                            std::to_string(m->num_local_slots_) + ") outside the placement's " +
                            std::to_string(num_slots) + " slots");
  }
  // All slots local (one rank): the single-process path, executor unused.
  m->ep_ = !(m->first_slot_ == 0 && m->num_local_slots_ == num_slots);
  if (m->ep_ && options.moe_executor == nullptr) {
    return invalid_argument("a CUDA model holding part of the slots needs a moe_executor");
  }
  m->moe_dims_.dtype = m->dtype_;
  m->moe_dims_.hidden = c.hidden_size;
  m->moe_dims_.intermediate = c.moe_intermediate_size;
  m->moe_dims_.num_experts = c.num_experts;
  m->moe_dims_.top_k = c.num_experts_per_tok;
  m->moe_dims_.num_slots = m->placement_.num_slots();
  m->moe_dims_.norm_topk_prob = c.norm_topk_prob;
  bool any_moe = false;
  for (int l = 0; l < c.num_hidden_layers; ++l) any_moe = any_moe || c.is_moe_layer(l);
  if (any_moe) FLEX_RETURN_IF_ERROR(m->moe_dims_.validate());

  FLEX_RETURN_IF_ERROR(set_device(device));
  FLEX_ASSIGN_OR_RETURN(m->stream_, Stream::create());
  FLEX_ASSIGN_OR_RETURN(m->blas_, Blas::create(m->stream_.get()));
  FLEX_RETURN_IF_ERROR(m->load_weights(options));
  FLEX_RETURN_IF_ERROR(m->allocate_scratch());
  if (m->ep_) FLEX_RETURN_IF_ERROR(StepDriver::init_ep(*m, options));
  m->slot_counts_.assign(c.num_hidden_layers,
                         std::vector<int64_t>(static_cast<size_t>(m->placement_.num_slots()), 0));
  return m;
}

CudaQwen3MoeModel::~CudaQwen3MoeModel() {
  (void)set_device(device_);
  (void)stream_.synchronize();
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
  return StepDriver::load_layers(*this, options);
}

Status CudaQwen3MoeModel::load_layer(int index, Layer* layer) {
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
  FLEX_ASSIGN_OR_RETURN(Tensor q, ck.get(p + "self_attn.q_proj.weight", {q_dim, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor k, ck.get(p + "self_attn.k_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor v, ck.get(p + "self_attn.v_proj.weight", {kv_dim, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor o, ck.get(p + "self_attn.o_proj.weight", {H, q_dim}));
  FLEX_ASSIGN_OR_RETURN(layer->w_qkv, upload_rows({&q, &k, &v}, dtype_));
  FLEX_ASSIGN_OR_RETURN(layer->w_o, upload_tensor(o, dtype_));
  layer->is_moe = c.is_moe_layer(index);
  if (layer->is_moe) {
    const int64_t E = c.num_experts;
    FLEX_ASSIGN_OR_RETURN(Tensor router, ck.get(p + "mlp.gate.weight", {E, H}));
    FLEX_ASSIGN_OR_RETURN(layer->router, upload_tensor(router, dtype_));
    FLEX_RETURN_IF_ERROR(load_slots(index, layer));
    const size_t num_slots = static_cast<size_t>(placement_.num_slots());
    FLEX_ASSIGN_OR_RETURN(layer->rep_start, DeviceBuffer::create(E * sizeof(int32_t)));
    FLEX_ASSIGN_OR_RETURN(layer->rep_count, DeviceBuffer::create(E * sizeof(int32_t)));
    FLEX_ASSIGN_OR_RETURN(layer->rep_slots, DeviceBuffer::create(num_slots * sizeof(int32_t)));
    FLEX_ASSIGN_OR_RETURN(layer->stats, DeviceBuffer::create_zeroed(num_slots * sizeof(int64_t)));
    FLEX_RETURN_IF_ERROR(
        StepDriver::write_routing_tables(*this, index, placement_.slot_map(index)));
  } else {
    const int64_t I = c.intermediate_size;
    FLEX_ASSIGN_OR_RETURN(Tensor gate, ck.get(p + "mlp.gate_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor up, ck.get(p + "mlp.up_proj.weight", {I, H}));
    FLEX_ASSIGN_OR_RETURN(Tensor down, ck.get(p + "mlp.down_proj.weight", {H, I}));
    FLEX_ASSIGN_OR_RETURN(layer->w_gu, upload_rows({&gate, &up}, dtype_));
    FLEX_ASSIGN_OR_RETURN(layer->w_down, upload_tensor(down, dtype_));
  }
  const size_t cache_bytes =
      static_cast<size_t>(max_sequences_ + 1) * max_seq_len_ * kv_dim * dtype_size(dtype_);
  FLEX_ASSIGN_OR_RETURN(layer->k_cache, DeviceBuffer::create_zeroed(cache_bytes));
  FLEX_ASSIGN_OR_RETURN(layer->v_cache, DeviceBuffer::create_zeroed(cache_bytes));
  return Status();
}

Status CudaQwen3MoeModel::load_slots(int index, Layer* layer) {
  const int num_slots = num_local_slots_;  // Global slots first_slot_ + [0, num_slots).
  const size_t slot_bytes = static_cast<size_t>(moe_dims_.slot_elems()) * dtype_size(dtype_);
  FLEX_ASSIGN_OR_RETURN(layer->slots, DeviceBuffer::create_zeroed(num_slots * slot_bytes));
  const std::vector<int>& map = placement_.slot_map(index);
  ExpertSlots& mirror = mirrors_[index];
  // Pack a batch of slots in parallel on the host (into the mirror when there is
  // one), then copy it up.
  constexpr int kBatch = 16;
  std::vector<uint8_t> own_staging(mirror.num_slots() > 0 ? 0 : kBatch * slot_bytes);
  ThreadPool& pool = ThreadPool::global();
  for (int s0 = 0; s0 < num_slots; s0 += kBatch) {
    const int n = std::min(kBatch, num_slots - s0);
    uint8_t* staging =
        mirror.num_slots() > 0 ? static_cast<uint8_t*>(mirror.slot_data(s0)) : own_staging.data();
    std::vector<Status> errors(static_cast<size_t>(n));
    pool.parallel_for(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int expert = map[first_slot_ + s0 + i];
        if (expert == ExpertPlacement::kFreeSlot) {
          std::memset(staging + i * slot_bytes, 0, slot_bytes);
          continue;
        }
        const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size;
        const std::string ep = "model.layers." + std::to_string(index) + ".mlp.experts." +
                               std::to_string(expert) + ".";
        auto gate = checkpoint_->get(ep + "gate_proj.weight", {I, H});
        auto up = checkpoint_->get(ep + "up_proj.weight", {I, H});
        auto down = checkpoint_->get(ep + "down_proj.weight", {H, I});
        if (!gate.ok() || !up.ok() || !down.ok()) {
          errors[i] = !gate.ok() ? gate.status() : !up.ok() ? up.status() : down.status();
          continue;
        }
        const Tensor g32 = gate.value().to(DType::kF32), u32 = up.value().to(DType::kF32),
                     d32 = down.value().to(DType::kF32);
        pack_expert(g32.data<float>(), u32.data<float>(), d32.data<float>(), static_cast<int>(H),
                    static_cast<int>(I), dtype_, staging + i * slot_bytes);
      }
    });
    for (const Status& s : errors) FLEX_RETURN_IF_ERROR(s);
    FLEX_CUDA_TRY(cudaMemcpy(layer->slots.as<uint8_t>() + s0 * slot_bytes, staging, n * slot_bytes,
                             cudaMemcpyHostToDevice));
  }
  return Status();
}

Status CudaQwen3MoeModel::load_expert(int layer, int expert, int local_slot) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || !layers_[layer].is_moe) {
    return invalid_argument("layer " + std::to_string(layer) + " has no routed experts");
  }
  if (expert < 0 || expert >= config_.num_experts || local_slot < 0 ||
      local_slot >= num_local_slots_) {
    return invalid_argument("expert " + std::to_string(expert) + " or local slot " +
                            std::to_string(local_slot) + " out of range");
  }
  const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size;
  const std::string ep =
      "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + ".";
  FLEX_ASSIGN_OR_RETURN(Tensor gate, checkpoint_->get(ep + "gate_proj.weight", {I, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor up, checkpoint_->get(ep + "up_proj.weight", {I, H}));
  FLEX_ASSIGN_OR_RETURN(Tensor down, checkpoint_->get(ep + "down_proj.weight", {H, I}));
  const Tensor g32 = gate.to(DType::kF32), u32 = up.to(DType::kF32), d32 = down.to(DType::kF32);
  const size_t slot_bytes = static_cast<size_t>(moe_dims_.slot_elems()) * dtype_size(dtype_);
  ExpertSlots& mirror = mirrors_[layer];
  std::vector<uint8_t> image(mirror.num_slots() > 0 ? 0 : slot_bytes);
  void* dst = mirror.num_slots() > 0 ? mirror.slot_data(local_slot) : image.data();
  pack_expert(g32.data<float>(), u32.data<float>(), d32.data<float>(), static_cast<int>(H),
              static_cast<int>(I), dtype_, dst);
  if (mirror.num_slots() > 0) return slots_written(layer, local_slot);
  FLEX_RETURN_IF_ERROR(set_device(device_));
  FLEX_CUDA_TRY(cudaMemcpyAsync(layers_[layer].slots.as<uint8_t>() + local_slot * slot_bytes,
                                image.data(), slot_bytes, cudaMemcpyHostToDevice,
                                upload_stream_.get()));
  return upload_stream_.synchronize();
}

ExpertSlots* CudaQwen3MoeModel::local_slots(int layer) {
  return StepDriver::local_slots(*this, layer);
}

Status CudaQwen3MoeModel::slots_written(int layer, int local_slot) {
  return StepDriver::slots_written(*this, layer, local_slot);
}

Status CudaQwen3MoeModel::copy_slot(int layer, int local_slot, int src_rank, int src_slot) {
  return StepDriver::copy_slot(*this, layer, local_slot, src_rank, src_slot);
}

Status CudaQwen3MoeModel::allocate_scratch() {
  const ModelConfig& c = config_;
  const size_t esize = dtype_size(dtype_);
  FLEX_RETURN_IF_ERROR(StepDriver::allocate_io(*this));
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
  // x += attn @ o_proj^T.
  return blas_.linear(dtype_, attn_.data(), n, q_dim, L.w_o.data(), H, x, /*accumulate=*/true);
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
    return run_moe_norm(moe_dims_, StepDriver::moe_weights(L), moe_,
                        MoeInputNorm{x, L.post_norm.as<float>(), eps}, h_.data(), n, in_.num_valid,
                        x, /*accumulate=*/true, blas_, s);
  }
  const int I = c.intermediate_size;
  FLEX_RETURN_IF_ERROR(blas_.linear_norm(dtype_, x, L.post_norm.as<float>(), eps, n, H,
                                         L.w_gu.data(), 2 * I, gu_.as<float>(), h_.data()));
  return blas_.linear_swiglu(dtype_, gu_.as<float>(), n, I, L.w_down.data(), H, x,
                             /*accumulate=*/true, act_.data());
}

Status CudaQwen3MoeModel::enqueue_head(int num_rows) {
  if (num_rows == 0) return Status();
  const ModelConfig& c = config_;
  FLEX_CUDA_TRY(rms_norm(dtype_, x_.as<float>(), in_.last_rows, final_norm_.as<float>(), num_rows,
                         c.hidden_size, static_cast<float>(c.rms_norm_eps), last_h_.data(),
                         stream_.get()));
  return blas_.gemm_nt(dtype_, last_h_.data(), num_rows, c.hidden_size, lm_head_.data(),
                       c.vocab_size, DType::kF32, logits_.data());
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

Status CudaQwen3MoeModel::forward(const std::vector<SequenceChunk>& batch, Tensor* logits) {
  return StepDriver::forward(*this, batch, logits);
}

Status CudaQwen3MoeModel::forward_step(const std::vector<SequenceChunk>& batch,
                                       const std::vector<RowOutput>& rows, Tensor* logits,
                                       std::vector<int32_t>* tokens) {
  return StepDriver::forward(*this, batch, logits, &rows, tokens);
}

const std::vector<std::vector<int64_t>>& CudaQwen3MoeModel::slot_counts() const {
  return StepDriver::slot_counts(*this);
}

void CudaQwen3MoeModel::reset_slot_counts() { StepDriver::reset_slot_counts(*this); }

Status CudaQwen3MoeModel::warm_up() { return StepDriver::warm_up(*this); }

Status CudaQwen3MoeModel::set_placement(ExpertPlacement placement) {
  return StepDriver::set_placement(*this, std::move(placement));
}

}  // namespace flexpert::cuda
