// SPDX-License-Identifier: Apache-2.0
// Block-scaled FP8 weights: Checkpoint::get_weight's dequantization, and the DeepSeek and
// Qwen3 synth presets with and without --fp8 (layout of the real checkpoints, error bound
// of the quantized values against the unquantized ones of the same seed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "checkpoint/synth.h"
#include "flexpert/checkpoint.h"
#include "test_util.h"

namespace flexpert {
namespace {

using testing::TempDir;

SafetensorsWriter::Fill bytes_fill(const void* data) {
  return [data](uint64_t off, void* dst, uint64_t n) {
    std::memcpy(dst, static_cast<const char*>(data) + off, n);
  };
}

TEST(Fp8Weights, DequantizesPerBlock) {
  // 300 x 200 with 128 x 128 blocks: 3 x 2 scales, partial blocks at both edges.
  const int64_t rows = 300, cols = 200;
  std::mt19937 rng(1);
  std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
  for (uint8_t& v : q) {
    v = static_cast<uint8_t>(rng());
    if ((v & 0x7f) == 0x7f) v = 0;  // No NaN patterns.
  }
  std::vector<float> scale = {0.5f, 2.0f, 0.001f, 3.0f, 1e-4f, 7.0f};
  std::vector<uint16_t> bf16_scale(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) bf16_scale[i] = f32_to_bf16(scale[i]);
  TempDir tmp;
  SafetensorsWriter writer;
  writer.add("w.weight", DType::kF8E4M3, {rows, cols}, bytes_fill(q.data()));
  writer.add("w.weight_scale_inv", DType::kF32, {3, 2}, bytes_fill(scale.data()));
  writer.add("b.weight", DType::kF8E4M3, {rows, cols}, bytes_fill(q.data()));
  writer.add("b.weight_scale_inv", DType::kBF16, {3, 2}, bytes_fill(bf16_scale.data()));
  writer.add("noscale.weight", DType::kF8E4M3, {rows, cols}, bytes_fill(q.data()));
  writer.add("bad.weight", DType::kF8E4M3, {rows, cols}, bytes_fill(q.data()));
  writer.add("bad.weight_scale_inv", DType::kF32, {2, 2}, bytes_fill(scale.data()));
  ASSERT_TRUE(writer.write(tmp.file("model.safetensors")).ok());
  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();

  auto raw = (*ckpt)->get("w.weight", {rows, cols});
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->dtype(), DType::kF8E4M3);
  for (const char* name : {"w.weight", "b.weight"}) {
    const bool bf16 = name[0] == 'b';
    auto w = (*ckpt)->get_weight(name, {rows, cols});
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    ASSERT_EQ(w->dtype(), DType::kBF16);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        float s = scale[(i / 128) * 2 + j / 128];
        if (bf16) s = bf16_to_f32(f32_to_bf16(s));
        const float want = bf16_to_f32(f32_to_bf16(f8e4m3_to_f32(q[i * cols + j]) * s));
        ASSERT_EQ(bf16_to_f32(w->data<uint16_t>()[i * cols + j]), want) << i << "," << j;
      }
    }
  }
  EXPECT_EQ((*ckpt)->get_weight("noscale.weight", {rows, cols}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*ckpt)->get_weight("bad.weight", {rows, cols}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*ckpt)->get_weight("w.weight", {cols, rows}).status().code(),
            StatusCode::kInvalidArgument);
  // Other dtypes pass through unconverted.
  auto s = (*ckpt)->get_weight("w.weight_scale_inv", {3, 2});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->dtype(), (*ckpt)->get("w.weight_scale_inv")->dtype());
}

TEST(DeepseekSynth, TinyPresetMatchesTheRealFixtureLayout) {
  auto preset = synth_preset_config("deepseek-tiny");
  ASSERT_TRUE(preset.ok()) << preset.status().to_string();
  TempDir tmp;
  Status st = synthesize_checkpoint(
      {.preset = "deepseek-tiny", .out_dir = tmp.path(), .dtype = DType::kF32, .seed = 3});
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto config = ModelConfig::load(tmp.path());
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  ModelConfig want = preset.value();
  want.torch_dtype = "float32";
  EXPECT_EQ(config.value(), want);
  // Same names and shapes as the checkpoint transformers wrote for this architecture.
  auto ckpt = Checkpoint::open(tmp.path());
  auto fixture = Checkpoint::open(std::string(FLEXPERT_TESTDATA_DIR) + "/deepseekv3-tiny");
  ASSERT_TRUE(ckpt.ok() && fixture.ok());
  ASSERT_EQ((*ckpt)->names(), (*fixture)->names());
  for (const std::string& name : (*fixture)->names()) {
    EXPECT_EQ((*ckpt)->get(name)->shape(), (*fixture)->get(name)->shape()) << name;
  }
  EXPECT_EQ((*ckpt)->get("model.layers.1.mlp.gate.e_score_correction_bias")->dtype(), DType::kF32);
}

TEST(DeepseekSynth, RealPresetConfigs) {
  auto v3 = synth_preset_config("deepseek-v3");
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(v3->num_experts, 256);
  EXPECT_EQ(v3->num_expert_groups(), 8);
  EXPECT_EQ(v3->first_k_dense_replace, 3);
  EXPECT_EQ(v3->rope_scaling.type, "yarn");
  auto lite = synth_preset_config("deepseek-v2-lite");
  ASSERT_TRUE(lite.ok());
  EXPECT_EQ(lite->model_type, "deepseek_v2");
  EXPECT_EQ(lite->q_lora_rank, 0);
  EXPECT_EQ(lite->num_shared_experts, 2);
  for (const auto* c : {&v3.value(), &lite.value()}) {
    auto back = ModelConfig::from_json(c->to_json());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back.value(), *c);
  }
}

