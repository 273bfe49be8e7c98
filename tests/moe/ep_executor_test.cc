// SPDX-License-Identifier: Apache-2.0
// EpMoeExecutor over a real shared-memory exchange between two ranks (one thread each):
// with a RowCompute installed (how a GPU model takes over the expert GEMMs) every row a
// rank owns is handed over once, with its local slot, and outputs and slot counts are
// those of the executor's own CPU compute.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <random>
#include <thread>

#include "moe/ep_executor.h"

namespace flexpert {
namespace {

constexpr int kRanks = 2, kSlotsPerRank = 3, H = 16, I = 8, K = 2, T = 7;

struct RankData {
  ExpertSlots slots{DType::kF32, kSlotsPerRank, H, I};
  Routing routing;
  std::vector<float> x;
};

struct Outcome {
  std::vector<std::vector<float>> out;
  std::vector<std::vector<int64_t>> counts;
  int64_t handed = 0;
};

Outcome run_group(const std::vector<RankData>& data, bool row_compute, const std::string& session) {
  std::vector<std::unique_ptr<Transport>> transports(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    TransportOptions o;
    o.session = session;
    o.rank = r;
    o.max_ranks = kRanks;
    o.max_exchange_bytes = EpMoeExecutor::max_exchange_bytes(T, K, H);
    o.timeout_ms = 10000;
    auto created = create_transport("shm", o);
    EXPECT_TRUE(created.ok()) << created.status().to_string();
    if (!created.ok()) return {};
    transports[r] = std::move(created).value();
  }
  for (int r = 0; r < kRanks; ++r) {
    for (int p = 0; p < kRanks; ++p) {
      if (p != r) {
        EXPECT_TRUE(transports[r]->connect(p, transports[p]->address()).ok());
      }
    }
  }
  Outcome result;
  result.out.assign(kRanks, std::vector<float>(static_cast<size_t>(T) * H, NAN));
  result.counts.assign(kRanks, std::vector<int64_t>(kRanks * kSlotsPerRank, 0));
  std::atomic<int64_t> handed{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      ThreadPool pool(1);
      EpMoeExecutor executor(*transports[r], kSlotsPerRank, pool);
      executor.set_group(Group{1, {0, 1}});
      const ExpertSlots& slots = data[r].slots;
      if (row_compute) {
        EXPECT_TRUE(executor.set_row_compute([&](int layer, const int32_t* local_slot,
                                                 const float* const* rows, int64_t count,
                                                 float* results) -> Status {
          EXPECT_EQ(layer, 5);
          handed += count;
          for (int64_t i = 0; i < count; ++i) {
            if (local_slot[i] < 0 || local_slot[i] >= kSlotsPerRank) return data_loss("bad slot");
            std::vector<int64_t> offsets(kSlotsPerRank + 1, 0);
            for (int s = local_slot[i] + 1; s <= kSlotsPerRank; ++s) offsets[s] = 1;
            compute_slots(rows[i], offsets, slots, results + i * H, pool);
          }
          return Status();
        }));
      }
      const Status s =
          executor.execute(5, data[r].x.data(), data[r].routing, slots, r * kSlotsPerRank,
                           result.out[r].data(), result.counts[r].data());
      EXPECT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(transports[r]->shutdown().ok());
    });
  }
  for (auto& t : threads) t.join();
  result.handed = handed.load();
  return result;
}

TEST(EpExecutorTest, RowComputeGetsEveryOwnedRowAndMatchesTheCpuCompute) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 0.5f);
  std::vector<RankData> data(kRanks);
  for (RankData& d : data) {
    for (int s = 0; s < kSlotsPerRank; ++s) {
      std::vector<float> gate(I * H), up(I * H), down(H * I);
      for (auto* v : {&gate, &up, &down}) {
        for (float& w : *v) w = dist(rng);
      }
      ASSERT_TRUE(d.slots
                      .load(s, Tensor::borrow(gate.data(), DType::kF32, {I, H}),
                            Tensor::borrow(up.data(), DType::kF32, {I, H}),
                            Tensor::borrow(down.data(), DType::kF32, {H, I}))
                      .ok());
    }
    d.x.resize(static_cast<size_t>(T) * H);
    for (float& v : d.x) v = dist(rng);
    d.routing.num_tokens = T;
    d.routing.top_k = K;
    for (int p = 0; p < T * K; ++p) {
      d.routing.slot.push_back(static_cast<int32_t>(rng() % (kRanks * kSlotsPerRank)));
      d.routing.expert.push_back(-1);
      d.routing.weight.push_back(0.25f + 0.5f * static_cast<float>(rng() % 2));
    }
  }
  const std::string session = "ep-exec-test-" + std::to_string(getpid());
  const Outcome cpu = run_group(data, false, session + "-cpu");
  const Outcome delegated = run_group(data, true, session + "-rc");
  ASSERT_EQ(cpu.out.size(), static_cast<size_t>(kRanks));
  ASSERT_EQ(delegated.out.size(), static_cast<size_t>(kRanks));
  EXPECT_EQ(delegated.handed, int64_t{kRanks} * T * K);  // Own rows included, once each.
  EXPECT_EQ(delegated.counts, cpu.counts);
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < cpu.out[r].size(); ++i) {
      ASSERT_TRUE(std::isfinite(cpu.out[r][i]));
      EXPECT_NEAR(delegated.out[r][i], cpu.out[r][i], 1e-4f * (1.f + std::fabs(cpu.out[r][i])))
          << "rank " << r << " element " << i;
    }
  }
}

}  // namespace
}  // namespace flexpert
