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

}  // namespace
}  // namespace flexpert
