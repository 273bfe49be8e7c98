// SPDX-License-Identifier: Apache-2.0
// LocalEngine: a ServingEngine over one Model in this process.
//
// One engine thread owns the Model and the Scheduler and is the only thread that
// touches them (llama.cpp server style). submit() validates on the caller's thread
// and hands the request to the engine thread through a mutex-protected inbox;
// cancel() does the same; the engine thread sleeps on a condition variable while
// there is no work. Each step: drain the inbox, Scheduler::build_step,
// Model::forward, Scheduler::complete_step, then one CompletionEvent per new token.
// A failed forward ends every live request with finish_reason "error".
// shutdown() ends every live request with a final event whose finish_reason is
// "abort" (its earlier tokens were already delivered), then joins the thread.
// Thread-safe. Callbacks run on the engine thread and must not call cancel() or
// shutdown() (cancel() waits for an in-progress delivery to finish).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/mutex.h"
#include "flexpert/model.h"
#include "flexpert/scheduler.h"
#include "serve/metrics.h"
#include "serve/serving_engine.h"

namespace flexpert {

struct LocalEngineOptions {
  int max_sequences = 32;          // KV-cache slots: requests decoded together.
  int max_tokens_per_step = 2048;  // Prefill chunking budget per step.
  std::string placement = "identity";
  int max_seq_len = 0;  // Positions per sequence; 0: min(config, 4096).
};

class LocalEngine : public ServingEngine {
 public:
  // Loads the model (blocking; seconds for real checkpoints) and starts the engine thread.
  static Result<std::unique_ptr<LocalEngine>> create(const std::string& model_dir,
                                                     const LocalEngineOptions& options = {});
  // Calls shutdown(): the engine thread is local to this object.
  ~LocalEngine() override;

  int vocab_size() const override { return vocab_size_; }
  int max_context() const override { return max_context_; }
  SamplingDefaults sampling_defaults() const override {
    return model_->config().sampling_defaults;  // Fixed at load: safe from any thread.
  }
  Result<uint64_t> submit(CompletionRequest request, CompletionCallback on_event) override;
  void cancel(uint64_t request_id) override;
  bool healthy() const override;
  nlohmann::json status() const override;
  std::string metrics_text() const override;
  Status shutdown() override;

 private:
  LocalEngine(std::unique_ptr<Model> model, const LocalEngineOptions& options);
  void run();  // The engine thread.
  void step();
  // Delivers `event` unless the request was cancelled; drops the callback when final.
  void deliver(uint64_t request_id, const CompletionEvent& event);
  void finish_all(const std::string& finish_reason, const Status& error);

  struct Submission {
    uint64_t id;
    CompletionRequest request;
    CompletionCallback on_event;
  };

  const std::unique_ptr<Model> model_;  // Engine thread only.
  const int vocab_size_;
  const int max_context_;
  // Only ever used for validate(), which is const and reads fixed limits: safe from
  // any thread, unlike scheduler_.
  const Scheduler validator_;
  Scheduler scheduler_;                                         // Engine thread only.
  std::unordered_map<uint64_t, CompletionCallback> callbacks_;  // Engine thread only.
  Tensor logits_;                                               // Engine thread only.
  std::vector<int32_t> tokens_;                                 // Engine thread only.
  std::vector<TokenEvent> events_;                              // Engine thread only.

  mutable Mutex mu_;
  CondVar work_cv_;
  std::vector<Submission> inbox_ GUARDED_BY(mu_);
  std::vector<uint64_t> cancels_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;

  // Held while callbacks run, so that after cancel() returns no callback of that
  // request is running or will run.
  Mutex delivery_mu_;
  std::unordered_set<uint64_t> cancelled_ GUARDED_BY(delivery_mu_);

  Mutex shutdown_mu_;  // Serialises shutdown() callers around the join.
  std::thread thread_;

  // Published by the engine thread for status() and metrics.
  std::atomic<bool> running_{true};
  std::atomic<int64_t> num_running_{0};
  std::atomic<int64_t> num_waiting_{0};
  std::atomic<double> step_ms_{0.0};   // Moving average over recent steps.
  mutable metrics::Registry metrics_;  // Thread-safe; metrics_text() samples gauges into it.
  metrics::Counter& steps_total_;
  metrics::Counter& step_tokens_total_;
  metrics::Histogram& step_seconds_;
};

}  // namespace flexpert
