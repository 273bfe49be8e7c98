// SPDX-License-Identifier: Apache-2.0
// FP8 routed experts under expert parallelism (docs/cuda.md "FP8 experts"): the deepseek-tiny
// shapes (and a Qwen3-MoE of the same expert shapes, for the logits) synthesised as block-FP8,
// served by two ranks of one process (a thread each, cuda_ipc transports with host collectives, as
// GPU workers run) holding half the FP8 slots each. Their logits must match one process holding
// every FP8 slot (an independent path: no exchange, the decode kernels combining in f32), through
// the device exchange and the host exchange; the host slot mirror has the FP8 slot's bytes (scales
// included); a slot moved by Model::copy_slot into a spare slot of the other rank, then mapped
// there, serves the same logits (its scales came with it). Skips without a GPU of compute
// capability 8.9+.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "checkpoint/synth.h"
#include "cuda/device.h"
#include "cuda/fp8_experts.h"
#include "cuda_ep_ranks.h"
#include "cuda_model_util.h"
#include "flexpert/model.h"
#include "moe/ep_executor.h"
#include "moe/expert_slots.h"

namespace flexpert {
namespace {

constexpr int kRanks = cuda_test::TwoEpRanks::kRanks;
constexpr int kExperts = 32;                     // deepseek-tiny, qwen3_tiny_32()
constexpr int kSlotsPerRank = kExperts / 2 + 1;  // Half the experts and one spare slot.

bool fp8_gpu() {
  int device = 0;
  return cuda::device_available() && cudaGetDevice(&device) == cudaSuccess &&
         cuda::fp8_device_supported(device);
}

// The tiny Qwen3-MoE preset with deepseek-tiny's expert count and shapes (hidden 128,
// expert intermediate 64): Qwen3's softmax routing over the same FP8 slots.
ModelConfig qwen3_tiny_32() {
  ModelConfig c = synth_preset_config("tiny").value();
  c.num_experts = kExperts;
  return c;
}

// deepseek-tiny (or `config`) with block-FP8 projections (as cuda_deepseek_test.cc's fp8
// variants).
std::string write_fp8_checkpoint(
    const ModelConfig& config = synth_preset_config("deepseek-tiny").value()) {
  const std::string dir =
      ::testing::TempDir() + "/cuda-fp8-ep-" + config.model_type + "-" + std::to_string(getpid());
  SynthOptions options;
  options.out_dir = dir;
  options.dtype = DType::kBF16;
  options.fp8 = true;
  options.seed = 5;
  options.config = config;
  Status s = synthesize_checkpoint(options);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return dir;
}

// Rank r holds experts [16 r, 16 r + 16) in its first 16 slots and a free spare slot.
std::string placement(int num_layers) {
  std::string map = "[";
  for (int r = 0; r < kRanks; ++r) {
    for (int e = 0; e < kSlotsPerRank - 1; ++e) {
      map += std::to_string(r * (kSlotsPerRank - 1) + e) + ",";
    }
    map += r + 1 < kRanks ? "-1," : "-1]";
  }
  std::string layers;
  for (int l = 0; l < num_layers; ++l) layers += (l ? "," : "") + map;
  return R"({"layers": [)" + layers + "]}";
}

ModelOptions fp8_options(const std::string& spec) {
  ModelOptions options;
  options.device = "cuda";
  options.quantization = "fp8";
  options.placement = spec;
  options.max_sequences = 4;
  return options;
}

struct TwoFp8Ranks : cuda_test::TwoEpRanks {
  TwoFp8Ranks(const std::string& dir, const std::string& spec, const std::string& tag)
      : TwoEpRanks(dir, fp8_options(spec),
                   {"cuda-fp8-ep-" + tag, kSlotsPerRank,
                    EpMoeExecutor::max_exchange_bytes(2048, 4, 128)}) {}
  // Both ranks run the same batch (they step together); rank 0's logits.
  std::vector<float> step(const std::vector<SequenceChunk>& batch) {
    std::vector<float> peer;
    std::thread t([&] { peer = cuda_test::step_logits(*models[1], batch); });
    std::vector<float> mine = cuda_test::step_logits(*models[0], batch);
    t.join();
    EXPECT_LT(cuda_test::rel_l2(peer, mine), 1e-6) << "the ranks differ on one batch";
    return mine;
  }
};

// A prefill of 33 + 5 tokens (the grouped FP8 tiles), then decode steps.
std::vector<std::vector<SequenceChunk>> steps(int vocab) {
  std::mt19937 rng(9);
  std::vector<SequenceChunk> batch = {{0, 0, {}}, {2, 0, {}}};
  for (int i = 0; i < 33; ++i) batch[0].tokens.push_back(static_cast<int32_t>(rng() % vocab));
  for (int i = 0; i < 5; ++i) batch[1].tokens.push_back(static_cast<int32_t>(rng() % vocab));
  std::vector<std::vector<SequenceChunk>> out;
  for (int s = 0; s < 5; ++s) {
    out.push_back(batch);
    for (auto& b : batch) {
      b.start_pos += static_cast<int>(b.tokens.size());
      b.tokens = {static_cast<int32_t>(rng() % vocab)};
    }
  }
  return out;
}

// DeepSeek (grouped routing, shared experts) and Qwen3 (softmax top-k through run_moe's
// router stages) over the same FP8 slot shapes.
class CudaFp8EpModelTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaFp8EpModelTest, TwoRanksMatchOneProcessThroughBothExchanges) {
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU of compute capability 8.9 or newer";
  const bool qwen3 = std::string(GetParam()) == "qwen3";
  const ModelConfig config = qwen3 ? qwen3_tiny_32() : synth_preset_config("deepseek-tiny").value();
  const std::string dir = write_fp8_checkpoint(config);
  const int num_layers = config.num_hidden_layers;
  const std::string spec = placement(num_layers);
  auto one = Model::load(dir, fp8_options(spec));
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  const auto batches = steps(one.value()->config().vocab_size);
  std::vector<std::vector<float>> want;
  for (const auto& b : batches) want.push_back(cuda_test::step_logits(*one.value(), b));
  one.value().reset();

