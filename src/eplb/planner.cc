// SPDX-License-Identifier: Apache-2.0
// plan(): input checks, per-layer planning on member indices, and the slot assignment that
// keeps staying experts in their slots.
#include "eplb/planner.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <system_error>
#include <thread>

#include "eplb/layer_planner.h"

namespace flexpert::eplb {
namespace {

using detail::LayerShape;

Status check_input(const PlanInput& in) {
  if (in.num_experts < 1) return invalid_argument("num_experts must be >= 1");
  if (in.slots_per_rank < 1) return invalid_argument("slots_per_rank must be >= 1");
  if (in.max_ranks < 1) return invalid_argument("max_ranks must be >= 1");
  if (in.ranks.empty()) return invalid_argument("no member ranks");
  for (size_t i = 0; i < in.ranks.size(); ++i) {
    if (in.ranks[i] < 0 || in.ranks[i] >= in.max_ranks) {
      return invalid_argument("member rank " + std::to_string(in.ranks[i]) + " outside [0, " +
                              std::to_string(in.max_ranks) + ")");
    }
    if (i > 0 && in.ranks[i] <= in.ranks[i - 1]) {
      return invalid_argument("member ranks must be strictly ascending");
    }
  }
  if (in.num_hosts < 1 || in.num_groups < 1) {
    return invalid_argument("num_hosts and num_groups must be >= 1");
  }
  if (!(in.tolerance >= 0)) return invalid_argument("tolerance must be >= 0");
  const int m = std::max(1, in.min_replicas);
  const int64_t members = static_cast<int64_t>(in.ranks.size());
  if (m > members) {
    return invalid_argument("min_replicas " + std::to_string(m) + " exceeds the " +
                            std::to_string(members) +
                            " member ranks: two replicas would share a rank");
  }
  if (static_cast<int64_t>(in.num_experts) * m > members * in.slots_per_rank) {
    return invalid_argument(std::to_string(in.num_experts) + " experts x " + std::to_string(m) +
                            " replicas need more slots than the " + std::to_string(members) +
                            " member ranks x " + std::to_string(in.slots_per_rank) + " slots");
  }
  if (in.current_slots_per_rank < 0) return invalid_argument("current_slots_per_rank must be >= 0");
  if (!(in.min_gain >= 0)) return invalid_argument("min_gain must be >= 0");
  if (in.num_threads < 0) return invalid_argument("num_threads must be >= 0");
  const int current_slots =
      in.current_slots_per_rank > 0 ? in.current_slots_per_rank : in.slots_per_rank;
  const size_t num_slots = static_cast<size_t>(in.max_ranks) * current_slots;
  for (size_t l = 0; l < in.load.size(); ++l) {
    if (in.load[l].size() != static_cast<size_t>(in.num_experts)) {
      return invalid_argument("load of layer " + std::to_string(l) + " has " +
                              std::to_string(in.load[l].size()) + " experts, expected " +
                              std::to_string(in.num_experts));
    }
    for (double w : in.load[l]) {
      if (!std::isfinite(w) || w < 0) {
        return invalid_argument("load of layer " + std::to_string(l) + " must be finite and >= 0");
      }
    }
  }
  if (!in.current.empty()) {
    if (in.current.size() != in.load.size()) {
      return invalid_argument("current placement has " + std::to_string(in.current.size()) +
                              " layers, load has " + std::to_string(in.load.size()));
    }
    for (size_t l = 0; l < in.current.size(); ++l) {
      if (in.current[l].size() != num_slots) {
        return invalid_argument("current placement of layer " + std::to_string(l) + " has " +
                                std::to_string(in.current[l].size()) + " slots, expected " +
                                std::to_string(num_slots) +
                                " (max_ranks x current_slots_per_rank)");
      }
      for (int e : in.current[l]) {
        if (e < -1 || e >= in.num_experts) {
          return invalid_argument("current placement of layer " + std::to_string(l) +
                                  " holds expert " + std::to_string(e) + ", outside [-1, " +
                                  std::to_string(in.num_experts) + ")");
        }
      }
    }
  }
  return Status();
}

// Why hierarchical placement does not apply, or "" when it does.
std::string hierarchical_blocker(const PlanInput& in) {
  const int members = static_cast<int>(in.ranks.size());
  const int m = std::max(1, in.min_replicas);
  if (in.num_experts % in.num_groups != 0) return "num_experts is not a multiple of num_groups";
  if (in.num_groups % in.num_hosts != 0) return "num_groups is not a multiple of num_hosts";
  if (members % in.num_hosts != 0) return "the members do not split into num_hosts equal hosts";
  const int64_t ranks_per_host = members / in.num_hosts;
  const int64_t experts_per_host = in.num_experts / in.num_hosts;
  if (m > ranks_per_host || experts_per_host * m > ranks_per_host * in.slots_per_rank) {
    return "a host's slots cannot hold its groups' experts";
  }
  return "";
}

// Writes rank sets into one layer's slot row: an expert staying on a rank keeps its (first)
// slot; new experts, ascending, take the slots that were free first (the mover can fill those
// before anything is released), then the slots whose expert leaves.
void assign_slots(const PlanInput& in, int current_slots, const std::vector<std::vector<int>>& sets,
                  const std::vector<int>* current_row, std::vector<int>& row) {
  const int s_per = in.slots_per_rank;
  const int kept_slots = std::min(s_per, current_slots);  // slot indices both rows have
  row.assign(static_cast<size_t>(in.max_ranks) * s_per, -1);
  std::vector<int> fresh;
  for (size_t i = 0; i < in.ranks.size(); ++i) {
    int* out = &row[static_cast<size_t>(in.ranks[i]) * s_per];
    const int* old =
        current_row ? &(*current_row)[static_cast<size_t>(in.ranks[i]) * current_slots] : nullptr;
    const std::vector<int>& set = sets[i];
    fresh.clear();
    for (int e : set) {
      int keep = -1;
      for (int k = 0; old && k < kept_slots && keep < 0; ++k) {
        if (old[k] == e) keep = k;
      }
      if (keep >= 0) {
        out[keep] = e;
      } else {
        fresh.push_back(e);
      }
    }
    size_t next = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (int k = 0; k < s_per && next < fresh.size(); ++k) {
        const bool was_free = !old || k >= kept_slots || old[k] == -1;
        if (out[k] == -1 && was_free == (pass == 0)) out[k] = fresh[next++];
      }
    }
  }
}

// After the slots per rank shrank: drops experts from ranks holding more than `slots`. Spare
// replicas go first (no weights to move: most replicas, then lowest load per replica); a last
// replica must be received elsewhere whichever it is, so among those the rank drops the ones
// that bring its load nearest the mean rank load (what it drops goes to ranks with room).
void trim_to_slots(const std::vector<double>& load, int slots, int num_experts,
                   std::vector<std::vector<int>>& sets) {
  std::vector<int> count(num_experts, 0);
  for (const auto& set : sets) {
    for (int e : set) ++count[e];
  }
  double total = 0;
  for (int e = 0; e < num_experts; ++e) total += load[e];
  const double mean = total / static_cast<double>(sets.size());
  for (auto& set : sets) {
    while (static_cast<int>(set.size()) > slots) {
      double rank_load = 0;
      for (int e : set) rank_load += load[e] / count[e];
      const double want = (rank_load - mean) / static_cast<double>(set.size() - slots);
      auto worse = [&](int a, int b) {  // a goes before b
        const bool spare_a = count[a] > 1, spare_b = count[b] > 1;
        if (spare_a != spare_b) return spare_a;
        if (spare_a && count[a] != count[b]) return count[a] > count[b];
        const double pa = load[a] / count[a], pb = load[b] / count[b];
        if (spare_a) return pa != pb ? pa < pb : a < b;
        const double da = std::abs(pa - want), db = std::abs(pb - want);
        return da != db ? da < db : a < b;
      };
      auto drop = std::min_element(set.begin(), set.end(), worse);
      --count[*drop];
      set.erase(drop);
    }
  }
}

// Whether `current` is itself a valid plan that min_gain may keep: same slots per rank, every
// expert with enough replicas on members, nothing on non-members (nor free with fill_slots).
bool keepable(const PlanInput& in, int current_slots) {
  if (in.current.empty() || current_slots != in.slots_per_rank) return false;
  std::vector<uint8_t> member(in.max_ranks, 0);
  for (int r : in.ranks) member[r] = 1;
  const int m = std::max(1, in.min_replicas);
  std::vector<int> count(in.num_experts);
  for (const auto& row : in.current) {
    std::fill(count.begin(), count.end(), 0);
    for (size_t s = 0; s < row.size(); ++s) {
      const bool on_member = member[s / in.slots_per_rank] != 0;
      if (row[s] < 0) {
        if (on_member && in.fill_slots) return false;
        continue;
      }
      if (!on_member) return false;
      ++count[row[s]];
    }
    for (int c : count) {
      if (c < m) return false;
    }
  }
  return true;
}

}  // namespace

