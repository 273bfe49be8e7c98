// SPDX-License-Identifier: Apache-2.0
// Internal to the planner: plans one layer on member indices (0 .. members - 1), as sets of
// experts per member rank; planner.cc turns those into slots.
#pragma once

#include <vector>

#include "eplb/planner.h"

namespace flexpert::eplb::detail {

struct LayerShape {
  int num_experts = 0;
  int slots_per_rank = 0;
  int num_ranks = 0;  // members
  int num_hosts = 1;
  int num_groups = 1;
  int min_replicas = 1;
  double tolerance = 0;
  bool hierarchical_applicable = false;
  bool fill_slots = false;           // PlanInput::fill_slots
  bool greedy_after_change = false;  // PlanInput::greedy_after_change
};

struct LayerResult {
  std::vector<std::vector<int>> rank_sets;  // [member] experts, ascending
  Policy used = Policy::kGlobal;
};

// `current` holds the distinct experts of each member rank (ascending); all empty when the
// layer has no placement yet. `requested` kHierarchical needs shape.hierarchical_applicable.
LayerResult plan_layer(const LayerShape& shape, Policy requested, const std::vector<double>& load,
                       const std::vector<std::vector<int>>& current);

// `fresh` ([member rank] -> experts) with its ranks renumbered to share as many experts with
// `current` as a greedy maximum-overlap matching finds; blocks of ranks_per_block ranks (hosts,
// for hierarchical plans) are matched first and stay whole.
std::vector<std::vector<int>> relabel(const LayerShape& shape,
                                      const std::vector<std::vector<int>>& fresh,
                                      const std::vector<std::vector<int>>& current,
                                      int ranks_per_block);

// Slots that receive an expert: sum over ranks of |next[r] \ current[r]| (sets ascending).
int64_t set_moves(const std::vector<std::vector<int>>& current,
                  const std::vector<std::vector<int>>& next);

}  // namespace flexpert::eplb::detail
