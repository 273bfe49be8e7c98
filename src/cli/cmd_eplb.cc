// SPDX-License-Identifier: Apache-2.0
// `flexpert eplb plan`: plans expert placements for the cases of a DeepSeek-EPLB-style JSON
// file (see src/eplb/plan_io.h) with flexpert's planner or the DeepSeek port, and writes the
// plans in the same format (by default with every slot filled, as DeepSeek's interface has
// it), plus balancedness and remote receives ("moved_slots") per case. Load windows are
// smoothed and the skip threshold applied as in the serving path (eplb::smooth_load,
// PlanInput::min_gain; docs/ARCHITECTURE.md, EPLB).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "eplb/plan_io.h"

namespace flexpert::cli {
namespace {

const char kEplbUsage[] =
    "usage: flexpert eplb plan --input cases.json --output plans.json [flags]\n"
    "  input:  {\"cases\": [{\"name\", \"weight\": [layers][experts], \"num_replicas\",\n"
    "           \"num_groups\", \"num_nodes\", \"num_gpus\", \"prev_phy2log\"?, "
    "\"prev_num_gpus\"?}]}\n"
    "          or, for load windows, \"windows\": [windows][layers][experts] (oldest first)\n"
    "          instead of \"weight\": the last window, smoothed with the earlier ones\n"
    "          (--smoothing), is planned on\n"
    "  output: {\"cases\": [{\"name\", \"phy2log\", \"time_s\", \"balancedness\", "
    "\"moved_slots\" (remote receives),\n"
    "           \"policy\", \"skipped\", \"balancedness_gain\"}]}  (--output - writes to "
    "stdout)\n"
    "  --min-gain: a case whose plan gains less keeps its prev_phy2log (\"skipped\": true)\n";

std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read --input " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

Status write_file(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return Status();
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return failed_precondition("cannot write --output " + path);
  return Status();
}

}  // namespace

int cmd_eplb(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kEplbUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] != "plan") {
    std::fprintf(stderr, "flexpert eplb: unknown subcommand '%s'\n%s", args[0].c_str(), kEplbUsage);
    return 2;
  }
  Flags flags;
  flags.value("input", "", "cases JSON file (DeepSeek EPLB interface)")
      .value("output", "", "plans JSON file, or - for stdout")
      .value("planner", "flexpert", "flexpert | deepseek (the port of deepseek-ai/EPLB)")
      .value("policy", "auto", "flexpert planner: auto | global | hierarchical")
      .value("tolerance", format_number(eplb::PlanInput().tolerance),
             "flexpert planner: keep/repair a previous plan within this fraction of the best "
             "max GPU load (a few percent: fewer moves after a GPU count change)")
      .boolean("tolerance-after-change",
               "flexpert planner: after a GPU count change, repair to the tolerance too (default: "
               "no better than a greedy packing from scratch, fewer moves)")
      .value("min-replicas", "1", "flexpert planner: replicas every expert keeps at least")
      .value("format", "deepseek",
             "flexpert planner: deepseek (every slot holds an expert) | flexpert (-1 marks a "
             "free slot)")
      .value("smoothing", "0",
             "weight of earlier load windows, in [0, 1), as serve's --eplb-smoothing (0: the "
             "last window alone)")
      .value("min-gain", "0",
             "flexpert planner: keep prev_phy2log when the plan raises the mean balancedness by "
             "less than this (0: never skip)")
      .value("threads", "0",
             "flexpert planner: layers planned in parallel (0 = one per core, at most 16)")
      .boolean("help", "show this help");
  if (Status s = flags.parse({args.begin() + 1, args.end()}); !s.ok()) {
    return report_error("eplb plan", s);
  }
  if (flags.flag("help")) {
    std::printf("%s%s", kEplbUsage, flags.help().c_str());
    return 0;
  }
  const bool to_stdout = flags.str("output") == "-";
  auto run = [&]() -> Status {
    if (!flags.has("input")) return invalid_argument("--input FILE is required");
    if (!flags.has("output")) return invalid_argument("--output FILE is required");
    eplb::RunOptions options;
    FLEX_ASSIGN_OR_RETURN(options.planner, eplb::parse_planner(flags.str("planner")));
    FLEX_ASSIGN_OR_RETURN(options.policy, eplb::parse_policy(flags.str("policy")));
    FLEX_ASSIGN_OR_RETURN(options.tolerance, flags.number("tolerance"));
    if (!(options.tolerance >= 0)) return invalid_argument("--tolerance must be >= 0");
    options.greedy_after_change = !flags.flag("tolerance-after-change");
    FLEX_ASSIGN_OR_RETURN(int64_t min_replicas, flags.integer("min-replicas"));
    if (min_replicas < 1 || min_replicas > 1 << 20) {
      return invalid_argument("--min-replicas must be >= 1");
    }
    options.min_replicas = static_cast<int>(min_replicas);
    FLEX_ASSIGN_OR_RETURN(options.format, eplb::parse_format(flags.str("format")));
    FLEX_ASSIGN_OR_RETURN(int64_t threads, flags.integer("threads"));
    if (threads < 0 || threads > 1024) return invalid_argument("--threads must be in [0, 1024]");
    options.num_threads = static_cast<int>(threads);
    FLEX_ASSIGN_OR_RETURN(options.smoothing, flags.number("smoothing"));
    if (!(options.smoothing >= 0 && options.smoothing < 1)) {
      return invalid_argument("--smoothing must be in [0, 1), got " + flags.str("smoothing"));
    }
    FLEX_ASSIGN_OR_RETURN(options.min_gain, flags.number("min-gain"));
    if (!(options.min_gain >= 0 && options.min_gain <= 1)) {
      return invalid_argument("--min-gain must be in [0, 1] (a balancedness gain), got " +
                              flags.str("min-gain"));
    }
    if (options.min_gain > 0 && options.planner != eplb::Planner::kFlexpert) {
      return invalid_argument("--min-gain needs --planner flexpert");
    }
    FLEX_ASSIGN_OR_RETURN(std::string text, read_file(flags.str("input")));
    auto cases = eplb::parse_cases(text);
    if (!cases.ok()) return cases.status().annotate(flags.str("input"));
    std::vector<eplb::CaseResult> results;
    FILE* table = to_stdout ? stderr : stdout;
    std::fprintf(table, "%-24s %6s %9s %10s %11s %10s\n", "case", "layers", "replicas", "balance",
                 "receives", "time_ms");
    for (const eplb::PlanCase& c : *cases) {
      const auto start = std::chrono::steady_clock::now();
      FLEX_ASSIGN_OR_RETURN(eplb::CaseResult r, eplb::run_case(c, options));
      r.time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      double mean = 0;
      for (double b : r.balancedness) mean += b / static_cast<double>(r.balancedness.size());
      std::fprintf(table, "%-24s %6zu %9d %10.4f %11lld %10.2f\n", r.name.c_str(), r.phy2log.size(),
                   c.num_replicas, mean, static_cast<long long>(r.moved_slots), r.time_s * 1e3);
      if (r.skipped) {
        std::fprintf(table,
                     "%-24s skipped: balancedness gain %.4f < --min-gain %g, prev_phy2log kept\n",
                     r.name.c_str(), r.balancedness_gain, options.min_gain);
      }
      results.push_back(std::move(r));
    }
    return write_file(flags.str("output"), eplb::results_to_json(results));
  };
  if (Status s = run(); !s.ok()) return report_error("eplb plan", s);
  return 0;
}

}  // namespace flexpert::cli