std::string_view policy_name(Policy policy) {
  switch (policy) {
    case Policy::kAuto:
      return "auto";
    case Policy::kGlobal:
      return "global";
    case Policy::kHierarchical:
      return "hierarchical";
  }
  return "?";
}

Result<Policy> parse_policy(std::string_view name) {
  if (name == "auto") return Policy::kAuto;
  if (name == "global") return Policy::kGlobal;
  if (name == "hierarchical") return Policy::kHierarchical;
  return invalid_argument("policy must be auto, global or hierarchical, got '" + std::string(name) +
                          "'");
}

Result<PlanOutput> plan(const PlanInput& in) {
  FLEX_RETURN_IF_ERROR(check_input(in));
  const std::string blocker = hierarchical_blocker(in);
  if (in.policy == Policy::kHierarchical && !blocker.empty()) {
    return invalid_argument("hierarchical policy not applicable: " + blocker);
  }
  LayerShape shape;
  shape.num_experts = in.num_experts;
  shape.slots_per_rank = in.slots_per_rank;
  shape.num_ranks = static_cast<int>(in.ranks.size());
  shape.num_hosts = in.num_hosts;
  shape.num_groups = in.num_groups;
  shape.min_replicas = std::max(1, in.min_replicas);
  shape.tolerance = in.tolerance;
  // One host: hierarchical is global under another name; kAuto reports global.
  shape.hierarchical_applicable =
      blocker.empty() && (in.num_hosts > 1 || in.policy == Policy::kHierarchical);

  shape.fill_slots = in.fill_slots;
  shape.greedy_after_change = in.greedy_after_change;
  const int current_slots =
      in.current_slots_per_rank > 0 ? in.current_slots_per_rank : in.slots_per_rank;

  PlanOutput out;
  const size_t num_layers = in.load.size();
  out.placement.resize(num_layers);
  out.balancedness.resize(num_layers);
  out.used.resize(num_layers);
  auto plan_one = [&](size_t l) {
    const std::vector<int>* current_row = in.current.empty() ? nullptr : &in.current[l];
    std::vector<std::vector<int>> current_sets(in.ranks.size());
    for (size_t i = 0; i < in.ranks.size() && current_row; ++i) {
      auto& set = current_sets[i];
      const int* slots = &(*current_row)[static_cast<size_t>(in.ranks[i]) * current_slots];
      for (int k = 0; k < current_slots; ++k) {
        if (slots[k] >= 0) set.push_back(slots[k]);
      }
      std::sort(set.begin(), set.end());
      set.erase(std::unique(set.begin(), set.end()), set.end());  // co-located copies: one stays
    }
    if (current_slots > in.slots_per_rank) {
      trim_to_slots(in.load[l], in.slots_per_rank, in.num_experts, current_sets);
    }
    detail::LayerResult layer = detail::plan_layer(shape, in.policy, in.load[l], current_sets);
    assign_slots(in, current_slots, layer.rank_sets, current_row, out.placement[l]);
    out.used[l] = layer.used;
    out.balancedness[l] = balancedness(in.load[l], out.placement[l], in.ranks, in.slots_per_rank);
  };
  int num_threads =
      in.num_threads > 0
          ? in.num_threads
          : std::min(kMaxPlanThreads, static_cast<int>(std::thread::hardware_concurrency()));
  num_threads = std::clamp(num_threads, 1, static_cast<int>(std::max<size_t>(1, num_layers)));
  // Layers write disjoint rows of `out`; which thread plans a layer does not change its plan.
  // The calling thread plans too; helpers that cannot be started leave their layers to it.
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t l; (l = next.fetch_add(1)) < num_layers;) plan_one(l);
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < num_threads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
  out.moved_slots = count_receives(in.current, current_slots, out.placement, in.slots_per_rank);
  if (keepable(in, current_slots)) {
    for (size_t l = 0; l < num_layers; ++l) {
      const double before = balancedness(in.load[l], in.current[l], in.ranks, in.slots_per_rank);
      out.balancedness_gain += (out.balancedness[l] - before) / static_cast<double>(num_layers);
    }
    if (in.min_gain > 0 && out.balancedness_gain < in.min_gain && out.moved_slots > 0) {
      out.skipped = true;
      out.placement = in.current;
      for (size_t l = 0; l < num_layers; ++l) {
        out.balancedness[l] = balancedness(in.load[l], in.current[l], in.ranks, in.slots_per_rank);
      }
      out.moved_slots = 0;
    }
  }
  return out;
}

