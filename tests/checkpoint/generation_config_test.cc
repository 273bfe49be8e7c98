// SPDX-License-Identifier: Apache-2.0
// generation_config.json beside config.json: extra EOS ids and the sampling defaults.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "flexpert/model_config.h"
#include "test_util.h"

namespace flexpert {
namespace {

using testing::read_file;
using testing::TempDir;
using testing::write_file;

const std::string kTiny = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

// The tiny fixture's config.json (vocabulary 512, no EOS) with eos_token_id 7.
std::string tiny_dir(const TempDir& dir, const std::string& generation_config) {
  nlohmann::json config = nlohmann::json::parse(read_file(kTiny + "/config.json"));
  config["eos_token_id"] = 7;
  write_file(dir.file("config.json"), config.dump());
  if (!generation_config.empty()) write_file(dir.file("generation_config.json"), generation_config);
  return dir.path();
}

TEST(GenerationConfigTest, AbsentMeansOpenAiDefaults) {
  TempDir dir;
  auto c = ModelConfig::load(tiny_dir(dir, ""));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{7}));
  EXPECT_EQ(c->sampling_defaults, SamplingDefaults());
  EXPECT_EQ(c->sampling_defaults.temperature, 1.0f);
  EXPECT_EQ(c->sampling_defaults.top_p, 1.0f);
}

TEST(GenerationConfigTest, EosIdsExtendAndSamplingFieldsBecomeDefaults) {
  // Qwen3's published generation_config.json, with EOS ids this vocabulary holds.
  TempDir dir;
  auto c = ModelConfig::load(tiny_dir(dir, R"({"bos_token_id": 1, "do_sample": true,
      "eos_token_id": [9, 7, 11], "pad_token_id": 9, "temperature": 0.6, "top_k": 20,
      "top_p": 0.95, "repetition_penalty": 1.05, "transformers_version": "4.51.0"})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{7, 9, 11}));  // config.json's first, no dup.
  EXPECT_FLOAT_EQ(c->sampling_defaults.temperature, 0.6f);
  EXPECT_EQ(c->sampling_defaults.top_k, 20);
  EXPECT_FLOAT_EQ(c->sampling_defaults.top_p, 0.95f);
  EXPECT_FLOAT_EQ(c->sampling_defaults.repetition_penalty, 1.05f);

  TempDir scalar;
  c = ModelConfig::load(tiny_dir(scalar, R"({"eos_token_id": 12, "top_k": -1})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{7, 12}));
  EXPECT_EQ(c->sampling_defaults.top_k, 0);  // -1: no limit.
}

TEST(GenerationConfigTest, BadValuesFailTheLoadNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"eos_token_id": 512})", "eos_token_id"},
      {R"({"eos_token_id": ["2"]})", "eos_token_id"},
      {R"({"temperature": -1})", "temperature"},
      {R"({"top_p": 0})", "top_p"},
      {R"({"top_k": 1.5})", "top_k"},
      {R"({"repetition_penalty": 3})", "repetition_penalty"},
      {R"([1])", "not a JSON object"},
      {R"({"temperature": )", "not a JSON object"},
  };
  for (const auto& [text, needle] : cases) {
    TempDir dir;
    auto c = ModelConfig::load(tiny_dir(dir, text));
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
  }
}

}  // namespace
}  // namespace flexpert
