// SPDX-License-Identifier: Apache-2.0
// The planner after membership changes and in DeepSeek's file contract: remote receives against
// a set-based reference, filled slots, plans across a change of GPU count against the DeepSeek
// port, the skip threshold (min_gain) and layers planned on several threads.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "eplb/deepseek_eplb.h"
#include "eplb/planner.h"
#include "eplb_test_util.h"

namespace flexpert::eplb {
namespace {

using testing::drift;
using testing::expect_valid;
using testing::iota_ranks;
using testing::Matrix;
using testing::mean;
using testing::Placement;
using testing::zipf_loads;

// Reference: per GPU a std::set of what it held and of what it holds.
int64_t receives_reference(const std::vector<int>& from, int from_slots, const std::vector<int>& to,
                           int to_slots) {
  std::map<int, std::set<int>> held, got;
  for (size_t s = 0; s < from.size(); ++s) held[static_cast<int>(s) / from_slots].insert(from[s]);
  for (size_t s = 0; s < to.size(); ++s) {
    if (to[s] >= 0) got[static_cast<int>(s) / to_slots].insert(to[s]);
  }
  int64_t n = 0;
  for (const auto& [gpu, experts] : got) {
    for (int e : experts) n += held[gpu].count(e) == 0;
  }
  return n;
}

TEST(ScaleTest, CountReceivesMatchesASetReference) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int from_slots = 1 + static_cast<int>(rng() % 5),
              to_slots = 1 + static_cast<int>(rng() % 5);
    std::vector<int> from((1 + rng() % 6) * from_slots), to((1 + rng() % 6) * to_slots);
    for (int& e : from) e = static_cast<int>(rng() % 7) - 1;
    for (int& e : to) e = static_cast<int>(rng() % 7) - 1;
    EXPECT_EQ(count_receives(from, from_slots, to, to_slots),
              receives_reference(from, from_slots, to, to_slots))
        << "trial " << trial;
  }
  // A copy within a GPU is local; a GPU the old plan lacks receives everything it holds.
  EXPECT_EQ(count_receives(std::vector<int>{0, 1}, 2, std::vector<int>{1, 0, 2, 2}, 2), 1);
  EXPECT_EQ(count_receives(Placement{{0, 1}}, 2, Placement{{1, 1}}, 2), 0);
}

PlanInput deepseek_shaped(int num_layers, int num_experts, int gpus, int slots, uint64_t seed) {
  PlanInput in;
  in.num_experts = num_experts;
  in.slots_per_rank = slots;
  in.ranks = iota_ranks(gpus);
  in.max_ranks = gpus;
  in.num_hosts = std::max(1, gpus / 8);
  in.num_groups = 8;
  in.load = zipf_loads(num_layers, num_experts, 1.0, seed);
  return in;
}

TEST(ScaleTest, FilledSlotsBalanceAsWellAsFreeOnes) {
  for (int gpus : {16, 48}) {
    PlanInput in = deepseek_shaped(4, 64, gpus, 64 / gpus + 2, 3);
    auto free_plan = plan(in);
    in.fill_slots = true;
    auto filled = plan(in);
    ASSERT_TRUE(free_plan.ok() && filled.ok());
    expect_valid(in, *filled);
    for (const auto& row : filled->placement) EXPECT_EQ(std::count(row.begin(), row.end(), -1), 0);
    // Extra replicas only split loads further: the max GPU load barely moves, if at all.
    EXPECT_GE(mean(filled->balancedness), mean(free_plan->balancedness) - 0.002) << gpus;
    // Planned again on its own output: nothing moves.
    in.current = filled->placement;
    auto again = plan(in);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->moved_slots, 0);
  }
}

