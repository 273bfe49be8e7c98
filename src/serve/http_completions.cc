// SPDX-License-Identifier: Apache-2.0
// HttpServer: POST /v1/completions, as one JSON response or as server-sent events.
//
// The engine reports progress through a callback on its own thread; the callback
// only appends to the request's Exchange and wakes the HTTP thread, which owns the
// response, the metrics and the decision to cancel. The Exchange is shared because
// the engine may call back after the HTTP side gave up on the request.
#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "serve/completion_api.h"
#include "serve/http_server.h"

namespace flexpert {
namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting handler re-checks for stop() (and a stream for new tokens
// when none woke it).
constexpr auto kPollInterval = std::chrono::milliseconds(100);

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void send_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  // 503: the group is recovering, shutting down or degraded; clients retry.
  if (status == 503) res.set_header("Retry-After", "1");
  res.set_content(dump_json(body), "application/json");
}

const nlohmann::json& shutting_down_json() {
  static const nlohmann::json body =
      error_json("the server is shutting down", "server_error", "", "UNAVAILABLE");
  return body;
}

}  // namespace

struct HttpServer::Exchange {
  // Set before submit(), read-only afterwards.
  Clock::time_point start;
  size_t prompt_tokens = 0;
  bool include_usage = false;
  bool want_logprobs = false;  // The request asked for logprobs.
  // Set on the HTTP thread after submit(); the callback never reads them.
  uint64_t request_id = 0;
  CompletionHeader header;
  std::string outcome;        // Set once the final response or event is decided.
  size_t tokens_counted = 0;  // Tokens already added to flexpert_generated_tokens_total.
  bool ttft_observed = false;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;         // GUARDED_BY(mu): all tokens (JSON), unsent ones (stream).
  std::vector<TokenLogprob> logprobs;  // GUARDED_BY(mu): parallel to tokens (want_logprobs).
  size_t num_tokens = 0;               // GUARDED_BY(mu)
  bool finished = false;               // GUARDED_BY(mu)
  std::string finish_reason;           // GUARDED_BY(mu)
  Status error;                        // GUARDED_BY(mu)
  std::optional<double> ttft_s;        // GUARDED_BY(mu)
  std::vector<double> pending_itl_s;   // GUARDED_BY(mu): not yet in the histogram.
  Clock::time_point last_token;        // GUARDED_BY(mu)

  // The engine callback.
  void on_event(const CompletionEvent& ev) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu);
    if (!ev.tokens.empty()) {
      if (!ttft_s) {
        ttft_s = seconds_between(start, now);
      } else {
        // Tokens that arrive together share the gap since the previous event.
        const double gap = seconds_between(last_token, now) / static_cast<double>(ev.tokens.size());
        pending_itl_s.insert(pending_itl_s.end(), ev.tokens.size(), gap);
      }
      last_token = now;
      tokens.insert(tokens.end(), ev.tokens.begin(), ev.tokens.end());
      logprobs.insert(logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      num_tokens += ev.tokens.size();
    }
    if (ev.finished) {
      finished = true;
      finish_reason = ev.finish_reason;
      error = ev.error;
    }
    cv.notify_all();
  }
};

