// SPDX-License-Identifier: Apache-2.0
// plan_memory against references it does not share code with: parameter counts and bytes
// summed from the safetensors headers of synthetic checkpoints (read here, not through
// src/checkpoint), DeepSeek-V3's parameters from its published shapes (671 B, 37 B
// activated), the capacity rule of docs/ARCHITECTURE.md, and the fit search's bounds.
#include "moe/memory_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/synth.h"
#include "flexpert/placement.h"

namespace flexpert {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kTestdata = FLEXPERT_TESTDATA_DIR;
constexpr uint64_t kH200 = 143771ull << 20;  // nvidia-smi's 143,771 MiB.

// What the safetensors headers of a checkpoint directory say, as a GPU rank of one would hold
// it: 1-D tensors (norms, biases) in f32, matrices as stored (bf16, or FP8 with scales).
struct HeaderSums {
  int64_t dense_params = 0;
  int64_t expert_params = 0;
  uint64_t dense_gpu_bytes = 0;
  uint64_t expert_bytes = 0;
};

HeaderSums sum_headers(const std::string& dir) {
  HeaderSums s;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);  // Little-endian, as the format says.
    std::string text(n, '\0');
    in.read(text.data(), static_cast<std::streamsize>(n));
    const json header = json::parse(text);
    for (const auto& [name, info] : header.items()) {
      if (name == "__metadata__") continue;
      int64_t elems = 1;
      for (int64_t d : info["shape"]) elems *= d;
      const uint64_t bytes =
          info["data_offsets"][1].get<uint64_t>() - info["data_offsets"][0].get<uint64_t>();
      const bool scale = name.size() > 10 && name.substr(name.size() - 10) == "_scale_inv";
      if (name.find(".mlp.experts.") != std::string::npos) {
        if (!scale) s.expert_params += elems;
        s.expert_bytes += bytes;
      } else {
        if (!scale) s.dense_params += elems;
        s.dense_gpu_bytes += info["shape"].size() == 1 ? static_cast<uint64_t>(elems) * 4 : bytes;
      }
    }
  }
  return s;
}

MemoryPlanOptions options(int ranks) {
  MemoryPlanOptions o;
  o.ranks = ranks;
  o.memory_bytes = kH200;
  return o;
}

MemoryPlan plan_or_die(const ModelConfig& c, const MemoryPlanOptions& o) {
  auto p = plan_memory(c, o);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? *p : MemoryPlan{};
}

// At one rank the plan's dense and expert totals are the checkpoint's, parameter for
// parameter and (for a 16-bit or FP8 checkpoint) byte for byte.
void expect_matches_checkpoint(const std::string& dir, bool compare_bytes) {
  SCOPED_TRACE(dir);
  auto config = ModelConfig::load(dir);
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  const HeaderSums ref = sum_headers(dir);
  ASSERT_GT(ref.expert_params, 0);
  const MemoryPlan p = plan_or_die(*config, options(1));
  EXPECT_EQ(p.dense_params, ref.dense_params);
  EXPECT_EQ(p.expert_params, ref.expert_params);
  // One spare slot per layer beside every expert (serve's --eplb-spare-slots 1).
  EXPECT_EQ(p.slots_per_rank, config->num_experts + 1);
  if (compare_bytes) {
    EXPECT_EQ(p.dense_bytes, ref.dense_gpu_bytes);
    EXPECT_EQ(p.slot_bytes * config->num_experts * p.num_moe_layers, ref.expert_bytes);
    EXPECT_EQ(p.expert_slot_bytes, p.slot_bytes * p.slots_per_rank * p.num_moe_layers);
  }
}

TEST(MemoryPlanTest, TinyFixturesMatchTheirSafetensorsHeaders) {
  expect_matches_checkpoint(kTestdata + "/qwen3moe-tiny", false);  // f32 files.
  expect_matches_checkpoint(kTestdata + "/deepseekv3-tiny", false);
  // The CPU path keeps the checkpoint's dtype: f32 slots of the f32 fixture, as in its file.
  auto c = ModelConfig::load(kTestdata + "/qwen3moe-tiny");
  ASSERT_TRUE(c.ok());
  MemoryPlanOptions o = options(1);
  o.device = "cpu";
  const MemoryPlan cpu = plan_or_die(*c, o);
  EXPECT_EQ(cpu.quantization, "f32");
  EXPECT_EQ(cpu.slot_bytes * c->num_experts * cpu.num_moe_layers,
            sum_headers(kTestdata + "/qwen3moe-tiny").expert_bytes);
}

