// SPDX-License-Identifier: Apache-2.0
// Model::load_expert (a recovery's reload of an expert from the checkpoint) on the CPU:
// the slot must hold exactly the bytes the checkpoint's tensors give through
// Checkpoint::get_weight (read whole, FP8 dequantized), whatever the file's dtype, and the
// slots beside it must keep theirs.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/synth.h"
#include "flexpert/checkpoint.h"
#include "moe/expert_slots.h"
#include "reference_util.h"

namespace flexpert {
namespace {

using namespace model_test;

// The tiny preset with projections of several 128 x 128 blocks (FP8 scales per block).
ModelConfig small_config() {
  ModelConfig c = synth_preset_config("tiny").value();
  c.hidden_size = 256;
  c.head_dim = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 192;
  return c;
}

struct Case {
  const char* name;
  DType dtype;
  bool fp8;
};

class LoadExpertTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ =
        ::testing::TempDir() + "/load-expert-" + GetParam().name + "-" + std::to_string(::getpid());
    SynthOptions o{.out_dir = dir_, .dtype = GetParam().dtype, .seed = 5};
    o.config = small_config();
    o.fp8 = GetParam().fp8;
    ASSERT_TRUE(synthesize_checkpoint(o).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

std::vector<uint8_t> bytes_of(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

TEST_P(LoadExpertTest, SlotHoldsTheCheckpointsBytes) {
  auto model = load(dir_, "identity");
  ASSERT_NE(model, nullptr);
  auto ck = Checkpoint::open(dir_);
  ASSERT_TRUE(ck.ok()) << ck.status().to_string();
  const ModelConfig& c = model->config();
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size;
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    ExpertSlots* slots = model->local_slots(layer);
    ASSERT_NE(slots, nullptr);
    ASSERT_EQ(slots->num_slots(), c.num_experts);
    const size_t slot_bytes = slots->slot_bytes();
    // Slot 2 overwritten with a pattern, then loaded with expert 4 (identity: slot 2 held 2).
    std::memset(slots->slot_data(2), 0xa5, slot_bytes);
    const auto before_1 = bytes_of(slots->slot_data(1), slot_bytes);
    const auto before_3 = bytes_of(slots->slot_data(3), slot_bytes);
    Status s = model->load_expert(layer, 4, 2);
    ASSERT_TRUE(s.ok()) << s.to_string();
    const std::string ep = "model.layers." + std::to_string(layer) + ".mlp.experts.4.";
    const std::pair<const char*, Tensor> parts[3] = {{"gate_proj.weight", slots->gate(2)},
                                                     {"up_proj.weight", slots->up(2)},
                                                     {"down_proj.weight", slots->down(2)}};
    for (const auto& [part, got] : parts) {
      auto want = ck.value()->get_weight(ep + part, got.shape(), c.weight_block_size);
      ASSERT_TRUE(want.ok()) << want.status().to_string();
      ASSERT_EQ(want->dtype(), got.dtype()) << part;
      ASSERT_EQ(want->num_bytes(), got.num_bytes()) << part;
      EXPECT_EQ(std::memcmp(want->raw(), got.raw(), got.num_bytes()), 0)
          << "layer " << layer << " " << part;
    }
    EXPECT_EQ(bytes_of(slots->slot_data(1), slot_bytes), before_1) << "layer " << layer;
    EXPECT_EQ(bytes_of(slots->slot_data(3), slot_bytes), before_3) << "layer " << layer;
    EXPECT_EQ(3 * I * H * static_cast<int64_t>(dtype_size(slots->dtype())),
              static_cast<int64_t>(slot_bytes));
  }
  EXPECT_EQ(model->load_expert(0, c.num_experts, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->load_expert(0, 0, c.num_experts).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LoadExpertTest,
                         ::testing::Values(Case{"f32", DType::kF32, false},
                                           Case{"bf16", DType::kBF16, false},
                                           Case{"fp8", DType::kBF16, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// An expert stored in another dtype than the others (the slots take the first's) is read and
// converted: its slot holds the values of the bf16 file, whose experts go straight in.
TEST(LoadExpertMixed, ExpertOfAnotherDtypeIsConvertedAtLoad) {
  const std::string base =
      ::testing::TempDir() + "/load-expert-mixed-" + std::to_string(::getpid()) + "-";
  SynthOptions o{.out_dir = base + "bf16", .dtype = DType::kBF16, .seed = 5};
  o.config = small_config();
  ASSERT_TRUE(synthesize_checkpoint(o).ok());
  const std::string f32_expert = "model.layers.1.mlp.experts.3.";
  rewrite_checkpoint(base + "bf16", base + "mixed", [&](const std::string& name, const Tensor& t) {
    return t.to(name.starts_with(f32_expert) ? DType::kF32 : t.dtype());
  });
  auto ck = Checkpoint::open(base + "mixed");
  ASSERT_TRUE(ck.ok());
  EXPECT_EQ(ck.value()->entry(f32_expert + "up_proj.weight")->dtype, DType::kF32);
  auto bf16 = load(base + "bf16", "identity");
  auto mixed = load(base + "mixed", "identity");
  ASSERT_TRUE(bf16 != nullptr && mixed != nullptr);
  for (int layer = 0; layer < small_config().num_hidden_layers; ++layer) {
    const ExpertSlots* want = bf16->local_slots(layer);
    const ExpertSlots* got = mixed->local_slots(layer);
    ASSERT_EQ(got->dtype(), DType::kBF16);
    ASSERT_EQ(got->slot_bytes(), want->slot_bytes());
    for (int slot = 0; slot < got->num_slots(); ++slot) {
      EXPECT_EQ(bytes_of(got->slot_data(slot), got->slot_bytes()),
                bytes_of(want->slot_data(slot), want->slot_bytes()))
          << "layer " << layer << " slot " << slot;
    }
  }
  // And reloaded: the f32 expert into another slot.
  ExpertSlots* slots = mixed->local_slots(1);
  std::memset(slots->slot_data(0), 0, slots->slot_bytes());
  ASSERT_TRUE(mixed->load_expert(1, 3, 0).ok());
  EXPECT_EQ(bytes_of(slots->slot_data(0), slots->slot_bytes()),
            bytes_of(bf16->local_slots(1)->slot_data(3), slots->slot_bytes()));
  std::filesystem::remove_all(base + "bf16");
  std::filesystem::remove_all(base + "mixed");
}

// A misshapen projection of any expert fails the load, naming the tensor.
TEST(LoadExpertMixed, MisshapenExpertFailsTheLoadNamingIt) {
  const std::string base =
      ::testing::TempDir() + "/load-expert-shape-" + std::to_string(::getpid()) + "-";
  SynthOptions o{.out_dir = base + "ok", .dtype = DType::kBF16, .seed = 5};
  o.config = small_config();
  ASSERT_TRUE(synthesize_checkpoint(o).ok());
  const std::string victim = "model.layers.1.mlp.experts.5.down_proj.weight";
  rewrite_checkpoint(base + "ok", base + "bad", [&](const std::string& name, const Tensor& t) {
    return name == victim ? Tensor::zeros(t.dtype(), {t.size(0), t.size(1) / 2}) : t.to(t.dtype());
  });
  ModelOptions options;
  options.placement = "identity";
  auto model = Model::load(base + "bad", options);
  EXPECT_EQ(model.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(model.status().message().find(victim), std::string::npos) << model.status().message();
  std::filesystem::remove_all(base + "ok");
  std::filesystem::remove_all(base + "bad");
}

}  // namespace
}  // namespace flexpert
