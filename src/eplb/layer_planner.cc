// SPDX-License-Identifier: Apache-2.0
// One layer: a plan from nothing per applicable policy (the best sets the target), then the one
// with fewer moves of (a) the current placement repaired until it meets the target (or stuck,
// but no worse than the greedy packing from nothing) and (b) the plan from nothing with its
// ranks renumbered to match the current placement; on both, moves that the target does not
// need are taken back.
#include "eplb/layer_planner.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>

#include "eplb/layer_state.h"

namespace flexpert::eplb::detail {
namespace {

constexpr double kRelEps = 1e-12;
// Search effort. Per step, about kPairsPerStep (replica, replica) pairs: the coldest
// kPairsPerStep / slots_per_rank^2 ranks (at least 8) are tried as partners of the hottest.
// From scratch: kPairPasses balancing sweeps, then steps on the hottest rank until
// kScratchPairs pairs are scored. That passes the greedy packing by 0.5-3 % of balance at
// DeepSeek-V3 shapes; searching until stuck gains a few tenths of a percent more at several
// times the cost (measured with bench/eplb_bench.cc; plans must stay well under 1 ms a layer).
constexpr int kPairsPerStep = 128;
constexpr int kPairPasses = 2;
constexpr int64_t kScratchPairs = 8192;
// Renumbering the plan from scratch keeps about half of the experts in place under drift: worth
// computing only when the repair failed or rewrites more than this share of the layer.
constexpr int kRelabelAbovePercent = 40;
// Likewise for the repair given the replica counts of the plan from scratch.
constexpr int kCountsAbovePercent = 30;

int candidate_ranks(const LayerShape& shape) {
  return std::max(8, kPairsPerStep / (shape.slots_per_rank * shape.slots_per_rank));
}

struct Candidate {
  std::vector<std::vector<int>> sets;
  double max_load = 0;     // after the search
  double greedy_load = 0;  // of the greedy packing it started from (DeepSeek's kind of plan)
};

int max_iterations(const LayerShape& shape) {
  return 4 * shape.num_ranks * shape.slots_per_rank + 64;
}

std::vector<Domain> global_domains(const LayerShape& shape) {
  Domain d{0, shape.num_ranks, std::vector<int>(shape.num_experts)};
  std::iota(d.experts.begin(), d.experts.end(), 0);
  return {d};
}

std::vector<Domain> host_domains(const LayerShape& shape, const std::vector<int>& host_of_group) {
  const int ranks_per_host = shape.num_ranks / shape.num_hosts;
  const int group_size = shape.num_experts / shape.num_groups;
  std::vector<Domain> domains(shape.num_hosts);
  for (int h = 0; h < shape.num_hosts; ++h) {
    domains[h].rank_begin = h * ranks_per_host;
    domains[h].rank_end = (h + 1) * ranks_per_host;
  }
  for (int e = 0; e < shape.num_experts; ++e) {
    domains[host_of_group[e / group_size]].experts.push_back(e);
  }
  return domains;
}

std::vector<double> group_loads(const LayerShape& shape, const std::vector<double>& load) {
  const int group_size = shape.num_experts / shape.num_groups;
  std::vector<double> g(shape.num_groups, 0.0);
  for (int e = 0; e < shape.num_experts; ++e) g[e / group_size] += load[e];
  return g;
}

// Groups onto hosts, num_groups / num_hosts each: heaviest first onto the lightest host with
// room, then pairwise swaps between the heaviest host and the others while they lower it.
std::vector<int> pack_groups(const LayerShape& shape, const std::vector<double>& load) {
  const std::vector<double> gl = group_loads(shape, load);
  const int per_host = shape.num_groups / shape.num_hosts;
  std::vector<int> order(shape.num_groups);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gl[a] > gl[b]; });
  std::vector<int> host_of(shape.num_groups, -1), used(shape.num_hosts, 0);
  std::vector<double> hl(shape.num_hosts, 0.0);
  for (int g : order) {
    int best = -1;
    for (int h = 0; h < shape.num_hosts; ++h) {
      if (used[h] < per_host && (best < 0 || hl[h] < hl[best])) best = h;
    }
    host_of[g] = best;
    ++used[best];
    hl[best] += gl[g];
  }
  for (int iteration = 0; iteration < 4 * shape.num_groups; ++iteration) {
    const int h = static_cast<int>(std::max_element(hl.begin(), hl.end()) - hl.begin());
    double best_peak = hl[h] * (1 - kRelEps);
    int best_a = -1, best_b = -1;
    for (int a = 0; a < shape.num_groups; ++a) {
      if (host_of[a] != h) continue;
      for (int b = 0; b < shape.num_groups; ++b) {
        const int o = host_of[b];
        if (o == h) continue;
        const double peak = std::max(hl[h] - gl[a] + gl[b], hl[o] - gl[b] + gl[a]);
        if (peak < best_peak) best_peak = peak, best_a = a, best_b = b;
      }
    }
    if (best_a < 0) break;
    const int o = host_of[best_b];
    hl[h] += gl[best_b] - gl[best_a];
    hl[o] += gl[best_a] - gl[best_b];
    std::swap(host_of[best_a], host_of[best_b]);
  }
  return host_of;
}

