// SPDX-License-Identifier: Apache-2.0
// Expert placement planner (EPLB): from measured load per layer and logical expert, decides
// which logical expert each physical slot holds, giving hot experts extra replicas and
// balancing the load of member ranks while moving as few expert weights as possible.
//
// How, per layer: a plan from scratch (greedy replica counts, greedy packing, a bounded local
// search) sets the target, its max rank load times (1 + tolerance); the current placement is
// then repaired step by step (moves, swaps, replicas added or dropped on the hottest rank,
// fewest slot writes first) until it meets the target. Where that rewrites much or gets stuck
// (typically after a membership change), the current placement is first given the replica
// counts of the plan from scratch, then repaired the same way. A repair that gets stuck is kept
// if no worse than the greedy packing from scratch; otherwise the plan from scratch is used,
// its ranks renumbered to match the current placement. The fewer moves win. With fill_slots,
// the slots left free are filled last. A repair step costs the remote receives it adds less
// those it takes back; after a membership change the repair aims no higher than the greedy
// packing from scratch (greedy_after_change).
//
// plan() is a pure function: no I/O, no globals; the same input always gives the same output
// (whatever num_threads), so it is safe to call from any thread. Layers are independent and are
// planned on num_threads threads that plan() starts and joins. Cost: about 35 ms of CPU per plan
// at DeepSeek-V3 shapes (61 layers x 256 experts x 256 ranks), see docs/benchmarks.md.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "flexpert/status.h"

