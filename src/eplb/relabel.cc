// SPDX-License-Identifier: Apache-2.0
// Renumbering a plan's ranks to match the current placement (declared in layer_planner.h).
#include <algorithm>
#include <numeric>
#include <vector>

#include "eplb/layer_planner.h"

namespace flexpert::eplb::detail {

// Greedy maximum-overlap matching of the `fresh` ranks to the `current` ranks, inside blocks of
// ranks_per_block ranks that are matched to each other first (hosts, for hierarchical plans),
// so renumbering keeps whole hosts together. Returns fresh's sets at their new positions.
std::vector<std::vector<int>> relabel(const LayerShape& shape,
                                      const std::vector<std::vector<int>>& fresh,
                                      const std::vector<std::vector<int>>& current,
                                      int ranks_per_block) {
  const int n = shape.num_ranks;
  // Current holders of each expert, flattened: holder_list[holder_begin[e] .. holder_begin[e+1]).
  std::vector<int> holder_begin(shape.num_experts + 1, 0), holder_list;
  for (int r = 0; r < n; ++r) {
    for (int e : current[r]) ++holder_begin[e + 1];
  }
  for (int e = 0; e < shape.num_experts; ++e) holder_begin[e + 1] += holder_begin[e];
  holder_list.resize(holder_begin.back());
  {
    std::vector<int> fill(holder_begin.begin(), holder_begin.end() - 1);
    for (int r = 0; r < n; ++r) {
      for (int e : current[r]) holder_list[fill[e]++] = r;
    }
  }
  // Non-zero overlaps (experts fresh rank i shares with current rank j, at most slots_per_rank),
  // row by row in discovery order.
  struct Pair {
    int i, j, w;
  };
  std::vector<Pair> pairs;
  std::vector<int> count(n, 0), touched;
  for (int i = 0; i < n; ++i) {
    touched.clear();
    for (int e : fresh[i]) {
      for (int k = holder_begin[e]; k < holder_begin[e + 1]; ++k) {
        if (count[holder_list[k]]++ == 0) touched.push_back(holder_list[k]);
      }
    }
    for (int j : touched) {
      pairs.push_back({i, j, count[j]});
      count[j] = 0;
    }
  }
  // Greedy matching by descending weight, ties in discovery order; rows left over take the
  // columns left over in ascending order.
  auto match = [](int num_rows, int num_cols, const Pair* begin, const Pair* end, int max_w,
                  auto row_of, auto col_of) {
    std::vector<std::vector<std::pair<int, int>>> buckets(max_w + 1);
    for (const Pair* p = begin; p != end; ++p) {
      const int a = row_of(p->i), b = col_of(p->j);
      if (a >= 0 && b >= 0) buckets[std::min(p->w, max_w)].emplace_back(a, b);
    }
    std::vector<int> to(num_rows, -1);
    std::vector<uint8_t> taken(num_cols, 0);
    for (int w = max_w; w > 0; --w) {
      for (const auto& [a, b] : buckets[w]) {
        if (to[a] < 0 && !taken[b]) to[a] = b, taken[b] = 1;
      }
    }
    int next = 0;
    for (int& t : to) {
      if (t >= 0) continue;
      while (taken[next]) ++next;
      t = next;
      taken[next] = 1;
    }
    return to;
  };
  const int num_blocks = n / ranks_per_block;
  std::vector<int> block_to(num_blocks, 0);
  if (num_blocks > 1) {
    // Block weights: summed overlaps of their ranks.
    std::vector<int> w(static_cast<size_t>(num_blocks) * num_blocks, 0);
    for (const Pair& p : pairs) {
      w[static_cast<size_t>(p.i / ranks_per_block) * num_blocks + p.j / ranks_per_block] += p.w;
    }
    std::vector<Pair> block_pairs;
    int max_w = 0;
    for (int a = 0; a < num_blocks; ++a) {
      for (int b = 0; b < num_blocks; ++b) {
        const int v = w[static_cast<size_t>(a) * num_blocks + b];
        if (v > 0) block_pairs.push_back({a, b, v});
        max_w = std::max(max_w, v);
      }
    }
    std::stable_sort(block_pairs.begin(), block_pairs.end(),
                     [](const Pair& x, const Pair& y) { return x.w > y.w; });
    // Weights can be large: rank them, so the buckets stay few.
    int rank_w = static_cast<int>(block_pairs.size());
    for (size_t k = 0; k < block_pairs.size(); ++k) {
      if (k > 0 && block_pairs[k].w != block_pairs[k - 1].w) --rank_w;
      block_pairs[k].w = rank_w;
    }
    block_to = match(
        num_blocks, num_blocks, block_pairs.data(), block_pairs.data() + block_pairs.size(),
        static_cast<int>(block_pairs.size()), [](int a) { return a; }, [](int b) { return b; });
  }
  // Ranks inside each pair of matched blocks; `pairs` is ordered by fresh rank, so a block's
  // rows are one range of it.
  std::vector<int> to(n);
  const Pair* first = pairs.data();
  const Pair* const last = pairs.data() + pairs.size();
  for (int a = 0; a < num_blocks; ++a) {
    const int rows = a * ranks_per_block, cols = block_to[a] * ranks_per_block;
    const Pair* stop = first;
    while (stop != last && stop->i < rows + ranks_per_block) ++stop;
    const std::vector<int> local = match(
        ranks_per_block, ranks_per_block, first, stop, shape.slots_per_rank,
        [&](int i) { return i - rows; },
        [&](int j) { return j / ranks_per_block == block_to[a] ? j - cols : -1; });
    first = stop;
    for (int k = 0; k < ranks_per_block; ++k) to[rows + k] = cols + local[k];
  }
  std::vector<std::vector<int>> out(n);
  for (int i = 0; i < n; ++i) out[to[i]] = fresh[i];
  return out;
}

}  // namespace flexpert::eplb::detail
