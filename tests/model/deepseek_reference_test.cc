// SPDX-License-Identifier: Apache-2.0
// DeepseekV3Model against Hugging Face's float64 reference of testdata/deepseekv3-tiny
// (MLA with q LoRA, a dense first layer, shared experts, sigmoid + noaux_tc grouped
// routing, interleaved RoPE): last-position logits within 1e-4 relative L2 and
// identical greedy continuations, for any valid expert placement, batched and chunked.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/synth.h"
#include "moe/expert_slots.h"
#include "reference_util.h"

namespace flexpert {
namespace {

using namespace model_test;

const std::string kModelDir = std::string(FLEXPERT_TESTDATA_DIR) + "/deepseekv3-tiny";

TEST(DeepseekReferenceTest, IdentityPlacement) {
  auto model = load(kModelDir, "identity");
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->config().model_type, "deepseek_v3");
  EXPECT_EQ(model->local_slots(0), nullptr);  // first_k_dense_replace = 1.
  EXPECT_NE(model->local_slots(1), nullptr);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, true);
}

TEST(DeepseekReferenceTest, ChunkedPrefill) {
  // 3 tokens per step: prompts split into chunks, decode tokens mixed with prefill chunks.
  auto model = load(kModelDir, "identity");
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, true, 3);
}

TEST(DeepseekReferenceTest, ReplicatedPlacements) {
  const auto ref = load_reference(kModelDir);
  std::random_device rd;
  for (int replicas : {2, 1 + static_cast<int>(rd() % 40)}) {
    const unsigned seed = rd();
    const std::string spec = "replicate:" + std::to_string(replicas) + ":" + std::to_string(seed);
    SCOPED_TRACE(spec);
    auto model = load(kModelDir, spec);
    ASSERT_NE(model, nullptr);
    EXPECT_EQ(model->placement().num_slots(), model->config().num_experts + replicas);
    check_against_reference(*model, ref, 1e-4, true);
  }
}

TEST(DeepseekReferenceTest, PlacementFileWithFreeSlots) {
  // Reversed slots, every expert twice, free slots in between: free slots never compute.
  const std::string path = ::testing::TempDir() + "/deepseek_placement.json";
  std::vector<int> map;
  for (int e = 31; e >= 0; --e) map.insert(map.end(), {e, -1, (e * 7) % 32});
  std::ofstream(path) << nlohmann::json({{"layers", map}}).dump();
  auto model = load(kModelDir, path);
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, true);
  int64_t routed = 0;
  for (const auto& layer : model->slot_counts()) {
    for (size_t s = 0; s < layer.size(); ++s) {
      routed += layer[s];
      if (map[s] == -1) {
        EXPECT_EQ(layer[s], 0) << "free slot " << s;
      }
    }
  }
  EXPECT_GT(routed, 0);
  model->reset_slot_counts();
  for (const auto& layer : model->slot_counts()) {
    for (int64_t n : layer) EXPECT_EQ(n, 0);
  }
  std::remove(path.c_str());
}

TEST(DeepseekReferenceTest, EmptyBatchRunsAndCountsNothing) {
  auto model = load(kModelDir, "identity");
  ASSERT_NE(model, nullptr);
  Tensor logits;
  ASSERT_TRUE(model->forward({}, &logits).ok());
  EXPECT_EQ(logits.size(0), 0);
  for (const auto& layer : model->slot_counts()) {
    for (int64_t n : layer) EXPECT_EQ(n, 0);
  }
}

TEST(DeepseekReferenceTest, DecodeAfterPrefillMatchesOneLongPrefill) {
  // The latent cache: prefill n-1 tokens, then decode the last one in the same slot,
  // against the whole prompt in one step of another slot.
  auto model = load(kModelDir, "identity");
  ASSERT_NE(model, nullptr);
  const auto ref = load_reference(kModelDir);
  const std::vector<int32_t>& ids = ref[1].input_ids;
  Tensor logits;
  ASSERT_TRUE(
      model->forward({{3, 0, std::vector<int32_t>(ids.begin(), ids.end() - 1)}}, &logits).ok());
  ASSERT_TRUE(model->forward({{3, static_cast<int>(ids.size()) - 1, {ids.back()}}}, &logits).ok());
  EXPECT_LT(rel_l2(logits.data<float>(), ref[1].logits), 1e-4);
}

TEST(DeepseekReferenceTest, LoadExpertRestoresASlot) {
  auto model = load(kModelDir, "replicate:3:5");
  ASSERT_NE(model, nullptr);
  const auto ref = load_reference(kModelDir);
  ExpertSlots* slots = model->local_slots(2);
  ASSERT_NE(slots, nullptr);
  // Wipe every slot of layer 2, then reload each from the checkpoint.
  std::memset(slots->slot_data(0), 0, slots->slot_bytes() * slots->num_slots());
  for (int s = 0; s < slots->num_slots(); ++s) {
    const int expert = model->placement().slot_expert(2, s);
    ASSERT_TRUE(model->load_expert(2, expert, s).ok());
  }
  EXPECT_LT(rel_l2(prompt_logits(*model, ref[0].input_ids).data(), ref[0].logits), 1e-4);
  EXPECT_EQ(model->load_expert(0, 0, 0).code(), StatusCode::kInvalidArgument);  // Dense layer.
  EXPECT_EQ(model->load_expert(2, 32, 0).code(), StatusCode::kInvalidArgument);
}