TEST(MemoryPlanTest, SynthCheckpointsMatchByteForByte) {
  for (const auto& [preset, fp8] : std::vector<std::pair<std::string, bool>>{
           {"tiny", false}, {"tiny", true}, {"deepseek-tiny", false}, {"deepseek-tiny", true}}) {
    const std::string dir = ::testing::TempDir() + "/flexpert-plan-" + preset + (fp8 ? "-fp8" : "");
    fs::remove_all(dir);
    SynthOptions so;
    so.preset = preset;
    so.out_dir = dir;
    so.fp8 = fp8;
    ASSERT_TRUE(synthesize_checkpoint(so).ok());
    auto config = ModelConfig::load(dir);
    ASSERT_TRUE(config.ok());
    EXPECT_EQ(plan_or_die(*config, options(1)).quantization, fp8 ? "fp8" : "bf16");
    expect_matches_checkpoint(dir, true);
    fs::remove_all(dir);
  }
}

// DeepSeek-V3 without its multi-token-prediction layer, from the published shapes.
int64_t deepseek_v3_params(bool activated_only) {
  const int64_t H = 7168, V = 129280, L = 61, dense_layers = 3, E = 256, K = 8;
  const int64_t heads = 128, q_lora = 1536, kv_lora = 512, nope = 128, rope = 64, v = 128;
  const int64_t attention = H * q_lora + q_lora               // q_a_proj, q_a_layernorm
                            + q_lora * heads * (nope + rope)  // q_b_proj
                            + H * (kv_lora + rope) + kv_lora  // kv_a_proj_with_mqa, norm
                            + kv_lora * heads * (nope + v)    // kv_b_proj
                            + heads * v * H;                  // o_proj
  const int64_t layer_norms = 2 * H;
  const int64_t expert = 3 * H * 2048;
  const int64_t moe = E * H + E + expert + (activated_only ? K : E) * expert;
  return V * H * 2 + H + L * (attention + layer_norms) + dense_layers * 3 * H * 18432 +
         (L - dense_layers) * moe;
}

Result<ModelConfig> deepseek_v3() { return ModelConfig::load(kTestdata + "/configs/deepseek-v3"); }

TEST(MemoryPlanTest, DeepseekV3HasItsPublishedParameterCounts) {
  auto c = deepseek_v3();
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const MemoryPlan p = plan_or_die(*c, options(1));
  EXPECT_EQ(p.dense_params + p.expert_params, deepseek_v3_params(false));
  EXPECT_EQ(p.activated_params, deepseek_v3_params(true));
  EXPECT_NEAR(static_cast<double>(p.dense_params + p.expert_params), 671e9, 1e9);
  EXPECT_NEAR(static_cast<double>(p.activated_params), 37e9, 1e9);
  EXPECT_EQ(p.num_moe_layers, 58);
}

TEST(MemoryPlanTest, DeepseekV3OnEightH200sFitsInFp8Only) {
  auto c = deepseek_v3();
  ASSERT_TRUE(c.ok());
  MemoryPlanOptions o = options(8);
  o.quantization = "bf16";
  const MemoryPlan bf16 = plan_or_die(*c, o);
  o.quantization = "";  // The checkpoint's: fp8.
  const MemoryPlan fp8 = plan_or_die(*c, o);
  EXPECT_EQ(fp8.quantization, "fp8");
  EXPECT_EQ(bf16.slots_per_rank, 256 / 8 + 1);
  EXPECT_EQ(bf16.slot_bytes, 3ull * 7168 * 2048 * 2);
  // e4m3 bytes plus a fp32 scale per 128 x 128 block of each of the three projections.
  EXPECT_EQ(fp8.slot_bytes, 3ull * (7168 * 2048 + (2048 / 128) * (7168 / 128) * 4));
  // MLA caches the latent and the rope key: 61 layers x 576 bf16 values a token.
  EXPECT_EQ(fp8.kv_bytes_per_token, 61u * 576 * 2);
  EXPECT_EQ(fp8.kv_bytes, 33ull * 4096 * 61 * 576 * 2);
  EXPECT_FALSE(bf16.fits());
  EXPECT_TRUE(fp8.fits());
  EXPECT_GT(bf16.expert_slot_bytes, kH200);  // The experts alone are more than a GPU.
}