std::vector<std::vector<double>> smooth_load(const std::vector<std::vector<double>>& previous,
                                             double weight,
                                             std::vector<std::vector<double>>& load) {
  bool same_shape = previous.size() == load.size();
  for (size_t l = 0; same_shape && l < load.size(); ++l) {
    same_shape = previous[l].size() == load[l].size();
  }
  std::vector<std::vector<double>> shares(load.size());
  for (size_t l = 0; l < load.size(); ++l) {
    double total = 0;
    for (double x : load[l]) total += x;
    shares[l].resize(load[l].size());
    for (size_t e = 0; e < load[l].size(); ++e) {
      const double now = total > 0 ? load[l][e] / total : 0.0;
      if (!same_shape) {
        shares[l][e] = now;
      } else if (total > 0) {
        shares[l][e] = weight * previous[l][e] + (1 - weight) * now;
      } else {
        shares[l][e] = previous[l][e];
      }
      if (total > 0) load[l][e] = shares[l][e] * total;
    }
  }
  return shares;
}

double balancedness(const std::vector<double>& load_row, const std::vector<int>& placement_row,
                    const std::vector<int>& ranks, int slots_per_rank) {
  const int num_experts = static_cast<int>(load_row.size());
  auto expert_at = [&](int rank, int k) {
    const size_t s = static_cast<size_t>(rank) * slots_per_rank + k;
    const int e = s < placement_row.size() ? placement_row[s] : -1;
    return e < num_experts ? e : -1;
  };
  std::vector<int> count(num_experts, 0);
  for (int r : ranks) {
    for (int k = 0; k < slots_per_rank; ++k) {
      if (const int e = expert_at(r, k); e >= 0) ++count[e];
    }
  }
  double total = 0, max_load = 0;
  for (int r : ranks) {
    double sum = 0;
    for (int k = 0; k < slots_per_rank; ++k) {
      if (const int e = expert_at(r, k); e >= 0) sum += load_row[e] / count[e];
    }
    total += sum;
    max_load = std::max(max_load, sum);
  }
  if (max_load <= 0 || ranks.empty()) return 1.0;
  return total / static_cast<double>(ranks.size()) / max_load;
}

