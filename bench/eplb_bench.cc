// SPDX-License-Identifier: Apache-2.0
// eplb_bench: flexpert's placement planner against the port of DeepSeek's open EPLB on
// synthetic skewed loads at DeepSeek-V3 shapes, replanning over a sequence of windows.
//
//   eplb_bench [--ranks 32,64,144,256] [--spare 1,2,3] [--windows 6] [--layers 61]
//              [--experts 256] [--groups 8] [--ranks-per-host 8] [--zipf-min 0.6]
//              [--zipf-max 1.2] [--sigma 0.15] [--swap-prob 0.05] [--seed 1] [--json out.json]
//
// Loads: per layer a Zipf law (exponent drawn in [zipf-min, zipf-max]) over the experts in a
// random order, scaled to 16384 tokens x top-8; between windows every load is multiplied by
// exp(sigma * N(0,1)) and, with probability swap-prob per layer, a top-16 expert swaps its load
// with a random expert; counts are rounded to tokens. Slots per rank: ceil(experts / ranks) +
// spare; hosts of ranks-per-host ranks. Window w is planned with plan w-1 as the current
// placement. Reported per (ranks, slots, planner): balancedness (mean / max rank load, mean over
// layers and windows) on the planned window and on the next one, slots that receive an expert
// per replan (windows 1..), plan time for all layers, the share of layers planned
// hierarchically, and (DeepSeek) replicas placed on a rank that already holds that expert.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "eplb/deepseek_eplb.h"
#include "eplb/planner.h"

namespace {

using Matrix = std::vector<std::vector<double>>;
using Placement = std::vector<std::vector<int>>;

struct Options {
  std::vector<int> ranks = {32, 64, 144, 256};
  std::vector<int> spare = {1, 2, 3};
  int windows = 6, layers = 61, experts = 256, groups = 8, ranks_per_host = 8;
  double zipf_min = 0.6, zipf_max = 1.2, sigma = 0.15, swap_prob = 0.05;
  double tolerance = flexpert::eplb::PlanInput().tolerance;
  unsigned seed = 1;
  std::string json;
};

std::vector<int> int_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::atoi(item.c_str()));
  return v;
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return false;
    const std::string v = argv[++i];
    if (a == "--ranks") o.ranks = int_list(v);
    else if (a == "--spare") o.spare = int_list(v);
    else if (a == "--windows") o.windows = std::atoi(v.c_str());
    else if (a == "--layers") o.layers = std::atoi(v.c_str());
    else if (a == "--experts") o.experts = std::atoi(v.c_str());
    else if (a == "--groups") o.groups = std::atoi(v.c_str());
    else if (a == "--ranks-per-host") o.ranks_per_host = std::atoi(v.c_str());
    else if (a == "--zipf-min") o.zipf_min = std::atof(v.c_str());
    else if (a == "--zipf-max") o.zipf_max = std::atof(v.c_str());
    else if (a == "--sigma") o.sigma = std::atof(v.c_str());
    else if (a == "--swap-prob") o.swap_prob = std::atof(v.c_str());
    else if (a == "--tolerance") o.tolerance = std::atof(v.c_str());
    else if (a == "--seed") o.seed = static_cast<unsigned>(std::atoi(v.c_str()));
    else if (a == "--json") o.json = v;
    else return false;
  }
  return o.windows >= 2 && o.layers >= 1 && o.experts >= 1;
}

// windows + 1 load matrices (the last one only scores the last plan).
std::vector<Matrix> make_loads(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double tokens = 16384.0 * 8;
  Matrix w(o.layers, std::vector<double>(o.experts));
  for (auto& row : w) {
    const double s = o.zipf_min + (o.zipf_max - o.zipf_min) * uniform(rng);
    std::vector<int> order(o.experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < o.experts; ++k) row[order[k]] = 1.0 / std::pow(k + 1.0, s);
  }
  std::vector<Matrix> out;
  for (int t = 0; t <= o.windows; ++t) {
    if (t > 0) {
      for (auto& row : w) {
        for (double& x : row) x *= std::exp(o.sigma * normal(rng));
        if (uniform(rng) < o.swap_prob) {
          std::vector<int> idx(o.experts);
          std::iota(idx.begin(), idx.end(), 0);
          std::partial_sort(idx.begin(), idx.begin() + std::min(16, o.experts), idx.end(),
                            [&](int a, int b) { return row[a] > row[b]; });
          const int hot = idx[rng() % std::min(16, o.experts)];
          const int other = static_cast<int>(rng() % o.experts);
          std::swap(row[hot], row[other]);
        }
      }
    }
    Matrix counts = w;
    for (auto& row : counts) {
      const double sum = std::accumulate(row.begin(), row.end(), 0.0);
      for (double& x : row) x = std::round(x / sum * tokens);
    }
    out.push_back(std::move(counts));
  }
  return out;
}

struct Row {
  int ranks = 0, slots = 0;
  std::string planner;
  double balance_now = 0, balance_next = 0, moved = 0, moved_pct = 0;
  double ms_mean = 0, ms_max = 0, hier_pct = 0, colocated = 0;
};

