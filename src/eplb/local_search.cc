// SPDX-License-Identifier: Apache-2.0
// The local search of the planner (declared in layer_state.h): repeatedly relieve the hottest
// rank of a domain with the best single step.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLEXPERT_EPLB_AVX2 1
#endif

#include "eplb/layer_state.h"

namespace flexpert::eplb::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kLazy = std::numeric_limits<double>::quiet_NaN();
// Relative slack for float comparisons: rank loads are sums whose order may differ between two
// states holding the same sets.
constexpr double kRelEps = 1e-12;

struct Step {
  enum Kind { kNone, kMove, kSwap, kReplicate, kDrop };
  Kind kind = kNone;
  int x = -1;          // expert leaving or replicated from the hottest rank
  int y = -1;          // expert coming back (swap) or evicted on `to` (replicate), else -1
  int to = -1;         // partner rank
  double peak = kInf;  // highest load among the ranks the step changes, after it
  int cost = 0;        // slots that receive weights
};

// Keeps the best step offered. Only steps that end below the current max (`bound`) count.
// With minimise_moves, a step reaching the target beats one that does not, and among those
// reaching it the one with fewer slot writes wins; otherwise (and then) the lower peak; the first
// offered wins ties, so the enumeration order makes the result deterministic.
class Chooser {
 public:
  Chooser(const SearchOptions& options, double bound)
      : minimise_moves_(options.minimise_moves),
        reach_(options.target * (1 + kRelEps)),
        bound_(bound) {}

  void offer(Step::Kind kind, int x, int y, int to, double peak, int cost) {
    if (!(peak < bound_)) return;
    const int tier = minimise_moves_ && peak <= reach_ ? cost : kNotReached;
    if (best_.kind != Step::kNone &&
        (tier > best_tier_ || (tier == best_tier_ && !(peak < best_.peak)))) {
      return;
    }
    best_ = Step{kind, x, y, to, peak, cost};
    best_tier_ = tier;
  }
  const Step& best() const { return best_; }
  double bound() const { return bound_; }
  // The peak up to which the target counts as reached; -inf without minimise_moves.
  double reach() const { return minimise_moves_ ? reach_ : -kInf; }
  // A key whose order is the order of preference above (smaller first); +inf for a step that
  // does not count. For choosing among many candidates before offering the best.
  double key(double peak, int cost, double scale) const {
    if (!(peak < bound_)) return kInf;
    const int tier = minimise_moves_ && peak <= reach_ ? cost + kCostBias : kTiers;
    return peak + scale * tier;
  }
  static constexpr int kCostBias = 2;  // the lowest cost: a swap that takes back two receives
  static constexpr int kTiers = 5;

 private:
  static constexpr int kNotReached = 1 << 20;
  bool minimise_moves_;
  double reach_;
  double bound_;
  Step best_;
  int best_tier_ = kNotReached;
};

#ifdef FLEXPERT_EPLB_AVX2
// Scoring one replica x of the hottest rank against the partners' replicas y, four at a time.
// NOTE: a branch per test in the scalar loop of improve() was most of a plan's time; here the
// tests are masks. The arithmetic is the scalar loop's, operation for operation (the scalar
// key's peak + scale * tier compiles to one fused multiply-add with FMA, as here), so that
// both give the same keys and the plans do not change (tests/eplb/golden_test.cc).
struct PairBlock {
  // Per candidate y (inputs): its rank, load per replica, that or +inf where the hottest rank
  // holds y (no swap), its rank's load without it, what evicting it adds to the hottest rank,
  // the receives a swap or an eviction changes on y's side.
  const int* rank;
  const double* py;
  const double* swap_py;
  const double* rest;
  const double* h_dy;
  const int* y_swap_cost;
  const int* y_evict_cost;
  // x: which ranks hold it, which held it before the plan; the hottest rank's load after
  // giving x up (before taking y), after x gains a replica; x's load per replica now and with
  // one replica more; 1 when x is a receive on the hottest rank.
  const uint8_t* x_on;
  const uint8_t* x_held;
  double h_swap, h_evict, px, px_more;
  int x_new;
  // The chooser's key: scale, reach (-inf: the target never counts), bound.
  double scale, reach, bound;
  // Per candidate: the highest load among y's other holders after evicting it (+inf: y has
  // no replica to spare).
  const double* evict_peak;
  // Per candidate (outputs): the swap's key and the eviction's; +inf where the step does not
  // count.
  double* swap_key;
  double* evict_key;
};

