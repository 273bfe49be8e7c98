// SPDX-License-Identifier: Apache-2.0
#include "eplb/plan_io.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/json_limits.h"
#include "eplb/deepseek_eplb.h"

namespace flexpert::eplb {
namespace {

using nlohmann::json;

Result<int> positive_int(const json& c, const std::string& where, const char* key, bool required,
                         int fallback) {
  if (!c.contains(key)) {
    if (required) return invalid_argument(where + ": missing \"" + key + "\"");
    return fallback;
  }
  const json& v = c[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (1 << 30)) {
    return invalid_argument(where + ": \"" + key + "\" must be a positive integer");
  }
  return static_cast<int>(v.get<int64_t>());
}

// A [layers][experts] load: rows of one length, finite numbers >= 0.
Result<std::vector<std::vector<double>>> parse_load(const json& v, const std::string& what) {
  if (!v.is_array() || v.empty()) {
    return invalid_argument(what + " must be a non-empty [layers][experts] array");
  }
  std::vector<std::vector<double>> load;
  for (const json& row : v) {
    if (!row.is_array() || row.empty()) {
      return invalid_argument(what + ": every row must be a non-empty array");
    }
    std::vector<double> r;
    r.reserve(row.size());
    for (const json& x : row) {
      if (!x.is_number() || !std::isfinite(x.get<double>()) || x.get<double>() < 0) {
        return invalid_argument(what + ": weights must be finite numbers >= 0");
      }
      r.push_back(x.get<double>());
    }
    if (!load.empty() && r.size() != load[0].size()) {
      return invalid_argument(what + ": rows differ in length");
    }
    load.push_back(std::move(r));
  }
  return load;
}

Result<PlanCase> parse_case(const json& c, size_t index) {
  std::string where = "case " + std::to_string(index);
  if (!c.is_object()) return invalid_argument(where + ": not an object");
  if (!c.contains("name") || !c["name"].is_string()) {
    return invalid_argument(where + ": \"name\" must be a string");
  }
  PlanCase pc;
  pc.name = c["name"].get<std::string>();
  where += " ('" + pc.name + "')";

  const bool has_weight = c.contains("weight"), has_windows = c.contains("windows");
  if (has_weight == has_windows) {
    return invalid_argument(where + ": give either \"weight\" or \"windows\"");
  }
  if (has_weight) {
    FLEX_ASSIGN_OR_RETURN(pc.weight, parse_load(c["weight"], where + ": \"weight\""));
  } else {
    const json& windows = c["windows"];
    if (!windows.is_array() || windows.empty()) {
      return invalid_argument(where + ": \"windows\" must be a non-empty array of " +
                              "[layers][experts] arrays");
    }
    for (size_t w = 0; w < windows.size(); ++w) {
      const std::string what = where + ": \"windows\"[" + std::to_string(w) + "]";
      FLEX_ASSIGN_OR_RETURN(std::vector<std::vector<double>> load, parse_load(windows[w], what));
      if (w > 0 && (load.size() != pc.weight.size() || load[0].size() != pc.weight[0].size())) {
        return invalid_argument(what + ": every window must have the first one's shape");
      }
      if (w > 0) pc.earlier_windows.push_back(std::move(pc.weight));
      pc.weight = std::move(load);
    }
  }
  FLEX_ASSIGN_OR_RETURN(pc.num_replicas, positive_int(c, where, "num_replicas", true, 0));
  FLEX_ASSIGN_OR_RETURN(pc.num_gpus, positive_int(c, where, "num_gpus", true, 0));
  FLEX_ASSIGN_OR_RETURN(pc.num_groups, positive_int(c, where, "num_groups", false, 1));
  FLEX_ASSIGN_OR_RETURN(pc.num_nodes, positive_int(c, where, "num_nodes", false, 1));
  if (pc.num_replicas % pc.num_gpus != 0) {
    return invalid_argument(where + ": num_replicas must be a multiple of num_gpus");
  }
  const int num_experts = static_cast<int>(pc.weight[0].size());
  if (pc.num_replicas < num_experts) {
    return invalid_argument(where + ": num_replicas is smaller than the number of experts");
  }
  if (c.contains("prev_num_gpus") && !c.contains("prev_phy2log")) {
    return invalid_argument(where + ": \"prev_num_gpus\" without \"prev_phy2log\"");
  }
  FLEX_ASSIGN_OR_RETURN(pc.prev_num_gpus,
                        positive_int(c, where, "prev_num_gpus", false, pc.num_gpus));
  if (c.contains("prev_phy2log")) {
    const json& prev = c["prev_phy2log"];
    if (!prev.is_array() || prev.size() != pc.weight.size()) {
      return invalid_argument(where + ": \"prev_phy2log\" must have one row per layer");
    }
    for (const json& row : prev) {
      if (!row.is_array() || row.empty() || row.size() % pc.prev_num_gpus != 0 ||
          (!pc.prev_phy2log.empty() && row.size() != pc.prev_phy2log[0].size())) {
        return invalid_argument(where +
                                ": \"prev_phy2log\" rows must have one length, a multiple of "
                                "prev_num_gpus");
      }
      std::vector<int> r;
      for (const json& v : row) {
        if (!v.is_number_integer() || v.get<int64_t>() < -1 || v.get<int64_t>() >= num_experts) {
          return invalid_argument(where + ": \"prev_phy2log\" entries must be experts or -1");
        }
        r.push_back(static_cast<int>(v.get<int64_t>()));
      }
      pc.prev_phy2log.push_back(std::move(r));
    }
  }
  return pc;
}

}  // namespace

Result<Format> parse_format(std::string_view name) {
  if (name == "deepseek") return Format::kDeepSeek;
  if (name == "flexpert") return Format::kFlexpert;
  return invalid_argument("format must be deepseek or flexpert, got '" + std::string(name) + "'");
}

Result<Planner> parse_planner(std::string_view name) {
  if (name == "flexpert") return Planner::kFlexpert;
  if (name == "deepseek") return Planner::kDeepSeek;
  return invalid_argument("planner must be flexpert or deepseek, got '" + std::string(name) + "'");
}

Result<std::vector<PlanCase>> parse_cases(std::string_view json_text) {
  FLEX_RETURN_IF_ERROR(check_json_nesting(json_text, "input"));
  json doc = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return invalid_argument("input is not valid JSON");
  if (!doc.is_object() || !doc.contains("cases") || !doc["cases"].is_array()) {
    return invalid_argument("input must be an object with a \"cases\" array");
  }
  std::vector<PlanCase> cases;
  for (size_t i = 0; i < doc["cases"].size(); ++i) {
    FLEX_ASSIGN_OR_RETURN(PlanCase c, parse_case(doc["cases"][i], i));
    cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<std::vector<int>> map_previous(const PlanCase& c) {
  std::vector<std::vector<int>> current;
  if (c.prev_phy2log.empty()) return current;
  const int prev_gpus = c.prev_num_gpus > 0 ? c.prev_num_gpus : c.num_gpus;
  for (const auto& prev : c.prev_phy2log) {
    const size_t prev_slots = prev.size() / prev_gpus;
    std::vector<int> row(static_cast<size_t>(c.num_gpus) * prev_slots, -1);
    const size_t kept = static_cast<size_t>(std::min(prev_gpus, c.num_gpus)) * prev_slots;
    std::copy(prev.begin(), prev.begin() + static_cast<std::ptrdiff_t>(kept), row.begin());
    current.push_back(std::move(row));
  }
  return current;
}

int previous_slots_per_gpu(const PlanCase& c) {
  if (c.prev_phy2log.empty()) return c.num_replicas / c.num_gpus;
  const int prev_gpus = c.prev_num_gpus > 0 ? c.prev_num_gpus : c.num_gpus;
  return static_cast<int>(c.prev_phy2log[0].size()) / prev_gpus;
}

std::vector<std::vector<double>> planned_load(const PlanCase& c, double smoothing) {
  if (smoothing == 0) return c.weight;  // The same numbers, not a rescaled copy of them.
  std::vector<std::vector<double>> shares;
  for (std::vector<std::vector<double>> window : c.earlier_windows) {
    shares = smooth_load(shares, smoothing, window);
  }
  std::vector<std::vector<double>> load = c.weight;
  (void)smooth_load(shares, smoothing, load);
  return load;
}

Result<CaseResult> run_case(const PlanCase& c, const RunOptions& options) {
  if (options.planner == Planner::kDeepSeek && options.min_gain > 0) {
    return invalid_argument("min_gain needs the flexpert planner");
  }
  const std::vector<std::vector<double>> load = planned_load(c, options.smoothing);
  CaseResult r;
  r.name = c.name;
  const std::vector<std::vector<int>> current = map_previous(c);
  const int slots = c.num_replicas / c.num_gpus;
  const int prev_slots = previous_slots_per_gpu(c);
  std::vector<int> ranks(c.num_gpus);
  std::iota(ranks.begin(), ranks.end(), 0);
  if (options.planner == Planner::kDeepSeek) {
    FLEX_ASSIGN_OR_RETURN(DeepSeekPlan p, deepseek_rebalance(load, c.num_replicas, c.num_groups,
                                                             c.num_nodes, c.num_gpus));
    r.phy2log = std::move(p.phy2log);
    r.policy.assign(r.phy2log.size(), p.hierarchical ? "hierarchical" : "global");
  } else {
    PlanInput in;
    in.num_experts = static_cast<int>(c.weight[0].size());
    in.slots_per_rank = slots;
    in.ranks = ranks;
    in.max_ranks = c.num_gpus;
    in.num_hosts = c.num_nodes;
    in.num_groups = c.num_groups;
    in.load = load;
    in.min_gain = options.min_gain;
    in.current = current;
    in.current_slots_per_rank = prev_slots;
    in.fill_slots = options.format == Format::kDeepSeek;
    in.num_threads = options.num_threads;
    in.policy = options.policy;
    in.min_replicas = options.min_replicas;
    in.tolerance = options.tolerance;
    in.greedy_after_change = options.greedy_after_change;
    auto out = plan(in);
    if (!out.ok()) return out.status().annotate("case '" + c.name + "'");
    r.phy2log = std::move(out->placement);
    r.skipped = out->skipped;
    r.balancedness_gain = out->balancedness_gain;
    for (Policy p : out->used) r.policy.emplace_back(policy_name(p));
  }
  for (size_t l = 0; l < r.phy2log.size(); ++l) {
    r.balancedness.push_back(balancedness(load[l], r.phy2log[l], ranks, slots));
  }
  r.moved_slots = count_receives(current, prev_slots, r.phy2log, slots);
  return r;
}

std::string results_to_json(const std::vector<CaseResult>& results) {
  // One phy2log row per line: readable, and diff-friendly between planners.
  std::string out = "{\"cases\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const CaseResult& r = results[i];
    out += i ? ",\n" : "\n";
    out += " {\"name\": " + json(r.name).dump() + ", \"time_s\": " + json(r.time_s).dump() +
           ", \"moved_slots\": " + std::to_string(r.moved_slots) +
           ", \"skipped\": " + (r.skipped ? "true" : "false") +
           ", \"balancedness_gain\": " + json(r.balancedness_gain).dump() +
           ",\n  \"balancedness\": " + json(r.balancedness).dump() +
           ",\n  \"policy\": " + json(r.policy).dump() + ",\n  \"phy2log\": [";
    for (size_t l = 0; l < r.phy2log.size(); ++l) {
      out += (l ? ",\n   " : "\n   ") + json(r.phy2log[l]).dump();
    }
    out += "]}";
  }
  out += "\n]}\n";
  return out;
}

}  // namespace flexpert::eplb
