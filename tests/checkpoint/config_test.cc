// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "flexpert/model_config.h"
#include "test_util.h"

namespace flexpert {
namespace {

using json = nlohmann::json;

const std::string kTestdata = FLEXPERT_TESTDATA_DIR;

// A Qwen3-30B-A3B config.json as published (transformers 4.x spellings).
json qwen3_30b_json() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 151936})");
}

Result<ModelConfig> parse(const json& j) { return ModelConfig::from_json(j.dump()); }

void expect_invalid(const json& j, const std::string& mention) {
  auto c = parse(j);
  ASSERT_FALSE(c.ok()) << "accepted: " << j.dump();
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
  EXPECT_NE(c.status().message().find(mention), std::string::npos)
      << "message should mention '" << mention << "': " << c.status().message();
}

TEST(ModelConfig, LoadsFixture) {
  // transformers 5 spellings: num_local_experts, rope_parameters.rope_theta, "dtype".
  auto c = ModelConfig::load(kTestdata + "/qwen3moe-tiny");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->model_type, "qwen3_moe");
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_EQ(c->hidden_size, 128);
  EXPECT_EQ(c->intermediate_size, 256);
  EXPECT_EQ(c->moe_intermediate_size, 64);
  EXPECT_EQ(c->num_hidden_layers, 4);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->num_experts, 16);
  EXPECT_EQ(c->num_experts_per_tok, 4);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_TRUE(c->mlp_only_layers.empty());
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->max_position_embeddings, 1024);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->torch_dtype, "float32");
  for (int l = 0; l < 4; ++l) EXPECT_TRUE(c->is_moe_layer(l)) << l;
}

TEST(ModelConfig, ParsesOlderSpellings) {
  auto c = parse(qwen3_30b_json());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->eos_token_ids, std::vector<int>{151645});
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_EQ(c->num_hidden_layers, 48);
}

TEST(ModelConfig, EosTokenIdForms) {
  json j = qwen3_30b_json();
  j["eos_token_id"] = {151643, 151645};
  EXPECT_EQ(parse(j)->eos_token_ids, (std::vector<int>{151643, 151645}));
  j["eos_token_id"] = nullptr;
  EXPECT_TRUE(parse(j)->eos_token_ids.empty());
  j.erase("eos_token_id");
  EXPECT_TRUE(parse(j)->eos_token_ids.empty());
  j["eos_token_id"] = "2";
  expect_invalid(j, "eos_token_id");
  j["eos_token_id"] = {1, "x"};
  expect_invalid(j, "eos_token_id");
  j["eos_token_id"] = 151936;  // == vocab_size: out of range.
  expect_invalid(j, "eos_token_id");
}

TEST(ModelConfig, DefaultsForOptionalFields) {
  json j = qwen3_30b_json();
  for (const char* key : {"head_dim", "num_key_value_heads", "rope_theta", "decoder_sparse_step",
                          "mlp_only_layers", "norm_topk_prob", "torch_dtype"}) {
    j.erase(key);
  }
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->head_dim, 2048 / 32);
  EXPECT_EQ(c->num_key_value_heads, 32);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_TRUE(c->torch_dtype.empty());

  j["dtype"] = "float16";  // transformers 5 spelling.
  EXPECT_EQ(parse(j)->torch_dtype, "float16");
}

TEST(ModelConfig, MoeLayersFollowSparseStepAndMlpOnlyLayers) {
  json j = qwen3_30b_json();
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {0, 3};
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  // (l + 1) % 2 == 0 picks 1, 3, 5; layer 3 is forced dense.
  const bool expected[] = {false, true, false, false, false, true};
  for (int l = 0; l < 6; ++l) EXPECT_EQ(c->is_moe_layer(l), expected[l]) << l;

  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = {5};
  c = parse(j);
  ASSERT_TRUE(c.ok());
  for (int l = 0; l < 6; ++l) EXPECT_EQ(c->is_moe_layer(l), l != 5) << l;

  j["num_experts"] = 0;  // No experts at all: a dense model.
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  for (int l = 0; l < 6; ++l) EXPECT_FALSE(c->is_moe_layer(l)) << l;
}