int64_t colocated_replicas(const Placement& p, int slots) {
  int64_t n = 0;
  for (const auto& row : p) {
    for (size_t r = 0; r * slots < row.size(); ++r) {
      std::vector<int> v(row.begin() + r * slots, row.begin() + (r + 1) * slots);
      std::sort(v.begin(), v.end());
      for (size_t k = 1; k < v.size(); ++k) n += v[k] >= 0 && v[k] == v[k - 1];
    }
  }
  return n;
}

Row run(const Options& o, const std::vector<Matrix>& loads, int num_ranks, int spare,
        bool deepseek) {
  Row row;
  row.ranks = num_ranks;
  row.slots = (o.experts + num_ranks - 1) / num_ranks + spare;
  row.planner = deepseek ? "deepseek" : "flexpert";
  std::vector<int> ranks(num_ranks);
  std::iota(ranks.begin(), ranks.end(), 0);
  const int hosts = std::max(1, num_ranks / o.ranks_per_host);
  Placement prev;
  int64_t hier_layers = 0;
  for (int t = 0; t < o.windows; ++t) {
    Placement next;
    const auto start = std::chrono::steady_clock::now();
    if (deepseek) {
      auto p = flexpert::eplb::deepseek_rebalance(loads[t], num_ranks * row.slots, o.groups,
                                                  hosts, num_ranks);
      if (!p.ok()) std::fprintf(stderr, "deepseek: %s\n", p.status().to_string().c_str()), std::exit(1);
      next = std::move(p->phy2log);
      hier_layers += p->hierarchical ? o.layers : 0;
    } else {
      flexpert::eplb::PlanInput in;
      in.num_experts = o.experts;
      in.slots_per_rank = row.slots;
      in.ranks = ranks;
      in.max_ranks = num_ranks;
      in.num_hosts = hosts;
      in.num_groups = o.groups;
      in.load = loads[t];
      in.current = prev;
      in.tolerance = o.tolerance;
      auto p = flexpert::eplb::plan(in);
      if (!p.ok()) std::fprintf(stderr, "flexpert: %s\n", p.status().to_string().c_str()), std::exit(1);
      next = std::move(p->placement);
      for (auto u : p->used) hier_layers += u == flexpert::eplb::Policy::kHierarchical;
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    row.ms_mean += ms / o.windows;
    row.ms_max = std::max(row.ms_max, ms);
    for (int l = 0; l < o.layers; ++l) {
      const double denom = static_cast<double>(o.layers) * o.windows;
      row.balance_now += flexpert::eplb::balancedness(loads[t][l], next[l], ranks, row.slots) / denom;
      row.balance_next +=
          flexpert::eplb::balancedness(loads[t + 1][l], next[l], ranks, row.slots) / denom;
    }
    if (t > 0) row.moved += static_cast<double>(flexpert::eplb::count_moves(prev, next)) / (o.windows - 1);
    row.colocated += static_cast<double>(colocated_replicas(next, row.slots)) / o.windows;
    prev = std::move(next);
  }
  row.moved_pct = 100.0 * row.moved / (static_cast<double>(o.layers) * num_ranks * row.slots);
  row.hier_pct = 100.0 * static_cast<double>(hier_layers) / (static_cast<double>(o.layers) * o.windows);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr, "usage: see the header of bench/eplb_bench.cc\n");
    return 2;
  }
  const std::vector<Matrix> loads = make_loads(o);
  std::vector<Row> rows;
  std::printf("| ranks | slots/rank | planner | balance (planned) | balance (next window) | "
              "moved slots/replan | moved %% | plan ms mean | plan ms max | hierarchical %% | "
              "co-located |\n");
  std::printf("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int r : o.ranks) {
    for (int s : o.spare) {
      for (bool deepseek : {true, false}) {
        const Row x = run(o, loads, r, s, deepseek);
        std::printf("| %d | %d | %s | %.4f | %.4f | %.0f | %.1f | %.1f | %.1f | %.0f | %.0f |\n",
                    x.ranks, x.slots, x.planner.c_str(), x.balance_now, x.balance_next, x.moved,
                    x.moved_pct, x.ms_mean, x.ms_max, x.hier_pct, x.colocated);
        std::fflush(stdout);
        rows.push_back(x);
      }
    }
  }
  if (!o.json.empty()) {
    std::ofstream out(o.json);
    out << "{\"layers\": " << o.layers << ", \"experts\": " << o.experts
        << ", \"windows\": " << o.windows << ", \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& x = rows[i];
      out << (i ? ",\n" : "") << "  {\"ranks\": " << x.ranks << ", \"slots_per_rank\": " << x.slots
          << ", \"planner\": \"" << x.planner << "\", \"balance_planned\": " << x.balance_now
          << ", \"balance_next\": " << x.balance_next << ", \"moved_per_replan\": " << x.moved
          << ", \"moved_pct\": " << x.moved_pct << ", \"plan_ms_mean\": " << x.ms_mean
          << ", \"plan_ms_max\": " << x.ms_max << ", \"hierarchical_pct\": " << x.hier_pct
          << ", \"colocated\": " << x.colocated << "}";
    }
    out << "\n]}\n";
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return 0;
}