// DeepSeek's plan on the old GPUs is the previous placement of both planners (as in a file
// with prev_phy2log); GPUs below min(old, new) are the same GPUs.
TEST(ScaleTest, MembershipChangesMoveAtMostHalfOfDeepSeeksReceives) {
  struct Change {
    int from, to;
  };
  // DeepSeek-V3's 256 experts on a few layers: at small shapes the forced moves (new GPUs,
  // lost experts) are most of DeepSeek's too. Scale-ups: every slot of a new GPU is a receive
  // for both planners, and the old GPUs lose slots (17 -> 12 at 16 -> 24).
  for (Change c : {Change{24, 16}, Change{64, 48}, Change{144, 128}, Change{16, 24}, Change{48, 64},
                   Change{192, 256}}) {
    SCOPED_TRACE(std::to_string(c.from) + " -> " + std::to_string(c.to));
    const int experts = 256, layers = 3;
    const int from_slots = (experts + c.from - 1) / c.from + 1;
    const int to_slots = (experts + c.to - 1) / c.to + 1;
    const Matrix old_load = zipf_loads(layers, experts, 1.0, 9);
    const Matrix load = drift(old_load, 0.15, 10);
    auto prev =
        deepseek_rebalance(old_load, c.from * from_slots, 8, std::max(1, c.from / 8), c.from);
    auto ds = deepseek_rebalance(load, c.to * to_slots, 8, std::max(1, c.to / 8), c.to);
    ASSERT_TRUE(prev.ok() && ds.ok());
    PlanInput in = deepseek_shaped(layers, experts, c.to, to_slots, 0);
    in.load = load;
    in.fill_slots = true;
    in.current_slots_per_rank = from_slots;
    for (const auto& row : prev->phy2log) {
      std::vector<int> cur(static_cast<size_t>(c.to) * from_slots, -1);
      std::copy(row.begin(), row.begin() + std::min(c.from, c.to) * from_slots, cur.begin());
      in.current.push_back(cur);
    }
    auto ours = plan(in);
    ASSERT_TRUE(ours.ok()) << ours.status().to_string();
    expect_valid(in, *ours);
    int64_t ds_receives = 0, our_receives = 0;
    for (int l = 0; l < layers; ++l) {
      ds_receives += receives_reference(prev->phy2log[l], from_slots, ds->phy2log[l], to_slots);
      our_receives +=
          receives_reference(prev->phy2log[l], from_slots, ours->placement[l], to_slots);
      EXPECT_EQ(std::count(ours->placement[l].begin(), ours->placement[l].end(), -1), 0);
    }
    EXPECT_EQ(ours->moved_slots, our_receives);
    EXPECT_LE(our_receives * 2, ds_receives);
    double ds_balance = 0;
    for (size_t l = 0; l < load.size(); ++l) {
      ds_balance += balancedness(load[l], ds->phy2log[l], in.ranks, to_slots) / layers;
    }
    EXPECT_GE(mean(ours->balancedness), ds_balance - 0.005);
  }
}

// greedy_after_change trades balance for receives only after a membership change: off, the
// plan balances better and receives more; the plan after it (loads
// unchanged, no longer after a change) balances as well as the plan with it off.
TEST(ScaleTest, GreedyAfterChangeTradesBalanceForReceives) {
  const int experts = 256, layers = 3, from = 192, to = 256;
  const int from_slots = (experts + from - 1) / from + 1, to_slots = (experts + to - 1) / to + 1;
  const Matrix old_load = zipf_loads(layers, experts, 1.0, 41);
  const Matrix load = drift(old_load, 0.15, 42);
  auto prev = deepseek_rebalance(old_load, from * from_slots, 8, from / 8, from);
  ASSERT_TRUE(prev.ok());
  PlanInput in = deepseek_shaped(layers, experts, to, to_slots, 0);
  in.load = load;
  in.fill_slots = true;
  in.current_slots_per_rank = from_slots;
  for (const auto& row : prev->phy2log) {
    std::vector<int> cur(static_cast<size_t>(to) * from_slots, -1);
    std::copy(row.begin(), row.end(), cur.begin());
    in.current.push_back(cur);
  }
  auto greedy = plan(in);
  in.greedy_after_change = false;
  auto aimed = plan(in);
  ASSERT_TRUE(greedy.ok() && aimed.ok());
  expect_valid(in, *greedy);
  expect_valid(in, *aimed);
  EXPECT_LT(greedy->moved_slots, aimed->moved_slots);  // the greedy aim binds at 2 slots per GPU
  EXPECT_GT(mean(aimed->balancedness), mean(greedy->balancedness));

  in.greedy_after_change = true;
  in.current = greedy->placement;
  in.current_slots_per_rank = 0;
  auto next = plan(in);
  ASSERT_TRUE(next.ok());
  expect_valid(in, *next);
  EXPECT_GE(mean(next->balancedness), mean(aimed->balancedness) - 0.005);
}