TEST(DeepseekReferenceTest, SkipsMultiTokenPredictionLayers) {
  // Real DeepSeek-V3 checkpoints carry layer num_hidden_layers (the MTP module).
  const std::string dir = ::testing::TempDir() + "/deepseekv3-tiny-mtp";
  std::vector<std::pair<std::string, Tensor>> extra;
  extra.emplace_back("model.layers.3.eh_proj.weight", Tensor::zeros(DType::kF32, {128, 256}));
  extra.emplace_back("model.layers.3.enorm.weight", Tensor::zeros(DType::kF32, {128}));
  rewrite_checkpoint(
      kModelDir, dir, [](const std::string&, const Tensor& t) { return t.to(t.dtype()); }, extra);
  auto model = load(dir, "identity");
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 1e-4, false);
  std::filesystem::remove_all(dir);
}

TEST(DeepseekReferenceTest, Bf16WeightsLoadAndRun) {
  const std::string dir = ::testing::TempDir() + "/deepseekv3-tiny-bf16";
  rewrite_checkpoint(kModelDir, dir,
                     [](const std::string&, const Tensor& t) { return t.to(DType::kBF16); });
  auto model = load(dir, "replicate:4:7");
  ASSERT_NE(model, nullptr);
  check_against_reference(*model, load_reference(kModelDir), 2e-2, false);
  std::filesystem::remove_all(dir);
}

TEST(DeepseekFp8Test, Fp8CheckpointMatchesItsBf16Twin) {
  // synth writes one seed's values rounded to bf16 and as DeepSeek-V3's block FP8 (E4M3
  // + 128x128 scales). E4M3 rounds each weight by up to 2^-4 relative (about 2.5% RMS for
  // these weights), independently per weight, so every projection's output moves by a
  // few percent and the three layers compound it: the logits of the twins differ by
  // about 0.07-0.13 relative L2 (seed 21), against about 1.4 for weights of another seed.
  // A dequantization bug (a wrong block, a missing or misplaced scale) lands near the
  // latter; hence the bound: below 0.25, and below a fifth of the unrelated distance.
  const std::string base = ::testing::TempDir() + "/deepseek-fp8-";
  SynthOptions options{.preset = "deepseek-tiny", .dtype = DType::kBF16, .seed = 21};
  options.out_dir = base + "bf16";
  ASSERT_TRUE(synthesize_checkpoint(options).ok());
  options.out_dir = base + "other";
  options.seed = 22;
  ASSERT_TRUE(synthesize_checkpoint(options).ok());
  options.out_dir = base + "fp8";
  options.seed = 21;
  options.fp8 = true;
  ASSERT_TRUE(synthesize_checkpoint(options).ok());
  auto bf16 = load(base + "bf16", "identity");
  auto other = load(base + "other", "identity");
  auto fp8 = load(base + "fp8", "replicate:8:3");
  ASSERT_TRUE(bf16 != nullptr && other != nullptr && fp8 != nullptr);
  EXPECT_EQ(fp8->config().quant_method, "fp8");
  EXPECT_EQ(fp8->local_slots(1)->dtype(), DType::kBF16);  // Dequantized at load.
  for (const RefPrompt& p : load_reference(kModelDir)) {
    const std::vector<float> a = prompt_logits(*bf16, p.input_ids);
    const std::vector<double> want(a.begin(), a.end());
    const double err = rel_l2(prompt_logits(*fp8, p.input_ids).data(), want);
    const double unrelated = rel_l2(prompt_logits(*other, p.input_ids).data(), want);
    std::printf("  fp8 vs bf16 twin: last-logit relative L2 = %.3g (another seed: %.3g)\n", err,
                unrelated);
    EXPECT_LT(err, 0.25);
    EXPECT_LT(err, 0.2 * unrelated);
    EXPECT_GT(err, 1e-4);  // The FP8 weights really were quantized.
  }
  for (const char* dir : {"bf16", "other", "fp8"}) std::filesystem::remove_all(base + dir);
}

TEST(DeepseekReferenceTest, RejectsBadInput) {
  auto model = load(kModelDir, "identity", 2);
  ASSERT_NE(model, nullptr);
  Tensor logits;
  EXPECT_EQ(model->forward({{0, 0, {1, 512}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{2, 0, {1}}}, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, 0, {1}}, {0, 0, {2}}}, &logits).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(model->forward({{0, model->max_seq_len(), {1}}}, &logits).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert
