// SPDX-License-Identifier: Apache-2.0
#include "checkpoint/synth.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "flexpert/checkpoint.h"
#include "test_util.h"

namespace flexpert {
namespace {

using testing::TempDir;

// Expected tensor names and shapes, written out independently of synth.cc.
std::map<std::string, Shape> expected_tensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size, hd = c.head_dim;
  std::map<std::string, Shape> t;
  t["model.embed_tokens.weight"] = {c.vocab_size, h};
  t["model.norm.weight"] = {h};
  if (!c.tie_word_embeddings) t["lm_head.weight"] = {c.vocab_size, h};
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t[p + "input_layernorm.weight"] = {h};
    t[p + "post_attention_layernorm.weight"] = {h};
    t[p + "self_attn.q_proj.weight"] = {c.num_attention_heads * hd, h};
    t[p + "self_attn.k_proj.weight"] = {c.num_key_value_heads * hd, h};
    t[p + "self_attn.v_proj.weight"] = {c.num_key_value_heads * hd, h};
    t[p + "self_attn.o_proj.weight"] = {h, c.num_attention_heads * hd};
    t[p + "self_attn.q_norm.weight"] = {hd};
    t[p + "self_attn.k_norm.weight"] = {hd};
    if (c.is_moe_layer(l)) {
      t[p + "mlp.gate.weight"] = {c.num_experts, h};
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        t[q + "gate_proj.weight"] = {c.moe_intermediate_size, h};
        t[q + "up_proj.weight"] = {c.moe_intermediate_size, h};
        t[q + "down_proj.weight"] = {h, c.moe_intermediate_size};
      }
    } else {
      t[p + "mlp.gate_proj.weight"] = {c.intermediate_size, h};
      t[p + "mlp.up_proj.weight"] = {c.intermediate_size, h};
      t[p + "mlp.down_proj.weight"] = {h, c.intermediate_size};
    }
  }
  return t;
}

void expect_tensors(const Checkpoint& ckpt, const std::map<std::string, Shape>& expected,
                    DType dtype) {
  EXPECT_EQ(ckpt.names().size(), expected.size());
  for (const auto& [name, shape] : expected) {
    auto t = ckpt.get(name, shape);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_EQ(t->dtype(), dtype) << name;
  }
}

struct Moments {
  double mean = 0, std = 0;
};

Moments moments(const Tensor& t, int64_t begin, int64_t end) {
  std::vector<float> v(t.numel());
  convert_to_f32(t.dtype(), t.raw(), v.data(), v.size());
  double sum = 0, sq = 0;
  for (int64_t i = begin; i < end; ++i) sum += v[i];
  const double mean = sum / (end - begin);
  for (int64_t i = begin; i < end; ++i) sq += (v[i] - mean) * (v[i] - mean);
  return {mean, std::sqrt(sq / (end - begin))};
}

