// SPDX-License-Identifier: Apache-2.0
// Qwen3MoeModel on a block-FP8 checkpoint (as Qwen3-*-FP8 ship them: every projection
// F8_E4M3 with 128 x 128 block scales) against its dequantized twin: synth writes the
// FP8 files and, separately, the values they stand for in bf16 (e4m3 * s computed by the
// writer, not by the loader's dequantizer). Dequantized at load, the FP8 checkpoint must
// give the twin's logits bit for bit and its greedy tokens; scales read from the wrong
// block must not.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/synth.h"
#include "moe/expert_slots.h"
#include "reference_util.h"

namespace flexpert {
namespace {

using namespace model_test;

// The tiny preset widened so that projections span several 128 x 128 blocks, partial ones
// at the edges (hidden 320 = 2.5 blocks, expert intermediate 192 = 1.5), with a dense
// layer for the dense MLP's projections.
ModelConfig multi_block_config() {
  ModelConfig c = synth_preset_config("tiny").value();
  c.hidden_size = 320;
  c.num_hidden_layers = 3;
  c.head_dim = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 192;
  c.intermediate_size = 384;
  c.mlp_only_layers = {1};
  return c;
}

std::vector<RefPrompt> prompts() {
  std::vector<RefPrompt> out;
  for (const std::vector<int32_t>& ids : std::vector<std::vector<int32_t>>{
           {3, 14, 15, 92, 65, 35, 89, 79, 32}, {271, 82, 18, 28}, {1, 2, 3, 5, 8, 13, 21}}) {
    out.push_back({ids, {}, std::vector<int32_t>(12, 0)});  // 12 greedy tokens each.
  }
  return out;
}

class Qwen3Fp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = ::testing::TempDir() + "/qwen3-fp8-" + std::to_string(::getpid()) + "-";
    SynthOptions o{.out_dir = base_ + "fp8", .seed = 21, .config = multi_block_config()};
    o.fp8 = true;
    ASSERT_TRUE(synthesize_checkpoint(o).ok());
    o.out_dir = base_ + "twin";
    o.fp8_dequantized = true;
    ASSERT_TRUE(synthesize_checkpoint(o).ok());
  }
  void TearDown() override {
    for (const char* d : {"fp8", "twin", "wrong"}) std::filesystem::remove_all(base_ + d);
  }
  std::string base_;
};

TEST_F(Qwen3Fp8Test, LoadsDequantizedAsItsTwin) {
  // One placement for both (replicas spread the rows differently, which moves the last bits).
  auto fp8 = load(base_ + "fp8", "replicate:4:3");
  auto twin = load(base_ + "twin", "replicate:4:3");
  ASSERT_TRUE(fp8 != nullptr && twin != nullptr);
  EXPECT_EQ(fp8->config().quant_method, "fp8");
  EXPECT_EQ(twin->config().quant_method, "");
  EXPECT_EQ(fp8->local_slots(0)->dtype(), DType::kBF16);  // Experts dequantized at load.
  for (const RefPrompt& p : prompts()) {
    EXPECT_EQ(prompt_logits(*fp8, p.input_ids), prompt_logits(*twin, p.input_ids));
  }
  const auto want = greedy_tokens(*twin, prompts());
  const auto got = greedy_tokens(*fp8, prompts(), /*step_budget=*/5);  // Chunked prefills.
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "prompt " << i;
}

TEST_F(Qwen3Fp8Test, ScalesOfTheWrongBlockChangeTheTokens) {
  // The dequantizer's likeliest bug: one scale for the whole tensor (here block [0, 0]'s)
  // instead of each block's. Block scales of one tensor differ by their blocks' absmax.
  rewrite_checkpoint(base_ + "fp8", base_ + "wrong", [](const std::string& name, const Tensor& t) {
    Tensor out = t.to(t.dtype());
    if (name.ends_with("_scale_inv")) {
      float* s = out.data<float>();
      for (int64_t i = 1; i < out.numel(); ++i) s[i] = s[0];
    }
    return out;
  });
  auto wrong = load(base_ + "wrong", "identity");
  auto twin = load(base_ + "twin", "identity");
  ASSERT_TRUE(wrong != nullptr && twin != nullptr);
  const auto want = greedy_tokens(*twin, prompts());
  const auto got = greedy_tokens(*wrong, prompts());
  ASSERT_EQ(got.size(), want.size());
  int differing = 0;
  for (size_t i = 0; i < want.size(); ++i) differing += got[i] != want[i];
  std::printf("  one scale per tensor: %d of %zu greedy continuations differ\n", differing,
              want.size());
  EXPECT_GT(differing, 0);
}

TEST(Qwen3Fp8Checks, RefusesFp8OutsideTheProjections) {
  // Only projections are quantized in Qwen3's FP8 checkpoints; an FP8 router has no reading.
  const std::string src = ::testing::TempDir() + "/qwen3-fp8-router-src";
  const std::string dst = ::testing::TempDir() + "/qwen3-fp8-router";
  ASSERT_TRUE(synthesize_checkpoint({.preset = "tiny", .out_dir = src, .num_layers = 1}).ok());
  rewrite_checkpoint(src, dst, [](const std::string& name, const Tensor& t) {
    return name.ends_with("mlp.gate.weight") ? t.to(DType::kF8E4M3) : t.to(t.dtype());
  });
  ModelOptions options;
  auto model = Model::load(dst, options);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented) << model.status().to_string();
  std::filesystem::remove_all(src);
  std::filesystem::remove_all(dst);
}

}  // namespace
}  // namespace flexpert
