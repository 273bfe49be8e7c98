// SPDX-License-Identifier: Apache-2.0
// EpMoeExecutor over a real shared-memory exchange between two ranks (one thread each):
// with a RowCompute installed (how a GPU model takes over the expert GEMMs) every row a
// rank owns is handed over once, with its local slot, and outputs and slot counts are
// those of the executor's own CPU compute; with step timing, a rank's exchange time holds
// its waits for a slow peer and none of its own compute.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
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
  std::vector<double> exchange_ms;  // [rank] EpMoeExecutor::exchange_ms() after the call.
  std::vector<double> execute_ms;   // [rank] wall time of execute().
};

// timing: EpMoeExecutor::set_timing. compute_sleep_ms: rank 1's RowCompute sleeps this
// long first (a slow owner).
Outcome run_group(const std::vector<RankData>& data, bool row_compute, const std::string& session,
                  bool timing = false, int compute_sleep_ms = 0) {
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
  result.exchange_ms.assign(kRanks, -1);
  result.execute_ms.assign(kRanks, -1);
  std::atomic<int64_t> handed{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      ThreadPool pool(1);
      EpMoeExecutor executor(*transports[r], kSlotsPerRank, pool);
      executor.set_group(Group{1, {0, 1}});
      executor.set_timing(timing);
      const ExpertSlots& slots = data[r].slots;
      if (row_compute) {
        EXPECT_TRUE(executor.set_row_compute([&](int layer, const int32_t* local_slot,
                                                 const float* const* rows, int64_t count,
                                                 float* results) -> Status {
          EXPECT_EQ(layer, 5);
          if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(compute_sleep_ms));
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
      const auto start = std::chrono::steady_clock::now();
      const Status s =
          executor.execute(5, data[r].x.data(), data[r].routing, slots, r * kSlotsPerRank,
                           result.out[r].data(), result.counts[r].data());
      result.execute_ms[r] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      result.exchange_ms[r] = executor.exchange_ms();
      EXPECT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(transports[r]->shutdown().ok());
    });
  }
  for (auto& t : threads) t.join();
  result.handed = handed.load();
  return result;
}

std::vector<RankData> random_data() {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 0.5f);
  std::vector<RankData> data(kRanks);
  for (RankData& d : data) {
    for (int s = 0; s < kSlotsPerRank; ++s) {
      std::vector<float> gate(I * H), up(I * H), down(H * I);
      for (auto* v : {&gate, &up, &down}) {
        for (float& w : *v) w = dist(rng);
      }
      EXPECT_TRUE(d.slots
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
  return data;
}

TEST(EpExecutorTest, RowComputeGetsEveryOwnedRowAndMatchesTheCpuCompute) {
  const std::vector<RankData> data = random_data();
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

// Rank 1 computes its rows 200 ms late. Rank 0's combine waits for them: its exchange time
// holds that wait, less its own compute of a few rows (microseconds; half the sleep is left
// to it). Rank 1's holds none of its own compute: exchange plus the sleep fit in
// its execute(). Without timing, and alone, nothing is added. (Bounds from the sleep, not
// speed: a sleep lasts at least its time.)
TEST(EpExecutorTest, ExchangeTimeHoldsWaitsForPeersNotOwnCompute) {
  const std::vector<RankData> data = random_data();
  const std::string session = "ep-exec-timing-" + std::to_string(getpid());
  constexpr int kSleepMs = 200;
  const Outcome timed = run_group(data, true, session + "-on", /*timing=*/true, kSleepMs);
  ASSERT_EQ(timed.exchange_ms.size(), static_cast<size_t>(kRanks));
  EXPECT_GE(timed.exchange_ms[0], kSleepMs / 2);
  EXPECT_LE(timed.exchange_ms[0], timed.execute_ms[0]);
  EXPECT_GT(timed.exchange_ms[1], 0);
  EXPECT_LE(timed.exchange_ms[1] + kSleepMs, timed.execute_ms[1]);
  const Outcome untimed = run_group(data, true, session + "-off", /*timing=*/false, kSleepMs);
  EXPECT_EQ(untimed.exchange_ms, std::vector<double>(kRanks, 0.0));

  // One member: its pairs stay local, and it reports no exchange time.
  TransportOptions o;
  o.session = session + "-alone";
  o.max_ranks = 1;
  o.max_exchange_bytes = EpMoeExecutor::max_exchange_bytes(T, K, H);
  auto transport = create_transport("shm", o);
  ASSERT_TRUE(transport.ok()) << transport.status().to_string();
  ThreadPool pool(1);
  EpMoeExecutor alone(**transport, kRanks * kSlotsPerRank, pool);
  alone.set_group(Group{1, {0}});
  alone.set_timing(true);
  ExpertSlots slots(DType::kF32, kRanks * kSlotsPerRank, H, I);
  std::vector<float> out(static_cast<size_t>(T) * H);
  ASSERT_TRUE(
      alone.execute(5, data[0].x.data(), data[0].routing, slots, 0, out.data(), nullptr).ok());
  EXPECT_EQ(alone.exchange_ms(), 0.0);
  EXPECT_TRUE((*transport)->shutdown().ok());
}

}  // namespace
}  // namespace flexpert