// Fills the free slots of the domain's ranks with extra replicas of the domain's experts
// (PlanInput::fill_slots), coldest rank first. Each takes, among the experts it does not hold:
// the one it held in `current` (no weights to move), else the one with the highest load per
// replica, provided the rank stays at or below the max load; when every choice raises the max,
// the one raising it least. A rank with more slots than experts it may hold keeps the rest free.
void fill_free_slots(LayerState& state, const Domain& d,
                     const std::vector<std::vector<int>>& current) {
  std::vector<uint8_t> in_domain(state.num_experts(), 0);
  for (int e : d.experts) in_domain[e] = 1;
  std::vector<uint8_t> done(d.num_ranks(), 0);  // full, or nothing left to add
  for (;;) {
    int r = -1;
    double max_load = 0;
    for (int q = d.rank_begin; q < d.rank_end; ++q) {
      max_load = std::max(max_load, state.rank_load(q));
      if (done[q - d.rank_begin] || state.size(q) >= state.slots_per_rank()) continue;
      if (r < 0 || state.rank_load(q) < state.rank_load(r)) r = q;
    }
    if (r < 0) return;
    const double lr = state.rank_load(r);
    const double cap = max_load * (1 + kRelEps);
    int best = -1;
    // Lexicographically smallest: (false, needs weights, -load per replica) when the max stays,
    // (true, the new load, needs weights) when it rises.
    std::tuple<bool, double, double> best_key{true, 0, 0};
    auto consider = [&](int e, bool held) {
      if (!in_domain[e] || state.holds(r, e)) return;
      const double after = lr + state.per_if_more(e);
      const bool raises = after > cap;
      const double needs_weights = held ? 0.0 : 1.0;
      const std::tuple<bool, double, double> key =
          raises ? std::make_tuple(true, after, needs_weights)
                 : std::make_tuple(false, needs_weights, -state.per_replica(e));
      if (best < 0 || key < best_key) best = e, best_key = key;
    };
    if (!current.empty()) {
      for (int e : current[r]) consider(e, true);
    }
    for (int e : d.experts) consider(e, false);
    if (best < 0) {
      done[r - d.rank_begin] = 1;
      continue;
    }
    state.add(r, best);
  }
}

Candidate from_scratch(const LayerShape& shape, const std::vector<double>& load,
                       const std::vector<Domain>& domains) {
  LayerState state(load, shape.num_ranks, shape.slots_per_rank);
  Candidate c;
  for (const Domain& d : domains) {
    const int m = std::max(1, shape.min_replicas);
    pack_lpt(state, d, greedy_counts(load, d, d.num_ranks() * shape.slots_per_rank, m));
    if (shape.fill_slots) fill_free_slots(state, d, {});
    c.greedy_load = std::max(c.greedy_load, state.max_load(d));
    double total = 0;
    for (int e : d.experts) total += load[e];
    SearchOptions options;
    options.target = total / d.num_ranks();  // unreachable in general: search until stuck
    options.minimise_moves = false;
    options.allow_drop = !shape.fill_slots;
    options.min_replicas = m;
    options.max_iterations = max_iterations(shape);
    options.num_candidate_ranks = candidate_ranks(shape);
    options.max_pairs = kScratchPairs;
    balance_pairs(state, d, kPairPasses);
    (void)improve(state, d, options);
    c.max_load = std::max(c.max_load, state.max_load(d));
  }
  c.sets = state.rank_sets();
  return c;
}

