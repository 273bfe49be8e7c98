// SPDX-License-Identifier: Apache-2.0
// ServingEngine: what the HTTP front end needs from whatever runs the model.
//
// Implementations: LocalEngine (one process, one Model; tests and small
// deployments) and ClusterEngine (a group of worker processes). submit()
// validates synchronously; accepted requests report progress through their
// callback, called from an engine thread, in order, ending with exactly one
// event whose `finished` is true. Callbacks must not block for long.
// All methods are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "flexpert/generate.h"
#include "flexpert/status.h"

namespace flexpert {

struct CompletionRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
};

struct CompletionEvent {
  std::vector<int32_t> tokens;  // New tokens since the previous event.
  bool finished = false;
  std::string finish_reason;  // "stop", "length", "abort" (shutdown) or "error" (see `error`).
  Status error;
  // Parallel to `tokens` when the request asked for logprobs (params.logprobs >= 0).
  std::vector<TokenLogprob> logprobs;
};

using CompletionCallback = std::function<void(const CompletionEvent&)>;

class ServingEngine {
 public:
  virtual ~ServingEngine() = default;

  virtual int vocab_size() const = 0;
  virtual int max_context() const = 0;  // Prompt + max_tokens limit.
  // Sampling values for fields a request omits (the model's generation_config.json).
  virtual SamplingDefaults sampling_defaults() const { return SamplingDefaults(); }

  // InvalidArgument for a request the model cannot run (nothing is queued then);
  // Unavailable when the engine is shutting down. Returns the request id.
  virtual Result<uint64_t> submit(CompletionRequest request, CompletionCallback on_event) = 0;
  // The client went away: stop work on the request. Its callback gets no further events.
  virtual void cancel(uint64_t request_id) = 0;

  virtual bool healthy() const = 0;
  // Seconds a client should wait before retrying a request answered 503 (Retry-After):
  // at least 1. An engine that knows when it may take requests again says so.
  virtual int retry_after_s() const { return 1; }
  // GET /v1/status body: ranks, epoch, per-rank queue and step time, phase.
  virtual nlohmann::json status() const = 0;
  // Engine-specific Prometheus lines (e.g. per-rank step time), appended to /metrics.
  virtual std::string metrics_text() const = 0;

  // Stops accepting, gives every in-flight request a final event (finished now,
  // with what it has), and releases workers. Idempotent.
  virtual Status shutdown() = 0;
};

}  // namespace flexpert