TEST(Synth, TinyPresetMatchesTheRealFixtureLayout) {
  auto preset = synth_preset_config("tiny");
  ASSERT_TRUE(preset.ok());
  TempDir tmp;
  SynthOptions opts{.preset = "tiny", .out_dir = tmp.path(), .dtype = DType::kF32, .seed = 7};
  uint64_t last_done = 0, last_total = 0;
  opts.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
  };
  Status s = synthesize_checkpoint(opts);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_GT(last_total, 0u);
  EXPECT_EQ(last_done, last_total);
  EXPECT_TRUE(std::filesystem::exists(tmp.file("model.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(tmp.file("model.safetensors.index.json")));

  auto config = ModelConfig::load(tmp.path());
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  ModelConfig want = preset.value();
  want.torch_dtype = "float32";
  EXPECT_EQ(config.value(), want);

  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  expect_tensors(**ckpt, expected_tensors(*config), DType::kF32);

  // Same names and shapes as the checkpoint transformers wrote for this architecture.
  auto fixture = Checkpoint::open(std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny");
  ASSERT_TRUE(fixture.ok());
  ASSERT_EQ((*ckpt)->names(), (*fixture)->names());
  for (const std::string& name : (*fixture)->names()) {
    EXPECT_EQ((*ckpt)->get(name)->shape(), (*fixture)->get(name)->shape()) << name;
  }
}

TEST(Synth, ValueDistributions) {
  TempDir tmp;
  ASSERT_TRUE(synthesize_checkpoint(
                  {.preset = "tiny", .out_dir = tmp.path(), .dtype = DType::kF32, .seed = 3})
                  .ok());
  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok());
  auto norm = (*ckpt)->get("model.layers.1.input_layernorm.weight");
  Moments m = moments(*norm, 0, norm->numel());
  EXPECT_NEAR(m.mean, 1.0, 0.02);
  EXPECT_GT(m.std, 0.01);
  EXPECT_LT(m.std, 0.1);

  auto down = (*ckpt)->get("model.layers.0.mlp.experts.3.down_proj.weight");  // fan_in 64.
  m = moments(*down, 0, down->numel());
  EXPECT_NEAR(m.mean, 0.0, 0.01);
  EXPECT_NEAR(m.std, 1.0 / 8, 0.01);

  auto gate = (*ckpt)->get("model.layers.2.mlp.gate.weight");  // [16, 128]: rows 0-1 boosted.
  const double base = 2.0 / std::sqrt(128.0);
  EXPECT_NEAR(moments(*gate, 0, 2 * 128).std, 2 * base, 0.25 * base);
  EXPECT_NEAR(moments(*gate, 2 * 128, 16 * 128).std, base, 0.1 * base);
}

TEST(Synth, DeterministicPerSeedAndDtype) {
  TempDir a, b, c, d;
  const auto write = [](const TempDir& dir, uint64_t seed, DType dtype) {
    Status s = synthesize_checkpoint(
        {.preset = "tiny", .out_dir = dir.path(), .num_layers = 1, .dtype = dtype, .seed = seed});
    EXPECT_TRUE(s.ok()) << s.to_string();
    return testing::read_file(dir.file("model.safetensors"));
  };
  const std::string first = write(a, 11, DType::kBF16);
  EXPECT_EQ(first, write(b, 11, DType::kBF16));
  EXPECT_NE(first, write(c, 12, DType::kBF16));

  // BF16 values are the F32 values rounded.
  write(d, 11, DType::kF32);
  auto bf16 = Checkpoint::open(a.path());
  auto f32 = Checkpoint::open(d.path());
  ASSERT_TRUE(bf16.ok() && f32.ok());
  auto x = (*bf16)->get("model.layers.0.self_attn.o_proj.weight");
  auto y = (*f32)->get("model.layers.0.self_attn.o_proj.weight");
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(x->dtype(), DType::kBF16);
  for (int64_t i = 0; i < x->numel(); i += 97) {
    ASSERT_EQ(x->data<uint16_t>()[i], f32_to_bf16(y->data<float>()[i])) << i;
  }
}

TEST(Synth, ShardsWithIndexWhenLarge) {
  TempDir whole, sharded;
  SynthOptions opts{
      .preset = "tiny", .out_dir = whole.path(), .num_layers = 2, .dtype = DType::kF16, .seed = 5};
  ASSERT_TRUE(synthesize_checkpoint(opts).ok());
  opts.out_dir = sharded.path();
  opts.max_shard_bytes = 256 << 10;
  uint64_t last_done = 0, last_total = 0;
  opts.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
  };
  Status s = synthesize_checkpoint(opts);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(last_done, last_total);
  EXPECT_FALSE(std::filesystem::exists(sharded.file("model.safetensors")));

  auto index =
      nlohmann::json::parse(testing::read_file(sharded.file("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), last_total);
  std::set<std::string> shards;
  for (const auto& [name, shard] : index["weight_map"].items()) shards.insert(shard);
  ASSERT_GE(shards.size(), 3u);
  const std::string n = std::to_string(shards.size());
  EXPECT_TRUE(shards.contains("model-00001-of-0000" + n + ".safetensors")) << *shards.begin();
  for (const std::string& shard : shards) {
    EXPECT_LE(std::filesystem::file_size(sharded.file(shard)), (256u << 10) + 64 * 1024) << shard;
  }

  auto a = Checkpoint::open(whole.path());
  auto b = Checkpoint::open(sharded.path());
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().to_string();
  auto config = ModelConfig::load(sharded.path());
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->num_hidden_layers, 2);
  EXPECT_EQ(config->torch_dtype, "float16");
  expect_tensors(**b, expected_tensors(*config), DType::kF16);
  // Values depend on (seed, name, element) only, not on the file layout.
  for (const std::string& name : (*a)->names()) {
    auto x = (*a)->get(name);
    auto y = (*b)->get(name);
    ASSERT_TRUE(x.ok() && y.ok()) << name;
    ASSERT_EQ(std::memcmp(x->raw(), y->raw(), x->num_bytes()), 0) << name;
  }

  // Rewriting the same directory unsharded drops the stale index.
  opts.max_shard_bytes = 4ull << 30;
  opts.progress = nullptr;
  ASSERT_TRUE(synthesize_checkpoint(opts).ok());
  EXPECT_FALSE(std::filesystem::exists(sharded.file("model.safetensors.index.json")));
  EXPECT_TRUE(Checkpoint::open(sharded.path()).ok());
}

TEST(Synth, Qwen3_30bPresetConfig) {
  auto c = synth_preset_config("qwen3-30b-a3b");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->model_type, "qwen3_moe");
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->num_hidden_layers, 48);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_EQ(c->intermediate_size, 6144);
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, std::vector<int>{151645});
  for (int l = 0; l < 48; ++l) EXPECT_TRUE(c->is_moe_layer(l));
  // Its config.json must be one the runtime accepts.
  auto back = ModelConfig::from_json(c->to_json());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back.value(), c.value());
}

TEST(Synth, BadOptions) {
  auto unknown = synth_preset_config("gpt-5");
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("tiny"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("qwen3-30b-a3b"), std::string::npos);

  TempDir tmp;
  EXPECT_EQ(synthesize_checkpoint({.preset = "gpt-5", .out_dir = tmp.path()}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      synthesize_checkpoint({.preset = "tiny", .out_dir = tmp.path(), .num_layers = 0}).code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(synthesize_checkpoint({.preset = "tiny", .out_dir = ""}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(tmp.file("config.json")));
}

}  // namespace
}  // namespace flexpert
