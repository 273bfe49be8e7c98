// SPDX-License-Identifier: Apache-2.0
// ExpertPlacement: which logical expert each physical slot of each MoE layer holds.
//
// The MoE layer executes slots, not experts. A logical expert has one or more
// replicas (slots holding a copy of its weights); a routed token goes to one of
// them, and which one never changes the result. Free slots hold kFreeSlot. This
// table is what expert parallelism and load balancing rewrite. Value type;
// const methods are thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

// Expert slots per rank and MoE layer that a serving group sizes at start
// (docs/ARCHITECTURE.md, "Membership, epochs, failure"): every expert and
// `extra_replicas` more replicas fit on `min_ranks` ranks (0: `ranks`; never more than
// `ranks`), plus `spare_slots` free slots a rank keeps for EPLB moves. The front end
// (ClusterEngine) and `flexpert plan-memory` size slots by this one rule.
int expert_slots_per_rank(int num_experts, int extra_replicas, int ranks, int min_ranks,
                          int spare_slots);

// The replicas every expert keeps in a group of `members` ranks of `slots_per_rank` slots
// when the operator asked for none (`--min-replicas auto`): two where the members' slots
// beside `spare_slots` each hold every expert twice (slots sized for fewer ranks than
// serve: a loss then reloads nothing), else one. Never more than `members`.
int auto_min_replicas(int num_experts, int members, int slots_per_rank, int spare_slots);

class ExpertPlacement {
 public:
  static constexpr int kFreeSlot = -1;

  ExpertPlacement() = default;
  // Slot s holds expert s for s < num_experts; the rest are free.
  static ExpertPlacement identity(int num_layers, int num_experts, int num_slots);
  // From explicit slot -> expert maps, one per layer (all of one length); validated.
  static Result<ExpertPlacement> from_slot_maps(int num_experts,
                                                std::vector<std::vector<int>> slot_to_expert);
  // Expert-parallel layout over max_ranks * slots_per_rank slots (slot s on rank
  // s / slots_per_rank): experts dealt round-robin over `members`, then
  // `extra_replicas` more replicas per layer (chosen by `seed`) on members that do
  // not hold that expert yet; the slots of non-members stay free. InvalidArgument
  // when the members' slots cannot hold them.
  static Result<ExpertPlacement> spread(int num_layers, int num_experts, int max_ranks,
                                        int slots_per_rank, const std::vector<int>& members,
                                        int extra_replicas, uint64_t seed);
  // Parses a placement spec:
  //   "identity"                 one slot per expert;
  //   "replicate:R[:SEED]"       identity plus R replica slots per layer holding experts chosen
  //                              by SEED, slots shuffled;
  //   a path to a JSON file      {"layers": [[expert of slot 0, ...], ...]} (one list per layer,
  //                              or a single list used for every layer; -1 marks a free slot).
  static Result<ExpertPlacement> parse(const std::string& spec, int num_layers, int num_experts);

  // InvalidArgument unless this placement has `num_layers` layers over `num_experts`
  // logical experts (a model's; a placement built elsewhere is checked against it).
  Status check_shape(int num_layers, int num_experts) const;

  // The rank holding `slot` when each rank holds slots_per_rank consecutive slots.
  static int rank_of(int slot, int slots_per_rank) { return slot / slots_per_rank; }

  int num_layers() const { return static_cast<int>(slot_to_expert_.size()); }
  int num_experts() const { return num_experts_; }
  int num_slots() const { return num_slots_; }
  int slot_expert(int layer, int slot) const { return slot_to_expert_[layer][slot]; }
  const std::vector<int>& slot_map(int layer) const { return slot_to_expert_[layer]; }
  const std::vector<std::vector<int>>& slot_maps() const { return slot_to_expert_; }  // [layer]
  // The slots holding `expert` in `layer`, ascending.
  const std::vector<int>& replicas(int layer, int expert) const {
    return expert_to_slots_[layer][expert];
  }
  std::string to_json() const;

 private:
  Status build_index();

  int num_experts_ = 0;
  int num_slots_ = 0;
  std::vector<std::vector<int>> slot_to_expert_;                // [layer][slot]
  std::vector<std::vector<std::vector<int>>> expert_to_slots_;  // [layer][expert] -> slots
};

}  // namespace flexpert
