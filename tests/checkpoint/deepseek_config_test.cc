// SPDX-License-Identifier: Apache-2.0
// ModelConfig for the DeepSeek-V2/V3 families: the fixture, published configs (YaRN,
// FP8 quantization, no q LoRA), the MoE layer rule, errors and the to_json round trip.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "flexpert/model_config.h"

namespace flexpert {
namespace {

using json = nlohmann::json;

const std::string kTestdata = FLEXPERT_TESTDATA_DIR;

// deepseek-ai/DeepSeek-V3's config.json as published (transformers 4 spellings).
json deepseek_v3_json() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.46.3", "use_cache": true,
    "v_head_dim": 128, "vocab_size": 129280})");
}

// deepseek-ai/DeepSeek-V2-Lite's config.json as published.
json deepseek_v2_lite_json() {
  return json::parse(R"({
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": false,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": null,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "seq_aux": true, "tie_word_embeddings": false, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": true, "v_head_dim": 128, "vocab_size": 102400})");
}

Result<ModelConfig> parse(const json& j) { return ModelConfig::from_json(j.dump()); }

void expect_error(const json& j, StatusCode code, const std::string& mention) {
  auto c = parse(j);
  ASSERT_FALSE(c.ok()) << "accepted: " << j.dump();
  EXPECT_EQ(c.status().code(), code) << c.status().to_string();
  EXPECT_NE(c.status().message().find(mention), std::string::npos)
      << "message should mention '" << mention << "': " << c.status().message();
}

TEST(DeepseekConfig, LoadsFixture) {
  // transformers 5.17 spellings: rope_parameters, "dtype", no topk_method/scoring_func.
  auto c = ModelConfig::load(kTestdata + "/deepseekv3-tiny");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->model_type, "deepseek_v3");
  EXPECT_TRUE(c->is_deepseek());
  EXPECT_EQ(c->num_experts, 32);
  EXPECT_EQ(c->num_experts_per_tok, 4);
  EXPECT_EQ(c->num_shared_experts, 1);
  EXPECT_EQ(c->moe_intermediate_size, 64);
  EXPECT_EQ(c->first_k_dense_replace, 1);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  EXPECT_EQ(c->q_lora_rank, 64);
  EXPECT_EQ(c->kv_lora_rank, 32);
  EXPECT_EQ(c->qk_nope_head_dim, 16);
  EXPECT_EQ(c->qk_rope_head_dim, 8);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->v_head_dim, 16);
  EXPECT_EQ(c->n_group, 4);
  EXPECT_EQ(c->num_expert_groups(), 4);
  EXPECT_EQ(c->topk_group, 2);
  EXPECT_EQ(c->topk_method, "noaux_tc");
  EXPECT_EQ(c->scoring_func, "sigmoid");
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 2.5);
  EXPECT_TRUE(c->rope_interleave);
  EXPECT_EQ(c->rope_scaling.type, "default");
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->eos_token_ids, std::vector<int>{1});
  EXPECT_TRUE(c->quant_method.empty());
  EXPECT_FALSE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  EXPECT_TRUE(c->is_moe_layer(2));
}

TEST(DeepseekConfig, PublishedV3WithYarnAndFp8) {
  auto c = parse(deepseek_v3_json());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->num_expert_groups(), 8);
  EXPECT_EQ(c->topk_group, 4);
  EXPECT_EQ(c->q_lora_rank, 1536);
  EXPECT_EQ(c->quant_method, "fp8");
  EXPECT_EQ(c->weight_block_size, (std::vector<int>{128, 128}));
  EXPECT_EQ(c->rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 40.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->rope_scaling.mscale_all_dim, 1.0);
  for (int l = 0; l < 61; ++l) EXPECT_EQ(c->is_moe_layer(l), l >= 3) << l;
}

// Unasked, a GPU keeps the routed experts of a block-FP8 checkpoint (DeepSeek or Qwen3) in FP8
// (the only FP8 experts it has: 128 x 128 blocks); every other checkpoint is dequantized to bf16.
TEST(DeepseekConfig, DefaultGpuQuantizationIsFp8ForBlockFp8Checkpoints) {
  json j = deepseek_v3_json();
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->default_gpu_quantization(), "fp8");
  j["quantization_config"]["weight_block_size"] = {64, 128};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->default_gpu_quantization(), "bf16");
  j = deepseek_v3_json();
  j.erase("quantization_config");
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->default_gpu_quantization(), "bf16");
  c = ModelConfig::load(kTestdata + "/configs/qwen3-30b-a3b");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->default_gpu_quantization(), "bf16");
  c->quant_method = "fp8";  // As Qwen3-30B-A3B-FP8.
  c->weight_block_size = {128, 128};
  EXPECT_EQ(c->default_gpu_quantization(), "fp8");
}

