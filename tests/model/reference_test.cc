// SPDX-License-Identifier: Apache-2.0
// The model against Hugging Face's float64 reference (testdata/*/reference.json):
// last-position logits within 1e-4 relative L2 and identical greedy continuations,
// for any valid expert placement, batched and chunked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "flexpert/checkpoint.h"
#include "flexpert/generate.h"
#include "flexpert/model.h"

namespace flexpert {
namespace {

const std::string kModelDir = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

struct RefPrompt {
  std::vector<int32_t> input_ids;
  std::vector<double> logits;
  std::vector<int32_t> greedy;
};

std::vector<RefPrompt> load_reference(const std::string& dir) {
  std::ifstream in(dir + "/reference.json");
  auto j = nlohmann::json::parse(in);
  std::vector<RefPrompt> out;
  for (const auto& p : j["prompts"]) {
    out.push_back({p["input_ids"].get<std::vector<int32_t>>(),
                   p["last_logits_f64"].get<std::vector<double>>(),
                   p["greedy"].get<std::vector<int32_t>>()});
  }
  return out;
}

double rel_l2(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

std::unique_ptr<Model> load(const std::string& dir, const std::string& placement,
                            int max_seqs = 8) {
  ModelOptions options;
  options.placement = placement;
  options.max_sequences = max_seqs;
  auto model = Model::load(dir, options);
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  return model.ok() ? std::move(model).value() : nullptr;
}

// Logits of every prompt (one step each) and greedy continuations (all prompts batched).
void check_against_reference(Model& model, const std::vector<RefPrompt>& ref, double logit_tol,
                             bool check_tokens, int step_budget = 2048) {
  Tensor logits;
  for (size_t i = 0; i < ref.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    ASSERT_TRUE(model.forward({{0, 0, ref[i].input_ids}}, &logits).ok());
    ASSERT_EQ(logits.size(1), static_cast<int64_t>(ref[i].logits.size()));
    const double err = rel_l2(logits.data<float>(), ref[i].logits);
    EXPECT_LT(err, logit_tol);
    ::testing::Test::RecordProperty("rel_l2_prompt_" + std::to_string(i), std::to_string(err));
    std::printf("  prompt %zu: last-logit relative L2 vs float64 = %.3g\n", i, err);
  }
  if (!check_tokens) return;
  std::vector<GenerationRequest> requests;
  for (const auto& r : ref) {
    SamplingParams params;
    params.max_tokens = static_cast<int>(r.greedy.size());
    params.ignore_eos = true;
    requests.push_back({r.input_ids, params});
  }
  GeneratorOptions gen_options;
  gen_options.max_tokens_per_step = step_budget;
  Generator generator(model, gen_options);
  auto results = generator.run(requests);
  ASSERT_TRUE(results.ok()) << results.status().to_string();
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_EQ(results.value()[i].tokens, ref[i].greedy) << "prompt " << i;
  }
}

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

TEST(ReferenceTest, Bf16WeightsLoadAndRun) {
  // Rewrite the fixture with bf16 weights: it loads, and the logits stay near the
  // float64 reference within the rounding of the weights.
  auto ckpt = Checkpoint::open(kModelDir);
  ASSERT_TRUE(ckpt.ok());
  const std::string dir = ::testing::TempDir() + "/qwen3moe-tiny-bf16";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(kModelDir + "/config.json", dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  SafetensorsWriter writer;
  std::vector<Tensor> keep;
  for (const std::string& name : ckpt.value()->names()) {
    auto t = ckpt.value()->get(name);
    ASSERT_TRUE(t.ok());
    keep.push_back(t.value().to(DType::kBF16));
    const Tensor& bf = keep.back();
    const char* data = static_cast<const char*>(bf.raw());  // Stable across keep's growth.
    writer.add(name, DType::kBF16, bf.shape(),
               [data](uint64_t off, void* dst, uint64_t n) { std::memcpy(dst, data + off, n); });
  }
  ASSERT_TRUE(writer.write(dir + "/model.safetensors").ok());
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
