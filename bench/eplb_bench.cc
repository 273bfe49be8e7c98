// SPDX-License-Identifier: Apache-2.0
// eplb_bench: flexpert's placement planner against the port of DeepSeek's open EPLB on
// synthetic skewed loads at DeepSeek-V3 shapes, replanning over a sequence of load windows, and
// replanning after membership changes (GPU count changes).
//
//   eplb_bench [--ranks 16,32,64,144,256] [--spare 1,2,3] [--windows 6] [--layers 61]
//              [--experts 256] [--groups 8] [--ranks-per-host 8] [--zipf-min 0.6]
//              [--zipf-max 1.2] [--sigma 0.05] [--noise 0.2] [--swap-prob 0.05]
//              [--tolerance 0.005,...] [--smooth 0,0.3] [--format deepseek|flexpert] [--threads 1]
//              [--scale 16:24,24:16,...] [--scale-spare 1] [--scale-prev deepseek|flexpert]
//              [--scale-tolerance 0.005,0.02,0.05] [--greedy-after-change 1,0]
//              [--time-ranks 256] [--parallel-threads 0] [--seed 1] [--json out.json]
//
// Loads: per layer a Zipf law (exponent drawn in [zipf-min, zipf-max]) over the experts in a
// random order, scaled to 16384 tokens x top-8; from one window to the next every load is
// multiplied by exp(sigma * N(0,1)) and, with probability swap-prob per layer, a top-16 expert
// trades its load with a random expert (a slow drift); each window then measures that load
// times exp(noise * N(0,1)), drawn anew per window (a noisy sample); counts are rounded to
// tokens. Slots per rank:
// ceil(experts / ranks) + spare; hosts of ranks-per-host ranks; `groups` expert groups.
//
// Steady table: window w is planned with the planner's own plan of window w-1 as the current
// placement (window 0 from nothing). One flexpert row per (tolerance, smooth): smooth a > 0
// plans on s_w = a s_(w-1) + (1 - a) load_w (eplb::smooth_load: shares of each layer's load,
// smoothed over windows) instead of load_w.
// Scale table (--scale old:new, one flexpert row per --scale-tolerance: the trade-off between
// moves and balance): window w (1..) is planned on `new` GPUs with, as the previous
// placement of both planners, the plan of window w-1 on `old` GPUs by --scale-prev (default
// DeepSeek's, as a file with prev_phy2log from a DeepSeek deployment has it). GPUs below
// min(old, new) are the same GPUs; scale-down removes the highest. --greedy-after-change 0
// adds rows without PlanInput::greedy_after_change (the tolerance alone sets the aim).
//
// Reported per row, means over layers and plans: balancedness (mean / max rank load) on the
// planned window and on the next one; remote receives per plan (count_receives: per GPU, the
// experts it holds after and did not hold before; GPUs are not renumbered for either
// planner, DeepSeek's output is taken as it is), also as a share of all slots; wall-clock time
// of a plan (all layers), mean and max, and CPU time of the process during it (with one thread:
// what one free core takes, whatever else runs on the machine); layers planned hierarchically;
// replicas placed on a rank that already holds their expert (wasted slots); free slots (-1).
// "targets" checks flexpert against these goals: balance >= DeepSeek's - 0.005 (on the next window
// for smoothed plans), receives <= half of DeepSeek's, every plan < 50 ms (CPU time with one
// thread, else wall clock).
//
// Timing table (--time-ranks, empty to skip): per GPU count and spare, flexpert's steady
// sequence planned on one thread (CPU time and wall clock) and again on --parallel-threads
// (0: one per core, at most eplb::kMaxPlanThreads; wall clock); the two must give the same plans.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "eplb/deepseek_eplb.h"
#include "eplb/planner.h"

