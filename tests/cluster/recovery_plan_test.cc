// SPDX-License-Identifier: Apache-2.0
// plan_recovery on thousands of random placements and losses: every expert keeps a
// replica on the next members, nothing lands on a lost rank, what survivors hold
// stays unless evicted as a surplus replica, and "missing" is exactly the shortfall
// of slots (an independent count).
#include "cluster/recovery_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

namespace flexpert::cluster {
namespace {

struct Case {
  RecoveryInput input;
  std::vector<int> lost;
};

// A random placement over `members`: every expert once, then random replicas
// and free slots.
Case random_case(std::mt19937_64& rng) {
  Case c;
  RecoveryInput& in = c.input;
  const int max_ranks = 2 + static_cast<int>(rng() % 7);
  in.slots_per_rank = 1 + static_cast<int>(rng() % 6);
  const int S = in.slots_per_rank;
  std::vector<int> ranks(max_ranks);
  for (int r = 0; r < max_ranks; ++r) ranks[r] = r;
  std::shuffle(ranks.begin(), ranks.end(), rng);
  const int num_members = 1 + static_cast<int>(rng() % max_ranks);
  std::vector<int> members(ranks.begin(), ranks.begin() + num_members);
  in.num_experts = 1 + static_cast<int>(rng() % (num_members * S));
  const int num_layers = 1 + static_cast<int>(rng() % 4);
  for (int l = 0; l < num_layers; ++l) {
    std::vector<int> map(static_cast<size_t>(max_ranks * S), -1);
    std::vector<int> slots;
    for (int r : members) {
      for (int k = 0; k < S; ++k) slots.push_back(r * S + k);
    }
    std::shuffle(slots.begin(), slots.end(), rng);
    size_t i = 0;
    for (int e = 0; e < in.num_experts; ++e) map[slots[i++]] = e;
    for (; i < slots.size(); ++i) {
      if (rng() % 2) map[slots[i]] = static_cast<int>(rng() % in.num_experts);
    }
    in.maps.push_back(map);
    in.routed.push_back(l == 0 ? rng() % 4 != 0 : true);
    std::vector<double> load(in.num_experts);
    for (auto& x : load) x = static_cast<double>(rng() % 100);
    in.load.push_back(load);
  }
  // Lose 1..members ranks; some free ids become joiners.
  const int num_lost = 1 + static_cast<int>(rng() % num_members);
  c.lost.assign(members.begin(), members.begin() + num_lost);
  in.survivors.assign(members.begin() + num_lost, members.end());
  std::vector<int> free(ranks.begin() + num_members, ranks.end());
  free.insert(free.end(), c.lost.begin(), c.lost.end());  // Reused ids (new incarnations).
  const int num_joiners = static_cast<int>(rng() % (free.size() + 1));
  in.joiners.assign(free.begin(), free.begin() + num_joiners);
  std::sort(in.survivors.begin(), in.survivors.end());
  return c;
}

void check(const Case& c, const RecoveryPlan& plan, const std::string& where) {
  const RecoveryInput& in = c.input;
  const int S = in.slots_per_rank;
  auto alive = [&](int rank) {
    return std::count(in.survivors.begin(), in.survivors.end(), rank) +
               std::count(in.joiners.begin(), in.joiners.end(), rank) >
           0;
  };
  const int alive_slots = static_cast<int>(in.survivors.size() + in.joiners.size()) * S;
  // Independent: the shortfall is what the slots lack for one replica per expert
  // (in any routed layer; dense layers need nothing).
  const bool any_routed = std::count(in.routed.begin(), in.routed.end(), true) > 0;
  EXPECT_EQ(plan.missing_slots, any_routed ? std::max(0, in.num_experts - alive_slots) : 0)
      << where;
  ASSERT_EQ(plan.maps.size(), in.maps.size()) << where;
  std::set<std::pair<int, int>> loaded;
  for (const RecoveryLoad& ld : plan.loads) {
    EXPECT_TRUE(alive(ld.slot / S)) << where << " load onto a lost rank";
    EXPECT_EQ(plan.maps[ld.layer][ld.slot], ld.logical_expert) << where;
    EXPECT_TRUE(loaded.insert({ld.layer, ld.slot}).second) << where << " slot loaded twice";
  }
  for (size_t l = 0; l < in.maps.size(); ++l) {
    if (!in.routed[l]) {
      EXPECT_EQ(plan.maps[l], in.maps[l]) << where << " dense layer changed";
      continue;
    }
    std::vector<int> before(in.num_experts, 0), after(in.num_experts, 0);
    for (size_t s = 0; s < in.maps[l].size(); ++s) {
      const int rank = static_cast<int>(s) / S;
      const bool survivor = std::count(in.survivors.begin(), in.survivors.end(), rank) > 0;
      if (survivor && in.maps[l][s] >= 0) before[in.maps[l][s]] += 1;
      const int e = plan.maps[l][s];
      if (e < 0) continue;
      EXPECT_TRUE(alive(rank)) << where << " layer " << l << " slot " << s << " on a lost rank";
      after[e] += 1;
      if (!loaded.count({static_cast<int>(l), static_cast<int>(s)})) {
        // Not loaded: the survivor's own weights, untouched.
        EXPECT_TRUE(survivor) << where;
        EXPECT_EQ(e, in.maps[l][s]) << where;
      }
    }
    for (int e = 0; e < in.num_experts; ++e) {
      if (plan.ok()) {
        EXPECT_GE(after[e], 1) << where << " expert " << e << " has no replica";
      }
      // A load only for an expert no survivor held.
      const int loads_of_e =
          static_cast<int>(std::count_if(plan.loads.begin(), plan.loads.end(), [&](auto& ld) {
            return ld.layer == static_cast<int>(l) && ld.logical_expert == e;
          }));
      EXPECT_EQ(loads_of_e, before[e] == 0 && (plan.ok() || after[e] > 0) ? 1 : 0)
          << where << " expert " << e;
    }
  }
}

TEST(RecoveryPlanTest, RandomLossesKeepEveryExpert) {
  const uint64_t seed = std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  int fitted = 0, short_of_slots = 0;
  for (int i = 0; i < 5000; ++i) {
    const Case c = random_case(rng);
    const RecoveryPlan plan = plan_recovery(c.input);
    const std::string where = "seed " + std::to_string(seed) + " case " + std::to_string(i);
    check(c, plan, where);
    if (plan.ok()) {
      ++fitted;
      continue;
    }
    ++short_of_slots;
    // As many fresh ranks as ranks_for_slots() says make it fit.
    Case more = c;
    const int need = ranks_for_slots(plan.missing_slots, c.input.slots_per_rank);
    for (int r = 0; r < need; ++r) {
      more.input.joiners.push_back(
          static_cast<int>(c.input.maps[0].size()) / c.input.slots_per_rank + r);
      for (auto& map : more.input.maps) map.resize(map.size() + c.input.slots_per_rank, -1);
    }
    const RecoveryPlan again = plan_recovery(more.input);
    EXPECT_TRUE(again.ok()) << where;
    check(more, again, where + " with joiners");
  }
  EXPECT_GT(fitted, 100);
  EXPECT_GT(short_of_slots, 100);
}

TEST(RecoveryPlanTest, JoinersFirstThenFreeSlotsThenHotReplicas) {
  // 2 ranks x 3 slots; rank 1 lost. Layer: rank 0 holds 0, 1, 1 (expert 1 twice);
  // rank 1 held 2 and 3.
  RecoveryInput in;
  in.num_experts = 4;
  in.slots_per_rank = 3;
  in.maps = {{0, 1, 1, 2, 3, -1}};
  in.routed = {true};
  in.survivors = {0};
  RecoveryPlan plan = plan_recovery(in);
  EXPECT_EQ(plan.missing_slots, 1);  // 3 slots, 4 experts.
  in.maps = {{0, 1, -1, 2, 3, -1, -1, -1, -1}};
  in.survivors = {0};
  in.joiners = {2};
  plan = plan_recovery(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan.maps[0], (std::vector<int>{0, 1, -1, -1, -1, -1, 2, 3, -1}));
  EXPECT_EQ(plan.evicted, 0);
  // No joiner: the free slot first, then the surplus replica of expert 1.
  in.maps = {{1, 1, -1, 2, 0, -1}};
  in.joiners = {};
  in.num_experts = 3;
  plan = plan_recovery(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan.evicted, 1);
  EXPECT_EQ(plan.maps[0], (std::vector<int>{1, 2, 0, -1, -1, -1}));
  EXPECT_EQ(plan.loads.size(), 2u);
}

}  // namespace
}  // namespace flexpert::cluster
