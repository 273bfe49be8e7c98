// SPDX-License-Identifier: Apache-2.0
#include "serve/local_engine.h"

#include <chrono>

#include "flexpert/logging.h"

namespace flexpert {
namespace {

SchedulerLimits limits_for(const Model& model, const LocalEngineOptions& options) {
  const ModelConfig& config = model.config();
  return SchedulerLimits{config.vocab_size, model.max_sequences(), model.max_seq_len(),
                         options.max_tokens_per_step, config.eos_token_ids};
}

const metrics::Labels kRank0 = {{"rank", "0"}};

}  // namespace

Result<std::unique_ptr<LocalEngine>> LocalEngine::create(const std::string& model_dir,
                                                         const LocalEngineOptions& options) {
  if (options.max_sequences < 1) return invalid_argument("max_sequences must be >= 1");
  if (options.max_tokens_per_step < 1) return invalid_argument("max_tokens_per_step must be >= 1");
  if (options.max_seq_len < 0) return invalid_argument("max_seq_len must be >= 0");
  ModelOptions model_options;
  model_options.placement = options.placement;
  model_options.max_sequences = options.max_sequences;
  model_options.max_seq_len = options.max_seq_len;
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::load(model_dir, model_options));
  return std::unique_ptr<LocalEngine>(new LocalEngine(std::move(model), options));
}

LocalEngine::LocalEngine(std::unique_ptr<Model> model, const LocalEngineOptions& options)
    : model_(std::move(model)),
      vocab_size_(model_->config().vocab_size),
      max_context_(model_->max_seq_len()),
      validator_(limits_for(*model_, options)),
      scheduler_(limits_for(*model_, options)),
      steps_total_(metrics_.counter("flexpert_engine_steps_total", "Model steps run.", kRank0)),
      step_tokens_total_(metrics_.counter("flexpert_engine_step_tokens_total",
                                          "Tokens (prompt and decode) run through the model.",
                                          kRank0)),
      step_seconds_(metrics_.histogram("flexpert_engine_step_seconds",
                                       "Wall time of one model step.",
                                       metrics::latency_buckets_seconds(), kRank0)) {
  thread_ = std::thread([this] { run(); });
}

LocalEngine::~LocalEngine() { (void)shutdown(); }

Result<uint64_t> LocalEngine::submit(CompletionRequest request, CompletionCallback on_event) {
  FLEX_RETURN_IF_ERROR(validator_.validate(request.prompt, request.params));
  uint64_t id = 0;
  {
    MutexLock lock(mu_);
    if (stopping_) return unavailable("the engine is shutting down");
    id = next_id_++;
    inbox_.push_back({id, std::move(request), std::move(on_event)});
  }
  work_cv_.notify_one();
  return id;
}

void LocalEngine::cancel(uint64_t request_id) {
  {
    // Marked first, under the delivery lock: from here on no event reaches the callback.
    MutexLock lock(delivery_mu_);
    cancelled_.insert(request_id);
  }
  {
    MutexLock lock(mu_);
    cancels_.push_back(request_id);
  }
  work_cv_.notify_one();
}

bool LocalEngine::healthy() const {
  MutexLock lock(mu_);
  return running_.load() && !stopping_;
}

nlohmann::json LocalEngine::status() const {
  int64_t queued = 0;
  bool stopping = false;
  {
    MutexLock lock(mu_);
    queued = static_cast<int64_t>(inbox_.size());
    stopping = stopping_;
  }
  const bool serving = running_.load() && !stopping;
  const char* state = serving ? "serving" : "stopped";
  nlohmann::json rank = {{"rank", 0},
                         {"state", state},
                         {"running", num_running_.load()},
                         {"waiting", num_waiting_.load() + queued},
                         {"step_ms", step_ms_.load()}};
  return {{"mode", "local"},
          {"phase", state},
          {"epoch", 0},
          {"ranks", nlohmann::json::array({rank})},
          {"vocab_size", vocab_size_},
          {"max_context", max_context_},
          {"max_sequences", model_->max_sequences()}};
}

std::string LocalEngine::metrics_text() const {
  // Gauges are sampled here rather than on every step: their value only matters when scraped.
  metrics_.gauge("flexpert_engine_running_sequences", "Sequences holding a KV slot.", kRank0)
      .set(static_cast<double>(num_running_.load()));
  metrics_.gauge("flexpert_engine_waiting_sequences", "Requests waiting for a KV slot.", kRank0)
      .set(static_cast<double>(num_waiting_.load()));
  return metrics_.render();
}