// DeepSeek-V3's and Qwen3's FP8 checkpoints quantize the same kind of tensors: every
// projection ("..._proj.weight"), nothing else.
class Fp8Synth : public ::testing::TestWithParam<const char*> {};

TEST_P(Fp8Synth, ProjectionsApproximateTheUnquantizedValues) {
  const std::string preset = GetParam();
  TempDir f32_dir, fp8_dir;
  ASSERT_TRUE(synthesize_checkpoint({.preset = preset,
                                     .out_dir = f32_dir.path(),
                                     .num_layers = 2,
                                     .dtype = DType::kF32,
                                     .seed = 9})
                  .ok());
  Status st = synthesize_checkpoint({.preset = preset,
                                     .out_dir = fp8_dir.path(),
                                     .num_layers = 2,
                                     .dtype = DType::kBF16,
                                     .seed = 9,
                                     .fp8 = true});
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto config = ModelConfig::load(fp8_dir.path());
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->quant_method, "fp8");
  EXPECT_EQ(config->weight_block_size, (std::vector<int>{128, 128}));
  auto exact = Checkpoint::open(f32_dir.path());
  auto fp8 = Checkpoint::open(fp8_dir.path());
  ASSERT_TRUE(exact.ok() && fp8.ok());
  int quantized = 0;
  for (const std::string& name : (*exact)->names()) {
    auto t = (*fp8)->get(name);
    ASSERT_TRUE(t.ok()) << name;
    const bool projection = name.find("proj") != std::string::npos;
    if (!projection) {
      EXPECT_EQ(t->dtype(),
                name.find("correction_bias") == std::string::npos ? DType::kBF16 : DType::kF32)
          << name;
      continue;
    }
    ++quantized;
    ASSERT_EQ(t->dtype(), DType::kF8E4M3) << name;
    const int64_t rows = t->size(0), cols = t->size(1);
    auto scale = (*fp8)->get(name + "_scale_inv", {(rows + 127) / 128, (cols + 127) / 128});
    ASSERT_TRUE(scale.ok()) << scale.status().to_string();
    auto w = (*fp8)->get_weight(name, t->shape());
    auto want = (*exact)->get(name);
    ASSERT_TRUE(w.ok() && want.ok()) << name;
    const Tensor got = w->to(DType::kF32);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const float v = want->data<float>()[i * cols + j];
        const float s = scale->data<float>()[(i / 128) * scale->size(1) + j / 128];
        // E4M3 keeps 3 mantissa bits (half-ulp 2^-4 relative) down to 2^-6 * s, below
        // that a fixed step of 2^-9 * s (half: 2^-10 * s); bf16 storage adds 2^-9 relative.
        const float bound = std::fabs(v) * (0.0625f + 0.004f) + s * std::ldexp(1.f, -10);
        ASSERT_LE(std::fabs(got.data<float>()[i * cols + j] - v), bound)
            << name << " [" << i << ", " << j << "]";
      }
    }
  }
  EXPECT_GT(quantized, 10);
}

INSTANTIATE_TEST_SUITE_P(Presets, Fp8Synth, ::testing::Values("deepseek-tiny", "tiny"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "tiny" ? "Qwen3" : "Deepseek";
                         });

// fp8_dequantized writes what the FP8 checkpoint stands for, computed by the writer from its
// own codes and scales: Checkpoint::get_weight on the FP8 files must give the same bits, and
// every other tensor is the same in both.
TEST_P(Fp8Synth, DequantizedTwinMatchesTheLoadersDequantization) {
  const std::string preset = GetParam();
  TempDir fp8_dir, twin_dir;
  SynthOptions o{.preset = preset, .out_dir = fp8_dir.path(), .num_layers = 2, .seed = 5};
  o.fp8 = true;
  ASSERT_TRUE(synthesize_checkpoint(o).ok());
  o.out_dir = twin_dir.path();
  o.fp8_dequantized = true;
  Status st = synthesize_checkpoint(o);
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto twin_config = ModelConfig::load(twin_dir.path());
  ASSERT_TRUE(twin_config.ok()) << twin_config.status().to_string();
  EXPECT_EQ(twin_config->quant_method, "");
  auto fp8 = Checkpoint::open(fp8_dir.path());
  auto twin = Checkpoint::open(twin_dir.path());
  ASSERT_TRUE(fp8.ok() && twin.ok());
  size_t compared = 0, quantized = 0;
  for (const std::string& name : (*twin)->names()) {
    auto want = (*twin)->get(name);
    ASSERT_TRUE(want.ok()) << name;
    EXPECT_FALSE((*twin)->contains(name + "_scale_inv")) << name;
    if ((*fp8)->contains(name + "_scale_inv")) ++quantized;
    auto got = (*fp8)->get_weight(name, want->shape());
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    ASSERT_EQ(got->dtype(), want->dtype()) << name;
    ASSERT_EQ(std::memcmp(got->raw(), want->raw(), got->num_bytes()), 0) << name;
    ++compared;
  }
  EXPECT_EQ((*fp8)->names().size(), compared + quantized);  // Weights plus their scales.
  EXPECT_GT(quantized, 10u);
}

TEST(Fp8SynthOptions, DequantizedTwinNeedsFp8) {
  TempDir tmp;
  SynthOptions o{.preset = "tiny", .out_dir = tmp.path()};
  o.fp8_dequantized = true;
  EXPECT_EQ(synthesize_checkpoint(o).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flexpert
