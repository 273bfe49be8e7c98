// SPDX-License-Identifier: Apache-2.0
// Qwen3MoeModel: the Hugging Face Qwen3MoeForCausalLM forward pass on CPU. A block-FP8
// checkpoint (Qwen3-*-FP8) has its projections dequantized to BF16 at load
// (Checkpoint::get_weight), as DeepseekV3Model does.
// See flexpert/model.h for the contract.
#pragma once

#include <memory>

#include "flexpert/checkpoint.h"
#include "flexpert/model.h"
#include "model/routed_experts.h"
#include "moe/expert_slots.h"
#include "moe/moe_executor.h"
#include "moe/moe_layer.h"

namespace flexpert {

class Qwen3MoeModel final : public Model {
 public:
  static Result<std::unique_ptr<Qwen3MoeModel>> create(std::unique_ptr<Checkpoint> checkpoint,
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
    Tensor q_norm;      // f32 [D]
    Tensor k_norm;      // f32 [D]
    // Projections as the checkpoint stores them (block-FP8 ones dequantized to BF16).
    Tensor q_proj, k_proj, v_proj, o_proj;
    bool is_moe = false;
    Tensor router;  // f32 [E, H]
    ExpertSlots experts;
    Tensor gate_proj, up_proj, down_proj;  // Dense MLP layers.
    Tensor k_cache;                        // f32 [max_sequences, max_seq_len, kv_heads, D]
    Tensor v_cache;
  };

  Qwen3MoeModel() = default;
  Status load_layer(int index, Layer* layer, const ModelOptions& options);
  Result<Tensor> weight(const std::string& name, const Shape& shape) const;
  Status validate(const std::vector<SequenceChunk>& batch) const;
  void attention_block(Layer& layer, const std::vector<SequenceChunk>& batch, int64_t num_tokens);
  Status mlp_block(int index, Layer& layer, int64_t num_tokens);

  std::unique_ptr<Checkpoint> checkpoint_;  // Owns the mappings the weights borrow.
  ModelConfig config_;
  RoutedExperts experts_;  // Placement, executor, load counters.
  ThreadPool* pool_ = nullptr;
  int max_sequences_ = 0;
  int max_seq_len_ = 0;
  Tensor embed_;       // Borrowed [V, H]
  Tensor lm_head_;     // Borrowed [V, H]
  Tensor final_norm_;  // f32 [H]
  std::vector<Layer> layers_;

  // Step scratch, grown as needed.
  Tensor x_, h_, q_, k_, v_, attn_, mlp_out_, gate_, up_;
  std::vector<int32_t> positions_;
  MoeWorkspace moe_ws_;
};

}  // namespace flexpert