Status LocalEngine::shutdown() {
  MutexLock guard(shutdown_mu_);
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  return Status();
}

void LocalEngine::run() {
  for (;;) {
    std::vector<Submission> inbox;
    std::vector<uint64_t> cancels;
    bool stopping = false;
    {
      MutexLock lock(mu_);
      // scheduler_ is read here under mu_ but only ever touched by this thread.
      work_cv_.wait(lock, [&]() REQUIRES(mu_) {
        return stopping_ || !inbox_.empty() || !cancels_.empty() || !scheduler_.idle();
      });
      inbox.swap(inbox_);
      cancels.swap(cancels_);
      stopping = stopping_;
    }
    // Submissions before cancels: a cancel can only follow its own submit().
    for (Submission& s : inbox) {
      callbacks_[s.id] = std::move(s.on_event);
      scheduler_.add(s.id, std::move(s.request.prompt), std::move(s.request.params));
    }
    if (!cancels.empty()) {
      MutexLock lock(delivery_mu_);
      for (uint64_t id : cancels) {
        scheduler_.cancel(id);
        callbacks_.erase(id);
        cancelled_.erase(id);  // Gone from the scheduler: nothing left to suppress.
      }
    }
    if (stopping) {
      finish_all("abort", Status());
      break;
    }
    if (!scheduler_.idle()) step();
    num_running_.store(static_cast<int64_t>(scheduler_.num_running()));
    num_waiting_.store(static_cast<int64_t>(scheduler_.num_waiting()));
  }
  num_running_.store(0);
  num_waiting_.store(0);
  running_.store(false);
}

void LocalEngine::step() {
  const std::vector<SequenceChunk>& batch = scheduler_.build_step();
  // Every running sequence contributes a decode token or a prompt chunk, so a
  // non-idle scheduler never builds an empty step (that would spin this loop).
  FLEX_CHECK(!batch.empty()) << "non-idle scheduler built an empty step";
  int64_t num_tokens = 0;
  for (const SequenceChunk& chunk : batch) num_tokens += static_cast<int64_t>(chunk.tokens.size());

  const auto t0 = std::chrono::steady_clock::now();
  Status s = model_->forward_step(batch, scheduler_.row_outputs(), &logits_, &tokens_);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!s.ok()) {
    // Requests were validated on submit, so this is the model's failure, not the client's.
    FLEX_LOG(ERROR) << "model step failed, ending " << callbacks_.size()
                    << " requests: " << s.to_string();
    finish_all("error", s.annotate("model step"));
    return;
  }
  events_.clear();
  scheduler_.complete_step(logits_, tokens_, &events_);

  steps_total_.inc();
  step_tokens_total_.inc(static_cast<double>(num_tokens));
  step_seconds_.observe(seconds);
  const double prev = step_ms_.load();
  step_ms_.store(prev == 0.0 ? seconds * 1e3 : 0.9 * prev + 0.1 * seconds * 1e3);

  for (const TokenEvent& ev : events_) {
    CompletionEvent out;
    out.tokens.push_back(ev.token);
    if (ev.has_logprob) out.logprobs.push_back(ev.logprob);
    out.finished = ev.finished;
    out.finish_reason = ev.finish_reason;
    deliver(ev.request_id, out);
  }
}

void LocalEngine::deliver(uint64_t request_id, const CompletionEvent& event) {
  auto it = callbacks_.find(request_id);
  if (it == callbacks_.end()) return;
  {
    MutexLock lock(delivery_mu_);
    if (cancelled_.count(request_id) == 0) it->second(event);
  }
  if (event.finished) callbacks_.erase(it);
}

void LocalEngine::finish_all(const std::string& finish_reason, const Status& error) {
  std::vector<uint64_t> ids;
  ids.reserve(callbacks_.size());
  for (const auto& [id, cb] : callbacks_) ids.push_back(id);
  for (uint64_t id : ids) {
    scheduler_.cancel(id);
    CompletionEvent final_event;
    final_event.finished = true;
    final_event.finish_reason = finish_reason;
    final_event.error = error;
    deliver(id, final_event);
  }
}

}  // namespace flexpert