  const cuda::Fp8SlotLayout layout = cuda::fp8_slot_layout(128, 64);
  for (const char* exchange : {"device", "host"}) {
    SCOPED_TRACE(exchange);
    if (std::string(exchange) == "host") {
      setenv("FLEXPERT_EP_EXCHANGE", "host", 1);
    } else {
      unsetenv("FLEXPERT_EP_EXCHANGE");
    }
    TwoFp8Ranks g(dir, spec, std::string(GetParam()) + "-" + exchange);
    ASSERT_TRUE(g.ready);
    // The host mirror holds the FP8 slot images: e4m3 weights and scales, not bf16 sizes.
    ExpertSlots* mirror = g.models[0]->local_slots(1);
    ASSERT_NE(mirror, nullptr);
    EXPECT_EQ(mirror->slot_bytes(), static_cast<size_t>(layout.slot_bytes()));
    EXPECT_EQ(mirror->num_slots(), kSlotsPerRank);
    for (size_t s = 0; s < batches.size(); ++s) {
      const double err = cuda_test::rel_l2(g.step(batches[s]), want[s]);
      std::printf("  %s exchange, step %zu: two FP8 ranks vs one process %.3g\n", exchange, s, err);
      EXPECT_LT(err, 1e-2) << "step " << s;
    }
    int64_t rows = 0;
    for (const auto& layer : g.models[0]->slot_counts()) {
      for (int s = 0; s < kSlotsPerRank; ++s) rows += layer[s];
    }
    EXPECT_GT(rows, 0) << "rank 0 computed no rows";
  }
  unsetenv("FLEXPERT_EP_EXCHANGE");
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, CudaFp8EpModelTest, ::testing::Values("deepseek", "qwen3"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

// Expert 19 (rank 1's local slot 3) copied device to device into rank 0's spare slot on both
// MoE layers, then mapped there (rank 1's copy freed): the same logits as before the move,
// so its block scales (the slot's last bytes) came with it.
TEST(CudaFp8EpTest, CopySlotMovesFp8SlotsWithTheirScales) {
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU of compute capability 8.9 or newer";
  unsetenv("FLEXPERT_EP_EXCHANGE");
  const std::string dir = write_fp8_checkpoint();
  const int num_layers = synth_preset_config("deepseek-tiny").value().num_hidden_layers;
  TwoFp8Ranks g(dir, placement(num_layers), "copy");
  ASSERT_TRUE(g.ready);
  const auto batches = steps(g.models[0]->config().vocab_size);
  const std::vector<float> before = g.step(batches[0]);

  const int expert = 19, src_local = expert - (kSlotsPerRank - 1), spare = kSlotsPerRank - 1;
  std::vector<std::vector<int>> maps;
  int moved_layers = 0;
  for (int l = 0; l < num_layers; ++l) {
    maps.push_back(g.models[0]->placement().slot_map(l));
    ExpertSlots* mine = g.models[0]->local_slots(l);
    ExpertSlots* theirs = g.models[1]->local_slots(l);
    if (mine == nullptr) continue;
    ASSERT_NE(theirs, nullptr);
    const size_t bytes = mine->slot_bytes();
    ASSERT_NE(std::memcmp(mine->slot_data(spare), theirs->slot_data(src_local), bytes), 0);
    Status s = g.models[0]->copy_slot(l, spare, /*src_rank=*/1, src_local);
    ASSERT_TRUE(s.ok()) << s.to_string();
    // The whole slot landed, the scales at its end too (mirror refreshed from the device).
    EXPECT_EQ(std::memcmp(mine->slot_data(spare), theirs->slot_data(src_local), bytes), 0);
    maps.back()[spare] = expert;
    maps.back()[kSlotsPerRank + src_local] = ExpertPlacement::kFreeSlot;
    ++moved_layers;
  }
  ASSERT_EQ(moved_layers, 2);
  auto next = ExpertPlacement::from_slot_maps(kExperts, maps);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  for (auto& m : g.models) {
    ASSERT_TRUE(m->set_placement(next.value()).ok());
    m->reset_slot_counts();
  }
  // The same first step again, in fresh KV slots.
  std::vector<SequenceChunk> again = batches[0];
  again[0].kv_slot = 1;
  again[1].kv_slot = 3;
  const double err = cuda_test::rel_l2(g.step(again), before);
  std::printf("  after moving expert %d: %.3g\n", expert, err);
  EXPECT_LT(err, 1e-5);
  int64_t at_spare = 0, at_old = 0;
  for (int l = 0; l < num_layers; ++l) {
    if (g.models[0]->local_slots(l) == nullptr) continue;
    at_spare += g.models[0]->slot_counts()[l][spare];
    at_old += g.models[1]->slot_counts()[l][kSlotsPerRank + src_local];
  }
  EXPECT_GT(at_spare, 0) << "no row reached the moved expert";
  EXPECT_EQ(at_old, 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace flexpert