TEST(ModelConfig, UnknownModelType) {
  json j = qwen3_30b_json();
  j["model_type"] = "llama";
  expect_invalid(j,
                 "unsupported model_type 'llama' (supported: qwen3_moe, deepseek_v3, deepseek_v2)");
  j.erase("model_type");
  expect_invalid(j, "model_type");
}

TEST(ModelConfig, MissingRequiredFields) {
  for (const char* key :
       {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size"}) {
    json j = qwen3_30b_json();
    j.erase(key);
    expect_invalid(j, "missing field '" + std::string(key) + "'");
  }
}

TEST(ModelConfig, BadValuesNameTheField) {
  const std::pair<const char*, json> cases[] = {
      {"hidden_size", -1},
      {"hidden_size", "2048"},
      {"hidden_size", 2048.5},
      {"hidden_size", 1ll << 40},
      {"num_key_value_heads", 5},  // 32 % 5 != 0.
      {"num_key_value_heads", 0},
      {"num_experts_per_tok", 129},
      {"num_experts_per_tok", 0},
      {"decoder_sparse_step", 0},
      {"mlp_only_layers", json::array({48})},
      {"mlp_only_layers", 3},
      {"head_dim", 127},
      {"rms_norm_eps", 0},
      {"rope_theta", "big"},
      {"norm_topk_prob", 1},
      {"torch_dtype", 16},
  };
  for (const auto& [key, value] : cases) {
    SCOPED_TRACE(std::string(key) + " = " + value.dump());
    json j = qwen3_30b_json();
    j[key] = value;
    expect_invalid(j, key);
  }
  json no_head_dim = qwen3_30b_json();
  no_head_dim.erase("head_dim");
  no_head_dim["num_attention_heads"] = 24;  // 2048 / 24 is not whole.
  no_head_dim["num_key_value_heads"] = 4;
  expect_invalid(no_head_dim, "head_dim");
}

TEST(ModelConfig, NotJsonOrNotObject) {
  for (const char* text : {"", "{", "[1]", "null"}) {
    auto c = ModelConfig::from_json(text);
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << text;
  }
}

TEST(ModelConfig, LoadErrorsNameThePath) {
  testing::TempDir tmp;
  auto missing = ModelConfig::load(tmp.path());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(tmp.file("config.json")), std::string::npos);
  testing::write_file(tmp.file("config.json"), "{\"model_type\": \"qwen3_moe\"}");
  auto bad = ModelConfig::load(tmp.path());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(tmp.file("config.json")), std::string::npos);
}

TEST(ModelConfig, ToJsonRoundtrips) {
  auto fixture = ModelConfig::load(kTestdata + "/qwen3moe-tiny");
  ASSERT_TRUE(fixture.ok());
  json custom = qwen3_30b_json();
  custom["num_hidden_layers"] = 6;
  custom["decoder_sparse_step"] = 2;
  custom["mlp_only_layers"] = {0, 3};
  custom["eos_token_id"] = {7, 9};
  custom["attention_bias"] = true;
  custom["tie_word_embeddings"] = true;
  custom["rms_norm_eps"] = 1.234567e-5;
  auto other = parse(custom);
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  for (const ModelConfig& c : {fixture.value(), other.value()}) {
    auto back = ModelConfig::from_json(c.to_json());
    ASSERT_TRUE(back.ok()) << back.status().to_string() << "\n" << c.to_json();
    EXPECT_EQ(back.value(), c) << c.to_json();
  }
  EXPECT_EQ(json::parse(fixture->to_json())["architectures"][0], "Qwen3MoeForCausalLM");
}

}  // namespace
}  // namespace flexpert
