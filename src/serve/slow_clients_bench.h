// SPDX-License-Identifier: Apache-2.0
// bench_slow_clients: how many slow clients a running server tolerates while its
// /health still answers quickly (docs/benchmarks.md, "Slow clients").
//
// Optionally `num_streams` streaming completions run first (their events are read
// and dropped). Then, for each step N, slow connections are added until N are held:
// each sends the start of a POST's headers and one more byte every `trickle_ms`,
// and is reopened when the server closes it (408 at its request deadline, or 503
// over a connection cap). Over `hold_s` seconds per step, a probe opens a fresh
// connection every `probe_interval_ms` and times GET /health to its full answer.
// Blocks; bounded by steps x hold_s plus connection setup. Not thread-safe.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flexpert/status.h"

namespace flexpert {

struct SlowClientsOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::vector<int> steps = {64, 256, 1024};  // Slow connections held, cumulative.
  double hold_s = 3.0;
  int trickle_ms = 500;
  int probe_interval_ms = 50;
  int probe_timeout_ms = 5000;
  int num_streams = 0;
  int stream_max_tokens = 256;
  double health_target_ms = 100.0;
  // The probe's own address, as a health checker is another client than the slow
  // ones (a per-client cap does not count it with them); "" for the default.
  std::string probe_source = "127.0.0.2";
};

// Result JSON: options, and per step {slow_target, slow_held (mean while probing),
// refused_503, timed_out_408, closed_other, probes, probe_failures, health_ms {p50,
// p99, max}, within_target}; tolerated: the largest step whose every probe answered
// 200 within health_target_ms (0 if none). Unavailable when nothing answers.
Result<nlohmann::json> bench_slow_clients(const SlowClientsOptions& options);

}  // namespace flexpert
