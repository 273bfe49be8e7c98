// SPDX-License-Identifier: Apache-2.0
// Internal to the planner: one layer's replicas as a set of experts per member rank, with the
// rank loads kept current, and the packing procedures that work on it: replica counts, greedy
// packing from nothing (LPT) and a local search that lowers the max rank load.
//
// Ranks here are member indices (0 .. number of members - 1), not rank ids. An expert's load is
// split evenly over its replicas. Plain value types, single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace flexpert::eplb::detail {

// A part of a layer that replicas never leave: member ranks [rank_begin, rank_end) and the
// logical experts that live there. Global policy: one domain; hierarchical: one per host.
struct Domain {
  int rank_begin = 0;
  int rank_end = 0;
  std::vector<int> experts;  // ascending
  int num_ranks() const { return rank_end - rank_begin; }
};

class LayerState {
 public:
  // `load` ([expert]) must outlive the state.
  LayerState(const std::vector<double>& load, int num_ranks, int slots_per_rank);

  int num_ranks() const { return num_ranks_; }
  int slots_per_rank() const { return slots_; }
  int size(int rank) const { return size_[rank]; }
  const int* items(int rank) const { return &items_[static_cast<size_t>(rank) * slots_]; }
  double rank_load(int rank) const { return rank_load_[rank]; }
  double weight(int expert) const { return (*load_)[expert]; }
  int count(int expert) const { return count_[expert]; }
  // Load of one replica (the whole load when the expert has none).
  double per_replica(int expert) const { return per_[expert]; }
  // Load of one replica if the expert had one replica more / one fewer (+inf: it has <= 1).
  double per_if_more(int expert) const { return more_[expert]; }
  double per_if_fewer(int expert) const { return fewer_[expert]; }
  bool holds(int rank, int expert) const {
    return has_[static_cast<size_t>(expert) * num_ranks_ + rank] != 0;
  }
  // holds_row(expert)[rank] == holds(rank, expert).
  const uint8_t* holds_row(int expert) const {
    return &has_[static_cast<size_t>(expert) * num_ranks_];
  }
  // The ranks holding `expert`, in the order they took it.
  std::span<const int> holders(int expert) const {
    return {&holders_[static_cast<size_t>(expert) * num_ranks_],
            static_cast<size_t>(count_[expert])};
  }
  size_t num_experts() const { return count_.size(); }

  // One replica more or less: the load of every rank holding `expert` follows (O(replicas)).
  void add(int rank, int expert);     // rank must have a free slot and not hold expert
  void remove(int rank, int expert);  // rank must hold expert
  // A replica changes rank; replica counts, so other ranks, stay as they are (O(slots)).
  void move(int from, int to, int expert);
  // x on rank a and y on rank b trade places (O(slots)).
  void swap(int a, int x, int b, int y);
  // Adds sets[r] to each rank r (free slots, no duplicates), then computes every rank load
  // once: for building a whole layer, where add() would update hot experts' ranks many times.
  void add_all(const std::vector<std::vector<int>>& sets);

  double max_load(const Domain& domain) const;
  // Experts held by each member rank, ascending.
  std::vector<std::vector<int>> rank_sets() const;

 private:
  void place(int rank, int expert);
  void unplace(int rank, int expert);
  void set_count_changed(int expert);

  const std::vector<double>* load_;
  int num_ranks_;
  int slots_;
  std::vector<int> items_;  // [rank * slots_ + k], k < size_[rank]
  std::vector<int> size_;
  std::vector<double> rank_load_;
  std::vector<int> count_;     // [expert]: replicas
  std::vector<double> per_;    // [expert]: load / replicas (the whole load without replicas)
  std::vector<double> more_;   // [expert]: load / (replicas + 1)
  std::vector<double> fewer_;  // [expert]: load / (replicas - 1)
  std::vector<uint8_t> has_;   // [expert * num_ranks_ + rank]
  // [expert * num_ranks_ + k], k < count_[expert]: one flat block, left uninitialised (a
  // vector per expert cost an allocation per expert and state, a tenth of a plan's time).
  std::unique_ptr<int[]> holders_;
};

// Replica counts for domain.experts (same order): min_replicas each, then one more at a time to
// the expert with the highest load per replica (ties: lowest id), at most one per rank of the
// domain, until num_slots replicas exist or no expert can take one more.
std::vector<int> greedy_counts(const std::vector<double>& load, const Domain& domain, int num_slots,
                               int min_replicas);

// Places counts[i] replicas of domain.experts[i] onto the (empty) domain ranks of `state`:
// largest load per replica first, each onto the least loaded rank with a free slot that does
// not hold that expert yet. Requires sum(counts) <= free slots and counts[i] <= domain ranks.
void pack_lpt(LayerState& state, const Domain& domain, const std::vector<int>& counts);

// Gives every expert of the domain at least min_replicas replicas, each new one where it
// raises the max load least (a free slot, or a slot of an expert with spare replicas). False
// when some expert cannot get one without a longer chain of changes.
bool ensure_min_replicas(LayerState& state, const Domain& domain, int min_replicas);

struct SearchOptions {
  double target = 0;             // stop once the domain's max rank load is <= target
  bool minimise_moves = true;    // among actions reaching target, prefer the fewest slot writes
  int min_replicas = 1;          // never drop an expert below this
  int max_iterations = 0;        // steps at most
  int num_candidate_ranks = 16;  // coldest ranks tried as partners of the hottest
  // Work bound: (replica of the hottest rank, replica of a partner) pairs scored, in all. When
  // the coldest ranks do not help the hottest one, four times as many, then every rank are tried
  // (if the bound allows).
  int64_t max_pairs = 0;
  bool allow_drop = true;  // false: never leave a slot free by dropping a spare replica
  // [expert * ranks + rank]: 1 where the rank held the expert before the plan. With it a step
  // costs the receives it adds on the ranks it changes, less those it takes back (a step on a
  // rank that receives anyway, e.g. one that joined, can cost nothing); without it, one per
  // slot written.
  const uint8_t* held = nullptr;
};

enum class SearchEnd {
  kReached,     // the domain's max rank load is <= target
  kStuck,       // no step lowers the hottest rank (with every rank tried, if allowed)
  kOutOfSteps,  // max_iterations or max_pairs spent
};

// Lowers the domain's max rank load step by step: each step changes the hottest rank by the
// best of moving one of its replicas to a free slot, swapping one with a colder rank's, giving
// one of its experts an extra replica (in a free slot or in place of a replica of an expert
// that has spare ones) or dropping a spare replica.
SearchEnd improve(LayerState& state, const Domain& domain, const SearchOptions& options);

// Up to `passes` sweeps that pair the i-th hottest rank of the domain with the i-th coldest
// and even each pair out by the best single swap or move between them (replica counts stay).
// Cheap (ranks x slots^2 per pass) and it flattens a greedy packing quickly; improve() then
// works on the few ranks that remain high.
void balance_pairs(LayerState& state, const Domain& domain, int passes);

// Takes back moves of a plan against `current` ([member rank] -> experts there now, ascending)
// without any rank of the domain going above `cap`: an expert that left rank r returns to it
// by trading places with a replica that arrived on r (or into a free slot of r), when its
// replica elsewhere is itself one that arrived. Each step writes at least one slot fewer.
void take_back_moves(LayerState& state, const Domain& domain,
                     const std::vector<std::vector<int>>& current, double cap);

}  // namespace flexpert::eplb::detail
