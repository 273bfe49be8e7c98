// SPDX-License-Identifier: Apache-2.0
#include "eplb/transition.h"

#include <algorithm>
#include <string>

namespace flexpert::eplb {
namespace {

constexpr int kFree = -1;

bool rank_holds(const std::vector<int>& map, int rank, int slots_per_rank, int expert) {
  const auto first = map.begin() + static_cast<std::ptrdiff_t>(rank) * slots_per_rank;
  return std::find(first, first + slots_per_rank, expert) != first + slots_per_rank;
}

std::vector<int> replica_counts(const std::vector<int>& map, int num_experts) {
  std::vector<int> count(static_cast<size_t>(num_experts), 0);
  for (int e : map) {
    if (e >= 0) ++count[e];
  }
  return count;
}

}  // namespace

Result<TransitionStep> next_transition_step(const std::vector<int>& current,
                                            const std::vector<int>& target, int slots_per_rank,
                                            int num_experts) {
  if (current.size() != target.size() || slots_per_rank <= 0 ||
      current.size() % static_cast<size_t>(slots_per_rank) != 0) {
    return invalid_argument("transition: maps of different shapes");
  }
  if (current == target) return not_found("transition: already at the target");
  const int S = slots_per_rank;
  TransitionStep step;
  step.map = current;

  std::vector<int> count = replica_counts(current, num_experts);
  // A misplaced last replica whose planned slots are all taken can only move by
  // staging through a free slot: keep one free slot for that.
  bool stuck = false;
  for (size_t s = 0; s < current.size() && !stuck; ++s) {
    const int e = current[s];
    if (e < 0 || e == target[s] || count[e] > 1) continue;
    bool direct = false;
    for (size_t t = 0; t < target.size(); ++t) direct |= target[t] == e && current[t] == kFree;
    stuck = !direct;
  }
  int free_left = static_cast<int>(std::count(current.begin(), current.end(), kFree));

  // 1. Fill free slots the plan wants filled, from a holder (same rank preferred).
  for (size_t s = 0; s < target.size(); ++s) {
    if (current[s] != kFree || target[s] == kFree) continue;
    // The last free slot goes to an expert whose only replica is misplaced (that
    // unblocks a chain); a redundant copy there would leave a cycle no room.
    const bool unblocks = count[target[s]] == 1 && [&] {
      for (size_t t = 0; t < current.size(); ++t) {
        if (current[t] == target[s]) return target[t] != target[s];
      }
      return false;
    }();
    if (stuck && free_left <= 1 && !unblocks) continue;
    int src = -1;
    for (size_t t = 0; t < current.size(); ++t) {
      if (current[t] != target[s]) continue;
      if (src < 0 || static_cast<int>(t) / S == static_cast<int>(s) / S) src = static_cast<int>(t);
    }
    if (src < 0) continue;  // Held nowhere yet: it arrives once staged.
    step.copies.emplace_back(static_cast<int>(s), src);
    step.map[s] = target[s];
    --free_left;
  }
  if (!step.copies.empty()) return step;

  // 2. Free slots whose expert the plan moves, keeping one replica of each.
  step.kind = TransitionStep::Kind::kFree;
  // Order: slots the plan wants for an expert whose only replica is misplaced
  // (freeing them unblocks a chain), then slots wanted for any expert, then the
  // rest. The copy that survives is the one a later step still needs.
  auto misplaced_single = [&](int e) {
    if (e < 0 || count[e] != 1) return false;
    for (size_t t = 0; t < current.size(); ++t) {
      if (current[t] == e) return target[t] != e;
    }
    return false;
  };
  for (int pass = 0; pass < 3; ++pass) {
    for (size_t s = 0; s < current.size(); ++s) {
      const int e = current[s];
      if (e < 0 || e == target[s] || count[e] <= 1) continue;
      const int rank_of_pass = misplaced_single(target[s]) ? 0 : target[s] != kFree ? 1 : 2;
      if (rank_of_pass != pass) continue;
      step.map[s] = kFree;
      --count[e];
    }
  }
  if (step.map != current) return step;

  // 3. Stage misplaced last replicas in free slots (another rank preferred; a
  //    second copy on the same rank is valid and lasts one step).
  step.kind = TransitionStep::Kind::kFill;
  for (size_t s = 0; s < current.size(); ++s) {
    const int e = current[s];
    if (e < 0 || e == target[s]) continue;
    // Prefer a slot the plan leaves free (so the next step frees the old one, not
    // this copy), then another rank.
    int dst = -1;
    for (int pass = 0; pass < 4 && dst < 0; ++pass) {
      for (size_t f = 0; f < step.map.size() && dst < 0; ++f) {
        if (step.map[f] != kFree) continue;
        const bool planned_free = target[f] == kFree;
        const bool other_rank = !rank_holds(step.map, static_cast<int>(f) / S, S, e);
        const bool ok = pass == 0   ? planned_free && other_rank
                        : pass == 1 ? planned_free
                        : pass == 2 ? other_rank
                                    : true;
        if (ok) dst = static_cast<int>(f);
      }
    }
    if (dst < 0) break;
    step.copies.emplace_back(dst, static_cast<int>(s));
    step.map[dst] = e;
  }
  if (!step.copies.empty()) return step;

  // 4. Every slot taken: give up one surplus replica so the next step can stage.
  step.kind = TransitionStep::Kind::kFree;
  for (size_t s = 0; s < current.size(); ++s) {
    const int e = current[s];
    if (e >= 0 && count[e] > 1) {
      step.map[s] = kFree;
      return step;
    }
  }
  return resource_exhausted("transition: no free slot to stage through (add spare slots)");
}

}  // namespace flexpert::eplb