// The host of each group when `current` keeps every group on one host and no host holds more
// than its share of groups; groups without replicas go to the hosts with the fewest groups.
std::optional<std::vector<int>> current_host_of_group(
    const LayerShape& shape, const std::vector<double>& load,
    const std::vector<std::vector<int>>& current) {
  const int ranks_per_host = shape.num_ranks / shape.num_hosts;
  const int group_size = shape.num_experts / shape.num_groups;
  const int per_host = shape.num_groups / shape.num_hosts;
  std::vector<int> host_of(shape.num_groups, -1);
  for (int r = 0; r < shape.num_ranks; ++r) {
    for (int e : current[r]) {
      int& h = host_of[e / group_size];
      if (h >= 0 && h != r / ranks_per_host) return std::nullopt;
      h = r / ranks_per_host;
    }
  }
  std::vector<int> used(shape.num_hosts, 0);
  for (int h : host_of) {
    if (h >= 0 && ++used[h] > per_host) return std::nullopt;
  }
  const std::vector<double> gl = group_loads(shape, load);
  std::vector<double> hl(shape.num_hosts, 0.0);
  for (int g = 0; g < shape.num_groups; ++g) {
    if (host_of[g] >= 0) hl[host_of[g]] += gl[g];
  }
  std::vector<int> orphans;
  for (int g = 0; g < shape.num_groups; ++g) {
    if (host_of[g] < 0) orphans.push_back(g);
  }
  std::stable_sort(orphans.begin(), orphans.end(), [&](int a, int b) { return gl[a] > gl[b]; });
  for (int g : orphans) {
    int best = -1;
    for (int h = 0; h < shape.num_hosts; ++h) {
      if (used[h] >= per_host) continue;
      if (best < 0 || std::tie(used[h], hl[h]) < std::tie(used[best], hl[best])) best = h;
    }
    host_of[g] = best;
    ++used[best];
    hl[best] += gl[g];
  }
  return host_of;
}

// Places one more replica of `e` when every rank with a free slot holds it already: the least
// loaded such rank r takes an item x of a full rank q that lacks e and that r lacks, and e takes
// x's place on q (the pair with the lowest peak). False when no such pair exists.
bool make_room(LayerState& state, const Domain& d, int e) {
  int r = -1;
  for (int g = d.rank_begin; g < d.rank_end; ++g) {
    if (state.size(g) >= state.slots_per_rank()) continue;
    if (r < 0 || state.rank_load(g) < state.rank_load(r)) r = g;
  }
  if (r < 0) return false;
  int best_q = -1, best_x = -1;
  double best_peak = std::numeric_limits<double>::infinity();
  for (int q = d.rank_begin; q < d.rank_end; ++q) {
    if (q == r || state.holds(q, e)) continue;
    for (int k = 0; k < state.size(q); ++k) {
      const int x = state.items(q)[k];
      if (state.holds(r, x)) continue;
      const double px = state.per_replica(x);
      const double peak =
          std::max(state.rank_load(r) + px, state.rank_load(q) - px + state.per_if_more(e));
      if (peak < best_peak) best_peak = peak, best_q = q, best_x = x;
    }
  }
  if (best_q < 0) return false;
  state.move(best_q, r, best_x);
  state.add(best_q, e);
  return true;
}

// Gives each expert of the domain counts[e] replicas: spare ones leave their hottest holder, then
// missing ones go, largest load per replica first, to the coldest rank with a free slot that
// lacks the expert (make_room when every such rank holds it). Turns the replica counts a plan from
// scratch chose into a few writes on the current placement, which the search then only has to
// rearrange (one replica more where every rank is near the mean needs a chain of steps the search
// does not find). False when a replica finds no rank.
bool adjust_counts(LayerState& state, const Domain& d, const std::vector<int>& counts) {
  for (int e : d.experts) {
    while (state.count(e) > counts[e]) {
      int hottest = -1;
      for (int g : state.holders(e)) {
        if (hottest < 0 || state.rank_load(g) > state.rank_load(hottest)) hottest = g;
      }
      state.remove(hottest, e);
    }
  }
  std::vector<int> order;
  for (int e : d.experts) {
    if (state.count(e) < counts[e]) order.push_back(e);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return state.weight(a) / counts[a] > state.weight(b) / counts[b];
  });
  for (int e : order) {
    while (state.count(e) < counts[e]) {
      int coldest = -1;
      for (int r = d.rank_begin; r < d.rank_end; ++r) {
        if (state.size(r) >= state.slots_per_rank() || state.holds(r, e)) continue;
        if (coldest < 0 || state.rank_load(r) < state.rank_load(coldest)) coldest = r;
      }
      if (coldest < 0 && !make_room(state, d, e)) return false;
      if (coldest < 0) continue;
      state.add(coldest, e);
    }
  }
  return true;
}

