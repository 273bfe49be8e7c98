// SPDX-License-Identifier: Apache-2.0
// The placement planner: valid plans on random inputs, determinism, zero moves on unchanged
// loads, few moves under drift, balance against the DeepSeek port, uneven rank counts, policy
// selection, membership changes and input errors.
#include "eplb/planner.h"

#include <gtest/gtest.h>

#include <functional>

#include "eplb/deepseek_eplb.h"
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

PlanInput basic_input(int num_experts, int num_ranks, int slots_per_rank, const Matrix& load) {
  PlanInput in;
  in.num_experts = num_experts;
  in.slots_per_rank = slots_per_rank;
  in.ranks = iota_ranks(num_ranks);
  in.max_ranks = num_ranks;
  in.load = load;
  return in;
}

// A random, valid input: shapes, members (a random subset of max_ranks), hosts and groups,
// loads of several kinds (zeros and ties included), and a current placement that may be
// empty, garbage (duplicates on a rank, experts on non-members), or the output of a plan.
PlanInput random_input(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return lo + static_cast<int>(rng() % (hi - lo + 1)); };
  PlanInput in;
  in.num_groups = pick(1, 4);
  in.num_experts = in.num_groups * pick(1, 12);
  in.max_ranks = pick(1, 20);
  for (int r = 0; r < in.max_ranks; ++r) {
    if (rng() % 4 != 0) in.ranks.push_back(r);
  }
  if (in.ranks.empty()) in.ranks.push_back(static_cast<int>(rng() % in.max_ranks));
  const int members = static_cast<int>(in.ranks.size());
  in.min_replicas = std::min(members, pick(1, 3));
  const int need = (in.num_experts * in.min_replicas + members - 1) / members;
  in.slots_per_rank = need + pick(0, 3);
  in.num_hosts = members % 2 == 0 && rng() % 2 ? 2 : 1;
  const int num_layers = pick(1, 3);
  const int kind = pick(0, 3);
  for (int l = 0; l < num_layers; ++l) {
    std::vector<double> row(in.num_experts);
    for (double& w : row) {
      switch (kind) {
        case 0:
          w = static_cast<double>(rng() % 1000);
          break;
        case 1:
          w = rng() % 3 == 0 ? 0.0 : 100.0;  // ties
          break;
        case 2:
          w = 0.0;
          break;
        default:
          w = std::pow(static_cast<double>(rng() % 1000) / 1000.0, 8) * 1e6;  // skewed
      }
    }
    in.load.push_back(row);
  }
  if (rng() % 3 != 0) {
    in.current.assign(num_layers,
                      std::vector<int>(static_cast<size_t>(in.max_ranks) * in.slots_per_rank));
    for (auto& row : in.current) {
      for (int& e : row) e = static_cast<int>(rng() % (in.num_experts + 1)) - 1;
    }
  }
  const Policy policies[] = {Policy::kAuto, Policy::kGlobal, Policy::kAuto};
  in.policy = policies[rng() % 3];
  in.fill_slots = rng() % 2 == 0 && !getenv("NOFILL");
  if (!in.current.empty() && rng() % 3 == 0) {
    // A membership change that changed the slots per rank: more or fewer than now.
    in.current_slots_per_rank = std::max(1, in.slots_per_rank + pick(-2, 3));
    for (auto& row : in.current) {
      row.resize(static_cast<size_t>(in.max_ranks) * in.current_slots_per_rank);
      for (int& e : row) e = static_cast<int>(rng() % (in.num_experts + 1)) - 1;
    }
  }
  return in;
}

TEST(PlannerTest, RandomInputsGiveValidDeterministicPlans) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const PlanInput in = random_input(rng);
    auto out = plan(in);
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    expect_valid(in, *out);
    if (::testing::Test::HasFatalFailure()) return;
    auto again = plan(in);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->placement, out->placement);
    EXPECT_EQ(again->moved_slots, out->moved_slots);
  }
}