TEST(DeepseekConfig, PublishedV2Lite) {
  auto c = parse(deepseek_v2_lite_json());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->model_type, "deepseek_v2");
  EXPECT_EQ(c->q_lora_rank, 0);  // null: q_proj.
  EXPECT_EQ(c->topk_method, "greedy");
  EXPECT_EQ(c->scoring_func, "softmax");
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_EQ(c->num_shared_experts, 2);
  EXPECT_EQ(c->num_expert_groups(), 1);
  EXPECT_TRUE(c->rope_interleave);  // V2's rotary embedding is always the interleaved form.
  EXPECT_DOUBLE_EQ(c->rope_scaling.mscale, 0.707);
  for (int l = 0; l < 27; ++l) EXPECT_EQ(c->is_moe_layer(l), l >= 1) << l;
  // V2 defaults differ from V3's.
  json j = deepseek_v2_lite_json();
  for (const char* key : {"topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor"})
    j.erase(key);
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->topk_method, "greedy");
  EXPECT_EQ(c->scoring_func, "softmax");
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.0);
}

TEST(DeepseekConfig, MoeLayersFollowFirstDenseAndFrequency) {
  json j = deepseek_v3_json();
  j["num_hidden_layers"] = 8;
  j["first_k_dense_replace"] = 1;
  j["moe_layer_freq"] = 2;
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const bool expected[] = {false, false, true, false, true, false, true, false};
  for (int l = 0; l < 8; ++l) EXPECT_EQ(c->is_moe_layer(l), expected[l]) << l;
}

TEST(DeepseekConfig, BadRoutingOptions) {
  json j = deepseek_v3_json();
  j["topk_method"] = "aux_free";
  expect_error(j, StatusCode::kInvalidArgument, "topk_method");
  expect_error(j, StatusCode::kInvalidArgument, "aux_free");
  j = deepseek_v3_json();
  j["scoring_func"] = "relu";
  expect_error(j, StatusCode::kInvalidArgument, "scoring_func");
  j["scoring_func"] = 1;
  expect_error(j, StatusCode::kInvalidArgument, "scoring_func");
  j = deepseek_v3_json();
  j["n_group"] = 3;  // 256 % 3 != 0.
  expect_error(j, StatusCode::kInvalidArgument, "n_group");
  j = deepseek_v3_json();
  j["topk_group"] = 9;
  expect_error(j, StatusCode::kInvalidArgument, "topk_group");
  j = deepseek_v3_json();
  j["topk_group"] = 1;
  j["num_experts_per_tok"] = 40;  // One group of 32 cannot give 40.
  expect_error(j, StatusCode::kInvalidArgument, "num_experts_per_tok");
  j = deepseek_v3_json();
  j["routed_scaling_factor"] = 0;
  expect_error(j, StatusCode::kInvalidArgument, "routed_scaling_factor");
}

TEST(DeepseekConfig, BadShapesAndMissingFields) {
  for (const char* key : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                          "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"}) {
    json j = deepseek_v3_json();
    j.erase(key);
    expect_error(j, StatusCode::kInvalidArgument, "missing field '" + std::string(key) + "'");
  }
  json j = deepseek_v3_json();
  j["qk_rope_head_dim"] = 63;
  expect_error(j, StatusCode::kInvalidArgument, "qk_rope_head_dim");
  j = deepseek_v3_json();
  j["q_lora_rank"] = -1;
  expect_error(j, StatusCode::kInvalidArgument, "q_lora_rank");
  j = deepseek_v3_json();
  j["moe_layer_freq"] = 0;
  expect_error(j, StatusCode::kInvalidArgument, "moe_layer_freq");
}

TEST(DeepseekConfig, RopeScalingAndQuantizationErrors) {
  json j = deepseek_v3_json();
  j["rope_scaling"]["type"] = "linear";
  expect_error(j, StatusCode::kUnimplemented, "'linear'");
  j = deepseek_v3_json();
  j["rope_scaling"].erase("factor");
  expect_error(j, StatusCode::kInvalidArgument, "factor");
  j = deepseek_v3_json();
  j.erase("rope_scaling");  // transformers 5 spelling.
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0}};
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 4.0);
  j = deepseek_v3_json();
  j["quantization_config"]["quant_method"] = "gptq";
  expect_error(j, StatusCode::kUnimplemented, "gptq");
  j = deepseek_v3_json();
  j["quantization_config"]["fmt"] = "e5m2";
  expect_error(j, StatusCode::kUnimplemented, "e5m2");
  j = deepseek_v3_json();
  j["quantization_config"]["weight_block_size"] = {128};
  expect_error(j, StatusCode::kInvalidArgument, "weight_block_size");
  j = deepseek_v3_json();
  j["quantization_config"] = "fp8";
  expect_error(j, StatusCode::kInvalidArgument, "quantization_config");
}

TEST(DeepseekConfig, ToJsonRoundtrips) {
  auto fixture = ModelConfig::load(kTestdata + "/deepseekv3-tiny");
  ASSERT_TRUE(fixture.ok());
  for (const json& j : {deepseek_v3_json(), deepseek_v2_lite_json()}) {
    auto c = parse(j);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    for (const ModelConfig& cfg : {c.value(), fixture.value()}) {
      auto back = ModelConfig::from_json(cfg.to_json());
      ASSERT_TRUE(back.ok()) << back.status().to_string() << "\n" << cfg.to_json();
      EXPECT_EQ(back.value(), cfg) << cfg.to_json();
    }
  }
  EXPECT_EQ(json::parse(fixture->to_json())["architectures"][0], "DeepseekV3ForCausalLM");
}

}  // namespace
}  // namespace flexpert
