// SPDX-License-Identifier: Apache-2.0
// The port of DeepSeek's EPLB: the example of its README, its policies and its assertions.
#include "eplb/deepseek_eplb.h"

#include <gtest/gtest.h>

#include <set>

#include "eplb/planner.h"
#include "eplb_test_util.h"

namespace flexpert::eplb {
namespace {

TEST(DeepSeekEplbTest, ReadmeExample) {
  const std::vector<std::vector<double>> weight = {
      {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86},
      {20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27}};
  auto plan = deepseek_rebalance(weight, 16, 4, 2, 8);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_TRUE(plan->hierarchical);
  const std::vector<std::vector<int>> expected = {
      {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1},
      {7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1}};
  EXPECT_EQ(plan->phy2log, expected);
  for (size_t l = 0; l < weight.size(); ++l) {
    for (int e = 0; e < 12; ++e) {
      EXPECT_EQ(plan->logcnt[l][e], std::count(expected[l].begin(), expected[l].end(), e));
    }
  }
}

TEST(DeepSeekEplbTest, PoliciesAndReplicas) {
  const auto weight = testing::zipf_loads(4, 64, 1.0, 3);
  // 8 groups on 4 nodes: hierarchical; every group's replicas stay on one node.
  auto hier = deepseek_rebalance(weight, 128, 8, 4, 16);
  ASSERT_TRUE(hier.ok());
  EXPECT_TRUE(hier->hierarchical);
  for (const auto& row : hier->phy2log) {
    ASSERT_EQ(row.size(), 128u);
    std::vector<std::set<int>> nodes_of_group(8);
    for (int s = 0; s < 128; ++s) nodes_of_group[row[s] / 8].insert(s / 32);
    for (const auto& nodes : nodes_of_group) EXPECT_EQ(nodes.size(), 1u);
    for (int e = 0; e < 64; ++e) EXPECT_GE(std::count(row.begin(), row.end(), e), 1);
  }
  // 8 groups on 3 nodes: global.
  auto global = deepseek_rebalance(weight, 96, 8, 3, 12);
  ASSERT_TRUE(global.ok());
  EXPECT_FALSE(global->hierarchical);
  for (const auto& row : global->phy2log) {
    for (int e = 0; e < 64; ++e) EXPECT_GE(std::count(row.begin(), row.end(), e), 1);
  }
  // Deterministic.
  auto again = deepseek_rebalance(weight, 96, 8, 3, 12);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->phy2log, global->phy2log);
}

TEST(DeepSeekEplbTest, ErrorsWhereTheOriginalAsserts) {
  const std::vector<std::vector<double>> weight = {std::vector<double>(12, 1.0)};
  EXPECT_FALSE(deepseek_rebalance(weight, 15, 4, 2, 8).ok());  // replicas % gpus
  EXPECT_FALSE(deepseek_rebalance(weight, 8, 4, 2, 8).ok());   // fewer replicas than experts
  EXPECT_FALSE(deepseek_rebalance(weight, 18, 5, 5, 9).ok());  // 12 experts in 5 groups
  EXPECT_FALSE(deepseek_rebalance(weight, 14, 2, 2, 7).ok());  // 7 gpus on 2 nodes
  EXPECT_TRUE(deepseek_rebalance(weight, 14, 3, 2, 7).ok());   // 3 % 2: global, any gpus
}

}  // namespace
}  // namespace flexpert::eplb
