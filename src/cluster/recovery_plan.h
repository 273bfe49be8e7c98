// SPDX-License-Identifier: Apache-2.0
// Where the experts of lost ranks go: a pure function over slot maps, no sockets,
// no processes (docs/ARCHITECTURE.md, "Membership, epochs, failure").
//
// Input: the committed slot maps (logical expert per physical slot, -1 free), the
// slots of each rank (rank r owns slots [r * S, (r + 1) * S)), the surviving
// members and the fresh joiners (replacements whose slots are all free). Output:
// the maps of the next epoch (slots of ranks that are neither survivors nor
// joiners freed) and the loads that fill them. An expert that keeps a replica on a
// survivor needs nothing; one that lost every replica is loaded (from the
// checkpoint) into, in order of preference: a joiner's free slot, a survivor's
// free slot, a survivor's slot holding a surplus replica (the expert with the most
// replicas is evicted first; ties: the least load per replica). Joiners are spread
// round-robin so that no joiner gets more than its share.
//
// When the slots cannot hold every expert, `missing_slots` says how many more
// free slots the worst layer needs; the caller then adds joiners (replacement
// ranks) and plans again. Thread-compatible; deterministic.
#pragma once

#include <vector>

namespace flexpert::cluster {

struct RecoveryLoad {
  int layer = 0;
  int slot = 0;  // Global slot index: the rank is slot / slots_per_rank.
  int logical_expert = 0;
};

struct RecoveryInput {
  std::vector<std::vector<int>> maps;  // [layer][slot] -> logical expert or -1.
  int num_experts = 0;
  int slots_per_rank = 0;
  std::vector<bool> routed;  // [layer]: MoE layers; others (dense) keep their map.
  std::vector<int> survivors;
  std::vector<int> joiners;
  // Optional [layer][logical expert] load; picks which surplus replica is evicted.
  std::vector<std::vector<double>> load;
};

struct RecoveryPlan {
  std::vector<std::vector<int>> maps;  // Next epoch's maps (when missing_slots == 0).
  std::vector<RecoveryLoad> loads;     // Slots to fill before the maps commit.
  int evicted = 0;                     // Surplus replicas overwritten.
  int missing_slots = 0;               // > 0: not enough room; maps and loads are partial.
  bool ok() const { return missing_slots == 0; }
};

RecoveryPlan plan_recovery(const RecoveryInput& input);

// How many ranks of slots_per_rank slots hold `missing_slots` (0 when none are missing).
int ranks_for_slots(int missing_slots, int slots_per_rank);

}  // namespace flexpert::cluster
