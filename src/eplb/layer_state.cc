// SPDX-License-Identifier: Apache-2.0
#include "eplb/layer_state.h"

#include <algorithm>
#include <limits>
#include <queue>

#include "flexpert/logging.h"

namespace flexpert::eplb::detail {

LayerState::LayerState(const std::vector<double>& load, int num_ranks, int slots_per_rank)
    : load_(&load),
      num_ranks_(num_ranks),
      slots_(slots_per_rank),
      items_(static_cast<size_t>(num_ranks) * slots_per_rank, -1),
      size_(num_ranks, 0),
      rank_load_(num_ranks, 0.0),
      per_(load),
      has_(load.size() * num_ranks, 0),
      holders_(load.size()) {}

void LayerState::place(int rank, int expert) {
  FLEX_CHECK(size_[rank] < slots_ && !holds(rank, expert)) << "rank " << rank << " expert " << expert;
  items_[static_cast<size_t>(rank) * slots_ + size_[rank]++] = expert;
  has_[static_cast<size_t>(expert) * num_ranks_ + rank] = 1;
  holders_[expert].push_back(rank);
}

void LayerState::unplace(int rank, int expert) {
  FLEX_CHECK(holds(rank, expert)) << "rank " << rank << " expert " << expert;
  int* it = &items_[static_cast<size_t>(rank) * slots_];
  int* pos = std::find(it, it + size_[rank], expert);
  std::copy(pos + 1, it + size_[rank], pos);  // keeps the others' order
  --size_[rank];
  has_[static_cast<size_t>(expert) * num_ranks_ + rank] = 0;
  auto& h = holders_[expert];
  h.erase(std::find(h.begin(), h.end(), rank));
}

// NOTE: loads are updated by differences, not re-summed: a search step must cost O(replicas of
// the experts it touches), and plans compare loads with a relative slack far above the rounding
// error this accumulates.
void LayerState::set_count_changed(int expert) {
  const int c = count(expert);
  per_[expert] = c > 0 ? weight(expert) / c : weight(expert);
}

void LayerState::add(int rank, int expert) {
  const double before = per_[expert];
  place(rank, expert);
  set_count_changed(expert);
  const double delta = per_[expert] - before;
  for (int g : holders_[expert]) rank_load_[g] += g == rank ? per_[expert] : delta;
}

void LayerState::remove(int rank, int expert) {
  const double before = per_[expert];
  unplace(rank, expert);
  set_count_changed(expert);
  rank_load_[rank] -= before;
  const double delta = per_[expert] - before;
  for (int g : holders_[expert]) rank_load_[g] += delta;
}

void LayerState::move(int from, int to, int expert) {
  unplace(from, expert);
  place(to, expert);
  rank_load_[from] -= per_[expert];
  rank_load_[to] += per_[expert];
}

void LayerState::swap(int a, int x, int b, int y) {
  unplace(a, x);
  unplace(b, y);
  place(a, y);
  place(b, x);
  rank_load_[a] += per_[y] - per_[x];
  rank_load_[b] += per_[x] - per_[y];
}

void LayerState::add_all(const std::vector<std::vector<int>>& sets) {
  for (size_t r = 0; r < sets.size(); ++r) {
    for (int e : sets[r]) place(static_cast<int>(r), e);
  }
  for (size_t e = 0; e < holders_.size(); ++e) set_count_changed(static_cast<int>(e));
  for (int r = 0; r < num_ranks_; ++r) {
    double sum = 0;
    for (int k = 0; k < size_[r]; ++k) sum += per_[items(r)[k]];
    rank_load_[r] = sum;
  }
}

double LayerState::max_load(const Domain& domain) const {
  double m = 0;
  for (int r = domain.rank_begin; r < domain.rank_end; ++r) m = std::max(m, rank_load_[r]);
  return m;
}

std::vector<std::vector<int>> LayerState::rank_sets() const {
  std::vector<std::vector<int>> sets(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) {
    sets[r].assign(items(r), items(r) + size_[r]);
    std::sort(sets[r].begin(), sets[r].end());
  }
  return sets;
}

std::vector<int> greedy_counts(const std::vector<double>& load, const Domain& domain,
                               int num_slots, int min_replicas) {
  const int n = static_cast<int>(domain.experts.size());
  std::vector<int> counts(n, min_replicas);
  int64_t left = num_slots - static_cast<int64_t>(n) * min_replicas;
  // Max-heap on load per replica; ties to the lowest id (DeepSeek and TensorRT-LLM alike).
  auto worse = [&](int a, int b) {
    const double pa = load[domain.experts[a]] / counts[a];
    const double pb = load[domain.experts[b]] / counts[b];
    return pa != pb ? pa < pb : domain.experts[a] > domain.experts[b];
  };
  std::priority_queue<int, std::vector<int>, decltype(worse)> heap(worse);
  for (int i = 0; i < n; ++i) {
    if (counts[i] < domain.num_ranks()) heap.push(i);
  }
  while (left > 0 && !heap.empty()) {
    const int i = heap.top();
    heap.pop();
    ++counts[i];
    --left;
    if (counts[i] < domain.num_ranks()) heap.push(i);
  }
  return counts;
}

void pack_lpt(LayerState& state, const Domain& domain, const std::vector<int>& counts) {
  const int num_ranks = domain.num_ranks();
  const int slots = state.slots_per_rank();
  const int n = static_cast<int>(domain.experts.size());
  struct Item {
    double per;
    int idx;  // into domain.experts
  };
  std::vector<Item> list;
  for (int i = 0; i < n; ++i) {
    const double per = state.weight(domain.experts[i]) / counts[i];
    for (int k = 0; k < counts[i]; ++k) list.push_back({per, i});
  }
  std::stable_sort(list.begin(), list.end(),
                   [](const Item& a, const Item& b) { return a.per > b.per; });
  // Local bookkeeping with final per-replica loads; the state is filled at the end.
  std::vector<double> load(num_ranks, 0.0);
  std::vector<std::vector<int>> held(num_ranks);  // domain expert indices
  std::vector<uint8_t> has(static_cast<size_t>(n) * num_ranks, 0);
  auto per_of = [&](int i) { return state.weight(domain.experts[i]) / counts[i]; };
  auto place = [&](int r, int i) {
    held[r].push_back(i);
    has[static_cast<size_t>(i) * num_ranks + r] = 1;
    load[r] += per_of(i);
  };
  using Key = std::pair<double, int>;
  std::priority_queue<Key, std::vector<Key>, std::greater<Key>> open;  // least loaded first
  for (int r = 0; r < num_ranks; ++r) {
    if (slots > 0) open.push({0.0, r});
  }
  std::vector<Key> skipped;
  for (const Item& item : list) {
    skipped.clear();
    int chosen = -1;
    while (!open.empty()) {
      const Key top = open.top();
      open.pop();
      if (!has[static_cast<size_t>(item.idx) * num_ranks + top.second]) {
        chosen = top.second;
        break;
      }
      skipped.push_back(top);
    }
    if (chosen < 0) {
      // Every rank with a free slot holds this expert already. Take the least loaded of them,
      // r, and a full rank q without the expert; q has an item x that r lacks (r holds at most
      // slots - 1 items, one of them this expert, q holds `slots` others): x moves to r and the
      // expert takes its place on q.
      FLEX_CHECK(!skipped.empty()) << "more replicas than slots";
      const int r = skipped.front().second;
      skipped.erase(skipped.begin());
      int best_q = -1, best_k = -1;
      double best_peak = std::numeric_limits<double>::infinity();
      for (int q = 0; q < num_ranks; ++q) {
        if (static_cast<int>(held[q].size()) < slots ||
            has[static_cast<size_t>(item.idx) * num_ranks + q]) {
          continue;
        }
        for (int k = 0; k < slots; ++k) {
          const int x = held[q][k];
          if (has[static_cast<size_t>(x) * num_ranks + r]) continue;
          const double peak = std::max(load[r] + per_of(x), load[q] - per_of(x) + item.per);
          if (peak < best_peak) best_peak = peak, best_q = q, best_k = k;
        }
      }
      FLEX_CHECK(best_q >= 0) << "no valid swap while packing";
      const int x = held[best_q][best_k];
      held[best_q].erase(held[best_q].begin() + best_k);
      has[static_cast<size_t>(x) * num_ranks + best_q] = 0;
      load[best_q] -= per_of(x);
      place(r, x);
      place(best_q, item.idx);
      if (static_cast<int>(held[r].size()) < slots) open.push({load[r], r});
    } else {
      place(chosen, item.idx);
      if (static_cast<int>(held[chosen].size()) < slots) open.push({load[chosen], chosen});
    }
    for (const Key& k : skipped) open.push(k);
  }
  std::vector<std::vector<int>> sets(state.num_ranks());
  for (int r = 0; r < num_ranks; ++r) {
    for (int i : held[r]) sets[domain.rank_begin + r].push_back(domain.experts[i]);
  }
  state.add_all(sets);
}

bool ensure_min_replicas(LayerState& state, const Domain& domain, int min_replicas) {
  std::vector<int> order;
  for (int e : domain.experts) {
    if (state.count(e) < min_replicas) order.push_back(e);
  }
  // Heaviest first, so it gets the best spot.
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return state.weight(a) > state.weight(b); });
  for (int e : order) {
    while (state.count(e) < min_replicas) {
      const double per_new = state.weight(e) / (state.count(e) + 1);
      const double delta_e = per_new - (state.count(e) > 0 ? state.per_replica(e) : 0.0);
      int best_r = -1, best_y = -1;
      double best_peak = std::numeric_limits<double>::infinity();
      for (int r = domain.rank_begin; r < domain.rank_end; ++r) {
        if (state.holds(r, e)) continue;
        const double lr = state.rank_load(r);
        if (state.size(r) < state.slots_per_rank()) {
          if (lr + per_new < best_peak) best_peak = lr + per_new, best_r = r, best_y = -1;
          continue;
        }
        for (int k = 0; k < state.size(r); ++k) {
          const int y = state.items(r)[k];
          if (state.count(y) <= min_replicas) continue;
          const double delta_y = state.weight(y) / (state.count(y) - 1) - state.per_replica(y);
          double peak = lr - state.per_replica(y) + per_new;
          for (int g : state.holders(y)) {
            if (g != r) peak = std::max(peak, state.rank_load(g) + delta_y +
                                                  (state.holds(g, e) ? delta_e : 0.0));
          }
          if (peak < best_peak) best_peak = peak, best_r = r, best_y = y;
        }
      }
      if (best_r < 0) return false;
      if (best_y >= 0) state.remove(best_r, best_y);
      state.add(best_r, e);
    }
  }
  return true;
}

}  // namespace flexpert::eplb::detail