TEST(MemoryPlanTest, QwenKvCacheIsGqaHeads) {
  auto c = ModelConfig::load(kTestdata + "/configs/qwen3-30b-a3b");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  MemoryPlanOptions o = options(1);
  o.max_sequences = 8;
  o.max_seq_len = 1000;
  const MemoryPlan p = plan_or_die(*c, o);
  EXPECT_EQ(p.kv_bytes_per_token, 48u * 2 * 4 * 128 * 2);  // k and v, 4 kv heads x 128, bf16.
  EXPECT_EQ(p.kv_bytes, 9ull * 1000 * p.kv_bytes_per_token);
  o.device = "cpu";  // f32, no spare sequence.
  const MemoryPlan cpu = plan_or_die(*c, o);
  EXPECT_EQ(cpu.kv_bytes, 8ull * 1000 * 48 * 2 * 4 * 128 * 4);
  EXPECT_TRUE(cpu.workspaces.empty());
  EXPECT_NEAR(static_cast<double>(p.dense_params + p.expert_params), 30.5e9, 0.2e9);
}

TEST(MemoryPlanTest, SlotsFollowTheCapacityRule) {
  // docs/ARCHITECTURE.md: N = 4, E = 128, --min-ranks 3: 43 slots instead of 32.
  EXPECT_EQ(expert_slots_per_rank(128, 0, 4, 0, 0), 32);
  EXPECT_EQ(expert_slots_per_rank(128, 0, 4, 3, 0), 43);
  EXPECT_EQ(expert_slots_per_rank(128, 0, 4, 9, 1), 33);    // min_ranks above ranks: ranks.
  EXPECT_EQ(expert_slots_per_rank(128, 128, 4, 0, 1), 65);  // Two replicas of every expert.
  // --min-replicas auto: a second replica where the slots beside the spare ones hold it.
  const int sized_for_two = expert_slots_per_rank(128, 0, 4, 2, 1);  // 65
  EXPECT_EQ(auto_min_replicas(128, 4, sized_for_two, 1), 2);
  EXPECT_EQ(auto_min_replicas(128, 3, sized_for_two, 1), 1);  // 192 < 256 slots
  EXPECT_EQ(auto_min_replicas(128, 2, sized_for_two, 1), 1);
  EXPECT_EQ(auto_min_replicas(128, 4, sized_for_two, 2), 1);  // The spare slots come first.
  EXPECT_EQ(auto_min_replicas(128, 4, expert_slots_per_rank(128, 0, 4, 0, 1), 1), 1);  // 33
  EXPECT_EQ(auto_min_replicas(8, 1, 100, 0), 1);  // One rank: no second place.
  EXPECT_EQ(auto_min_replicas(8, 2, 9, 1), 2);
  auto c = deepseek_v3();
  ASSERT_TRUE(c.ok());
  MemoryPlanOptions o = options(8);
  o.max_ranks = 12;
  o.min_ranks = 7;
  const MemoryPlan p = plan_or_die(*c, o);
  EXPECT_EQ(p.slots_per_rank, 37 + 1);
  EXPECT_EQ(p.max_ranks, 12);
  o.min_ranks = 0;
  o.slots_per_rank = 31;  // 8 x 31 < 256.
  EXPECT_EQ(plan_memory(*c, o).status().code(), StatusCode::kInvalidArgument);
}