// With greedy_after_change, a plan after a membership change stops at the greedy packing's
// balance and the plan after it balances the rest: the fixed point comes one plan later.
TEST(PlannerTest, UnchangedLoadsGiveZeroMoves) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    PlanInput in = random_input(rng);
    in.greedy_after_change = trial % 2 == 0;
    auto first = plan(in);
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    in.current = first->placement;
    in.current_slots_per_rank = 0;
    if (in.greedy_after_change) {
      first = plan(in);
      ASSERT_TRUE(first.ok()) << first.status().to_string();
      in.current = first->placement;
    }
    auto second = plan(in);
    ASSERT_TRUE(second.ok());
    EXPECT_EQ(second->moved_slots, 0);
    EXPECT_EQ(second->placement, first->placement);
    expect_valid(in, *second);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(PlannerTest, UnchangedLoadsGiveZeroMovesAtDeepSeekShapes) {
  for (int num_ranks : {32, 64, 144, 256}) {
    for (int spare : {1, 3}) {
      SCOPED_TRACE(std::to_string(num_ranks) + " ranks, " + std::to_string(spare) + " spare");
      const int slots = (256 + num_ranks - 1) / num_ranks + spare;
      PlanInput in = basic_input(256, num_ranks, slots, zipf_loads(4, 256, 1.0, num_ranks));
      in.num_hosts = num_ranks / 8;
      in.num_groups = 8;
      // The previous plan came from other loads: the first plan repairs it.
      auto previous = plan(basic_input(256, num_ranks, slots, zipf_loads(4, 256, 1.0, 99)));
      ASSERT_TRUE(previous.ok());
      in.current = previous->placement;
      auto first = plan(in);
      ASSERT_TRUE(first.ok());
      in.current = first->placement;
      auto second = plan(in);
      ASSERT_TRUE(second.ok());
      EXPECT_EQ(second->moved_slots, 0);
      EXPECT_EQ(second->placement, first->placement);
    }
  }
}

TEST(PlannerTest, SmallDriftMovesFewExperts) {
  const int num_ranks = 64, slots = 6;
  const Matrix load = zipf_loads(8, 256, 1.0, 3);
  PlanInput in = basic_input(256, num_ranks, slots, load);
  auto first = plan(in);
  ASSERT_TRUE(first.ok());
  auto ds_first = deepseek_rebalance(load, num_ranks * slots, 8, 8, num_ranks);
  ASSERT_TRUE(ds_first.ok());
  const int64_t total = static_cast<int64_t>(load.size()) * num_ranks * slots;
  // Loads multiplied by exp(sigma N(0,1)): the rank loads drift by about sigma / 2.
  for (auto [sigma, max_share] : {std::pair{0.01, 0.10}, std::pair{0.03, 0.20}}) {
    SCOPED_TRACE("sigma " + std::to_string(sigma));
    in.current = first->placement;
    in.load = drift(load, sigma, 4);
    auto second = plan(in);
    ASSERT_TRUE(second.ok());
    expect_valid(in, *second);
    EXPECT_LT(second->moved_slots, max_share * total) << second->moved_slots << " of " << total;
    EXPECT_GE(mean(second->balancedness), 0.99);
    // DeepSeek's balancer plans from nothing: most slots change.
    auto ds_second = deepseek_rebalance(in.load, num_ranks * slots, 8, 8, num_ranks);
    ASSERT_TRUE(ds_second.ok());
    EXPECT_LT(second->moved_slots * 4, count_moves(ds_first->phy2log, ds_second->phy2log));
  }
}

TEST(PlannerTest, BalanceAtLeastDeepSeeksOnZipfLoads) {
  struct Shape {
    int ranks, slots, hosts;
  };
  for (Shape s : {Shape{8, 33, 1}, Shape{32, 9, 4}, Shape{64, 5, 8}, Shape{144, 3, 18},
                  Shape{256, 2, 32}, Shape{256, 4, 32}}) {
    for (double exponent : {0.6, 1.0, 1.3}) {
      SCOPED_TRACE(std::to_string(s.ranks) + "x" + std::to_string(s.slots) + " zipf " +
                   std::to_string(exponent));
      const Matrix load = zipf_loads(6, 256, exponent, s.ranks * 7 + s.slots);
      PlanInput in = basic_input(256, s.ranks, s.slots, load);
      in.num_hosts = s.hosts;
      in.num_groups = 8;
      auto ours = plan(in);
      ASSERT_TRUE(ours.ok());
      auto ds = deepseek_rebalance(load, s.ranks * s.slots, 8, s.hosts, s.ranks);
      ASSERT_TRUE(ds.ok());
      std::vector<double> ds_balance;
      for (size_t l = 0; l < load.size(); ++l) {
        ds_balance.push_back(balancedness(load[l], ds->phy2log[l], in.ranks, s.slots));
      }
      EXPECT_GE(mean(ours->balancedness), mean(ds_balance));
      // And after replanning on drifted loads, from its own previous plan.
      in.current = ours->placement;
      in.load = drift(load, 0.15, 5);
      auto replanned = plan(in);
      ASSERT_TRUE(replanned.ok());
      auto ds2 = deepseek_rebalance(in.load, s.ranks * s.slots, 8, s.hosts, s.ranks);
      ASSERT_TRUE(ds2.ok());
      std::vector<double> ds2_balance;
      for (size_t l = 0; l < load.size(); ++l) {
        ds2_balance.push_back(balancedness(in.load[l], ds2->phy2log[l], in.ranks, s.slots));
      }
      // A replan stops within `tolerance` of the best plan it knows: it keeps moves down.
      EXPECT_GE(mean(replanned->balancedness), mean(ds2_balance) * (1 - in.tolerance));
      EXPECT_LE(replanned->moved_slots, count_moves(ds->phy2log, ds2->phy2log) / 2);
    }
  }
}

