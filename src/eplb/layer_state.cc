// SPDX-License-Identifier: Apache-2.0
#include "eplb/layer_state.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "flexpert/logging.h"

namespace flexpert::eplb::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A tournament tree over n keys: the index with the smallest key (ties: the lowest index) in
// O(1), a key change in O(log n). Cheaper than a binary heap of pairs for the few hundred
// ranks or experts a layer has, and without stale entries. Nodes carry the winner's key, so a
// level costs one dependent load, not two.
class MinTree {
 public:
  explicit MinTree(const std::vector<double>& keys) : leaves_(1) {
    const int n = static_cast<int>(keys.size());
    while (leaves_ < n) leaves_ *= 2;
    key_.assign(2 * static_cast<size_t>(leaves_), kInf);
    idx_.assign(2 * static_cast<size_t>(leaves_), 0);
    for (int i = 0; i < leaves_; ++i) {
      idx_[leaves_ + i] = i;
      if (i < n) key_[leaves_ + i] = keys[i];
    }
    for (int v = leaves_ - 1; v >= 1; --v) pull(v);
  }
  int top() const { return idx_[1]; }
  double top_key() const { return key_[1]; }
  // The index with the smallest finite key (ties: the lowest index) for which ok(index) holds;
  // -1 when none. Reads only: a node's winner is the least of its subtree, so subtrees that
  // cannot beat the best found are skipped and only the paths to excluded leaves are walked.
  template <typename Ok>
  int top_where(Ok ok) {
    int best = -1;
    double best_key = kInf;
    stack_.assign(1, 1);
    while (!stack_.empty()) {
      const int v = stack_.back();
      stack_.pop_back();
      const double k = key_[v];
      const int i = idx_[v];
      if (!(k < kInf) || (best >= 0 && (k > best_key || (k == best_key && i > best)))) continue;
      if (ok(i)) {
        best = i, best_key = k;
      } else if (v < leaves_) {
        const bool right_first = key_[2 * v + 1] < key_[2 * v];  // popped first: pushed last
        stack_.push_back(right_first ? 2 * v : 2 * v + 1);
        stack_.push_back(right_first ? 2 * v + 1 : 2 * v);
      }
    }
    return best;
  }
  // The path to the root is re-played with the new winner kept in registers (pull's rule: the
  // right child wins only when strictly smaller), so no level reads back what it just stored.
  void set(int i, double key) {
    int v = leaves_ + i;
    key_[v] = key;
    double k = key;
    int idx = idx_[v];
    for (; v > 1; v /= 2) {
      const double other = key_[v ^ 1];
      const int other_idx = idx_[v ^ 1];
      const bool take_other = (v & 1) ? !(k < other) : other < k;
      k = take_other ? other : k;
      idx = take_other ? other_idx : idx;
      key_[v / 2] = k;
      idx_[v / 2] = idx;
    }
  }

 private:
  // NOTE: written as selects of loaded values so that it compiles without branches: which
  // child wins is unpredictable, and a mispredicted branch per level dominated the packing.
  void pull(int v) {
    const double left = key_[2 * v], right = key_[2 * v + 1];
    const int left_idx = idx_[2 * v], right_idx = idx_[2 * v + 1];
    const bool take_right = right < left;  // the left (lower index) wins ties
    key_[v] = take_right ? right : left;
    idx_[v] = take_right ? right_idx : left_idx;
  }

  int leaves_;
  std::vector<double> key_;  // [node]
  std::vector<int> idx_;     // [node]: the winning leaf
  std::vector<int> stack_;   // top_where's nodes to visit
};

}  // namespace

LayerState::LayerState(const std::vector<double>& load, int num_ranks, int slots_per_rank)
    : load_(&load),
      num_ranks_(num_ranks),
      slots_(slots_per_rank),
      items_(static_cast<size_t>(num_ranks) * slots_per_rank, -1),
      size_(num_ranks, 0),
      rank_load_(num_ranks, 0.0),
      count_(load.size(), 0),
      per_(load),
      more_(load.size()),
      fewer_(load.size()),
      has_(load.size() * num_ranks, 0),
      holders_(new int[load.size() * static_cast<size_t>(num_ranks)]) {
  for (size_t e = 0; e < load.size(); ++e) set_count_changed(static_cast<int>(e));
}

