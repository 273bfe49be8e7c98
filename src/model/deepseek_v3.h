// SPDX-License-Identifier: Apache-2.0
// DeepseekV3Model: the Hugging Face DeepseekV3ForCausalLM (and DeepseekV2ForCausalLM)
// forward pass on CPU. See flexpert/model.h for the contract.
//
// Attention is multi-head latent attention (MLA). The KV cache holds per token only
// the normalized latent (kv_lora_rank floats) and the rotated rope key
// (qk_rope_head_dim floats), never per-head keys or values; attention runs in the
// absorbed form: each head's q_nope is mapped into the latent space through kv_b's
// key part, scores are taken against the cached rows, and the weighted latent is
// mapped out through kv_b's value part. Layers below first_k_dense_replace are dense;
// MoE layers route with DeepSeek's grouped router (moe/moe_layer.h) and add the shared
// experts, which every rank computes locally for its own tokens.
// NOTE: with YaRN the softmax scale is multiplied by mscale(factor, mscale_all_dim)^2
// for both families, as DeepSeek's own V2/V3 code and transformers' V3 do;
// transformers' V2 port leaves it out (a difference only for YaRN V2 checkpoints).
#pragma once

#include <memory>

#include "checkpoint/rope.h"
#include "flexpert/checkpoint.h"
#include "flexpert/model.h"
#include "model/routed_experts.h"

namespace flexpert {

class DeepseekV3Model final : public Model {
 public:
  static Result<std::unique_ptr<DeepseekV3Model>> create(std::unique_ptr<Checkpoint> checkpoint,
                                                         ModelConfig config,
                                                         const ModelOptions& options);

  const ModelConfig& config() const override { return config_; }
  const ExpertPlacement& placement() const override { return experts_.placement(); }
  int max_sequences() const override { return max_sequences_; }
  int max_seq_len() const override { return max_seq_len_; }
  Status forward(const std::vector<SequenceChunk>& batch, Tensor* logits) override;
  const std::vector<std::vector<int64_t>>& slot_counts() const override {
    return experts_.slot_counts();
  }
  void reset_slot_counts() override { experts_.reset_slot_counts(); }
  ExpertSlots* local_slots(int layer) override;
  Status set_placement(ExpertPlacement placement) override {
    return experts_.set_placement(std::move(placement));
  }
  Status load_expert(int layer, int expert, int local_slot) override;

 private:
  struct Layer {
    Tensor input_norm;  // f32 [H]
    Tensor post_norm;   // f32 [H]
    // Projections are borrowed from the checkpoint (FP8 ones dequantized to BF16).
    Tensor q_proj;     // [heads * (nope + rope), H] without q LoRA
    Tensor q_a_proj;   // [q_lora_rank, H]
    Tensor q_a_norm;   // f32 [q_lora_rank]
    Tensor q_b_proj;   // [heads * (nope + rope), q_lora_rank]
    Tensor kv_a_proj;  // [kv_lora_rank + rope, H]
    Tensor kv_a_norm;  // f32 [kv_lora_rank]
    Tensor w_uk_t;     // f32 [heads, kv_lora_rank, nope]: kv_b's key part, transposed.
    Tensor w_uv;       // f32 [heads, v_head_dim, kv_lora_rank]: kv_b's value part.
    Tensor o_proj;     // [H, heads * v_head_dim]
    Tensor kv_cache;   // f32 [max_sequences, max_seq_len, kv_lora_rank + rope]
    bool is_moe = false;
    Tensor router;      // f32 [E, H]
    Tensor score_bias;  // f32 [E], e_score_correction_bias (noaux_tc only)
    ExpertSlots experts;
    Tensor shared_gate, shared_up, shared_down;  // Shared experts (undefined when none).
    Tensor gate_proj, up_proj, down_proj;        // Dense MLP layers.
  };

  DeepseekV3Model() = default;
  Status load_layer(int index, Layer* layer, const ModelOptions& options);
  Result<Tensor> weight(const std::string& name, const Shape& shape) const;
  void attention_block(Layer& layer, const std::vector<SequenceChunk>& batch, int64_t num_tokens);
  Status mlp_block(int index, Layer& layer, int64_t num_tokens);
  // out[T, H] = down(silu(gate(h)) * up(h)).
  void swiglu(const float* h, int64_t num_tokens, const Tensor& gate, const Tensor& up,
              const Tensor& down, float* out);

  std::unique_ptr<Checkpoint> checkpoint_;  // Owns the mappings the weights borrow.
  ModelConfig config_;
  RoutedExperts experts_;
  GroupedRouterParams router_params_;
  RopeTables rope_;
  float softmax_scale_ = 1.0f;
  ThreadPool* pool_ = nullptr;
  int max_sequences_ = 0;
  int max_seq_len_ = 0;
  Tensor embed_;       // Borrowed [V, H]
  Tensor lm_head_;     // Borrowed [V, H]
  Tensor final_norm_;  // f32 [H]
  std::vector<Layer> layers_;

  // Step scratch, grown as needed.
  Tensor x_, h_, q_a_, q_, kv_a_, q_latent_, attn_latent_, attn_, mlp_out_, shared_out_, gate_, up_;
  std::vector<int32_t> positions_;
  MoeWorkspace moe_ws_;
};

}  // namespace flexpert