TEST(PlannerTest, RankCountsThatDoNotDivideTheExperts) {
  // 16 experts on 3 ranks (6 slots: 2 spare) and on 5 ranks (4 slots: 4 spare): every expert
  // placed, the spare slots go to the hottest experts.
  for (auto [ranks, slots] : {std::pair{3, 6}, std::pair{5, 4}, std::pair{7, 3}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    Matrix load = {std::vector<double>(16, 10.0)};
    load[0][3] = 500;  // hot
    PlanInput in = basic_input(16, ranks, slots, load);
    auto out = plan(in);
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    expect_valid(in, *out);
    const auto& row = out->placement[0];
    EXPECT_EQ(std::count(row.begin(), row.end(), 3), std::min(ranks, ranks * slots - 15));
    EXPECT_EQ(std::count(row.begin(), row.end(), -1), 0);
  }
}

TEST(PlannerTest, HotExpertsGetReplicasOnDistinctRanks) {
  Matrix load = {std::vector<double>(8, 1.0)};
  load[0][5] = 1000;
  PlanInput in = basic_input(8, 4, 4, load);  // 16 slots for 8 experts
  auto out = plan(in);
  ASSERT_TRUE(out.ok());
  expect_valid(in, *out);
  const auto& row = out->placement[0];
  EXPECT_EQ(std::count(row.begin(), row.end(), 5), 4);  // one per rank, no more
}

TEST(PlannerTest, MinReplicas) {
  PlanInput in = basic_input(12, 4, 8, zipf_loads(2, 12, 1.2, 1));
  in.min_replicas = 2;
  auto out = plan(in);
  ASSERT_TRUE(out.ok());
  expect_valid(in, *out);
  in.min_replicas = 5;  // more than members
  auto too_many = plan(in);
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("min_replicas"), std::string::npos);
}

TEST(PlannerTest, StayingExpertsKeepTheirSlots) {
  PlanInput in = basic_input(64, 16, 6, zipf_loads(4, 64, 1.0, 21));
  auto first = plan(in);
  ASSERT_TRUE(first.ok());
  in.current = first->placement;
  in.load = drift(in.load, 0.3, 22);
  auto second = plan(in);
  ASSERT_TRUE(second.ok());
  expect_valid(in, *second);
  EXPECT_GT(second->moved_slots, 0);
  for (size_t l = 0; l < in.load.size(); ++l) {
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 6; ++k) {
        const int e = in.current[l][r * 6 + k];
        if (e < 0) continue;
        const auto begin = second->placement[l].begin() + r * 6;
        const auto it = std::find(begin, begin + 6, e);
        if (it != begin + 6) {
          EXPECT_EQ(it - begin, k) << "layer " << l << " rank " << r << " expert " << e;
        }
      }
    }
  }
}

TEST(PlannerTest, HierarchicalWhenItBalancesAsWell) {
  // 4 groups of 8 equally loaded experts on 2 hosts: keeping groups on hosts costs nothing.
  PlanInput in = basic_input(32, 8, 6, {std::vector<double>(32, 100.0)});
  in.num_hosts = 2;
  in.num_groups = 4;
  auto out = plan(in);
  ASSERT_TRUE(out.ok());
  expect_valid(in, *out);
  EXPECT_EQ(out->used[0], Policy::kHierarchical);
  EXPECT_DOUBLE_EQ(out->balancedness[0], 1.0);
}

TEST(PlannerTest, GlobalWhenOneGroupIsHot) {
  // Group 0 carries most of the load: on one host it cannot be balanced.
  std::vector<double> row(32, 10.0);
  for (int e = 0; e < 8; ++e) row[e] = 1000;
  PlanInput in = basic_input(32, 8, 6, {row});
  in.num_hosts = 4;
  in.num_groups = 4;
  auto out = plan(in);
  ASSERT_TRUE(out.ok());
  expect_valid(in, *out);
  EXPECT_EQ(out->used[0], Policy::kGlobal);
  in.policy = Policy::kHierarchical;  // forced: valid, but worse
  auto forced = plan(in);
  ASSERT_TRUE(forced.ok());
  expect_valid(in, *forced);
  EXPECT_EQ(forced->used[0], Policy::kHierarchical);
  EXPECT_LT(forced->balancedness[0], out->balancedness[0]);
}

