// SPDX-License-Identifier: Apache-2.0
// ModelConfig: the architecture hyper-parameters read from a Hugging Face config.json.
//
// Families: qwen3_moe, deepseek_v3 and deepseek_v2 (MLA attention, shared experts,
// grouped routing). Accepts the spellings found in the wild: `num_experts` /
// `num_local_experts` / `n_routed_experts`, `rope_theta` / `rope_parameters.rope_theta`,
// `rope_scaling` / `rope_parameters` for YaRN, `eos_token_id` as a number, a list
// or null, `head_dim` absent (hidden_size / num_attention_heads). An unknown
// `model_type`, a missing required field or an inconsistent value is an
// InvalidArgument naming the field; a known but unimplemented option (a RoPE
// scaling other than YaRN, a quantization other than block FP8) is Unimplemented.
// Plain value type.
#pragma once

#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

// RoPE frequency scaling (`rope_scaling` / `rope_parameters`), as transformers computes it.
struct RopeScaling {
  std::string type = "default";  // "default" or "yarn".
  double factor = 1.0;
  int original_max_position_embeddings = 0;  // 0: max_position_embeddings.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;            // 0: absent.
  double mscale_all_dim = 0.0;    // 0: absent.
  double attention_factor = 0.0;  // 0: absent (derived from factor and mscale).
  bool truncate = true;

  bool operator==(const RopeScaling&) const = default;
};

// Defaults for the sampling fields a request omits: generation_config.json's where the
// model directory has one (vLLM's reading of it: `do_sample` is not consulted), else
// OpenAI's (temperature 1, top_p 1, no top_k, no repetition penalty).
struct SamplingDefaults {
  float temperature = 1.0f;
  float top_p = 1.0f;
  int top_k = 0;  // 0: no limit.
  float repetition_penalty = 1.0f;

  bool operator==(const SamplingDefaults&) const = default;
};

struct ModelConfig {
  std::string model_type;  // "qwen3_moe", "deepseek_v3", "deepseek_v2".
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;      // Dense MLP layers.
  int moe_intermediate_size = 0;  // Each routed expert.
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  int num_experts = 0;  // Logical (routed) experts per MoE layer; n_routed_experts.
  int num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int max_position_embeddings = 0;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  std::vector<int> eos_token_ids;      // config.json's, then generation_config.json's new ones.
  SamplingDefaults sampling_defaults;  // From generation_config.json; not in to_json().
  std::string torch_dtype;             // "bfloat16", "float32", ... as written; informational.

  // DeepSeek-V2/V3 (zero or default for other families). Each head's query/key is
  // [qk_nope_head_dim | qk_rope_head_dim]; head_dim is set to qk_rope_head_dim.
  int num_shared_experts = 0;  // n_shared_experts, each of moe_intermediate_size.
  int first_k_dense_replace = 0;
  int moe_layer_freq = 1;
  int num_nextn_predict_layers = 0;  // Multi-token-prediction layers; not run.
  int q_lora_rank = 0;               // 0 (null in config.json): q_proj, no q LoRA.
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  int n_group = 1;  // Expert groups of the router (and of EPLB's hierarchical policy).
  int topk_group = 1;
  std::string topk_method;   // "greedy", "group_limited_greedy", "noaux_tc"; "" for qwen3.
  std::string scoring_func;  // "softmax", "sigmoid"; "" for qwen3 (softmax).
  double routed_scaling_factor = 1.0;
  bool rope_interleave = false;  // q_pe/k_pe pairs are (2i, 2i+1), not (i, i + D/2).
  RopeScaling rope_scaling;
  // `quantization_config`: "" or "fp8" (E4M3 weights with `<name>_scale_inv` block scales).
  std::string quant_method;
  std::vector<int> weight_block_size;  // [rows, cols] of an FP8 scale block.

  // True when `layer` has a routed-expert MoE block (else a dense MLP).
  bool is_moe_layer(int layer) const;
  bool is_deepseek() const { return model_type == "deepseek_v3" || model_type == "deepseek_v2"; }
  // The routed experts' quantization on a GPU when none is asked for (ModelOptions::
  // quantization ""): "fp8" for a block-FP8 checkpoint (DeepSeek, Qwen3) with 128 x 128
  // blocks, the ones the GPU keeps in FP8 (docs/cuda.md "FP8 experts"), else "bf16"
  // (dequantized).
  std::string default_gpu_quantization() const;
  // Expert groups for EPLB's hierarchical policy: n_group, 1 when the family has none.
  int num_expert_groups() const { return n_group > 0 ? n_group : 1; }

  static Result<ModelConfig> from_json(const std::string& text);
  // DIR/config.json, then DIR/generation_config.json when present
  // (apply_generation_config).
  static Result<ModelConfig> load(const std::string& dir);
  // Applies a generation_config.json text: its eos_token_id (a number, a list or null)
  // adds the ids not yet in eos_token_ids; temperature, top_p, top_k and
  // repetition_penalty become sampling_defaults. InvalidArgument naming the field for a
  // wrong type, a value out of range or an EOS id outside the vocabulary.
  Status apply_generation_config(const std::string& text);
  // A config.json text that from_json() reads back to the same config.
  std::string to_json() const;

  bool operator==(const ModelConfig&) const = default;
};

}  // namespace flexpert
