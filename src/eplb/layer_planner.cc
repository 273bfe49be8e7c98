// SPDX-License-Identifier: Apache-2.0
// One layer: a best-balance plan from nothing per policy (it sets the target), then the
// cheapest of (a) repairing the current placement until it meets the target and (b) the plan
// from nothing with its ranks renumbered to match the current placement.
#include "eplb/layer_planner.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <tuple>

#include "eplb/layer_state.h"

namespace flexpert::eplb::detail {
namespace {

constexpr double kRelEps = 1e-12;
static int kScratchCandidateRanks = getenv("KS") ? atoi(getenv("KS")) : 32;
static int kRepairCandidateRanks = getenv("KR") ? atoi(getenv("KR")) : 16;

struct Candidate {
  std::vector<std::vector<int>> sets;
  double max_load = 0;
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

Candidate from_scratch(const LayerShape& shape, const std::vector<double>& load,
                       const std::vector<Domain>& domains) {
  LayerState state(load, shape.num_ranks, shape.slots_per_rank);
  Candidate c;
  for (const Domain& d : domains) {
    const int m = std::max(1, shape.min_replicas);
    pack_lpt(state, d, greedy_counts(load, d, d.num_ranks() * shape.slots_per_rank, m));
    double total = 0;
    for (int e : d.experts) total += load[e];
    SearchOptions options;
    options.target = total / d.num_ranks();  // unreachable in general: search until stuck
    options.minimise_moves = false;
    options.min_replicas = m;
    options.max_iterations = max_iterations(shape);
    options.num_candidate_ranks = kScratchCandidateRanks;
    (void)improve(state, d, options);
    c.max_load = std::max(c.max_load, state.max_load(d));
  }
  c.sets = state.rank_sets();
  return c;
}

// The host of each group when `current` keeps every group on one host and no host holds more
// than its share of groups; groups without replicas go to the hosts with the fewest groups.
std::optional<std::vector<int>> current_host_of_group(const LayerShape& shape,
                                                      const std::vector<double>& load,
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

// The current placement, completed to min_replicas and relieved rank by rank until its max load
// is <= target, preferring the steps that write the fewest slots.
std::optional<std::vector<std::vector<int>>> repair(const LayerShape& shape,
                                                    const std::vector<double>& load,
                                                    const std::vector<std::vector<int>>& current,
                                                    const std::vector<Domain>& domains,
                                                    double target) {
  LayerState state(load, shape.num_ranks, shape.slots_per_rank);
  state.add_all(current);
  const int m = std::max(1, shape.min_replicas);
  for (const Domain& d : domains) {
    if (!ensure_min_replicas(state, d, m)) return std::nullopt;
    SearchOptions options;
    options.target = target;
    options.minimise_moves = true;
    options.min_replicas = m;
    options.max_iterations = max_iterations(shape);
    options.num_candidate_ranks = kRepairCandidateRanks;
    if (!improve(state, d, options)) return std::nullopt;
  }
  return state.rank_sets();
}

// Greedy maximum-overlap matching of the `fresh` ranks to the `current` ranks, inside blocks of
// ranks_per_block ranks that are matched to each other first (hosts, for hierarchical plans),
// so renumbering keeps whole hosts together. Returns fresh's sets at their new positions.
std::vector<std::vector<int>> relabel(const LayerShape& shape,
                                      const std::vector<std::vector<int>>& fresh,
                                      const std::vector<std::vector<int>>& current,
                                      int ranks_per_block) {
  const int n = shape.num_ranks;
  std::vector<std::vector<int>> holders(shape.num_experts);
  for (int r = 0; r < n; ++r) {
    for (int e : current[r]) holders[e].push_back(r);
  }
  // overlap[i * n + j]: experts fresh rank i shares with current rank j (at most slots_per_rank);
  // touched[i]: the j with a non-zero overlap, in discovery order.
  std::vector<int> overlap(static_cast<size_t>(n) * n, 0);
  std::vector<std::vector<int>> touched(n);
  for (int i = 0; i < n; ++i) {
    for (int e : fresh[i]) {
      for (int j : holders[e]) {
        if (overlap[static_cast<size_t>(i) * n + j]++ == 0) touched[i].push_back(j);
      }
    }
  }
  const int num_blocks = n / ranks_per_block;
  std::vector<int> block_to(num_blocks, 0);
  if (num_blocks > 1) {
    std::vector<int> block_overlap(static_cast<size_t>(num_blocks) * num_blocks, 0);
    for (int i = 0; i < n; ++i) {
      for (int j : touched[i]) {
        block_overlap[static_cast<size_t>(i / ranks_per_block) * num_blocks +
                      j / ranks_per_block] += overlap[static_cast<size_t>(i) * n + j];
      }
    }
    std::vector<std::tuple<int, int, int>> pairs;  // (-overlap, fresh block, current block)
    for (int a = 0; a < num_blocks; ++a) {
      for (int b = 0; b < num_blocks; ++b) {
        if (const int w = block_overlap[static_cast<size_t>(a) * num_blocks + b]; w > 0) {
          pairs.emplace_back(-w, a, b);
        }
      }
    }
    std::sort(pairs.begin(), pairs.end());
    std::fill(block_to.begin(), block_to.end(), -1);
    std::vector<uint8_t> taken(num_blocks, 0);
    for (const auto& [w, a, b] : pairs) {
      if (block_to[a] < 0 && !taken[b]) block_to[a] = b, taken[b] = 1;
    }
    int next = 0;
    for (int& b : block_to) {
      if (b >= 0) continue;
      while (taken[next]) ++next;
      b = next;
      taken[next] = 1;
    }
  }
  // Inside each pair of blocks: pairs by descending overlap (a bucket per value), ties in
  // discovery order; fresh ranks left over take the current ranks left over in order.
  std::vector<std::vector<int>> out(n);
  std::vector<std::vector<std::pair<int, int>>> buckets(shape.slots_per_rank + 1);
  std::vector<int> to(n, -1);
  std::vector<uint8_t> taken(n, 0);
  for (int a = 0; a < num_blocks; ++a) {
    const int rows = a * ranks_per_block, cols = block_to[a] * ranks_per_block;
    for (auto& bucket : buckets) bucket.clear();
    for (int i = rows; i < rows + ranks_per_block; ++i) {
      for (int j : touched[i]) {
        if (j >= cols && j < cols + ranks_per_block) {
          buckets[overlap[static_cast<size_t>(i) * n + j]].emplace_back(i, j);
        }
      }
    }
    for (int w = shape.slots_per_rank; w > 0; --w) {
      for (const auto& [i, j] : buckets[w]) {
        if (to[i] < 0 && !taken[j]) to[i] = j, taken[j] = 1;
      }
    }
    int next = cols;
    for (int i = rows; i < rows + ranks_per_block; ++i) {
      if (to[i] >= 0) continue;
      while (taken[next]) ++next;
      to[i] = next;
      taken[next] = 1;
    }
    for (int i = rows; i < rows + ranks_per_block; ++i) out[to[i]] = fresh[i];
  }
  return out;
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
    hier = from_scratch(shape, load, host_domains(shape, hier_host_of));
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
  LayerResult result;
  result.used = used;
  if (!has_current) {
    result.rank_sets = fresh.sets;
    return result;
  }

  std::optional<std::vector<std::vector<int>>> repaired;
  if (used == Policy::kGlobal) {
    repaired = repair(shape, load, current, global_domains(shape), target);
  } else if (current_host_of) {
    repaired = repair(shape, load, current, host_domains(shape, *current_host_of), target);
  }
  if (repaired && set_moves(current, *repaired) == 0) {
    result.rank_sets = std::move(*repaired);
    return result;
  }
  const int ranks_per_block =
      used == Policy::kHierarchical ? shape.num_ranks / shape.num_hosts : shape.num_ranks;
  std::vector<std::vector<int>> renumbered = relabel(shape, fresh.sets, current, ranks_per_block);
  if (repaired && set_moves(current, *repaired) <= set_moves(current, renumbered)) {
    result.rank_sets = std::move(*repaired);
  } else {
    result.rank_sets = std::move(renumbered);
  }
  return result;
}

}  // namespace flexpert::eplb::detail
