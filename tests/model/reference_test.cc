// SPDX-License-Identifier: Apache-2.0
// The model against Hugging Face's float64 reference (testdata/*/reference.json):
// last-position logits within 1e-4 relative L2 and identical greedy continuations,
// for any valid expert placement, batched and chunked.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "reference_util.h"

namespace flexpert {
namespace {

using namespace model_test;

const std::string kModelDir = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

TEST(ReferenceTest, Qwen3MoeTinyIdentityPlacement) {
  auto model = load(kModelDir, "identity");
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, true);
}

TEST(ReferenceTest, Qwen3MoeTinyChunkedPrefill) {
  // A budget of 3 tokens per step splits every prompt into chunks and mixes
  // decode tokens of some sequences with prefill chunks of others.
  auto model = load(kModelDir, "identity");
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, true, 3);
}

TEST(ReferenceTest, Qwen3MoeTinyReplicatedPlacements) {
  const auto ref = load_reference(kModelDir);
  std::random_device rd;
  for (int trial = 0; trial < 3; ++trial) {
    const unsigned seed = rd();
    const int replicas = 1 + static_cast<int>(seed % 24);
    const std::string spec = "replicate:" + std::to_string(replicas) + ":" + std::to_string(seed);
    SCOPED_TRACE(spec);
    auto model = load(kModelDir, spec);
    ASSERT_NE(model, nullptr);
    EXPECT_GT(model->placement().num_slots(), model->config().num_experts);
    check_against_reference(*model, ref, 1e-4, true);
  }
}

TEST(ReferenceTest, Qwen3MoeTinyPlacementFile) {
  // Reversed slots, every expert twice, and free slots in between.
  const std::string path = ::testing::TempDir() + "/placement.json";
  std::vector<int> map;
  for (int e = 15; e >= 0; --e) map.insert(map.end(), {e, -1, (e * 7) % 16});
  std::ofstream(path) << nlohmann::json({{"layers", map}}).dump();
  auto model = load(kModelDir, path);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->placement().num_slots(), 48);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, true);
  // Every routed row ran in some slot, never in a free one.
  for (const auto& layer : model->slot_counts()) {
    for (size_t s = 0; s < layer.size(); ++s) {
      if (map[s] == -1) {
        EXPECT_EQ(layer[s], 0) << "free slot " << s;
      }
    }
  }
  std::remove(path.c_str());
}

TEST(ReferenceTest, Qwen3MoeTinyPlacementValue) {
  // ModelOptions::expert_placement (what a worker gets from the front end) wins over the
  // spec, which is left unparsable here: a different map in each layer, free slots.
  const auto ref = load_reference(kModelDir);
  auto loaded_config = ModelConfig::load(kModelDir);
  ASSERT_TRUE(loaded_config.ok()) << loaded_config.status().to_string();
  const ModelConfig& config = *loaded_config;
  ASSERT_GT(config.num_experts, 1);
  std::vector<std::vector<int>> maps(config.num_hidden_layers);
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    for (int e = 0; e < config.num_experts; ++e) {
      maps[l].insert(maps[l].end(), {(e + 5 * l) % config.num_experts, -1});
    }
  }
  auto placement = ExpertPlacement::from_slot_maps(config.num_experts, maps);
  ASSERT_TRUE(placement.ok()) << placement.status().to_string();
  ModelOptions options;
  options.placement = "replicate:x";
  options.expert_placement = *placement;
  auto model = Model::load(kModelDir, options);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  EXPECT_EQ((*model)->placement().slot_maps(), maps);
  check_against_reference(**model, ref, 1e-4, true);
  // A placement of another model's shape is refused.
  options.expert_placement = ExpertPlacement::identity(config.num_hidden_layers + 1,
                                                       config.num_experts, config.num_experts);
  auto layers = Model::load(kModelDir, options);
  EXPECT_EQ(layers.status().code(), StatusCode::kInvalidArgument);
  options.expert_placement = ExpertPlacement::identity(
      config.num_hidden_layers, config.num_experts + 1, config.num_experts + 1);
  EXPECT_EQ(Model::load(kModelDir, options).status().code(), StatusCode::kInvalidArgument);
}

TEST(ReferenceTest, Bf16WeightsLoadAndRun) {
  // Rewrite the fixture with bf16 weights: it loads, and the logits stay near the
  // float64 reference within the rounding of the weights.
  const std::string dir = ::testing::TempDir() + "/qwen3moe-tiny-bf16";
  rewrite_checkpoint(kModelDir, dir,
                     [](const std::string&, const Tensor& t) { return t.to(DType::kBF16); });
  auto model = load(dir, "replicate:4:7");
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 2e-2, false);
  std::filesystem::remove_all(dir);
}

TEST(ReferenceTest, RejectsBadInput) {
  auto model = load(kModelDir, "identity", 2);
  ASSERT_NE(model, nullptr);
  Tensor logits;
  EXPECT_EQ(model->forward({{0, 0, {1, 512}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, 0, {-1}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{2, 0, {1}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, 0, {1}}, {0, 0, {2}}}, &logits).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, model->max_seq_len(), {1}}}, &logits).code(),
            StatusCode::kInvalidArgument);
  ModelOptions bad;
  bad.placement = "replicate:x";
  EXPECT_EQ(Model::load(kModelDir, bad).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert
