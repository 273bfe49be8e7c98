// SPDX-License-Identifier: Apache-2.0
// The local search of the planner (declared in layer_state.h): repeatedly relieve the hottest
// rank of a domain with the best single step.
#include <algorithm>
#include <array>
#include <limits>

#include "eplb/layer_state.h"

namespace flexpert::eplb::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Relative slack for float comparisons: rank loads are sums whose order may differ between two
// states holding the same sets.
constexpr double kRelEps = 1e-12;

struct Step {
  enum Kind { kNone, kMove, kSwap, kReplicate, kDrop };
  Kind kind = kNone;
  int x = -1;      // expert leaving or replicated from the hottest rank
  int y = -1;      // expert coming back (swap) or evicted on `to` (replicate), else -1
  int to = -1;     // partner rank
  double peak = kInf;  // highest load among the ranks the step changes, after it
  int cost = 0;        // slots that receive weights
};

class Chooser {
 public:
  Chooser(const SearchOptions& options, double bound) : options_(options), bound_(bound) {}

  // Keeps the better of the best so far and `s`. Only steps that end below the current max
  // (`bound_`) count. With minimise_moves, a step reaching the target beats one that does not,
  // and among those reaching it the one with fewer slot writes wins.
  void offer(const Step& s) {
    if (!(s.peak < bound_)) return;
    if (best_.kind == Step::kNone || better(s, best_)) best_ = s;
  }
  const Step& best() const { return best_; }

 private:
  bool reaches(const Step& s) const { return s.peak <= options_.target * (1 + kRelEps); }
  bool better(const Step& a, const Step& b) const {
    if (options_.minimise_moves) {
      const bool ra = reaches(a), rb = reaches(b);
      if (ra != rb) return ra;
      if (ra && a.cost != b.cost) return a.cost < b.cost;
    }
    if (a.peak != b.peak) return a.peak < b.peak;
    return a.cost < b.cost;
  }

  const SearchOptions& options_;
  double bound_;
  Step best_;
};

// The highest loads among each expert's holders, computed at most once per step and expert:
// evaluating a step must not walk the dozens of replicas of a hot expert again and again.
class HolderPeaks {
 public:
  explicit HolderPeaks(size_t num_experts) : stamp_(num_experts, -1), top_(num_experts) {}
  void next_step() { ++step_; }
  // Highest load among the ranks holding `expert` other than a and b; -inf when none.
  double max_except(const LayerState& state, int expert, int a, int b) {
    auto& top = top_[expert];
    if (stamp_[expert] != step_) {
      stamp_[expert] = step_;
      top.fill({-kInf, -1});
      for (int g : state.holders(expert)) {
        Entry e{state.rank_load(g), g};
        for (Entry& t : top) {
          if (e.load > t.load) std::swap(e, t);
        }
      }
    }
    for (const Entry& t : top) {
      if (t.rank != a && t.rank != b) return t.load;  // rank -1 carries -inf
    }
    return -kInf;
  }

 private:
  struct Entry {
    double load;
    int rank;
  };
  std::vector<int> stamp_;
  std::vector<std::array<Entry, 3>> top_;
  int step_ = 0;
};

int hottest(const LayerState& state, const Domain& domain) {
  int h = domain.rank_begin;
  for (int r = domain.rank_begin + 1; r < domain.rank_end; ++r) {
    if (state.rank_load(r) > state.rank_load(h)) h = r;
  }
  return h;
}

void apply(LayerState& state, int h, const Step& s) {
  switch (s.kind) {
    case Step::kMove:
      state.move(h, s.to, s.x);
      break;
    case Step::kSwap:
      state.swap(h, s.x, s.to, s.y);
      break;
    case Step::kReplicate:
      if (s.y >= 0) state.remove(s.to, s.y);
      state.add(s.to, s.x);
      break;
    case Step::kDrop:
      state.remove(h, s.x);
      break;
    case Step::kNone:
      break;
  }
}

}  // namespace

bool improve(LayerState& state, const Domain& domain, const SearchOptions& options) {
  const int slots = state.slots_per_rank();
  const int m = std::max(1, options.min_replicas);
  std::vector<int> cold;
  cold.reserve(domain.num_ranks());
  HolderPeaks peaks(state.num_experts());
  for (int iteration = 0;; ++iteration) {
    peaks.next_step();
    const int h = hottest(state, domain);
    const double lh = state.rank_load(h);
    if (lh <= options.target * (1 + kRelEps)) return true;
    if (iteration >= options.max_iterations || domain.num_ranks() < 1) return false;

    cold.clear();
    for (int r = domain.rank_begin; r < domain.rank_end; ++r) {
      if (r != h) cold.push_back(r);
    }
    const size_t k = std::min<size_t>(cold.size(), options.num_candidate_ranks);
    std::partial_sort(cold.begin(), cold.begin() + k, cold.end(), [&](int a, int b) {
      const double la = state.rank_load(a), lb = state.rank_load(b);
      return la != lb ? la < lb : a < b;
    });
    cold.resize(k);

    Chooser chooser(options, lh * (1 - kRelEps));
    const int* h_items = state.items(h);
    for (int hi = 0; hi < state.size(h); ++hi) {
      const int x = h_items[hi];
      const double px = state.per_replica(x);
      const int cx = state.count(x);
      const double px_more = state.weight(x) / (cx + 1);  // per replica with one more
      const double dx = px_more - px;
      // Drop a spare replica of x: free for the mover (a slot becoming free receives nothing).
      if (cx > m) {
        const double dx_less = state.weight(x) / (cx - 1) - px;
        chooser.offer({Step::kDrop, x, -1, -1,
                       std::max(lh - px, peaks.max_except(state, x, h, h) + dx_less), 0});
      }
      for (int r : cold) {
        if (state.holds(r, x)) continue;
        const double lr = state.rank_load(r);
        if (state.size(r) < slots) {
          chooser.offer({Step::kMove, x, -1, r, std::max(lh - px, lr + px), 1});
          chooser.offer({Step::kReplicate, x, -1, r, std::max(lh + dx, lr + px_more), 1});
        }
        const int* r_items = state.items(r);
        for (int ri = 0; ri < state.size(r); ++ri) {
          const int y = r_items[ri];
          const double py = state.per_replica(y);
          const bool h_has_y = state.holds(h, y);
          if (!h_has_y && py < px) {
            chooser.offer({Step::kSwap, x, y, r, std::max(lh - px + py, lr - py + px), 2});
          }
          const int cy = state.count(y);
          if (cy <= m) continue;
          // One more replica of x in place of one of y: every replica of x gets lighter, every
          // other replica of y heavier. NOTE: a rank holding both x and y is scored without the
          // relief from x (an upper bound), so the hot path stays O(1) per candidate.
          const double dy = state.weight(y) / (cy - 1) - py;
          const double peak = std::max(lh + dx + (h_has_y ? dy : 0.0), lr - py + px_more);
          if (!(peak < lh)) continue;
          chooser.offer({Step::kReplicate, x, y, r,
                         std::max(peak, peaks.max_except(state, y, r, h) + dy), 1});
        }
      }
    }
    if (chooser.best().kind == Step::kNone) return false;
    apply(state, h, chooser.best());
  }
}

}  // namespace flexpert::eplb::detail