TEST(ScaleTest, MinGainSkipsSmallGainsOnly) {
  PlanInput in = deepseek_shaped(4, 64, 16, 6, 21);
  in.fill_slots = true;
  auto first = plan(in);
  ASSERT_TRUE(first.ok());
  in.current = first->placement;
  in.load = drift(in.load, 0.3, 22);
  auto replanned = plan(in);
  ASSERT_TRUE(replanned.ok());
  ASSERT_GT(replanned->moved_slots, 0);
  ASSERT_GT(replanned->balancedness_gain, 0);
  EXPECT_FALSE(replanned->skipped);

  in.min_gain = replanned->balancedness_gain * 2;  // above the gain: keep the current placement
  auto skipped = plan(in);
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->placement, in.current);
  EXPECT_EQ(skipped->moved_slots, 0);
  EXPECT_DOUBLE_EQ(skipped->balancedness_gain, replanned->balancedness_gain);
  expect_valid(in, *skipped);

  in.min_gain = replanned->balancedness_gain / 2;  // below it: replan
  auto again = plan(in);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->skipped);
  EXPECT_EQ(again->placement, replanned->placement);

  // A rank left: the current placement lost experts, so it cannot be kept whatever min_gain.
  in.min_gain = 1;
  in.ranks.pop_back();
  auto shrunk = plan(in);
  ASSERT_TRUE(shrunk.ok());
  EXPECT_FALSE(shrunk->skipped);
  expect_valid(in, *shrunk);
}

TEST(ScaleTest, SmoothLoadAveragesShares) {
  Matrix load = {{30, 10}, {0, 0}};
  auto shares = smooth_load({}, 0.5, load);  // nothing earlier: the window as it is
  EXPECT_EQ(load, (Matrix{{30, 10}, {0, 0}}));
  EXPECT_EQ(shares, (Matrix{{0.75, 0.25}, {0, 0}}));
  Matrix next = {{10, 30}, {4, 4}};
  shares = smooth_load(shares, 0.5, next);
  EXPECT_EQ(shares, (Matrix{{0.5, 0.5}, {0.25, 0.25}}));  // shares, whatever the totals
  EXPECT_EQ(next, (Matrix{{20, 20}, {2, 2}}));            // scaled to the window's total
  Matrix idle = {{0, 0}, {0, 0}};
  EXPECT_EQ(smooth_load(shares, 0.5, idle), shares);  // no load: the shares stay
  EXPECT_EQ(idle, (Matrix{{0, 0}, {0, 0}}));
}

TEST(ScaleTest, ThreadsGiveTheSamePlan) {
  PlanInput in = deepseek_shaped(12, 64, 24, 4, 31);
  in.fill_slots = true;
  auto one = plan(in);
  in.num_threads = 4;
  auto four = plan(in);
  in.num_threads = 0;  // all cores
  auto all = plan(in);
  ASSERT_TRUE(one.ok() && four.ok() && all.ok());
  EXPECT_EQ(four->placement, one->placement);
  EXPECT_EQ(all->placement, one->placement);
  EXPECT_EQ(four->moved_slots, one->moved_slots);
}

}  // namespace
}  // namespace flexpert::eplb