// The smallest of four lanes.
double lane_min(__m256d v) {
  const __m128d half = _mm_min_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return std::min(_mm_cvtsd_f64(half), _mm_cvtsd_f64(_mm_unpackhi_pd(half, half)));
}

struct PairMinima {
  double swap_key, evict_key;
};

// Scores n candidates, n a multiple of 4; returns the smallest keys.
PairMinima score_pairs(const PairBlock& b, int n) {
  const __m256d inf = _mm256_set1_pd(kInf);
  const __m256d h_swap = _mm256_set1_pd(b.h_swap), h_evict = _mm256_set1_pd(b.h_evict);
  const __m256d px = _mm256_set1_pd(b.px), px_more = _mm256_set1_pd(b.px_more);
  const __m256d x_new = _mm256_set1_pd(b.x_new), bias = _mm256_set1_pd(Chooser::kCostBias);
  const __m256d tiers = _mm256_set1_pd(Chooser::kTiers);
  const __m256d scale = _mm256_set1_pd(b.scale), reach = _mm256_set1_pd(b.reach);
  const __m256d bound = _mm256_set1_pd(b.bound);
  // Chooser::key: +inf unless peak < bound; tier = cost + bias where peak <= reach.
  auto key = [&](__m256d peak, __m256d cost) {
    const __m256d reached = _mm256_cmp_pd(peak, reach, _CMP_LE_OQ);
    const __m256d tier = _mm256_blendv_pd(tiers, _mm256_add_pd(cost, bias), reached);
    const __m256d k = _mm256_fmadd_pd(scale, tier, peak);
    return _mm256_blendv_pd(inf, k, _mm256_cmp_pd(peak, bound, _CMP_LT_OQ));
  };
  __m256d swap_min = inf, evict_min = inf;
  for (int j = 0; j < n; j += 4) {
    // Built in registers: four scalar stores read back as one vector stall the load.
    const int r0 = b.rank[j], r1 = b.rank[j + 1], r2 = b.rank[j + 2], r3 = b.rank[j + 3];
    const __m256d blk = _mm256_setr_pd(b.x_on[r0] ? kInf : 0.0, b.x_on[r1] ? kInf : 0.0,
                                       b.x_on[r2] ? kInf : 0.0, b.x_on[r3] ? kInf : 0.0);
    const __m256d xc =
        _mm256_setr_pd(1 - b.x_held[r0], 1 - b.x_held[r1], 1 - b.x_held[r2], 1 - b.x_held[r3]);
    const __m256d py = _mm256_loadu_pd(b.py + j), rest = _mm256_loadu_pd(b.rest + j);
    // std::max(a, b) is a < b ? b : a, which max_pd(b, a) is.
    const __m256d s = _mm256_max_pd(_mm256_add_pd(rest, px), _mm256_add_pd(h_swap, py));
    const __m256d can_swap =
        _mm256_cmp_pd(_mm256_add_pd(_mm256_loadu_pd(b.swap_py + j), blk), px, _CMP_LT_OQ);
    const __m256d swap_cost = _mm256_sub_pd(
        _mm256_add_pd(_mm256_cvtepi32_pd(
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.y_swap_cost + j))),
                      xc),
        x_new);
    const __m256d swap_key = key(_mm256_blendv_pd(inf, s, can_swap), swap_cost);
    _mm256_storeu_pd(b.swap_key + j, swap_key);
    swap_min = _mm256_min_pd(swap_min, swap_key);
    const __m256d e = _mm256_max_pd(_mm256_add_pd(rest, px_more),
                                    _mm256_add_pd(h_evict, _mm256_loadu_pd(b.h_dy + j)));
    // std::max(e + blk, evict_peak), as max_pd(b, a) is.
    const __m256d peak = _mm256_max_pd(_mm256_loadu_pd(b.evict_peak + j), _mm256_add_pd(e, blk));
    const __m256d evict_cost = _mm256_add_pd(
        _mm256_cvtepi32_pd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.y_evict_cost + j))),
        xc);
    const __m256d evict_key = key(peak, evict_cost);
    _mm256_storeu_pd(b.evict_key + j, evict_key);
    evict_min = _mm256_min_pd(evict_min, evict_key);
  }
  return {lane_min(swap_min), lane_min(evict_min)};
}

// The first index of keys (blocks of four) equal to their smallest, `best`; -1 when that is
// +inf. What the scalar "if (k < best) best = k, best_j = j" from best = +inf finds.
int first_min(const double* keys, double best) {
  if (!(best < kInf)) return -1;
  const __m256d target = _mm256_set1_pd(best);
  for (int j = 0;; j += 4) {
    const int mask =
        _mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(keys + j), target, _CMP_EQ_OQ));
    if (mask != 0) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
}
#endif

// The three highest loads among each expert's holders, recomputed only when asked for after a
// step changed the load of one of its ranks: scoring a step that evicts a replica must not walk
// the dozens of replicas of a hot expert every time.
class HolderPeaks {
 public:
  explicit HolderPeaks(const LayerState& state)
      : state_(state), top_(state.num_experts()), stale_(state.num_experts(), 1) {}
  // Highest load among the ranks holding `expert` other than a and b; -inf when none.
  double max_except(int expert, int a, int b) {
    if (stale_[expert]) refresh(expert);
    for (const Entry& t : top_[expert]) {
      if (t.rank != a && t.rank != b) return t.load;  // rank -1 carries -inf
    }
    return -kInf;
  }
  // The load of `rank` changed: the experts it holds may have a new top.
  void rank_changed(int rank) {
    for (int k = 0; k < state_.size(rank); ++k) stale_[state_.items(rank)[k]] = 1;
  }
  void expert_changed(int expert) { stale_[expert] = 1; }

 private:
  struct Entry {
    double load;
    int rank;
  };
  // NOTE: each holder passes down the three places, trading with any it beats (ties keep the
  // earlier holder), written as selects: which place it beats is unpredictable.
  void refresh(int expert) {
    double load[3] = {-kInf, -kInf, -kInf};
    int rank[3] = {-1, -1, -1};
    for (int g : state_.holders(expert)) {
      double l = state_.rank_load(g);
      for (int i = 0; i < 3; ++i) {
        const bool beats = l > load[i];
        const double kept = beats ? l : load[i];
        const int kept_rank = beats ? g : rank[i];
        l = beats ? load[i] : l;
        g = beats ? rank[i] : g;
        load[i] = kept, rank[i] = kept_rank;
      }
    }
    for (int i = 0; i < 3; ++i) top_[expert][i] = Entry{load[i], rank[i]};
    stale_[expert] = 0;
  }

  const LayerState& state_;
  std::vector<std::array<Entry, 3>> top_;
  std::vector<uint8_t> stale_;
};

// Orders ranks by (load, rank).
struct LoadLess {
  const LayerState& state;
  bool operator()(int a, int b) const {
    const double la = state.rank_load(a), lb = state.rank_load(b);
    return la != lb ? la < lb : a < b;
  }
};

void sort_by_load(const LayerState& state, std::vector<int>& order) {
  std::sort(order.begin(), order.end(), LoadLess{state});
}

// Moves ranks a (the hottest: found from the hot end) and b (a partner: found from the cold
// end), whose loads changed, to their places in `order` (sorted otherwise).
void reposition(const LayerState& state, std::vector<int>& order, int a, int b) {
  order.erase(std::find(order.rbegin(), order.rend(), a).base() - 1);
  order.erase(std::find(order.begin(), order.end(), b));
  for (int r : {a, b}) {
    order.insert(std::lower_bound(order.begin(), order.end(), r, LoadLess{state}), r);
  }
}

// Re-sorts `order` after a few loads changed: insertion sort, O(ranks) when nearly sorted, on
// a copy of the loads in order (`loads`, scratch) rather than through the ranks (LoadLess).
void resort(const LayerState& state, std::vector<int>& order, std::vector<double>& loads) {
  loads.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) loads[i] = state.rank_load(order[i]);
  for (size_t i = 1; i < order.size(); ++i) {
    const int v = order[i];
    const double lv = loads[i];
    size_t j = i;
    for (; j > 0 && (lv != loads[j - 1] ? lv < loads[j - 1] : v < order[j - 1]); --j) {
      order[j] = order[j - 1];
      loads[j] = loads[j - 1];
    }
    order[j] = v;
    loads[j] = lv;
  }
}