void LayerState::place(int rank, int expert) {
  FLEX_CHECK(size_[rank] < slots_ && !holds(rank, expert))
      << "rank " << rank << " expert " << expert;
  items_[static_cast<size_t>(rank) * slots_ + size_[rank]++] = expert;
  has_[static_cast<size_t>(expert) * num_ranks_ + rank] = 1;
  holders_[static_cast<size_t>(expert) * num_ranks_ + count_[expert]++] = rank;
}

void LayerState::unplace(int rank, int expert) {
  FLEX_CHECK(holds(rank, expert)) << "rank " << rank << " expert " << expert;
  int* it = &items_[static_cast<size_t>(rank) * slots_];
  int* pos = std::find(it, it + size_[rank], expert);
  std::copy(pos + 1, it + size_[rank], pos);  // keeps the others' order
  --size_[rank];
  has_[static_cast<size_t>(expert) * num_ranks_ + rank] = 0;
  int* h = &holders_[static_cast<size_t>(expert) * num_ranks_];
  int* const end = h + count_[expert]--;
  int* at = std::find(h, end, rank);
  std::copy(at + 1, end, at);  // keeps the others' order
}

void LayerState::set_count_changed(int expert) {
  const int c = count(expert);
  const double w = weight(expert);
  per_[expert] = c > 0 ? w / c : w;
  more_[expert] = w / (c + 1);
  fewer_[expert] = c > 1 ? w / (c - 1) : std::numeric_limits<double>::infinity();
}

// NOTE: loads are updated by differences, not re-summed: a search step must cost O(replicas of
// the experts it touches), and plans compare loads with a relative slack far above the rounding
// error this accumulates.
void LayerState::add(int rank, int expert) {
  const double before = per_[expert];
  place(rank, expert);
  set_count_changed(expert);
  const double delta = per_[expert] - before;
  for (int g : holders(expert)) rank_load_[g] += g == rank ? per_[expert] : delta;
}

