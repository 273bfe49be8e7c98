// SPDX-License-Identifier: Apache-2.0
// DeepSeek's open expert-parallel load balancer (deepseek-ai/EPLB, eplb.py), re-implemented in
// C++ from its algorithm as the baseline flexpert's planner is measured against. Same steps and
// output: greedy replication (next replica to the highest load per replica), balanced packing
// with exactly n/m items per pack, hierarchical (groups to nodes, replicas within nodes, then
// GPUs) when num_groups % num_nodes == 0, global otherwise. Like the original it ignores any
// previous placement and may put two replicas of one expert on the same GPU.
//
// Pure and deterministic; float32 arithmetic like the original. Ties go to the lowest index
// (PyTorch's sort is not guaranteed stable, so exact ties may be ordered differently there).
#pragma once

#include <vector>

#include "flexpert/status.h"

namespace flexpert::eplb {

struct DeepSeekPlan {
  std::vector<std::vector<int>> phy2log;  // [layer][num_replicas]: physical slot -> expert
  std::vector<std::vector<int>> logcnt;   // [layer][expert]: replicas per logical expert
  bool hierarchical = false;              // which policy ran
};

// weight: [layers][logical experts]. Slot s lives on GPU s / (num_replicas / num_gpus).
// InvalidArgument where the original asserts (num_replicas % num_gpus, num_replicas >=
// experts, and for the hierarchical policy num_experts % num_groups and num_gpus % num_nodes).
Result<DeepSeekPlan> deepseek_rebalance(const std::vector<std::vector<double>>& weight,
                                        int num_replicas, int num_groups, int num_nodes,
                                        int num_gpus);

}  // namespace flexpert::eplb