int64_t count_moves(const std::vector<int>& from_row, const std::vector<int>& to_row) {
  int64_t moves = 0;
  for (size_t s = 0; s < to_row.size(); ++s) {
    const int before = s < from_row.size() ? from_row[s] : -1;
    if (to_row[s] != -1 && to_row[s] != before) ++moves;
  }
  return moves;
}

int64_t count_moves(const std::vector<std::vector<int>>& from,
                    const std::vector<std::vector<int>>& to) {
  int64_t moves = 0;
  const std::vector<int> none;
  for (size_t l = 0; l < to.size(); ++l) {
    moves += count_moves(l < from.size() ? from[l] : none, to[l]);
  }
  return moves;
}

int64_t count_receives(const std::vector<int>& from_row, int from_slots_per_rank,
                       const std::vector<int>& to_row, int to_slots_per_rank) {
  const size_t from_ranks = from_slots_per_rank > 0 ? from_row.size() / from_slots_per_rank : 0;
  const size_t to_ranks = to_row.size() / to_slots_per_rank;
  int num_experts = 0;
  for (int e : from_row) num_experts = std::max(num_experts, e + 1);
  for (int e : to_row) num_experts = std::max(num_experts, e + 1);
  // mark[e] == stamp: e is on rank r (in `from`, or counted already); stamps avoid clearing.
  std::vector<size_t> mark(num_experts, 0);
  int64_t receives = 0;
  for (size_t r = 0; r < to_ranks; ++r) {
    const size_t stamp = r + 1;
    for (int k = 0; r < from_ranks && k < from_slots_per_rank; ++k) {
      if (const int e = from_row[r * from_slots_per_rank + k]; e >= 0) mark[e] = stamp;
    }
    for (int k = 0; k < to_slots_per_rank; ++k) {
      const int e = to_row[r * to_slots_per_rank + k];
      if (e >= 0 && mark[e] != stamp) {
        mark[e] = stamp;
        ++receives;
      }
    }
  }
  return receives;
}

int64_t count_receives(const std::vector<std::vector<int>>& from, int from_slots_per_rank,
                       const std::vector<std::vector<int>>& to, int to_slots_per_rank) {
  int64_t receives = 0;
  const std::vector<int> none;
  for (size_t l = 0; l < to.size(); ++l) {
    receives += count_receives(l < from.size() ? from[l] : none, from_slots_per_rank, to[l],
                               to_slots_per_rank);
  }
  return receives;
}

}  // namespace flexpert::eplb
