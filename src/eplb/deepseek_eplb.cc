// SPDX-License-Identifier: Apache-2.0
#include "eplb/deepseek_eplb.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace flexpert::eplb {
namespace {

struct Packing {
  std::vector<int> pack;  // item -> pack
  std::vector<int> rank;  // item -> position inside its pack
};

// n items into num_packs packs of exactly n / num_packs items: heaviest first, each into the
// lightest pack that still has room (first on ties).
Packing balanced_packing(const std::vector<float>& weight, int num_packs) {
  const int n = static_cast<int>(weight.size());
  const int per_pack = n / num_packs;
  Packing p{std::vector<int>(n), std::vector<int>(n, 0)};
  if (per_pack == 1) {
    std::iota(p.pack.begin(), p.pack.end(), 0);
    return p;
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return weight[a] > weight[b]; });
  std::vector<float> pack_weight(num_packs, 0.0f);
  std::vector<int> pack_items(num_packs, 0);
  for (int item : order) {
    int best = -1;
    for (int k = 0; k < num_packs; ++k) {
      if (pack_items[k] < per_pack && (best < 0 || pack_weight[k] < pack_weight[best])) best = k;
    }
    p.pack[item] = best;
    p.rank[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
  }
  return p;
}

struct Replication {
  std::vector<int> phy2log;  // physical -> logical
  std::vector<int> logcnt;   // logical -> replicas
};

// num_phy physical experts from the logical ones: one each, then each extra one to the
// logical expert with the highest weight per replica (first on ties).
Replication replicate_experts(const std::vector<float>& weight, int num_phy) {
  const int num_log = static_cast<int>(weight.size());
  Replication r{std::vector<int>(num_phy), std::vector<int>(num_log, 1)};
  std::iota(r.phy2log.begin(), r.phy2log.begin() + num_log, 0);
  for (int i = num_log; i < num_phy; ++i) {
    int best = 0;
    float best_value = weight[0] / static_cast<float>(r.logcnt[0]);
    for (int j = 1; j < num_log; ++j) {
      const float v = weight[j] / static_cast<float>(r.logcnt[j]);
      if (v > best_value) best_value = v, best = j;
    }
    r.phy2log[i] = best;
    ++r.logcnt[best];
  }
  return r;
}

std::vector<int> inverse(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int>(i);
  return inv;
}

// One layer of rebalance_experts_hierarchical; returns phy2log.
std::vector<int> rebalance_layer(const std::vector<double>& weight64, int num_phy, int num_groups,
                                 int num_nodes, int num_gpus) {
  const int num_log = static_cast<int>(weight64.size());
  const std::vector<float> weight(weight64.begin(), weight64.end());
  const int group_size = num_log / num_groups;
  const int groups_per_node = num_groups / num_nodes;
  const int phy_per_gpu = num_phy / num_gpus;
  const int log_per_node = num_log / num_nodes;
  const int phy_per_node = num_phy / num_nodes;

  // Step 1: groups onto nodes.
  std::vector<float> group_weight(num_groups, 0.0f);
  for (int e = 0; e < num_log; ++e) group_weight[e / group_size] += weight[e];
  const Packing groups = balanced_packing(group_weight, num_nodes);
  std::vector<int> log2mlog(num_log);
  for (int e = 0; e < num_log; ++e) {
    const int g = e / group_size;
    log2mlog[e] = (groups.pack[g] * groups_per_node + groups.rank[g]) * group_size + e % group_size;
  }
  const std::vector<int> mlog2log = inverse(log2mlog);

  std::vector<int> phy2log(num_phy);
  for (int node = 0; node < num_nodes; ++node) {
    // Step 2: replicas within the node.
    std::vector<float> node_weight(log_per_node);
    for (int j = 0; j < log_per_node; ++j)
      node_weight[j] = weight[mlog2log[node * log_per_node + j]];
    const Replication rep = replicate_experts(node_weight, phy_per_node);
    // Step 3: the node's replicas onto its GPUs.
    std::vector<float> phy_weight(phy_per_node);
    for (int j = 0; j < phy_per_node; ++j) {
      const int mlog = rep.phy2log[j];
      phy_weight[j] = node_weight[mlog] / static_cast<float>(rep.logcnt[mlog]);
    }
    const Packing gpus = balanced_packing(phy_weight, num_gpus / num_nodes);
    std::vector<int> phy2pphy(phy_per_node);
    for (int j = 0; j < phy_per_node; ++j) phy2pphy[j] = gpus.pack[j] * phy_per_gpu + gpus.rank[j];
    const std::vector<int> pphy2phy = inverse(phy2pphy);
    for (int pp = 0; pp < phy_per_node; ++pp) {
      const int mlog = rep.phy2log[pphy2phy[pp]] + node * log_per_node;
      phy2log[node * phy_per_node + pp] = mlog2log[mlog];
    }
  }
  return phy2log;
}

}  // namespace

Result<DeepSeekPlan> deepseek_rebalance(const std::vector<std::vector<double>>& weight,
                                        int num_replicas, int num_groups, int num_nodes,
                                        int num_gpus) {
  if (num_groups < 1 || num_nodes < 1 || num_gpus < 1) {
    return invalid_argument("num_groups, num_nodes and num_gpus must be >= 1");
  }
  if (num_replicas % num_gpus != 0) {
    return invalid_argument("num_replicas must be a multiple of num_gpus");
  }
  DeepSeekPlan plan;
  plan.hierarchical = num_groups % num_nodes == 0;
  if (!plan.hierarchical) num_groups = num_nodes = 1;  // the global policy
  for (size_t l = 0; l < weight.size(); ++l) {
    const int num_log = static_cast<int>(weight[l].size());
    if (num_log < 1 || (l > 0 && weight[l].size() != weight[0].size())) {
      return invalid_argument("every layer needs the same, non-zero number of experts");
    }
    if (num_replicas < num_log) {
      return invalid_argument("num_replicas " + std::to_string(num_replicas) + " < " +
                              std::to_string(num_log) + " logical experts");
    }
    if (num_log % num_groups != 0) {
      return invalid_argument("hierarchical: experts not a multiple of num_groups");
    }
    if (num_gpus % num_nodes != 0) {
      return invalid_argument("hierarchical: num_gpus not a multiple of num_nodes");
    }
    plan.phy2log.push_back(
        rebalance_layer(weight[l], num_replicas, num_groups, num_nodes, num_gpus));
    std::vector<int> cnt(num_log, 0);
    for (int e : plan.phy2log.back()) ++cnt[e];
    plan.logcnt.push_back(std::move(cnt));
  }
  return plan;
}

}  // namespace flexpert::eplb