// The hottest rank: among those within kRelEps of the max load, the lowest rank. NOTE: not just
// the last of `order`: loads reached by different sequences of steps differ in their last bits,
// and planning a plan again must pick the same rank to find it as stuck as before.
int hottest(const LayerState& state, const std::vector<int>& order) {
  const double top = state.rank_load(order.back());
  int h = order.back();
  for (size_t i = order.size(); i-- > 0 && state.rank_load(order[i]) >= top * (1 - kRelEps);) {
    h = std::min(h, order[i]);
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

SearchEnd improve(LayerState& state, const Domain& domain, const SearchOptions& options) {
  const int slots = state.slots_per_rank();
  const int m = std::max(1, options.min_replicas);
  std::vector<int> order(domain.num_ranks());
  for (int r = domain.rank_begin; r < domain.rank_end; ++r) order[r - domain.rank_begin] = r;
  sort_by_load(state, order);
  HolderPeaks peaks(state);
  const int num_ranks = state.num_ranks();
  const uint8_t* const held = options.held;
  const std::vector<uint8_t> none_held(held ? 0 : num_ranks, 0);  // without `held`: all new
  // Highest load among the holders of `expert` other than a and b (-inf: none). An expert held
  // by many ranks is found near the hot end of `order` at once; the cached top three of its
  // holders would be recomputed after almost every step (one of them changed load). Only when
  // the domain is every rank (`order` holds them all). The scan finds the two hottest holders
  // other than b once per step and expert (b is the hottest rank, the same all step; a is the
  // candidate's rank).
  struct ScanTop {
    int step = -1, b = -1, first = -1, second = -1;
  };
  std::vector<ScanTop> scan_top(state.num_experts());
  int step_idx = 0;
  auto max_except = [&](int expert, int a, int b) {
    const int c = state.count(expert);
    if (static_cast<int64_t>(c) * c <= 4 * num_ranks ||
        order.size() != static_cast<size_t>(num_ranks)) {
      return peaks.max_except(expert, a, b);
    }
    ScanTop& t = scan_top[expert];
    if (t.step != step_idx || t.b != b) {
      t = ScanTop{step_idx, b, -1, -1};
      const uint8_t* on = state.holds_row(expert);
      for (size_t i = order.size(); i-- > 0 && t.second < 0;) {
        const int g = order[i];
        if (on[g] && g != b) (t.first < 0 ? t.first : t.second) = g;
      }
    }
    const int g = t.first != a ? t.first : t.second;
    return g >= 0 ? state.rank_load(g) : -kInf;
  };
  auto held_at = [&](int e, int r) -> int { return held[static_cast<size_t>(e) * num_ranks + r]; };
  const size_t num_cold = std::min<size_t>(order.size() - 1, options.num_candidate_ranks);
  // The replicas of the partner ranks, as flat arrays (the inner loops run over them for every
  // replica of the hottest rank; keep them free of branches and indirections).
  struct Candidates {
    std::vector<int> rank, expert;
    std::vector<double> py;          // load per replica
    std::vector<double> rest;        // the partner's load without this replica
    std::vector<double> h_dy;        // what evicting it adds to the hottest rank (if it holds it)
    std::vector<double> evict_peak;  // highest other holder after evicting it; +inf: not evictable
    std::vector<uint8_t> on_h;       // the hottest rank holds this expert too
    // Receives a swap adds on both ranks, less those of x: (y new on h) - (y was new on r).
    std::vector<int> swap_cost;
    std::vector<int> evict_cost;  // receives evicting it saves: -(y was new on its rank)
    std::vector<int> free_ranks;  // partners with a free slot
    // Per replica x of the hottest rank (score_pairs): the keys of swapping x for the
    // candidate and of evicting it, +inf where no step.
    std::vector<double> swap_py;  // py, +inf where on_h (no swap)
    std::vector<double> swap_key, evict_key;
    void clear() { free_ranks.clear(); }
    void resize(size_t n) {
      rank.resize(n), expert.resize(n), py.resize(n), rest.resize(n), h_dy.resize(n);
      evict_peak.resize(n), on_h.resize(n), swap_cost.resize(n), evict_cost.resize(n);
      swap_py.resize(n), swap_key.resize(n), evict_key.resize(n);
    }
  } cand;
  std::vector<int> partners;
  std::vector<double> order_loads;  // resort's
  int64_t pairs = 0;                // scored so far
  // Offers the best steps that relieve the hottest rank h with one of the num_partners coldest.
  // Partners: the ranks other than h from the begin-th coldest to the end-th (exclusive).
  auto evaluate = [&](int h, double lh, size_t begin, size_t end, Chooser& chooser) {
    cand.clear();
    partners.clear();
    size_t seen = 0;
    for (size_t ci = 0; ci < order.size() && seen < end; ++ci) {
      if (order[ci] == h) continue;
      if (seen++ >= begin) partners.push_back(order[ci]);
    }
    size_t total = 0;
    for (int r : partners) total += state.size(r);
    // Padded to a multiple of four (score_pairs) with candidates on h itself: no step.
    const size_t padded = (total + 3) / 4 * 4;
    cand.resize(padded);
    for (size_t p = total; p < padded; ++p) {
      cand.rank[p] = h, cand.expert[p] = -1, cand.py[p] = 0, cand.rest[p] = 0, cand.h_dy[p] = 0;
      cand.evict_peak[p] = kInf, cand.on_h[p] = 1, cand.swap_cost[p] = 0, cand.evict_cost[p] = 0;
      cand.swap_py[p] = kInf;
    }
    size_t j = 0;
    for (int r : partners) {
      const double lr = state.rank_load(r);
      if (state.size(r) < slots) cand.free_ranks.push_back(r);
      for (int k = 0; k < state.size(r); ++k, ++j) {
        const int y = state.items(r)[k];
        const double py = state.per_replica(y);
        const bool on_h = state.holds(h, y);
        const double dy = state.per_if_fewer(y) - py;  // +inf when it has one replica
        cand.rank[j] = r;
        cand.expert[j] = y;
        cand.py[j] = py;
        cand.rest[j] = lr - py;
        cand.on_h[j] = on_h;
        cand.swap_py[j] = on_h ? kInf : py;
        cand.h_dy[j] = on_h ? dy : 0.0;
#ifdef FLEXPERT_EPLB_AVX2
        // Computed for all: about half of them are needed, and then every eviction is scored
        // in blocks of four, without a branch per candidate.
        cand.evict_peak[j] =
            state.count(y) > m ? max_except(y, r, h) + (state.per_if_fewer(y) - py) : kInf;
#else
        // Computed when first needed (kLazy): refreshing a hot expert's holders is the costly
        // part of building the candidates, and most are never the best eviction.
        cand.evict_peak[j] = state.count(y) > m ? kLazy : kInf;
#endif
        if (held) {
          cand.swap_cost[j] = (1 - held_at(y, h)) - (1 - held_at(y, r));
          cand.evict_cost[j] = -(1 - held_at(y, r));
        } else {
          cand.swap_cost[j] = 1;  // with x's 1: two slots written
          cand.evict_cost[j] = 0;
        }
      }
    }
    const int n = static_cast<int>(total);
    pairs += static_cast<int64_t>(n) * state.size(h);
    const int* h_items = state.items(h);
    const double scale = 4 * lh;  // above any peak that counts (< lh)
    for (int hi = 0; hi < state.size(h); ++hi) {
      const int x = h_items[hi];
      const uint8_t* x_on = state.holds_row(x);
      // new_on[r]: x would be a receive on rank r; x_new: it is one on h (leaving saves it).
      const uint8_t* x_held = held ? held + static_cast<size_t>(x) * num_ranks : none_held.data();
      const int x_new = held ? 1 - x_held[h] : 0;
      auto new_on = [&](int r) { return 1 - x_held[r]; };
      const double px = state.per_replica(x);
      const double px_more = state.per_if_more(x);
      const double dx = px_more - px;
      // Drop a spare replica of x: free for the mover (a slot becoming free receives nothing).
      if (options.allow_drop && state.count(x) > m) {
        chooser.offer(Step::kDrop, x, -1, -1,
                      std::max(lh - px, max_except(x, h, h) + (state.per_if_fewer(x) - px)),
                      -x_new);
      }
      for (int r : cand.free_ranks) {
        if (x_on[r]) continue;
        const double lr = state.rank_load(r);
        chooser.offer(Step::kMove, x, -1, r, std::max(lh - px, lr + px), new_on(r) - x_new);
        chooser.offer(Step::kReplicate, x, -1, r, std::max(lh + dx, lr + px_more), new_on(r));
      }
      // Swap x for a lighter replica y; or give x one more replica in place of y: every
      // replica of x gets lighter, every other replica of y heavier. NOTE: a rank holding both
      // x and y is scored without the relief from x (an upper bound), which keeps this O(1).
      // Per step kind, the candidate with the smallest chooser key, then offered.
      double swap_key = kInf, evict_key = kInf;
      int swap_j = -1, evict_j = -1;
      int j0 = 0;  // candidates before j0 are scored already
#ifdef FLEXPERT_EPLB_AVX2
      const PairMinima minima = score_pairs(PairBlock{cand.rank.data(),
                                                      cand.py.data(),
                                                      cand.swap_py.data(),
                                                      cand.rest.data(),
                                                      cand.h_dy.data(),
                                                      cand.swap_cost.data(),
                                                      cand.evict_cost.data(),
                                                      x_on,
                                                      x_held,
                                                      lh - px,
                                                      lh + dx,
                                                      px,
                                                      px_more,
                                                      x_new,
                                                      scale,
                                                      chooser.reach(),
                                                      chooser.bound(),
                                                      cand.evict_peak.data(),
                                                      cand.swap_key.data(),
                                                      cand.evict_key.data()},
                                            static_cast<int>(padded));
      swap_j = first_min(cand.swap_key.data(), minima.swap_key);
      evict_j = first_min(cand.evict_key.data(), minima.evict_key);
      j0 = n;
#endif
      for (int j = j0; j < n; ++j) {
        const int r = cand.rank[j];
        if (x_on[r]) continue;
        const int x_cost = new_on(r);
        if (cand.py[j] < px && !cand.on_h[j]) {
          const double s = std::max(lh - px + cand.py[j], cand.rest[j] + px);
          const double k = chooser.key(s, cand.swap_cost[j] + x_cost - x_new, scale);
          if (k < swap_key) swap_key = k, swap_j = j;
        }
        const double e = std::max(lh + dx + cand.h_dy[j], cand.rest[j] + px_more);
        const int e_cost = cand.evict_cost[j] + x_cost;
        if (!(chooser.key(e, e_cost, scale) < evict_key)) continue;  // a lower bound of the key
        if (std::isnan(cand.evict_peak[j])) {
          const int y = cand.expert[j];
          cand.evict_peak[j] = max_except(y, r, h) + (state.per_if_fewer(y) - state.per_replica(y));
        }
        const double k = chooser.key(std::max(e, cand.evict_peak[j]), e_cost, scale);
        if (k < evict_key) evict_key = k, evict_j = j;
      }
      if (swap_j >= 0) {
        const int j = swap_j, r = cand.rank[j];
        chooser.offer(Step::kSwap, x, cand.expert[j], r,
                      std::max(lh - px + cand.py[j], cand.rest[j] + px),
                      cand.swap_cost[j] + new_on(r) - x_new);
      }
      if (evict_j >= 0) {
        const int j = evict_j, r = cand.rank[j];
        chooser.offer(
            Step::kReplicate, x, cand.expert[j], r,
            std::max(std::max(lh + dx + cand.h_dy[j], cand.rest[j] + px_more), cand.evict_peak[j]),
            cand.evict_cost[j] + new_on(r));
      }
    }
  };
  for (int iteration = 0;; ++iteration) {
    step_idx = iteration;
    const int h = hottest(state, order);
    const double lh = state.rank_load(h);
    if (lh <= options.target * (1 + kRelEps)) return SearchEnd::kReached;
    if (iteration >= options.max_iterations || pairs >= options.max_pairs) {
      return SearchEnd::kOutOfSteps;
    }
    Chooser chooser(options, lh * (1 - kRelEps));
    // The coldest ranks first; only when none of them helps, as many again, and so on up to
    // every rank (stuck is expensive: it makes the caller fall back to a plan with many more
    // moves). NOTE: the widening that finds a step is most of the search's work, so each pass
    // scores only the ranks the previous one did not.
    const size_t num_others = order.size() - 1;
    for (size_t done = 0, width = num_cold;; width *= 2) {
      width = std::min(width, num_others);
      evaluate(h, lh, done, width, chooser);
      done = width;
      if (chooser.best().kind != Step::kNone || done >= num_others) break;
      if (pairs >= options.max_pairs) return SearchEnd::kOutOfSteps;
    }
    if (chooser.best().kind == Step::kNone) return SearchEnd::kStuck;
    const Step& step = chooser.best();
    apply(state, h, step);
    // Ranks whose load changed: both ends of a move or swap; with a replica more or fewer, also
    // every rank holding the experts whose count changed. Experts that left a rank, too.
    peaks.rank_changed(h);
    if (step.to >= 0) peaks.rank_changed(step.to);
    if (step.kind == Step::kReplicate || step.kind == Step::kDrop) {
      for (int g : state.holders(step.x)) peaks.rank_changed(g);
      if (step.y >= 0) {
        for (int g : state.holders(step.y)) peaks.rank_changed(g);
      }
    }
    peaks.expert_changed(step.x);
    if (step.y >= 0) peaks.expert_changed(step.y);
    if (step.kind == Step::kMove || step.kind == Step::kSwap) {
      reposition(state, order, h, step.to);
    } else {
      resort(state, order, order_loads);
    }
  }
}

void take_back_moves(LayerState& state, const Domain& domain,
                     const std::vector<std::vector<int>>& current, double cap) {
  const int num_ranks = state.num_ranks();
  const int slots = state.slots_per_rank();
  std::vector<uint8_t> was(state.num_experts() * static_cast<size_t>(num_ranks), 0);
  auto was_on = [&](int e, int r) -> uint8_t& {
    return was[static_cast<size_t>(e) * num_ranks + r];
  };
  for (int r = domain.rank_begin; r < domain.rank_end; ++r) {
    for (int e : current[r]) was_on(e, r) = 1;
  }
  const double limit = cap * (1 + kRelEps);
  for (int r = domain.rank_begin; r < domain.rank_end; ++r) {
    for (int e : current[r]) {  // e was on r
      if (state.holds(r, e)) continue;
      // A replica of e that arrived somewhere else: bring it back to r.
      int from = -1;
      for (int q : state.holders(e)) {
        if (q >= domain.rank_begin && q < domain.rank_end && !was_on(e, q)) {
          from = q;
          break;
        }
      }
      if (from < 0) continue;
      const double pe = state.per_replica(e);
      if (state.size(r) < slots && state.rank_load(r) + pe <= limit) {
        state.move(from, r, e);
        continue;
      }
      // Or trade places with a replica y that arrived on r.
      for (int k = 0; k < state.size(r); ++k) {
        const int y = state.items(r)[k];
        if (was_on(y, r) || state.holds(from, y)) continue;
        const double py = state.per_replica(y);
        if (state.rank_load(r) - py + pe <= limit && state.rank_load(from) - pe + py <= limit) {
          state.swap(r, y, from, e);
          break;
        }
      }
    }
  }
}

void balance_pairs(LayerState& state, const Domain& domain, int passes) {
  std::vector<int> order(domain.num_ranks());
  for (int r = domain.rank_begin; r < domain.rank_end; ++r) order[r - domain.rank_begin] = r;
  const int slots = state.slots_per_rank();
  for (int pass = 0; pass < passes; ++pass) {
    sort_by_load(state, order);
    bool changed = false;
    const size_t n = order.size();
    for (size_t i = 0; i < n / 2; ++i) {
      const int a = order[n - 1 - i], b = order[i];  // the i-th hottest and the i-th coldest
      const double la = state.rank_load(a), lb = state.rank_load(b);
      double best = la * (1 - kRelEps);
      int best_x = -1, best_y = -1;
      for (int xi = 0; xi < state.size(a); ++xi) {
        const int x = state.items(a)[xi];
        if (state.holds(b, x)) continue;
        const double px = state.per_replica(x);
        if (state.size(b) < slots && std::max(la - px, lb + px) < best) {
          best = std::max(la - px, lb + px), best_x = x, best_y = -1;
        }
        for (int yi = 0; yi < state.size(b); ++yi) {
          const int y = state.items(b)[yi];
          const double py = state.per_replica(y);
          if (py >= px || state.holds(a, y)) continue;
          const double peak = std::max(la - px + py, lb - py + px);
          if (peak < best) best = peak, best_x = x, best_y = y;
        }
      }
      if (best_x < 0) continue;
      if (best_y < 0) {
        state.move(a, b, best_x);
      } else {
        state.swap(a, best_x, b, best_y);
      }
      changed = true;
    }
    if (!changed) break;
  }
}

}  // namespace flexpert::eplb::detail
