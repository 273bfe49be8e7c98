// SPDX-License-Identifier: Apache-2.0
// The file interface of DeepSeek's open EPLB, so plans of both planners can be compared:
//   in:  {"cases": [{"name", "weight": [layers][logical experts], "num_replicas", "num_groups",
//                    "num_nodes", "num_gpus", "prev_phy2log"?: [layers][prev slots],
//                    "prev_num_gpus"?}]}
//   out: {"cases": [{"name", "phy2log": [layers][num_replicas], "time_s", "balancedness":
//                    [layers], "moved_slots", "policy": [layers], "skipped",
//                    "balancedness_gain"}]}
// Instead of "weight", a case may give "windows": [window][layers][logical experts], load windows
// oldest first, all of one shape; the plan uses the last one smoothed with the earlier ones
// (RunOptions::smoothing, as the serving path's rebalances, eplb::smooth_load).
// Slot s lives on GPU s / (num_replicas / num_gpus). Format kDeepSeek (the default) fills every
// slot, as DeepSeek's interface has it; with kFlexpert, -1 in phy2log marks a free slot (a slot
// the plan gains nothing by filling, so it needs no weights). "moved_slots" counts remote
// receives (count_receives in planner.h) against the previous plan. JSON text in and out: the
// caller does the file I/O and owns the clock (time_s). Pure functions otherwise; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eplb/planner.h"
#include "flexpert/status.h"

namespace flexpert::eplb {

enum class Planner { kFlexpert, kDeepSeek };
enum class Format { kDeepSeek, kFlexpert };
Result<Format> parse_format(std::string_view name);    // "deepseek" | "flexpert"
Result<Planner> parse_planner(std::string_view name);  // "flexpert" | "deepseek"

struct PlanCase {
  std::string name;
  std::vector<std::vector<double>> weight;  // [layer][logical expert]: the last window
  // The windows before `weight`, oldest first ("windows" in the file); empty for "weight".
  std::vector<std::vector<std::vector<double>>> earlier_windows;
  int num_replicas = 0;
  int num_groups = 1;  // optional in the file, default 1
  int num_nodes = 1;   // optional in the file, default 1
  int num_gpus = 0;
  std::vector<std::vector<int>> prev_phy2log;  // empty: no previous plan
  int prev_num_gpus = 0;                       // GPUs of prev_phy2log; defaults to num_gpus
};

struct CaseResult {
  std::string name;
  std::vector<std::vector<int>> phy2log;
  std::vector<double> balancedness;  // per layer, mean / max GPU load
  int64_t moved_slots = 0;           // remote receives against the previous plan; all if none
  std::vector<std::string> policy;   // per layer: "global" or "hierarchical"
  // RunOptions::min_gain not reached: phy2log is the previous plan, nothing moves.
  bool skipped = false;
  double balancedness_gain = 0;  // mean over layers, plan minus previous plan (flexpert only)
  double time_s = 0;             // set by the caller
};

struct RunOptions {
  Planner planner = Planner::kFlexpert;
  Policy policy = Policy::kAuto;                               // flexpert only
  int min_replicas = 1;                                        // flexpert only
  double tolerance = PlanInput().tolerance;                    // flexpert only
  bool greedy_after_change = PlanInput().greedy_after_change;  // flexpert only
  Format format = Format::kDeepSeek;          // flexpert only (DeepSeek's has no -1)
  int num_threads = PlanInput().num_threads;  // flexpert only: layers in parallel, 0 = per core
  // Weight of the earlier windows, in [0, 1): the planned load is smooth_load applied window by
  // window, oldest first, as the serving path does rebalance by rebalance (--eplb-smoothing);
  // 0 = the last window alone.
  double smoothing = 0;
  // Skip threshold (PlanInput::min_gain): a case whose plan raises the mean balancedness by
  // less than this over its prev_phy2log keeps prev_phy2log (skipped). flexpert only.
  double min_gain = 0;
};

// InvalidArgument naming the case and field for anything malformed.
Result<std::vector<PlanCase>> parse_cases(std::string_view json_text);

// The previous plan as a current placement of num_gpus x (previous slots per GPU) slots
// (PlanInput::current_slots_per_rank). A GPU present in both keeps all its experts; GPUs >=
// num_gpus are gone (scale-down removes the highest ranks) and their experts must be placed
// anew; new GPUs start empty. Empty when the case has no previous plan.
std::vector<std::vector<int>> map_previous(const PlanCase& c);
// Slots per GPU of the previous plan (num_replicas / num_gpus when there is none).
int previous_slots_per_gpu(const PlanCase& c);

// The load a case is planned on: its windows smoothed with `smoothing` (see RunOptions); the
// last window as it is when smoothing is 0 or the case has one window.
std::vector<std::vector<double>> planned_load(const PlanCase& c, double smoothing);

// Balancedness and moved_slots are scored on planned_load(c, options.smoothing).
Result<CaseResult> run_case(const PlanCase& c, const RunOptions& options);

std::string results_to_json(const std::vector<CaseResult>& results);

}  // namespace flexpert::eplb