void LayerState::remove(int rank, int expert) {
  const double before = per_[expert];
  unplace(rank, expert);
  set_count_changed(expert);
  rank_load_[rank] -= before;
  const double delta = per_[expert] - before;
  for (int g : holders(expert)) rank_load_[g] += delta;
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
  for (size_t e = 0; e < count_.size(); ++e) set_count_changed(static_cast<int>(e));
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

std::vector<int> greedy_counts(const std::vector<double>& load, const Domain& domain, int num_slots,
                               int min_replicas) {
  const int n = static_cast<int>(domain.experts.size());
  const int cap = domain.num_ranks();
  std::vector<int> counts(n, min_replicas);
  // Replicas the greedy surely gives. Its last pick has a load per replica lambda with
  // num_slots <= n min_replicas + W / lambda (W: the total load), so lambda < lambda0 =
  // W / (num_slots - n min_replicas): every replica with a load >= lambda0 is among its picks,
  // and starting from those picks the same set, faster.
  const int64_t extra = num_slots - static_cast<int64_t>(n) * min_replicas;
  if (extra > 0) {
    double total = 0;
    for (int e : domain.experts) total += load[e];
    const double lambda0 = total / static_cast<double>(extra) * (1 + 1e-9);
    for (int i = 0; i < n && lambda0 > 0; ++i) {
      const double sure = std::floor(load[domain.experts[i]] / lambda0);
      counts[i] = static_cast<int>(std::clamp<double>(sure, min_replicas, cap));
    }
  }
  int64_t left = num_slots;
  for (int c : counts) left -= c;
  // The next replica to the highest load per replica; ties to the lowest id (DeepSeek and
  // TensorRT-LLM alike). Keys are negated: the tree finds minima.
  std::vector<double> keys(n, kInf);
  for (int i = 0; i < n; ++i) {
    if (counts[i] < cap) keys[i] = -load[domain.experts[i]] / counts[i];
  }
  MinTree tree(keys);
  while (left > 0 && tree.top_key() < kInf) {
    const int i = tree.top();
    ++counts[i];
    --left;
    tree.set(i, counts[i] < cap ? -load[domain.experts[i]] / counts[i] : kInf);
  }
  return counts;
}

void pack_lpt(LayerState& state, const Domain& domain, const std::vector<int>& counts) {
  const int num_ranks = domain.num_ranks();
  const int slots = state.slots_per_rank();
  const int n = static_cast<int>(domain.experts.size());
  std::vector<double> per(n);
  std::vector<int> by_per(n);
  for (int i = 0; i < n; ++i) {
    per[i] = state.weight(domain.experts[i]) / counts[i];
    by_per[i] = i;
  }
  // Heaviest replicas first; ties by expert (replicas of one expert are interchangeable, so
  // sorting the experts and repeating each counts[i] times gives the order of the replicas).
  std::sort(by_per.begin(), by_per.end(),
            [&](int a, int b) { return per[a] != per[b] ? per[a] > per[b] : a < b; });
  std::vector<int> list;  // domain expert index per replica, heaviest replicas first
  for (int i : by_per) list.insert(list.end(), counts[i], i);
  // Local bookkeeping with the final per-replica loads; the state is filled at the end.
  std::vector<double> load(num_ranks, 0.0);
  std::vector<int> held(static_cast<size_t>(num_ranks) * slots);  // [rank * slots + k]
  std::vector<int> size(num_ranks, 0);
  std::vector<uint8_t> has(static_cast<size_t>(n) * num_ranks, 0);
  auto has_at = [&](int i, int r) -> uint8_t& {
    return has[static_cast<size_t>(i) * num_ranks + r];
  };
  auto place = [&](int r, int i) {
    held[static_cast<size_t>(r) * slots + size[r]++] = i;
    has_at(i, r) = 1;
    load[r] += per[i];
  };
  // The heaviest replica goes to the least loaded rank with room that lacks its expert. While
  // the ranks are still empty (and the replicas carry load) that is simply the next rank.
  size_t li = 0;
  for (; li < list.size() && static_cast<int>(li) < num_ranks && per[list[li]] > 0; ++li) {
    place(static_cast<int>(li), list[li]);
  }
  std::vector<double> keys(num_ranks);
  for (int r = 0; r < num_ranks; ++r) keys[r] = size[r] < slots ? load[r] : kInf;
  MinTree open(keys);  // ranks with room, by load
  for (; li < list.size(); ++li) {
    int i = list[li];
    int chosen = open.top_where([&](int r) { return !has_at(i, r); });
    if (chosen < 0) {
      // Every rank with room holds this expert already. Take the least loaded of them, r, and
      // a full rank q without the expert; q has an item x that r lacks (r holds at most
      // slots - 1 items, one of them this expert, q holds `slots` others): x moves to r and the
      // expert takes its place on q.
      FLEX_CHECK(open.top_key() < kInf) << "more replicas than slots";
      const int r = open.top();
      int best_q = -1, best_k = -1;
      double best_peak = kInf;
      for (int q = 0; q < num_ranks; ++q) {
        if (size[q] < slots || has_at(i, q)) continue;
        for (int k = 0; k < slots; ++k) {
          const int x = held[static_cast<size_t>(q) * slots + k];
          if (has_at(x, r)) continue;
          const double peak = std::max(load[r] + per[x], load[q] - per[x] + per[i]);
          if (peak < best_peak) best_peak = peak, best_q = q, best_k = k;
        }
      }
      FLEX_CHECK(best_q >= 0) << "no valid swap while packing";
      int& slot = held[static_cast<size_t>(best_q) * slots + best_k];
      const int x = slot;
      has_at(x, best_q) = 0;
      has_at(i, best_q) = 1;
      load[best_q] += per[i] - per[x];
      slot = i;
      chosen = r;
      i = x;
    }
    place(chosen, i);
    open.set(chosen, size[chosen] < slots ? load[chosen] : kInf);
  }
  std::vector<std::vector<int>> sets(state.num_ranks());
  for (int r = 0; r < num_ranks; ++r) {
    for (int k = 0; k < size[r]; ++k) {
      sets[domain.rank_begin + r].push_back(
          domain.experts[held[static_cast<size_t>(r) * slots + k]]);
    }
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
            if (g != r)
              peak = std::max(peak,
                              state.rank_load(g) + delta_y + (state.holds(g, e) ? delta_e : 0.0));
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
