// SPDX-License-Identifier: Apache-2.0
// The CUDA Qwen3-MoE model in its expert-parallel mode, in one process: a loopback
// executor hands every routed row to the model's RowCompute (as EpMoeExecutor does for
// the rows a rank owns), so the device segments, the host round trip of each MoE
// layer, the segment graphs, the host slot mirror and slots_written() are exercised
// without peers. Greedy tokens must equal the Hugging Face reference, also after a map
// that moves experts into slots filled through the mirror, without a graph recapture.
// Qwen3-MoE and DeepSeek-V3 (shared experts beside the exchanged routed ones).
#include <gtest/gtest.h>

#include <cstring>

#include "cuda_model_util.h"
#include "flexpert/generate.h"
#include "flexpert/model.h"
#include "moe/expert_slots.h"
#include "moe/moe_executor.h"

namespace flexpert {
namespace {

// One rank holding local slots [first_slot, ...): every pair is computed here.
class LoopbackExecutor final : public MoeExecutor {
 public:
  bool set_row_compute(RowCompute compute) override {
    compute_ = std::move(compute);
    return true;
  }
  Status execute(int layer, const float* x, const Routing& routing, const ExpertSlots& local_slots,
                 int first_slot, float* out, int64_t* slot_counts) override {
    ++calls;
    const int64_t H = local_slots.hidden();
    const int K = routing.top_k;
    const int64_t pairs = routing.num_tokens * K;
    std::vector<int32_t> slots(pairs);
    std::vector<const float*> rows(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
      slots[p] = routing.slot[p] - first_slot;
      rows[p] = x + (p / K) * H;
      if (slot_counts != nullptr) ++slot_counts[routing.slot[p]];
    }
    std::vector<float> results(pairs * H);
    if (pairs > 0) {
      FLEX_RETURN_IF_ERROR(compute_(layer, slots.data(), rows.data(), pairs, results.data()));
    }
    for (int64_t t = 0; t < routing.num_tokens; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int k = 0; k < K; ++k) {
        const float w = routing.weight[t * K + k];
        const float* r = results.data() + (t * K + k) * H;
        for (int64_t h = 0; h < H; ++h) o[h] += w * r[h];
      }
    }
    return Status();
  }
  int64_t calls = 0;

 private:
  RowCompute compute_;
};

using cuda_test::load_reference;

std::vector<std::vector<int32_t>> greedy(Model& model,
                                         const std::vector<cuda_test::RefPrompt>& ref) {
  return cuda_test::greedy_tokens(model, ref);
}

// `num_experts` experts in slots 0.. of every layer, then a free local slot and a free
// slot of a "peer".
void check_ep_model(const std::string& name, int num_experts, int num_layers) {
  const std::string dir = std::string(FLEXPERT_TESTDATA_DIR) + "/" + name;
  const int spare = num_experts;
  std::string slots = "[";
  for (int s = 0; s < num_experts; ++s) slots += std::to_string(s) + ",";
  slots += "-1,-1]";
  std::string layers = slots;
  for (int l = 1; l < num_layers; ++l) layers += "," + slots;
  LoopbackExecutor executor;
  ModelOptions options;
  options.device = "cuda";
  options.device_dtype = DType::kF32;
  options.placement = R"({"layers": [)" + layers + "]}";
  options.max_sequences = 8;
  options.first_slot = 0;
  options.num_local_slots = num_experts + 1;
  options.moe_executor = &executor;
  auto loaded = Model::load(dir, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  Model& model = *loaded.value();
  const auto ref = load_reference(dir);
  const auto first = greedy(model, ref);
  ASSERT_EQ(first.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(first[i], ref[i].greedy) << "prompt " << i;
  EXPECT_GT(executor.calls, 0);
  EXPECT_GT(model.num_graph_captures(), 0);
  // Run again so that every bucket seen is captured, then count.
  (void)greedy(model, ref);
  const int64_t captures = model.num_graph_captures();

  // Move expert 3 of every MoE layer into the free local slot through the host mirror
  // (as the worker's mover does after a pull), then switch to a map without slot 3.
  const ExpertPlacement& p = model.placement();
  std::vector<std::vector<int>> maps;
  for (int l = 0; l < p.num_layers(); ++l) {
    std::vector<int> map = p.slot_map(l);
    ExpertSlots* mirror = model.local_slots(l);
    if (mirror != nullptr) {
      std::memcpy(mirror->slot_data(spare), mirror->slot_data(3), mirror->slot_bytes());
      ASSERT_TRUE(model.slots_written(l, spare).ok());
      map[spare] = 3;
      map[3] = ExpertPlacement::kFreeSlot;
    }
    maps.push_back(map);
  }
  auto next = ExpertPlacement::from_slot_maps(p.num_experts(), maps);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  ASSERT_TRUE(model.set_placement(std::move(next).value()).ok());
  model.reset_slot_counts();
  const auto second = greedy(model, ref);
  EXPECT_EQ(second, first);
  EXPECT_EQ(model.num_graph_captures(), captures) << "a map switch must not recapture";
  int64_t moved = 0;
  for (int l = 0; l < p.num_layers(); ++l) {
    if (model.local_slots(l) == nullptr) continue;
    EXPECT_EQ(model.slot_counts()[l][3], 0) << "layer " << l;
    moved += model.slot_counts()[l][spare];
  }
  EXPECT_GT(moved, 0) << "no row reached the moved expert";
}

TEST(CudaEpTest, Qwen3RowComputeMatchesReferenceAndMapsDoNotRecapture) {
  FLEX_SKIP_WITHOUT_GPU();
  check_ep_model("qwen3moe-tiny", 16, 4);
}

TEST(CudaEpTest, DeepseekRowComputeMatchesReferenceAndMapsDoNotRecapture) {
  FLEX_SKIP_WITHOUT_GPU();
  check_ep_model("deepseekv3-tiny", 32, 3);
}

}  // namespace
}  // namespace flexpert