namespace flexpert::eplb {

// kGlobal: replicas of any expert may go to any member rank.
// kHierarchical: the experts of one group (DeepSeek "expert group") and all their replicas stay
//   on one host; groups are packed onto hosts, then replicas onto the host's ranks. Applicable
//   when num_experts % num_groups == 0, num_groups % num_hosts == 0 and the members split into
//   num_hosts equal hosts that can each hold their experts.
// kAuto: per layer, whichever applicable policy balances best; among those within `tolerance`
//   of the best, the one the current placement already follows (no moves just to switch), else
//   hierarchical (it keeps group-limited routing inside hosts).
enum class Policy { kAuto, kGlobal, kHierarchical };

std::string_view policy_name(Policy policy);  // "auto", "global", "hierarchical"
Result<Policy> parse_policy(std::string_view name);

// Cap of PlanInput::num_threads = 0: past it a thread plans too few layers of DeepSeek-V3's 61
// to pay for starting it.
inline constexpr int kMaxPlanThreads = 16;

struct PlanInput {
  int num_experts = 0;     // logical experts per layer
  int slots_per_rank = 0;  // slot s of the global slot space lives on rank s / slots_per_rank
  std::vector<int> ranks;  // member rank ids, strictly ascending, each < max_ranks
  int max_ranks = 0;       // global slot space = max_ranks * slots_per_rank per layer
  int num_hosts = 1;       // members split into num_hosts contiguous equal groups
  int num_groups = 1;      // logical experts split into num_groups contiguous groups
  std::vector<std::vector<double>> load;  // [layer][logical_expert], finite, >= 0
  // [layer][max_ranks * current_slots_per_rank]: logical expert or -1 (free); empty = no
  // placement yet. Experts on slots of non-member ranks count as lost.
  std::vector<std::vector<int>> current;
  // Slots per rank of `current`; 0 = slots_per_rank. Differs after a membership change that
  // changes the slots per rank: a rank holding more experts than slots_per_rank keeps those the
  // plan needs most (a spare replica goes first).
  int current_slots_per_rank = 0;
  Policy policy = Policy::kAuto;
  int min_replicas = 1;  // every expert keeps at least max(1, min_replicas) replicas
  // A current placement whose max rank load is within this fraction of the best this planner
  // finds from scratch is kept as is; otherwise it is repaired until it is, with the fewest
  // moves the planner finds. 0 targets the best balance; after a membership change a few
  // percent buys markedly fewer moves (docs/benchmarks.md, EPLB planner).
  double tolerance = 0.005;
  // After a membership change (an expert without a replica on a member, or an empty member
  // rank) a layer is repaired only until it balances as well as the greedy packing from
  // scratch (the kind of plan DeepSeek's balancer returns) when that is below the tolerance's
  // aim: fewer moves during the change (docs/benchmarks.md); the next plan, no longer after a
  // change, balances the rest. false: the tolerance alone sets the aim.
  bool greedy_after_change = true;
  // Every member slot holds an expert (DeepSeek's contract: no -1 on members): slots the plan
  // leaves free get extra replicas, of the expert the rank held before when that does not
  // raise the max load (no weights to move), else of the expert with the highest load per
  // replica that keeps the max load lowest; never two replicas of one expert on a rank.
  bool fill_slots = false;
  // Skip threshold: when the plan raises the mean balancedness over layers by less than this
  // over `current` (scored on `load`), `current` is returned unchanged (zero moves, skipped).
  // 0 = always replan. Needs a current placement with current_slots_per_rank == slots_per_rank
  // whose experts all have a replica on a member (otherwise there is nothing to keep).
  double min_gain = 0;
  // Threads planning layers in parallel (the calling one included); 0 = one per core
  // (std::thread::hardware_concurrency()), at most kMaxPlanThreads and one per layer.
  int num_threads = 0;
};

struct PlanOutput {
  std::vector<std::vector<int>> placement;  // same shape as `current`: [layer][slot]
  std::vector<double> balancedness;         // per layer: mean / max member rank load
  std::vector<Policy> used;                 // per layer: kGlobal or kHierarchical
  // count_receives(current, placement): slots receiving an expert their rank did not hold.
  int64_t moved_slots = 0;
  bool skipped = false;          // min_gain not reached: placement == current
  double balancedness_gain = 0;  // mean over layers of planned minus current balancedness
};

// Plans every layer. Guarantees, for each layer:
//  - every logical expert has >= max(1, min_replicas) replicas, all on member ranks;
//  - no rank holds two replicas of one expert; slots of non-member ranks are -1; with
//    fill_slots, no member slot is -1;
//  - an expert that stays on a rank keeps its slot index; new experts take slots that were free
//    first, then slots whose expert leaves;
//  - unchanged loads give zero moves: a plan applied to its own output returns it unchanged
//    (after a membership change with greedy_after_change, from the second plan on: the first
//    stops at the greedy packing's balance, the next one balances the rest).
// Any number of ranks works (no divisibility needed): 16 experts on 3 ranks of 6 slots give
// every expert one replica and 2 extra replicas to the experts with the highest load per
// replica; ranks then hold different numbers of experts, balanced by load, not by count. A
// slot may stay free when nothing is gained by filling it (it then needs no weights), e.g.
// after a replica is dropped or a rank joins. InvalidArgument for malformed input, for fewer
// member slots than num_experts * min_replicas, for min_replicas above the number of members,
// and for kHierarchical when not applicable (the message says why).
Result<PlanOutput> plan(const PlanInput& input);

// Load smoothing over windows: per layer, the window's load as shares of its total, averaged
// with `previous` (shares, [layer][expert]) as weight * previous + (1 - weight) * window, then
// scaled back to the window's total (a layer without load keeps its previous shares). Plans on
// the result balance the next window better than plans on the last window alone under drift
// (docs/benchmarks.md). weight in [0, 1); an empty or differently shaped `previous` starts anew.
// Returns the new shares; `load` is replaced by the smoothed load.
std::vector<std::vector<double>> smooth_load(const std::vector<std::vector<double>>& previous,
                                             double weight, std::vector<std::vector<double>>& load);

// mean / max of the member ranks' loads, where an expert's load is split evenly over the
// replicas it has on member ranks; 1 when every rank load is 0.
double balancedness(const std::vector<double>& load_row, const std::vector<int>& placement_row,
                    const std::vector<int>& ranks, int slots_per_rank);

// Slots that receive an expert they did not hold: to[s] != -1 && to[s] != from[s]. An empty
// `from` (or a shorter row) counts as free slots.
int64_t count_moves(const std::vector<int>& from_row, const std::vector<int>& to_row);
int64_t count_moves(const std::vector<std::vector<int>>& from,
                    const std::vector<std::vector<int>>& to);

// Remote receives: per rank r < min(ranks of from, ranks of to), the slots of `to` holding an
// expert that no slot of r holds in `from` (a copy of an expert r already holds is local and
// not counted; two replicas of one new expert on r count once); every expert on a rank that
// `from` lacks counts. Rows may have different slots per rank (a membership change).
int64_t count_receives(const std::vector<int>& from_row, int from_slots_per_rank,
                       const std::vector<int>& to_row, int to_slots_per_rank);
int64_t count_receives(const std::vector<std::vector<int>>& from, int from_slots_per_rank,
                       const std::vector<std::vector<int>>& to, int to_slots_per_rank);

}  // namespace flexpert::eplb
