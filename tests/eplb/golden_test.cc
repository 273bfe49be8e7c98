// SPDX-License-Identifier: Apache-2.0
// The planner's decisions pinned: plans of fixed inputs hash to the values the planner gave
// when they were recorded. A change meant only to make the planner faster (data structures,
// not decisions) must keep every plan bit-identical; a change of decisions updates the hashes
// and says so in its commit. Covers steady replans, membership changes (other GPU counts and
// slots per GPU), free and filled slots, hierarchical and uneven shapes, and thread counts.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "eplb/deepseek_eplb.h"
#include "eplb/planner.h"
#include "eplb_test_util.h"

namespace flexpert::eplb {
namespace {

using testing::drift;
using testing::iota_ranks;
using testing::Placement;
using testing::zipf_loads;

// FNV-1a over the placement (row lengths included) and the receives.
uint64_t hash_plan(const PlanOutput& out) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& row : out.placement) {
    mix(static_cast<int64_t>(row.size()));
    for (int e : row) mix(e);
  }
  mix(out.moved_slots);
  return h;
}

PlanInput shaped(int layers, int gpus, int slots, uint64_t seed, bool fill) {
  PlanInput in;
  in.num_experts = 256;
  in.slots_per_rank = slots;
  in.ranks = iota_ranks(gpus);
  in.max_ranks = gpus;
  in.num_hosts = std::max(1, gpus / 8);
  in.num_groups = 8;
  in.load = zipf_loads(layers, 256, 0.6 + 0.1 * static_cast<double>(seed % 6), seed);
  in.fill_slots = fill;
  return in;
}

// A chain of plans: from nothing, two steady replans under drift, then a membership change to
// `to_gpus` with DeepSeek's plan on the old GPUs as the current placement. Hashes every plan.
uint64_t chain(int layers, int gpus, int to_gpus, int spare, uint64_t seed, bool fill,
               int threads) {
  uint64_t h = 0;
  const int slots = (256 + gpus - 1) / gpus + spare;
  PlanInput in = shaped(layers, gpus, slots, seed, fill);
  in.num_threads = threads;
  for (int w = 0; w < 3; ++w) {
    auto out = plan(in);
    EXPECT_TRUE(out.ok()) << out.status().to_string();
    if (!out.ok()) return 0;
    h = h * 31 + hash_plan(*out);
    in.current = out->placement;
    in.load = drift(in.load, 0.2, seed * 7 + w);
  }
  auto prev = deepseek_rebalance(in.load, gpus * slots, 8, std::max(1, gpus / 8), gpus);
  EXPECT_TRUE(prev.ok());
  if (!prev.ok()) return 0;
  const int to_slots = (256 + to_gpus - 1) / to_gpus + spare;
  PlanInput change = shaped(layers, to_gpus, to_slots, seed + 1, fill);
  change.num_threads = threads;
  change.current_slots_per_rank = slots;
  const size_t kept = static_cast<size_t>(std::min(gpus, to_gpus)) * slots;
  for (const auto& row : prev->phy2log) {
    std::vector<int> cur(static_cast<size_t>(to_gpus) * slots, -1);
    std::copy(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(kept), cur.begin());
    change.current.push_back(std::move(cur));
  }
  for (bool greedy : {true, false}) {
    change.greedy_after_change = greedy;
    auto out = plan(change);
    EXPECT_TRUE(out.ok()) << out.status().to_string();
    if (!out.ok()) return 0;
    h = h * 31 + hash_plan(*out);
  }
  return h;
}

struct Case {
  int layers, gpus, to_gpus, spare;
  uint64_t seed;
  bool fill;
  uint64_t expected;
};

// NOTE: a build that fuses multiplies and adds (Release: -march=x86-64-v3 has FMA) rounds some
// of the search's scores differently from one that does not (Debug, sanitizers); one case here
// turns out differently, so it has a hash per kind of build. Either build plans deterministically.
#if defined(__FMA__)
constexpr uint64_t kFmaDependent = 0xb6705df5261d030eull;
#else
constexpr uint64_t kFmaDependent = 0x060bd3bada1181eeull;
#endif

TEST(GoldenTest, PlansAreBitIdenticalToTheRecordedOnes) {
  const Case cases[] = {
      {6, 16, 24, 1, 1, true, 0x7863f446318fc5d1ull},
      {6, 32, 24, 2, 2, false, 0xa9b2f5cabc887f54ull},
      {6, 64, 48, 1, 3, true, 0x34783c8f2d0f1a4eull},
      {4, 144, 128, 1, 4, true, 0xf7006546556e528cull},
      {4, 256, 192, 1, 5, true, 0x92428aadd5bb567cull},
      {4, 256, 192, 2, 6, false, kFmaDependent},
      {4, 192, 256, 1, 7, true, 0x0c6748597267392dull},
      {6, 20, 13, 3, 8, true, 0x022d3deda9a51e3dull},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.gpus) + "->" + std::to_string(c.to_gpus) + " spare " +
                 std::to_string(c.spare));
    const uint64_t h = chain(c.layers, c.gpus, c.to_gpus, c.spare, c.seed, c.fill, 1);
    EXPECT_EQ(h, c.expected);
    // Layers on several threads: the same plans.
    EXPECT_EQ(chain(c.layers, c.gpus, c.to_gpus, c.spare, c.seed, c.fill, 3), h);
  }
}

}  // namespace
}  // namespace flexpert::eplb