TEST(PlannerTest, HierarchicalNotApplicable) {
  PlanInput in = basic_input(30, 6, 6, {std::vector<double>(30, 1.0)});
  in.num_hosts = 2;
  in.num_groups = 3;  // 3 groups on 2 hosts
  auto out = plan(in);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->used[0], Policy::kGlobal);
  in.policy = Policy::kHierarchical;
  auto forced = plan(in);
  ASSERT_FALSE(forced.ok());
  EXPECT_EQ(forced.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(forced.status().message().find("num_groups is not a multiple of num_hosts"),
            std::string::npos);
}

TEST(PlannerTest, MembersLeaveAndJoin) {
  // A plan on ranks 0..7 of 10; rank 3 leaves, then ranks 8 and 9 join.
  const Matrix load = zipf_loads(3, 40, 1.0, 5);
  PlanInput in = basic_input(40, 8, 6, load);
  in.max_ranks = 10;
  auto first = plan(in);
  ASSERT_TRUE(first.ok());
  expect_valid(in, *first);

  in.current = first->placement;
  in.ranks = {0, 1, 2, 4, 5, 6, 7};
  auto shrunk = plan(in);
  ASSERT_TRUE(shrunk.ok()) << shrunk.status().to_string();
  expect_valid(in, *shrunk);
  // Only the lost rank's experts need new homes: far fewer moves than slots.
  EXPECT_LT(shrunk->moved_slots, static_cast<int64_t>(3 * 7 * 6) / 2);

  in.current = shrunk->placement;
  in.ranks = {0, 1, 2, 4, 5, 6, 7, 8, 9};
  auto grown = plan(in);
  ASSERT_TRUE(grown.ok());
  expect_valid(in, *grown);
  for (size_t l = 0; l < load.size(); ++l) {
    // The joiners carry load.
    const auto& row = grown->placement[l];
    EXPECT_GT(std::count_if(row.begin() + 8 * 6, row.end(), [](int e) { return e >= 0; }), 0);
  }
}

TEST(PlannerTest, InputErrors) {
  const Matrix load = {std::vector<double>(8, 1.0)};
  struct Case {
    const char* what;
    std::function<void(PlanInput&)> edit;
  };
  const std::vector<Case> cases = {
      {"slots", [](PlanInput& in) { in.slots_per_rank = 1; }},  // 8 experts, 4 slots
      {"ascending",
       [](PlanInput& in) {
         in.ranks = {1, 0};
       }},
      {"outside",
       [](PlanInput& in) {
         in.ranks = {0, 9};
       }},
      {"experts, expected", [](PlanInput& in) { in.load[0].pop_back(); }},
      {"finite", [](PlanInput& in) { in.load[0][2] = -1; }},
      {"layers",
       [](PlanInput& in) {
         in.current = {{}, {}};
       }},
      {"max_ranks x current_slots_per_rank",
       [](PlanInput& in) {
         in.current = {{0, 1}};
       }},
      {"holds expert 8",
       [](PlanInput& in) { in.current = {std::vector<int>(16, -1)}, in.current[0][3] = 8; }},
      {"num_experts", [](PlanInput& in) { in.num_experts = 0; }},
      {"tolerance", [](PlanInput& in) { in.tolerance = -1; }},
      {"min_gain", [](PlanInput& in) { in.min_gain = -0.1; }},
      {"num_threads", [](PlanInput& in) { in.num_threads = -1; }},
      {"current_slots_per_rank must", [](PlanInput& in) { in.current_slots_per_rank = -1; }},
  };
  for (const Case& c : cases) {
    PlanInput in = basic_input(8, 4, 4, load);
    in.ranks = {0, 1};
    c.edit(in);
    auto out = plan(in);
    ASSERT_FALSE(out.ok()) << c.what;
    EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(out.status().message().find(c.what), std::string::npos)
        << c.what << ": " << out.status().message();
  }
}

TEST(PlannerTest, HelpersAndPolicyNames) {
  // Rank 0 holds experts 0 and 1, rank 1 holds 1: expert 1's load is split.
  EXPECT_DOUBLE_EQ(balancedness({4, 2}, {0, 1, 1, -1}, {0, 1}, 2), (5.0 + 1.0) / 2 / 5.0);
  EXPECT_DOUBLE_EQ(balancedness({0, 0}, {0, 1}, {0, 1}, 1), 1.0);
  EXPECT_EQ(count_moves(std::vector<int>{0, 1, -1, 2}, std::vector<int>{0, 2, 3, -1}), 2);
  EXPECT_EQ(count_moves(std::vector<int>{}, std::vector<int>{0, -1, 1}), 2);
  for (Policy p : {Policy::kAuto, Policy::kGlobal, Policy::kHierarchical}) {
    auto parsed = parse_policy(policy_name(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_FALSE(parse_policy("greedy").ok());
}

}  // namespace
}  // namespace flexpert::eplb
