// SPDX-License-Identifier: Apache-2.0
// bench_serve: a load generator for a running flexpert (or any server speaking the
// same token-id completions API).
//
// `concurrency` client threads, each with its own keep-alive connection, send
// `num_requests` completions in total: random prompts of `prompt_len` token ids,
// temperature 0 and ignore_eos so that every answer has exactly `max_tokens`
// tokens. With streaming it measures time to first token and inter-token latency
// per request from the server-sent events. Blocks until all requests are done;
// `progress` is called on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "flexpert/status.h"

namespace flexpert {

struct BenchServeOptions {
  std::string url = "http://127.0.0.1:8000";
  int concurrency = 8;
  int num_requests = 64;
  int prompt_len = 32;
  int max_tokens = 32;
  int vocab_size = 0;  // Prompt ids are drawn from [0, vocab_size); 0: ask GET
                       // /v1/status, or 1000 when it does not say.
  uint64_t seed = 0;   // Prompts are a function of (seed, request index).
  bool stream = true;  // false: TTFT is the whole request, no ITL.
  int request_timeout_s = 600;
  std::string api_key;    // Sent as a bearer token with the completions (serve --api-key).
  std::string admin_key;  // Sent with GET /v1/status (serve --admin-key): its per-rank detail.
};

// Result JSON (times in seconds): url, concurrency, num_requests, prompt_len,
// max_tokens, stream, vocab_size, completed, failed, errors (first few messages),
// duration_s, requests_per_s, prompt_tokens, output_tokens, output_tokens_per_s,
// and ttft_s / itl_s / latency_s, each {count, mean, p50, p90, p99, max}; against a
// flexpert cluster also `steps` (step_breakdown of GET /v1/status before and after the run;
// absent where the status hides per-rank detail: a server with an admin key that
// options.admin_key does not give).
// InvalidArgument for bad options; Unavailable when the server cannot be reached.
// Failed requests are counted, not errors.
Result<nlohmann::json> bench_serve(const BenchServeOptions& options,
                                   std::function<void(int done, int total)> progress = nullptr);

// Each rank's busy steps between two GET /v1/status answers of a cluster, from the totals its
// StepReports carry: {"ranks": [{rank, steps, step_ms, header_ms[, exchange_ms,
// exchange_share]}], and the same over all ranks' steps as "all"}; times per step in ms,
// exchange_share = exchange_ms / step_ms. A rank absent from either answer, restarted
// between them (another incarnation) or without steps is left out; exchange_* only where
// both answers have total_exchange_ms (serve --step-timing). Null without such a rank.
nlohmann::json step_breakdown(const nlohmann::json& before, const nlohmann::json& after);

// A human-readable table of bench_serve's result (latencies in ms).
std::string format_bench_table(const nlohmann::json& result);

}  // namespace flexpert