namespace {

using Matrix = std::vector<std::vector<double>>;
using Placement = std::vector<std::vector<int>>;

struct Options {
  std::vector<int> ranks = {16, 32, 64, 144, 256};
  std::vector<int> spare = {1, 2, 3};
  int windows = 6, layers = 61, experts = 256, groups = 8, ranks_per_host = 8;
  double zipf_min = 0.6, zipf_max = 1.2, sigma = 0.05, swap_prob = 0.05, noise = 0.2;
  std::vector<double> tolerance = {flexpert::eplb::PlanInput().tolerance};
  std::vector<double> scale_tolerance = {flexpert::eplb::PlanInput().tolerance, 0.02, 0.05};
  std::vector<double> smooth = {0, 0.3};
  bool fill = true;  // --format deepseek
  int threads = 1;
  // Timing table: these GPU counts, the steady sequence on one thread and on parallel_threads.
  std::vector<int> time_ranks = {256};
  int parallel_threads = 0;  // 0: one per core (PlanInput::num_threads)
  std::vector<std::pair<int, int>> scale = {{16, 24},   {24, 16},   {64, 48},   {48, 64},
                                            {144, 128}, {128, 144}, {256, 192}, {192, 256}};
  int scale_spare = 1;
  std::vector<int> greedy_after_change = {1};
  bool scale_prev_deepseek = true;
  unsigned seed = 1;
  std::string json;
};

template <typename T>
std::vector<T> list(const std::string& s) {
  std::vector<T> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(static_cast<T>(std::atof(item.c_str())));
  return v;
}

bool parse(int argc, char** argv, Options& o) {
  auto to_int = [](int& out) {
    return [&out](const std::string& v) { out = std::atoi(v.c_str()); };
  };
  auto to_double = [](double& out) {
    return [&out](const std::string& v) { out = std::atof(v.c_str()); };
  };
  bool ok = true;
  const std::map<std::string, std::function<void(const std::string&)>> flags = {
      {"--ranks", [&](const std::string& v) { o.ranks = list<int>(v); }},
      {"--spare", [&](const std::string& v) { o.spare = list<int>(v); }},
      {"--windows", to_int(o.windows)},
      {"--layers", to_int(o.layers)},
      {"--experts", to_int(o.experts)},
      {"--groups", to_int(o.groups)},
      {"--ranks-per-host", to_int(o.ranks_per_host)},
      {"--zipf-min", to_double(o.zipf_min)},
      {"--zipf-max", to_double(o.zipf_max)},
      {"--sigma", to_double(o.sigma)},
      {"--swap-prob", to_double(o.swap_prob)},
      {"--noise", to_double(o.noise)},
      {"--tolerance", [&](const std::string& v) { o.tolerance = list<double>(v); }},
      {"--smooth", [&](const std::string& v) { o.smooth = list<double>(v); }},
      {"--scale-tolerance", [&](const std::string& v) { o.scale_tolerance = list<double>(v); }},
      {"--format",
       [&](const std::string& v) {
         o.fill = v == "deepseek";
         ok = ok && (v == "deepseek" || v == "flexpert");
       }},
      {"--threads", to_int(o.threads)},
      {"--time-ranks", [&](const std::string& v) { o.time_ranks = list<int>(v); }},
      {"--parallel-threads", to_int(o.parallel_threads)},
      {"--scale",
       [&](const std::string& v) {
         o.scale.clear();
         std::stringstream in(v);
         std::string item;
         while (std::getline(in, item, ',')) {
           const size_t colon = item.find(':');
           if (colon == std::string::npos) {
             ok = false;
             continue;
           }
           o.scale.emplace_back(std::atoi(item.substr(0, colon).c_str()),
                                std::atoi(item.substr(colon + 1).c_str()));
         }
       }},
      {"--scale-spare", to_int(o.scale_spare)},
      {"--greedy-after-change",
       [&](const std::string& v) { o.greedy_after_change = list<int>(v); }},
      {"--scale-prev",
       [&](const std::string& v) {
         o.scale_prev_deepseek = v == "deepseek";
         ok = ok && (v == "deepseek" || v == "flexpert");
       }},
      {"--seed",
       [&](const std::string& v) { o.seed = static_cast<unsigned>(std::atoi(v.c_str())); }},
      {"--json", [&](const std::string& v) { o.json = v; }},
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    auto it = flags.find(argv[i]);
    if (it == flags.end()) return false;
    it->second(argv[i + 1]);
  }
  for (auto [a, b] : o.scale) ok = ok && a >= 1 && b >= 1;
  return ok && argc % 2 == 1 && o.windows >= 2 && o.layers >= 1 && o.experts >= 1 &&
         o.groups >= 1 && o.ranks_per_host >= 1 && !o.ranks.empty() && !o.spare.empty() &&
         !o.tolerance.empty() && !o.scale_tolerance.empty() && !o.smooth.empty() &&
         !o.greedy_after_change.empty() && o.threads >= 0 && o.scale_spare >= 0 &&
         o.parallel_threads >= 0;
}

// windows + 1 load matrices (the last one only scores the last plan).
std::vector<Matrix> make_loads(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double tokens = 16384.0 * 8;
  const int top = std::min(16, o.experts);
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
          std::partial_sort(idx.begin(), idx.begin() + top, idx.end(),
                            [&](int a, int b) { return row[a] > row[b]; });
          const int hot = idx[rng() % top];
          std::swap(row[hot], row[rng() % o.experts]);
        }
      }
    }
    Matrix counts = w;
    for (auto& row : counts) {
      for (double& x : row) x *= std::exp(o.noise * normal(rng));  // this window only
      const double sum = std::accumulate(row.begin(), row.end(), 0.0);
      for (double& x : row) x = std::round(x / sum * tokens);
    }
    out.push_back(std::move(counts));
  }
  return out;
}

