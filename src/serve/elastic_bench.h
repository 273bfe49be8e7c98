// SPDX-License-Identifier: Apache-2.0
// The elastic scenario behind `flexpert demo` and `flexpert bench elastic`: a
// serving group under steady load from client threads while scale events and
// rank kills happen on a schedule. Measures, per event: preparation and commit
// time (the engine's report), the commit stall (longest inter-token gap spanning
// the event minus the steady-state longest gap) and failed requests; plus a
// timeline of tokens/s and the longest inter-token gap, and checks every greedy
// completion against a reference.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "serve/cluster_engine.h"

namespace flexpert {

struct ElasticEvent {
  double at_s = 0;
  std::string kind;  // "scale" (to `ranks`) or "kill" (SIGKILL rank `rank`'s worker).
  int ranks = -1;
  int rank = -1;
  std::string label() const;  // "scale to 4", "kill rank 1"
};

// "2:scale:4,5:kill:1": AT_SECONDS:scale:RANKS or AT_SECONDS:kill:RANK, ascending times.
Result<std::vector<ElasticEvent>> parse_elastic_events(const std::string& spec);

struct ElasticRunOptions {
  ClusterOptions cluster;
  std::vector<ElasticEvent> events;
  double duration_s = 12;
  int concurrency = 6;
  int max_tokens = 24;  // Greedy, ignore_eos: every request generates exactly this many.
  std::vector<std::vector<int32_t>> prompts;
  // Expected greedy continuation per prompt (at least max_tokens); empty: not checked.
  std::vector<std::vector<int32_t>> expected;
  std::function<void(const std::string&)> log;  // Progress lines.
};

// Runs the scenario on a fresh group (started and stopped here). The report:
// {"mode", "requests": {completed, failed, rejected, mismatched}, "steady": {...},
//  "events": [...], "timeline": {"t", "tokens_per_s", "max_gap_ms"}}.
Result<nlohmann::json> run_elastic(const ElasticRunOptions& options);

// Writes a PNG timeline of one or more reports (python3 + matplotlib); an
// Unavailable status says why when they are missing.
Status plot_elastic(const std::vector<nlohmann::json>& reports, const std::string& png_path);

}  // namespace flexpert
