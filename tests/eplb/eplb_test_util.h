// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the EPLB tests: synthetic loads and the invariants every plan must keep.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "eplb/planner.h"

namespace flexpert::eplb::testing {

using Matrix = std::vector<std::vector<double>>;
using Placement = std::vector<std::vector<int>>;

// Zipf-like loads over the experts in a random order, as integer token counts.
inline Matrix zipf_loads(int num_layers, int num_experts, double exponent, uint64_t seed,
                         double tokens = 65536) {
  std::mt19937_64 rng(seed);
  Matrix load(num_layers, std::vector<double>(num_experts));
  for (auto& row : load) {
    std::vector<int> order(num_experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    double sum = 0;
    for (int k = 0; k < num_experts; ++k) sum += 1.0 / std::pow(k + 1.0, exponent);
    for (int k = 0; k < num_experts; ++k) {
      row[order[k]] = std::round(tokens / std::pow(k + 1.0, exponent) / sum);
    }
  }
  return load;
}

// Every load times exp(sigma * N(0, 1)), rounded to tokens.
inline Matrix drift(const Matrix& load, double sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Matrix out = load;
  for (auto& row : out) {
    for (double& w : row) w = std::round(w * std::exp(sigma * normal(rng)));
  }
  return out;
}

inline std::vector<int> iota_ranks(int n) {
  std::vector<int> r(n);
  std::iota(r.begin(), r.end(), 0);
  return r;
}

// The plan's guarantees: shape, replicas >= max(1, min_replicas) on members, no expert twice
// on a rank, nothing on non-members, with fill_slots no free member slot (unless the rank holds
// every expert it may hold), the reported balancedness and moves.
inline void expect_valid(const PlanInput& in, const PlanOutput& out) {
  const size_t num_slots = static_cast<size_t>(in.max_ranks) * in.slots_per_rank;
  ASSERT_EQ(out.placement.size(), in.load.size());
  ASSERT_EQ(out.balancedness.size(), in.load.size());
  ASSERT_EQ(out.used.size(), in.load.size());
  const std::set<int> members(in.ranks.begin(), in.ranks.end());
  const int m = std::max(1, in.min_replicas);
  for (size_t l = 0; l < out.placement.size(); ++l) {
    const auto& row = out.placement[l];
    ASSERT_EQ(row.size(), num_slots) << "layer " << l;
    std::vector<int> count(in.num_experts, 0);
    for (int r = 0; r < in.max_ranks; ++r) {
      std::set<int> seen;
      for (int k = 0; k < in.slots_per_rank; ++k) {
        const int e = row[static_cast<size_t>(r) * in.slots_per_rank + k];
        ASSERT_GE(e, -1);
        ASSERT_LT(e, in.num_experts);
        if (e < 0) continue;
        ASSERT_TRUE(members.count(r)) << "layer " << l << ": expert on non-member rank " << r;
        ASSERT_TRUE(seen.insert(e).second)
            << "layer " << l << ": expert " << e << " twice on rank " << r;
        ++count[e];
      }
    }
    for (int e = 0; e < in.num_experts; ++e) {
      ASSERT_GE(count[e], m) << "layer " << l << ": expert " << e;
    }
    EXPECT_DOUBLE_EQ(out.balancedness[l],
                     balancedness(in.load[l], row, in.ranks, in.slots_per_rank));
    const int group_size = in.num_experts / in.num_groups;
    const int ranks_per_host = static_cast<int>(in.ranks.size()) / in.num_hosts;
    std::vector<int> host_of_group(in.num_groups, -1);
    if (out.used[l] == Policy::kHierarchical) {
      // Every group on one host.
      for (size_t i = 0; i < in.ranks.size(); ++i) {
        for (int k = 0; k < in.slots_per_rank; ++k) {
          const int e = row[static_cast<size_t>(in.ranks[i]) * in.slots_per_rank + k];
          if (e < 0) continue;
          int& host = host_of_group[e / group_size];
          const int h = static_cast<int>(i) / ranks_per_host;
          ASSERT_TRUE(host < 0 || host == h) << "layer " << l << ": group split over hosts";
          host = h;
        }
      }
    } else {
      EXPECT_EQ(out.used[l], Policy::kGlobal);
    }
    for (size_t i = 0; in.fill_slots && !out.skipped && i < in.ranks.size(); ++i) {
      const int* slots = &row[static_cast<size_t>(in.ranks[i]) * in.slots_per_rank];
      const int held = static_cast<int>(
          std::count_if(slots, slots + in.slots_per_rank, [](int e) { return e >= 0; }));
      if (held == in.slots_per_rank) continue;
      int may_hold = in.num_experts;
      if (out.used[l] == Policy::kHierarchical) {
        may_hold =
            group_size * static_cast<int>(std::count(host_of_group.begin(), host_of_group.end(),
                                                     static_cast<int>(i) / ranks_per_host));
      }
      EXPECT_EQ(held, may_hold) << "layer " << l << ": free slot on member rank " << in.ranks[i];
    }
  }
  const int current_slots =
      in.current_slots_per_rank > 0 ? in.current_slots_per_rank : in.slots_per_rank;
  EXPECT_EQ(out.moved_slots, out.skipped ? 0
                                         : count_receives(in.current, current_slots, out.placement,
                                                          in.slots_per_rank));
}

inline double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

}  // namespace flexpert::eplb::testing