struct Row {
  std::string gpus;  // "64" or "64->48"
  int slots = 0;
  std::string planner;
  double tolerance = 0, smooth = 0;
  double balance_now = 0, balance_next = 0, moved = 0, moved_pct = 0;
  double ms_mean = 0, ms_max = 0, cpu_mean = 0, cpu_max = 0;
  double hier_pct = 0, colocated = 0, free_slots = 0;
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

int64_t free_slots(const Placement& p) {
  int64_t n = 0;
  for (const auto& row : p) n += std::count(row.begin(), row.end(), -1);
  return n;
}

[[noreturn]] void fail(const char* planner, const flexpert::Status& s) {
  std::fprintf(stderr, "eplb_bench: %s: %s\n", planner, s.to_string().c_str());
  std::exit(1);
}

int slots_for(const Options& o, int num_ranks, int spare) {
  return (o.experts + num_ranks - 1) / num_ranks + spare;
}

// One plan of `load` on num_ranks ranks; `prev` (prev_slots per rank, possibly another number
// of ranks) is the current placement. Adds the plan's time to `row` and returns the plan.
struct Planned {
  Placement placement;
  int64_t hier_layers = 0;
  double ms = 0;      // wall clock
  double cpu_ms = 0;  // CPU time of the process (of all planner threads)
};

// CPU time of the process: a plan's compute, without the time other programs held the core.
double cpu_ms_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

Planned plan_once(const Options& o, const Matrix& load, int num_ranks, int slots,
                  const Placement& prev, int prev_slots, bool deepseek, double tolerance,
                  bool greedy_after_change = true) {
  Planned out;
  const int hosts = std::max(1, num_ranks / o.ranks_per_host);
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_ms_now();
  if (deepseek) {
    auto p =
        flexpert::eplb::deepseek_rebalance(load, num_ranks * slots, o.groups, hosts, num_ranks);
    if (!p.ok()) fail("deepseek", p.status());
    out.placement = std::move(p->phy2log);
    out.hier_layers = p->hierarchical ? o.layers : 0;
  } else {
    flexpert::eplb::PlanInput in;
    in.num_experts = o.experts;
    in.slots_per_rank = slots;
    in.ranks.resize(num_ranks);
    std::iota(in.ranks.begin(), in.ranks.end(), 0);
    in.max_ranks = num_ranks;
    in.num_hosts = hosts;
    in.num_groups = o.groups;
    in.load = load;
    if (!prev.empty()) {
      // The previous GPUs that remain, all their slots; new GPUs empty (map_previous in
      // src/eplb/plan_io.h).
      const int prev_ranks = static_cast<int>(prev[0].size()) / prev_slots;
      const size_t kept = static_cast<size_t>(std::min(prev_ranks, num_ranks)) * prev_slots;
      for (const auto& row : prev) {
        std::vector<int> cur(static_cast<size_t>(num_ranks) * prev_slots, -1);
        std::copy(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(kept), cur.begin());
        in.current.push_back(std::move(cur));
      }
      in.current_slots_per_rank = prev_slots;
    }
    in.tolerance = tolerance;
    in.greedy_after_change = greedy_after_change;
    in.fill_slots = o.fill;
    in.num_threads = o.threads;
    auto p = flexpert::eplb::plan(in);
    if (!p.ok()) fail("flexpert", p.status());
    out.placement = std::move(p->placement);
    for (auto used : p->used) out.hier_layers += used == flexpert::eplb::Policy::kHierarchical;
  }
  out.cpu_ms = cpu_ms_now() - cpu_start;
  out.ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return out;
}

// Adds one plan's figures to `row` (means over `plans` plans; receives only when `scored`).
void score(const Options& o, const std::vector<Matrix>& loads, int t, int num_ranks, int slots,
           const Planned& p, const Placement& prev, int prev_slots, bool scored, double plans,
           double moved_plans, Row& row) {
  std::vector<int> ranks(num_ranks);
  std::iota(ranks.begin(), ranks.end(), 0);
  const double cells = static_cast<double>(o.layers) * plans;
  for (int l = 0; l < o.layers; ++l) {
    using flexpert::eplb::balancedness;
    row.balance_now += balancedness(loads[t][l], p.placement[l], ranks, slots) / cells;
    row.balance_next += balancedness(loads[t + 1][l], p.placement[l], ranks, slots) / cells;
  }
  if (scored) {
    row.moved +=
        static_cast<double>(flexpert::eplb::count_receives(prev, prev_slots, p.placement, slots)) /
        moved_plans;
  }
  row.ms_mean += p.ms / plans;
  row.ms_max = std::max(row.ms_max, p.ms);
  row.cpu_mean += p.cpu_ms / plans;
  row.cpu_max = std::max(row.cpu_max, p.cpu_ms);
  row.hier_pct += 100.0 * static_cast<double>(p.hier_layers) / cells;
  row.colocated += static_cast<double>(colocated_replicas(p.placement, slots)) / plans;
  row.free_slots += static_cast<double>(free_slots(p.placement)) / plans;
}

Row run_steady(const Options& o, const std::vector<Matrix>& loads, int num_ranks, int spare,
               bool deepseek, double tolerance, double smooth) {
  Row row;
  row.gpus = std::to_string(num_ranks);
  row.slots = slots_for(o, num_ranks, spare);
  row.planner = deepseek ? "deepseek" : "flexpert";
  row.tolerance = tolerance;
  row.smooth = smooth;
  Placement prev;
  Matrix shares;
  for (int t = 0; t < o.windows; ++t) {
    Matrix smoothed = loads[t];
    if (smooth > 0) shares = flexpert::eplb::smooth_load(shares, smooth, smoothed);
    Planned p = plan_once(o, smoothed, num_ranks, row.slots, prev, row.slots, deepseek, tolerance);
    score(o, loads, t, num_ranks, row.slots, p, prev, row.slots, t > 0, o.windows, o.windows - 1,
          row);
    prev = std::move(p.placement);
  }
  row.moved_pct = 100.0 * row.moved / (static_cast<double>(o.layers) * num_ranks * row.slots);
  return row;
}

Row run_scale(const Options& o, const std::vector<Matrix>& loads, int from, int to, bool deepseek,
              double tolerance, bool greedy_after_change = true) {
  Row row;
  row.gpus = std::to_string(from) + "->" + std::to_string(to);
  row.slots = slots_for(o, to, o.scale_spare);
  row.planner = deepseek ? "deepseek" : greedy_after_change ? "flexpert" : "flexpert/tol";
  row.tolerance = tolerance;
  const int from_slots = slots_for(o, from, o.scale_spare);
  const double plans = o.windows - 1;
  for (int t = 1; t < o.windows; ++t) {
    const Placement prev = plan_once(o, loads[t - 1], from, from_slots, {}, from_slots,
                                     o.scale_prev_deepseek, flexpert::eplb::PlanInput().tolerance)
                               .placement;
    Planned p = plan_once(o, loads[t], to, row.slots, prev, from_slots, deepseek, tolerance,
                          greedy_after_change);
    score(o, loads, t, to, row.slots, p, prev, from_slots, true, plans, plans, row);
  }
  row.moved_pct = 100.0 * row.moved / (static_cast<double>(o.layers) * to * row.slots);
  return row;
}

// The steady sequence of plans (flexpert, default tolerance, no smoothing) on one thread and on
// o.parallel_threads: single-core time (CPU and wall clock) and parallel wall clock, mean and
// max over the windows; `same` checks that the thread count changed no plan.
struct Timing {
  int gpus = 0, slots = 0, threads = 0;
  double cpu_mean = 0, cpu_max = 0, wall_mean = 0, wall_max = 0, par_mean = 0, par_max = 0;
  bool same = true;
};

Timing run_timing(const Options& o, const std::vector<Matrix>& loads, int num_ranks, int spare) {
  Timing t;
  t.gpus = num_ranks;
  t.slots = slots_for(o, num_ranks, spare);
  Options one = o, many = o;
  one.threads = 1;
  many.threads = o.parallel_threads;
  t.threads = o.parallel_threads > 0
                  ? o.parallel_threads
                  : std::min(flexpert::eplb::kMaxPlanThreads,
                             static_cast<int>(std::thread::hardware_concurrency()));
  const double tol = flexpert::eplb::PlanInput().tolerance;
  Placement prev;
  for (int w = 0; w < o.windows; ++w) {
    Planned a = plan_once(one, loads[w], num_ranks, t.slots, prev, t.slots, false, tol);
    const Planned b = plan_once(many, loads[w], num_ranks, t.slots, prev, t.slots, false, tol);
    t.same = t.same && a.placement == b.placement;
    t.cpu_mean += a.cpu_ms / o.windows;
    t.cpu_max = std::max(t.cpu_max, a.cpu_ms);
    t.wall_mean += a.ms / o.windows;
    t.wall_max = std::max(t.wall_max, a.ms);
    t.par_mean += b.ms / o.windows;
    t.par_max = std::max(t.par_max, b.ms);
    prev = std::move(a.placement);
  }
  return t;
}

// A smoothed plan aims at the next window, not at the one it was measured on: its balance is
// compared there.
// Time: CPU time on one planner thread (what one free core takes, whatever else runs on the
// machine), wall clock with more threads.
std::string targets(const Options& o, const Row& ours, const Row& ds) {
  std::string missed;
  if (ours.smooth > 0 ? ours.balance_next < ds.balance_next - 0.005
                      : ours.balance_now < ds.balance_now - 0.005) {
    missed += " balance";
  }
  if (ours.moved > ds.moved / 2) missed += " moves";
  if ((o.threads == 1 ? ours.cpu_max : ours.ms_max) >= 50) missed += " time";
  return missed.empty() ? "met" : "missed:" + missed;
}

void print_header(const char* first) {
  std::printf(
      "| %s | slots/GPU | planner | tol | smooth | balance (planned) | balance (next window) | "
      "receives/plan | receives %% | plan ms mean | plan ms max | cpu ms mean | cpu ms max | "
      "hier %% | co-located | free | targets |\n",
      first);
  std::printf(
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
}

void print_row(const Row& x, const std::string& target) {
  std::printf(
      "| %s | %d | %s | %s | %s | %.4f | %.4f | %.0f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f "
      "| %.0f | %.0f | %s |\n",
      x.gpus.c_str(), x.slots, x.planner.c_str(),
      x.planner == "deepseek" ? "" : std::to_string(x.tolerance).substr(0, 5).c_str(),
      x.planner == "deepseek" ? "" : std::to_string(x.smooth).substr(0, 4).c_str(), x.balance_now,
      x.balance_next, x.moved, x.moved_pct, x.ms_mean, x.ms_max, x.cpu_mean, x.cpu_max, x.hier_pct,
      x.colocated, x.free_slots, target.c_str());
  std::fflush(stdout);
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
  std::printf("steady state: replans over %d windows, %s format, %d thread(s)\n\n", o.windows,
              o.fill ? "deepseek" : "flexpert", o.threads);
  print_header("GPUs");
  for (int r : o.ranks) {
    for (int s : o.spare) {
      const Row ds = run_steady(o, loads, r, s, true, 0, 0);
      print_row(ds, "");
      rows.push_back(ds);
      for (double tol : o.tolerance) {
        for (double sm : o.smooth) {
          const Row ours = run_steady(o, loads, r, s, false, tol, sm);
          print_row(ours, targets(o, ours, ds));
          rows.push_back(ours);
        }
      }
    }
  }
  if (!o.scale.empty()) {
    std::printf(
        "\nmembership changes: previous placement = %s's plan on the old GPUs, spare %d\n\n",
        o.scale_prev_deepseek ? "deepseek" : "flexpert", o.scale_spare);
    print_header("GPUs old->new");
    for (auto [from, to] : o.scale) {
      const Row ds = run_scale(o, loads, from, to, true, 0);
      print_row(ds, "");
      rows.push_back(ds);
      for (int greedy : o.greedy_after_change) {
        for (double tol : o.scale_tolerance) {
          const Row ours = run_scale(o, loads, from, to, false, tol, greedy != 0);
          print_row(ours, targets(o, ours, ds));
          rows.push_back(ours);
        }
      }
    }
  }
  std::vector<Timing> timings;
  if (!o.time_ranks.empty()) {
    std::printf(
        "\nplan time: %d layers, flexpert, steady replans over %d windows (window 0 from "
        "nothing); one thread: CPU time of the process and wall clock\n\n",
        o.layers, o.windows);
    std::printf(
        "| GPUs | slots/GPU | 1 thread: cpu ms mean | cpu ms max | wall ms mean | wall ms max | "
        "threads | parallel: wall ms mean | wall ms max | same plans |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for (int r : o.time_ranks) {
      for (int sp : o.spare) {
        const Timing t = run_timing(o, loads, r, sp);
        std::printf("| %d | %d | %.1f | %.1f | %.1f | %.1f | %d | %.1f | %.1f | %s |\n", t.gpus,
                    t.slots, t.cpu_mean, t.cpu_max, t.wall_mean, t.wall_max, t.threads, t.par_mean,
                    t.par_max, t.same ? "yes" : "NO");
        std::fflush(stdout);
        timings.push_back(t);
      }
    }
  }
  if (!o.json.empty()) {
    std::ofstream out(o.json);
    out << "{\"layers\": " << o.layers << ", \"experts\": " << o.experts
        << ", \"windows\": " << o.windows << ", \"format\": \""
        << (o.fill ? "deepseek" : "flexpert") << "\", \"threads\": " << o.threads
        << ", \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& x = rows[i];
      out << (i ? ",\n" : "") << "  {\"gpus\": \"" << x.gpus << "\", \"slots_per_gpu\": " << x.slots
          << ", \"planner\": \"" << x.planner << "\", \"tolerance\": " << x.tolerance
          << ", \"smooth\": " << x.smooth << ", \"balance_planned\": " << x.balance_now
          << ", \"balance_next\": " << x.balance_next << ", \"receives_per_plan\": " << x.moved
          << ", \"receives_pct\": " << x.moved_pct << ", \"plan_ms_mean\": " << x.ms_mean
          << ", \"plan_ms_max\": " << x.ms_max << ", \"plan_cpu_ms_mean\": " << x.cpu_mean
          << ", \"plan_cpu_ms_max\": " << x.cpu_max << ", \"hierarchical_pct\": " << x.hier_pct
          << ", \"colocated\": " << x.colocated << ", \"free_slots\": " << x.free_slots << "}";
    }
    out << "\n], \"timing\": [\n";
    for (size_t i = 0; i < timings.size(); ++i) {
      const Timing& t = timings[i];
      out << (i ? ",\n" : "") << "  {\"gpus\": " << t.gpus << ", \"slots_per_gpu\": " << t.slots
          << ", \"one_thread_cpu_ms_mean\": " << t.cpu_mean
          << ", \"one_thread_cpu_ms_max\": " << t.cpu_max
          << ", \"one_thread_wall_ms_mean\": " << t.wall_mean
          << ", \"one_thread_wall_ms_max\": " << t.wall_max << ", \"threads\": " << t.threads
          << ", \"parallel_wall_ms_mean\": " << t.par_mean
          << ", \"parallel_wall_ms_max\": " << t.par_max
          << ", \"same_plans\": " << (t.same ? "true" : "false") << "}";
    }
    out << "\n]}\n";
    if (!out) {
      std::fprintf(stderr, "eplb_bench: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  for (const Timing& t : timings) {
    if (!t.same) {
      std::fprintf(stderr, "eplb_bench: plans differ with %d threads\n", t.threads);
      return 1;
    }
  }
  return 0;
}