const MemoryTerm* find_term(const std::vector<MemoryTerm>& terms, const std::string& name) {
  for (const MemoryTerm& t : terms) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// Capacity (--max-ranks) sizes the exchange buffers and the mailboxes, not the slots.
TEST(MemoryPlanTest, CapacitySizesExchangeBuffers) {
  auto c = ModelConfig::load(kTestdata + "/configs/qwen3-30b-a3b");
  ASSERT_TRUE(c.ok());
  MemoryPlanOptions o = options(1);
  const MemoryPlan alone = plan_or_die(*c, o);
  EXPECT_EQ(find_term(alone.workspaces, "EP exchange"), nullptr);  // All slots local.
  o.max_ranks = 4;
  const MemoryPlan four = plan_or_die(*c, o);
  o.max_ranks = 8;
  const MemoryPlan eight = plan_or_die(*c, o);
  EXPECT_EQ(four.slots_per_rank, alone.slots_per_rank);
  EXPECT_EQ(four.expert_slot_bytes, alone.expert_slot_bytes);
  ASSERT_NE(find_term(four.workspaces, "EP exchange"), nullptr);
  // An owner may receive 2048 tokens x top-8 from each of max_ranks ranks, up to 65536 rows.
  EXPECT_EQ(find_term(four.workspaces, "EP exchange")->detail, "65536 rows an owner receives");
  const MemoryTerm* m4 = find_term(four.host, "transport (shm mailboxes)");
  const MemoryTerm* m8 = find_term(eight.host, "transport (shm mailboxes)");
  ASSERT_TRUE(m4 != nullptr && m8 != nullptr);
  // Two exchange mailboxes per possible peer: 256 tokens x top-8 rows of 2048 f32 each.
  const uint64_t mailbox = 4 + 256 * 8 * (4 + 2048 * 4);
  EXPECT_GE(m8->bytes - m4->bytes, 8 * mailbox);
  EXPECT_LT(m8->bytes - m4->bytes, 8 * mailbox + 8 * 4096);
  o.spare_ranks = 3;  // Spare ranks hold what a member holds.
  EXPECT_EQ(plan_or_die(*c, o).total_bytes, eight.total_bytes);
}

TEST(MemoryPlanTest, FitIsTheLargestThatFits) {
  auto c = deepseek_v3();
  ASSERT_TRUE(c.ok());
  const MemoryPlanOptions o = options(8);
  auto fit = fit_memory(*c, o);
  ASSERT_TRUE(fit.ok()) << fit.status().to_string();
  ASSERT_GT(fit->max_seq_len, 4096);
  ASSERT_GT(fit->max_sequences, 32);
  MemoryPlanOptions t = o;
  t.max_seq_len = fit->max_seq_len;
  EXPECT_TRUE(plan_or_die(*c, t).fits());
  t.max_seq_len = fit->max_seq_len + 1;
  EXPECT_FALSE(plan_or_die(*c, t).fits());
  t = o;
  t.max_sequences = fit->max_sequences;
  EXPECT_TRUE(plan_or_die(*c, t).fits());
  t.max_sequences = fit->max_sequences + 1;
  EXPECT_FALSE(plan_or_die(*c, t).fits());
  // The KV room is what the rest leaves, in whole tokens.
  const MemoryPlan p = plan_or_die(*c, o);
  const uint64_t rest = p.total_bytes - p.kv_bytes;
  EXPECT_EQ(static_cast<uint64_t>(fit->kv_tokens), (kH200 - rest) / p.kv_bytes_per_token);
  // bf16 does not fit even one token.
  MemoryPlanOptions b = o;
  b.quantization = "bf16";
  auto none = fit_memory(*c, b);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->max_seq_len, 0);
  EXPECT_EQ(none->max_sequences, 0);
  EXPECT_EQ(none->kv_tokens, 0);
}

TEST(MemoryPlanTest, BadOptionsAreInvalidArguments) {
  auto c = deepseek_v3();
  ASSERT_TRUE(c.ok());
  auto expect_invalid = [&](MemoryPlanOptions o, const std::string& mention) {
    auto p = plan_memory(*c, o);
    ASSERT_FALSE(p.ok()) << mention;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(mention), std::string::npos) << p.status().to_string();
  };
  MemoryPlanOptions o = options(0);
  expect_invalid(o, "--ranks");
  o = options(4);
  o.max_ranks = 2;
  expect_invalid(o, "--max-ranks");
  o = options(4);
  o.spare_ranks = 1;  // max_ranks defaults to ranks: no room.
  expect_invalid(o, "--spare-ranks");
  o = options(4);
  o.quantization = "int4";
  expect_invalid(o, "--quantization");
  o = options(4);
  o.device = "cpu";
  o.quantization = "fp8";
  expect_invalid(o, "dequantizes");
  o = options(4);
  o.device = "tpu";
  expect_invalid(o, "--device");
  o = options(4);
  o.max_sequences = 0;
  expect_invalid(o, "--max-sequences");
}

}  // namespace
}  // namespace flexpert
