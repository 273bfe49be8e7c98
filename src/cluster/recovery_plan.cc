// SPDX-License-Identifier: Apache-2.0
#include "cluster/recovery_plan.h"

#include <algorithm>

namespace flexpert::cluster {
namespace {

// Free slots of `ranks`, one slot of each rank in turn (spreads the loads).
std::vector<int> free_slots_interleaved(const std::vector<int>& map, const std::vector<int>& ranks,
                                        int slots_per_rank) {
  std::vector<int> out;
  for (int k = 0; k < slots_per_rank; ++k) {
    for (int r : ranks) {
      const int s = r * slots_per_rank + k;
      if (s >= 0 && s < static_cast<int>(map.size()) && map[s] < 0) out.push_back(s);
    }
  }
  return out;
}

}  // namespace

int ranks_for_slots(int missing_slots, int slots_per_rank) {
  if (missing_slots <= 0 || slots_per_rank <= 0) return 0;
  return (missing_slots + slots_per_rank - 1) / slots_per_rank;
}

RecoveryPlan plan_recovery(const RecoveryInput& in) {
  RecoveryPlan plan;
  const int S = in.slots_per_rank;
  auto is_in = [](const std::vector<int>& v, int r) {
    return std::find(v.begin(), v.end(), r) != v.end();
  };
  for (size_t l = 0; l < in.maps.size(); ++l) {
    std::vector<int> map = in.maps[l];
    const bool routed = l < in.routed.size() && in.routed[l];
    if (!routed || S <= 0) {
      plan.maps.push_back(std::move(map));
      continue;
    }
    // Only survivors keep what they hold; joiners start empty.
    for (int s = 0; s < static_cast<int>(map.size()); ++s) {
      if (!is_in(in.survivors, s / S)) map[s] = -1;
    }
    std::vector<int> count(static_cast<size_t>(in.num_experts), 0);
    for (int e : map) {
      if (e >= 0 && e < in.num_experts) count[e] += 1;
    }
    std::vector<int> free = free_slots_interleaved(map, in.joiners, S);
    for (int s : free_slots_interleaved(map, in.survivors, S)) free.push_back(s);
    size_t next_free = 0;
    auto load_of = [&](int e) {
      return l < in.load.size() && e < static_cast<int>(in.load[l].size()) ? in.load[l][e] : 0.0;
    };
    int missing = 0;
    for (int e = 0; e < in.num_experts; ++e) {
      if (count[e] > 0) continue;
      int slot = next_free < free.size() ? free[next_free++] : -1;
      if (slot < 0) {
        // Evict a surplus replica: most replicas first, then least load per replica.
        int victim = -1;
        for (int x = 0; x < in.num_experts; ++x) {
          if (count[x] < 2) continue;
          if (victim < 0 || count[x] > count[victim] ||
              (count[x] == count[victim] &&
               load_of(x) / count[x] < load_of(victim) / count[victim])) {
            victim = x;
          }
        }
        for (int s = static_cast<int>(map.size()) - 1; victim >= 0 && s >= 0; --s) {
          if (map[s] == victim) {
            slot = s;
            break;
          }
        }
        if (slot < 0) {
          ++missing;
          continue;
        }
        count[victim] -= 1;
        ++plan.evicted;
      }
      map[slot] = e;
      count[e] = 1;
      plan.loads.push_back({static_cast<int>(l), slot, e});
    }
    plan.missing_slots = std::max(plan.missing_slots, missing);
    plan.maps.push_back(std::move(map));
  }
  return plan;
}

}  // namespace flexpert::cluster
