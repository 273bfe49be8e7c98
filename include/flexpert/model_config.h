// SPDX-License-Identifier: Apache-2.0
// ModelConfig: the architecture hyper-parameters read from a Hugging Face config.json.
//
// Accepts the spellings found in the wild: `num_experts` / `num_local_experts`,
// `rope_theta` / `rope_parameters.rope_theta`, `eos_token_id` as a number, a list
// or null, `head_dim` absent (hidden_size / num_attention_heads). An unknown
// `model_type`, a missing required field or an inconsistent value is an
// InvalidArgument naming the field. Plain value type.
#pragma once

#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

struct ModelConfig {
  std::string model_type;  // "qwen3_moe".
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;      // Dense MLP layers.
  int moe_intermediate_size = 0;  // Each routed expert.
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  int num_experts = 0;  // Logical experts per MoE layer.
  int num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int max_position_embeddings = 0;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  std::vector<int> eos_token_ids;
  std::string torch_dtype;  // "bfloat16", "float32", ... as written; informational.

  // True when `layer` has a routed-expert MoE block (else a dense MLP).
  bool is_moe_layer(int layer) const;

  static Result<ModelConfig> from_json(const std::string& text);
  static Result<ModelConfig> load(const std::string& dir);  // DIR/config.json.
  // A config.json text that from_json() reads back to the same config.
  std::string to_json() const;

  bool operator==(const ModelConfig&) const = default;
};

}  // namespace flexpert