// The current placement, completed to min_replicas (with `counts`: first given those replica
// counts) and relieved rank by rank until its max load is <= target, preferring the steps that
// write the fewest slots. Also accepted: a placement no single step improves whose max load is
// <= fallback_limit. None otherwise.
std::optional<std::vector<std::vector<int>>> repair(const LayerShape& shape,
                                                    const std::vector<double>& load,
                                                    const std::vector<std::vector<int>>& current,
                                                    const std::vector<Domain>& domains,
                                                    double target, double fallback_limit,
                                                    const std::vector<int>* counts) {
  LayerState state(load, shape.num_ranks, shape.slots_per_rank);
  state.add_all(current);
  const int m = std::max(1, shape.min_replicas);
  std::vector<uint8_t> held(static_cast<size_t>(shape.num_experts) * shape.num_ranks, 0);
  for (int r = 0; r < shape.num_ranks; ++r) {
    for (int e : current[r]) held[static_cast<size_t>(e) * shape.num_ranks + r] = 1;
  }
  bool reached = true;
  for (const Domain& d : domains) {
    if (counts && !adjust_counts(state, d, *counts)) return std::nullopt;
    if (!ensure_min_replicas(state, d, m)) return std::nullopt;
    // Filled before the search, so that the search sees the loads the plan will have and a plan
    // planned again is found as it was left (full, and within target or stuck).
    if (shape.fill_slots) fill_free_slots(state, d, current);
    SearchOptions options;
    options.target = target;
    options.minimise_moves = true;
    options.min_replicas = m;
    options.max_iterations = max_iterations(shape);
    options.num_candidate_ranks = candidate_ranks(shape);
    // Unlimited, so that "stuck" means no step helps at all: a plan returned stuck is then
    // stuck again when planned anew, which keeps unchanged loads at zero moves.
    options.max_pairs = std::numeric_limits<int64_t>::max();
    options.allow_drop = !shape.fill_slots;
    options.held = held.data();
    const SearchEnd end = improve(state, d, options);
    if (end == SearchEnd::kOutOfSteps ||
        (end == SearchEnd::kStuck && state.max_load(d) > fallback_limit * (1 + kRelEps))) {
      return std::nullopt;
    }
    reached = reached && end == SearchEnd::kReached;
  }
  // Steps taken early may be unneeded once the target is met. (Not on a plan accepted stuck:
  // planned again, it must be found stuck again, and these changes could unblock a step.)
  if (reached) {
    for (const Domain& d : domains) take_back_moves(state, d, current, target);
  }
  return state.rank_sets();
}

}  // namespace

int64_t set_moves(const std::vector<std::vector<int>>& current,
                  const std::vector<std::vector<int>>& next) {
  int64_t moves = 0;
  for (size_t r = 0; r < next.size(); ++r) {
    for (int e : next[r]) {
      if (!std::binary_search(current[r].begin(), current[r].end(), e)) ++moves;
    }
  }
  return moves;
}