uint64_t HttpServer::next_seed() {
  // splitmix64 over a per-server random base: distinct, well-mixed seeds per request.
  uint64_t z = seed_base_ + 0x9e3779b97f4a7c15ULL * (seed_counter_.fetch_add(1) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void HttpServer::handle_completions(const httplib::Request& req, httplib::Response& res) {
  auto ex = std::make_shared<Exchange>();  // Shared with the engine callback.
  ex->start = Clock::now();
  // Counted open before stopping_ is read, so that stop() either sees this request
  // and waits for its answer, or this request sees stopping_.
  ++num_open_exchanges_;
  struct OpenGuard {
    std::atomic<int>& count;
    bool accepted = false;
    ~OpenGuard() {
      if (!accepted) --count;  // Not accepted: nothing to wait for.
    }
  } open{num_open_exchanges_};
  if (stopping_) {
    requests_counter("unavailable").inc();
    send_json(res, 503, shutting_down_json());
    return;
  }
  ParsedCompletion parsed;
  std::string param;
  Status s = parse_completion_request(req.body, engine_.vocab_size(), engine_.max_context(),
                                      &parsed, &param, engine_.sampling_defaults());
  if (!s.ok()) {
    requests_counter("invalid").inc();
    send_json(res, 400, error_json(s.message(), "invalid_request_error", param));
    return;
  }
  if (!parsed.model.empty() && parsed.model != options_.model_name) {
    // As OpenAI answers a model it does not serve.
    requests_counter("invalid").inc();
    send_json(res, 404,
              error_json("The model '" + parsed.model.substr(0, 128) +
                             "' does not exist: this server serves '" + options_.model_name + "'",
                         "invalid_request_error", "model", "model_not_found"));
    return;
  }
  if (!parsed.has_seed) parsed.request.params.seed = next_seed();
  ex->prompt_tokens = parsed.request.prompt.size();
  ex->include_usage = parsed.include_usage;
  ex->want_logprobs = parsed.request.params.logprobs >= 0;

  Result<uint64_t> id = engine_.submit(std::move(parsed.request),
                                       [ex](const CompletionEvent& ev) { ex->on_event(ev); });
  if (!id.ok()) {
    const StatusCode code = id.status().code();
    requests_counter(code == StatusCode::kInvalidArgument ? "invalid"
                     : code == StatusCode::kUnavailable   ? "unavailable"
                                                          : "error")
        .inc();
    send_json(res, http_status_for(id.status()), status_error_json(id.status()));
    return;
  }
  ex->request_id = id.value();
  ex->header = {"cmpl-" + std::to_string(id.value()), unix_seconds(), options_.model_name};
  prompt_tokens_.inc(static_cast<double>(ex->prompt_tokens));
  in_flight_.add(1);
  open.accepted = true;  // finish_exchange() closes it.

  if (!parsed.stream) {
    respond_when_finished(*ex, res);
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // Proxies: pass events through unbuffered.
  // NOTE: exactly "text/event-stream": httplib exempts only that exact string from
  // gzip/brotli, and a compressed stream would arrive in bursts.
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, ex](size_t, httplib::DataSink& sink) {
        try {
          return stream_step(*ex, sink);
        } catch (...) {
          return false;  // Ends the stream; the releaser below cancels the request.
        }
      },
      [this, ex](bool) {
        try {
          bool engine_done = false;
          {
            std::lock_guard<std::mutex> lock(ex->mu);
            engine_done = ex->finished;
          }
          // The client went away (or the server stopped) before the engine finished.
          if (!engine_done) engine_.cancel(ex->request_id);
          if (ex->outcome.empty()) finish_exchange(*ex, "cancelled");
        } catch (...) {
          // Runs in httplib's Response destructor: nothing may escape.
        }
      });
}

void HttpServer::respond_when_finished(Exchange& ex, httplib::Response& res) {
  std::unique_lock<std::mutex> lock(ex.mu);
  while (!ex.finished && !stopping_) ex.cv.wait_for(lock, kPollInterval);
  if (!ex.finished) {
    lock.unlock();
    engine_.cancel(ex.request_id);
    send_json(res, 503, shutting_down_json());
    finish_exchange(ex, "abort");
    return;
  }
  const std::vector<int32_t> tokens = ex.tokens;
  const std::vector<TokenLogprob> logprobs = ex.logprobs;
  const std::string reason = ex.finish_reason;
  const Status error = ex.error;
  lock.unlock();

  if (!error.ok() || reason == "error") {
    const Status cause = error.ok() ? internal_error("the engine failed the request") : error;
    // Unavailable (a degraded group, a shutdown): 503, which clients retry; else 500.
    send_json(res, cause.code() == StatusCode::kUnavailable ? 503 : 500,
              error_json(cause.message(), "server_error", "",
                         std::string(status_code_name(cause.code()))));
    finish_exchange(ex, "error");
    return;
  }
  if (reason == "abort") {
    // The engine shut down under the request: an error status, so that a client
    // checking only the status does not take a cut answer for a whole one.
    send_json(res, 503, shutting_down_json());
    finish_exchange(ex, "abort");
    return;
  }
  send_json(res, 200,
            completion_response(ex.header, tokens, reason, ex.prompt_tokens,
                                ex.want_logprobs ? &logprobs : nullptr));
  finish_exchange(ex, "ok");
}

bool HttpServer::stream_step(Exchange& ex, httplib::DataSink& sink) {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  bool finished = false;
  std::string reason;
  Status error;
  {
    std::unique_lock<std::mutex> lock(ex.mu);
    ex.cv.wait_for(lock, kPollInterval,
                   [&] { return !ex.tokens.empty() || ex.finished || stopping_.load(); });
    tokens.swap(ex.tokens);
    logprobs.swap(ex.logprobs);
    finished = ex.finished;
    reason = ex.finish_reason;
    error = ex.error;
  }
  observe_tokens(ex);
  const std::vector<TokenLogprob>* lp = ex.want_logprobs ? &logprobs : nullptr;

  std::string out;
  std::string outcome;
  if (finished) {
    if (!error.ok() && reason != "error") reason = "error";
    out = sse_event(dump_json(completion_chunk(ex.header, tokens, reason, error, lp)));
    outcome = reason == "error" ? "error" : reason == "abort" ? "abort" : "ok";
  } else if (stopping_) {
    out = sse_event(dump_json(completion_chunk(ex.header, tokens, "abort",
                                               unavailable("the server is shutting down"), lp)));
    outcome = "abort";
  } else if (!tokens.empty()) {
    out = sse_event(dump_json(completion_chunk(ex.header, tokens, std::nullopt, Status(), lp)));
  } else {
    return true;  // Nothing new yet: httplib calls again.
  }
  if (!outcome.empty()) {
    if (ex.include_usage) {
      nlohmann::json usage = completion_chunk(ex.header, {}, std::nullopt);
      usage["choices"] = nlohmann::json::array();
      usage["usage"] = usage_json(ex.prompt_tokens, ex.tokens_counted);
      out += sse_event(dump_json(usage));
    }
    out += sse_event("[DONE]");
  }
  if (!outcome.empty()) {
    // Counted before the write, so that a client that has read [DONE] sees its request
    // in /metrics.
    ex.outcome = outcome;
    finish_exchange(ex, outcome);
  }
  // A failed write means the client is gone: returning false ends the stream and
  // the releaser cancels the request in the engine.
  if (!sink.write(out.data(), out.size())) return false;
  if (!outcome.empty()) sink.done();
  return true;
}

void HttpServer::observe_tokens(Exchange& ex) {
  std::optional<double> ttft;
  std::vector<double> itl;
  size_t num_tokens = 0;
  {
    std::lock_guard<std::mutex> lock(ex.mu);
    if (!ex.ttft_observed) ttft = ex.ttft_s;
    itl.swap(ex.pending_itl_s);
    num_tokens = ex.num_tokens;
  }
  if (ttft) {
    ttft_seconds_.observe(*ttft);
    ex.ttft_observed = true;
  }
  for (double s : itl) itl_seconds_.observe(s);
  generated_tokens_.inc(static_cast<double>(num_tokens - ex.tokens_counted));
  ex.tokens_counted = num_tokens;
}

void HttpServer::finish_exchange(Exchange& ex, const std::string& outcome) {
  observe_tokens(ex);
  in_flight_.add(-1);
  --num_open_exchanges_;
  duration_seconds_.observe(seconds_between(ex.start, Clock::now()));
  requests_counter(outcome).inc();
}

}  // namespace flexpert