LayerResult plan_layer(const LayerShape& shape, Policy requested, const std::vector<double>& load,
                       const std::vector<std::vector<int>>& current) {
  const bool try_global = requested != Policy::kHierarchical;
  const bool try_hier = requested == Policy::kHierarchical ||
                        (requested == Policy::kAuto && shape.hierarchical_applicable);
  std::optional<Candidate> global, hier;
  std::vector<int> hier_host_of;
  if (try_global) global = from_scratch(shape, load, global_domains(shape));
  if (try_hier) {
    hier_host_of = pack_groups(shape, load);
    // A host's load spread over its ranks bounds its plan: skip planning what cannot come
    // within tolerance of the global plan.
    const std::vector<double> gl = group_loads(shape, load);
    std::vector<double> host_load(shape.num_hosts, 0.0);
    for (int g = 0; g < shape.num_groups; ++g) host_load[hier_host_of[g]] += gl[g];
    const double bound =
        *std::max_element(host_load.begin(), host_load.end()) / (shape.num_ranks / shape.num_hosts);
    if (!global || bound <= global->max_load * (1 + shape.tolerance) * (1 + kRelEps)) {
      hier = from_scratch(shape, load, host_domains(shape, hier_host_of));
    }
  }
  const double best = std::min(global ? global->max_load : hier->max_load,
                               hier ? hier->max_load : global->max_load);
  const double target = best * (1 + shape.tolerance);
  auto acceptable = [&](const std::optional<Candidate>& c) {
    return c && c->max_load <= target * (1 + kRelEps);
  };

  bool has_current = false;
  for (const auto& s : current) has_current = has_current || !s.empty();
  std::optional<std::vector<int>> current_host_of;
  if (has_current && try_hier) current_host_of = current_host_of_group(shape, load, current);

  // Among the policies within tolerance of the best: the one the current placement follows,
  // else hierarchical.
  Policy used = Policy::kGlobal;
  if (acceptable(hier) && (!has_current || current_host_of || !acceptable(global))) {
    used = Policy::kHierarchical;
  }
  const Candidate& fresh = used == Policy::kHierarchical ? *hier : *global;
  // After a membership change (an expert lost its last replica, or a member rank is empty) most
  // of the layer is rewritten whatever the plan; the repair then (greedy_after_change) aims no
  // higher than the greedy packing from scratch (the kind of plan DeepSeek's balancer returns):
  // weights are not moved to beat it during the change, the next replan (no longer reshaped) does
  // that with fewer moves. Otherwise the repair aims at the target. One that gets stuck short of
  // its aim is still taken when no worse than that greedy packing: the alternative, the plan from
  // scratch renumbered, rewrites about half of the layer. See the trade-off in docs/benchmarks.md.
  std::vector<int> held(shape.num_experts, 0);
  bool reshaped = false;
  for (const auto& set : current) {
    reshaped = reshaped || set.empty();
    for (int e : set) held[e] = 1;
  }
  reshaped = reshaped || std::count(held.begin(), held.end(), 0) > 0;
  const double repair_target =
      reshaped && shape.greedy_after_change ? std::max(target, fresh.greedy_load) : target;
  const double fallback_limit = std::max(fresh.greedy_load, repair_target);
  LayerResult result;
  result.used = used;
  if (!has_current) {
    result.rank_sets = fresh.sets;
    return result;
  }

  std::optional<std::vector<Domain>> domains;
  if (used == Policy::kGlobal) {
    domains = global_domains(shape);
  } else if (current_host_of) {
    domains = host_domains(shape, *current_host_of);
  }
  std::optional<std::vector<std::vector<int>>> repaired;
  int64_t repaired_moves = 0;  // set_moves(current, *repaired)
  // After a membership change the plain repair mostly gets stuck or rewrites much: only the one
  // given the counts runs.
  if (domains && !reshaped) {
    repaired = repair(shape, load, current, *domains, repair_target, fallback_limit, nullptr);
    if (repaired) repaired_moves = set_moves(current, *repaired);
  }
  // The current placement given the replica counts of the plan from scratch: where the plain
  // repair got stuck or rewrites much (after a membership change), it usually writes less.
  if (domains && (!repaired || repaired_moves * 100 > static_cast<int64_t>(kCountsAbovePercent) *
                                                          shape.num_ranks * shape.slots_per_rank)) {
    std::vector<int> counts(shape.num_experts, 0);
    for (const auto& set : fresh.sets) {
      for (int e : set) ++counts[e];
    }
    auto by_counts = repair(shape, load, current, *domains, repair_target, fallback_limit, &counts);
    if (by_counts) {
      const int64_t moves = set_moves(current, *by_counts);
      if (!repaired || moves < repaired_moves) {
        repaired = std::move(by_counts);
        repaired_moves = moves;
      }
    }
  }
  if (repaired && repaired_moves == 0) {
    result.rank_sets = std::move(*repaired);
    return result;
  }
  // Renumbering the plan from scratch keeps about half of the experts in place under drift
  // (most when loads barely changed, but then the repair writes little): worth computing only
  // when the repair failed or rewrites a large part of the layer.
  if (repaired && repaired_moves * 100 <= static_cast<int64_t>(kRelabelAbovePercent) *
                                              shape.num_ranks * shape.slots_per_rank) {
    result.rank_sets = std::move(*repaired);
    return result;
  }
  const int ranks_per_block =
      used == Policy::kHierarchical ? shape.num_ranks / shape.num_hosts : shape.num_ranks;
  std::vector<std::vector<int>> renumbered = relabel(shape, fresh.sets, current, ranks_per_block);
  {
    // Then back to where they were, for the experts that can go back within the target.
    LayerState state(load, shape.num_ranks, shape.slots_per_rank);
    state.add_all(renumbered);
    for (int begin = 0; begin < shape.num_ranks; begin += ranks_per_block) {
      take_back_moves(state, Domain{begin, begin + ranks_per_block, {}}, current, repair_target);
    }
    renumbered = state.rank_sets();
  }
  if (repaired && repaired_moves <= set_moves(current, renumbered)) {
    result.rank_sets = std::move(*repaired);
  } else {
    result.rank_sets = std::move(renumbered);
  }
  return result;
}

}  // namespace flexpert::eplb::detail
