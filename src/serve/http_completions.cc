// SPDX-License-Identifier: Apache-2.0
// HttpServer: POST /v1/completions and POST /v1/chat/completions, as one JSON response or
// as server-sent events.
//
// A request runs as one engine request per choice (prompts x n). The engine reports
// progress through a callback on its own thread; the callback only appends to the
// request's Exchange and wakes the HTTP thread, which owns the text (detokenization, stop
// strings), the response, the metrics and the decision to cancel. The Exchange is shared
// because the engine may call back after the HTTP side gave up on the request.
#include <httplib.h>

#include <chrono>
#include <optional>

#include "core/mutex.h"
#include "serve/chat_api.h"
#include "serve/completion_api.h"
#include "serve/http_server.h"
#include "tokenizer/utf8.h"

namespace flexpert {
namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting handler re-checks for stop() (and a stream for new tokens
// when none woke it).
constexpr auto kPollInterval = std::chrono::milliseconds(100);

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

const nlohmann::json& shutting_down_json() {
  static const nlohmann::json body =
      error_json("the server is shutting down", "server_error", "", "UNAVAILABLE");
  return body;
}

// Code points of the tokens' logprob strings: how far legacy text_offset advances.
size_t logprob_text_length(const Tokenizer* tokenizer, const std::vector<TokenLogprob>& lps) {
  size_t n = 0;
  for (const TokenLogprob& lp : lps) {
    const std::string text = logprob_token_text(tokenizer, lp.token);
    size_t pos = 0;
    while (pos < text.size()) {
      (void)tok::next_code_point(text, &pos);
      ++n;
    }
  }
  return n;
}

// What the engine sent for one choice, not yet taken by the HTTP thread.
struct Arrivals {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  bool logprobs_missing = false;  // Tokens came without the logprobs asked for.
  bool finished = false;
  std::string finish_reason;
  Status error;
};
// One choice as the HTTP thread sees it.
struct ChoiceState {
  uint64_t request_id = 0;
  bool engine_done = false;  // Finished in the engine, or cancelled by us.
  std::optional<TextStream> text;
  ChoiceOutput pending;         // Not sent yet (a stream), or everything (a JSON response).
  size_t next_text_offset = 0;  // Legacy logprobs: where the next token starts.
  size_t completion_tokens = 0;
  bool done = false;  // The finish reason is decided.
  std::string reason;
  Status error;
  bool final_sent = false;
};

}  // namespace

struct HttpServer::Exchange {
  // Set before submit(), read-only afterwards.
  bool chat = false;
  Clock::time_point start;
  size_t prompt_tokens = 0;
  bool include_usage = false;
  bool logprobs = false;
  const Tokenizer* tokenizer = nullptr;
  // HTTP thread only.
  CompletionHeader header;
  std::vector<ChoiceState> choices;
  bool role_sent = false;
  std::string outcome;        // Set once the final response or event is decided.
  size_t tokens_counted = 0;  // Tokens already added to flexpert_generated_tokens_total.
  bool ttft_observed = false;

  Mutex mu;
  CondVar cv;
  std::vector<Arrivals> arrivals GUARDED_BY(mu);  // One per choice.
  bool dirty GUARDED_BY(mu) = false;              // Arrivals not yet taken.
  size_t num_tokens GUARDED_BY(mu) = 0;
  std::optional<double> ttft_s GUARDED_BY(mu);
  std::vector<double> pending_itl_s GUARDED_BY(mu);  // Not yet in the histogram.
  Clock::time_point last_token GUARDED_BY(mu);

  // The engine callback of choice `idx`.
  void on_event(size_t idx, const CompletionEvent& ev) {
    const Clock::time_point now = Clock::now();
    MutexLock lock(mu);
    Arrivals& a = arrivals[idx];
    if (!ev.tokens.empty()) {
      if (!ttft_s) {
        ttft_s = seconds_between(start, now);
      } else {
        // Tokens that arrive together share the gap since the previous event.
        const double gap = seconds_between(last_token, now) / static_cast<double>(ev.tokens.size());
        pending_itl_s.insert(pending_itl_s.end(), ev.tokens.size(), gap);
      }
      last_token = now;
      a.tokens.insert(a.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      if (logprobs) {
        if (ev.logprobs.size() != ev.tokens.size()) a.logprobs_missing = true;
        a.logprobs.insert(a.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      }
      num_tokens += ev.tokens.size();
    }
    if (ev.finished) {
      a.finished = true;
      a.finish_reason = ev.finish_reason;
      a.error = ev.error;
    }
    dirty = true;
    cv.notify_all();
  }

  bool all_done() const {
    for (const ChoiceState& c : choices) {
      if (!c.done) return false;
    }
    return true;
  }
};

uint64_t HttpServer::next_seed() {
  // splitmix64 over a per-server random base: distinct, well-mixed seeds per request.
  uint64_t z = seed_base_ + 0x9e3779b97f4a7c15ULL * (seed_counter_.fetch_add(1) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void HttpServer::handle_generation(bool chat, const httplib::Request& req, httplib::Response& res) {
  auto ex = std::make_shared<Exchange>();  // Shared with the engine callbacks.
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
  Status s =
      chat
          ? parse_chat_request(req.body, options_.text, engine_.vocab_size(), engine_.max_context(),
                               &parsed, &param, engine_.sampling_defaults())
          : parse_completion_request(req.body, engine_.vocab_size(), engine_.max_context(), &parsed,
                                     &param, options_.text.tokenizer, engine_.sampling_defaults());
  if (!s.ok()) {
    requests_counter("invalid").inc();
    send_json(res, 400, error_json(s.message(), "invalid_request_error", param));
    return;
  }
  if (!check_model(parsed.model, res)) {
    requests_counter("invalid").inc();
    return;
  }
  ex->chat = chat;
  ex->tokenizer = options_.text.tokenizer;
  ex->include_usage = parsed.include_usage;
  ex->logprobs = parsed.request.params.logprobs >= 0;
  const size_t num_choices = parsed.prompts.size() * static_cast<size_t>(parsed.n);
  ex->choices.resize(num_choices);
  {
    MutexLock lock(ex->mu);  // No callback exists yet; the lock costs nothing.
    ex->arrivals.resize(num_choices);
  }
  for (size_t i = 0; i < num_choices; ++i) {
    ChoiceState& c = ex->choices[i];
    c.pending.index = static_cast<int>(i);
    c.pending.with_logprobs = ex->logprobs;
    if (ex->tokenizer != nullptr) c.text.emplace(*ex->tokenizer, parsed.stops);
    // Echo: the prompt's text opens the choice's text.
    if (!parsed.echo_texts.empty()) c.pending.text = parsed.echo_texts[i / parsed.n];
  }
  for (const auto& prompt : parsed.prompts) ex->prompt_tokens += prompt.size();

  // One engine request per choice: choice i is sample i % n of prompt i / n.
  for (size_t i = 0; i < num_choices; ++i) {
    CompletionRequest request{parsed.prompts[i / parsed.n], parsed.request.params};
    request.params.seed = parsed.has_seed ? parsed.request.params.seed + i % parsed.n : next_seed();
    Result<uint64_t> id = engine_.submit(
        std::move(request), [ex, i](const CompletionEvent& ev) { ex->on_event(i, ev); });
    if (!id.ok()) {
      for (size_t k = 0; k < i; ++k) engine_.cancel(ex->choices[k].request_id);
      const StatusCode code = id.status().code();
      requests_counter(code == StatusCode::kInvalidArgument ? "invalid"
                       : code == StatusCode::kUnavailable   ? "unavailable"
                                                            : "error")
          .inc();
      send_json(res, http_status_for(id.status()), status_error_json(id.status()));
      return;
    }
    ex->choices[i].request_id = id.value();
  }
  ex->header = {(chat ? "chatcmpl-" : "cmpl-") + std::to_string(ex->choices[0].request_id),
                unix_seconds(), options_.model_name};
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
          // The client went away (or the server stopped) before the engine finished.
          cancel_unfinished(*ex);
          if (ex->outcome.empty()) finish_exchange(*ex, "cancelled");
        } catch (...) {
          // Runs in httplib's Response destructor: nothing may escape.
        }
      });
}

void HttpServer::cancel_unfinished(Exchange& ex) {
  {
    MutexLock lock(ex.mu);
    for (size_t i = 0; i < ex.choices.size(); ++i) {
      if (ex.arrivals[i].finished) ex.choices[i].engine_done = true;
    }
  }
  for (ChoiceState& c : ex.choices) {
    if (!c.engine_done) engine_.cancel(c.request_id);
    c.engine_done = true;
  }
}

void HttpServer::absorb(Exchange& ex) {
  std::vector<Arrivals> taken(ex.choices.size());
  {
    MutexLock lock(ex.mu);
    for (size_t i = 0; i < ex.choices.size(); ++i) {
      Arrivals& a = ex.arrivals[i];
      taken[i].tokens.swap(a.tokens);
      taken[i].logprobs.swap(a.logprobs);
      taken[i].logprobs_missing = a.logprobs_missing;
      taken[i].finished = a.finished;
      taken[i].finish_reason = a.finish_reason;
      taken[i].error = a.error;
    }
    ex.dirty = false;
  }
  for (size_t i = 0; i < ex.choices.size(); ++i) {
    ChoiceState& c = ex.choices[i];
    Arrivals& a = taken[i];
    if (a.finished) c.engine_done = true;
    if (c.done) continue;  // Stopped by a stop string: later tokens are dropped.
    if (a.logprobs_missing) {
      c.done = true;
      c.reason = "error";
      // Both engines send one per token when asked; anything else is the engine's fault.
      c.error = internal_error("the engine sent tokens without their logprobs");
      continue;
    }
    for (size_t k = 0; k < a.tokens.size() && !c.done; ++k) {
      c.pending.tokens.push_back(a.tokens[k]);
      if (ex.logprobs) c.pending.logprobs.push_back(a.logprobs[k]);
      ++c.completion_tokens;
      if (!c.text) continue;
      Result<std::string> piece = c.text->push(a.tokens[k]);
      if (!piece.ok()) {
        c.done = true;
        c.reason = "error";
        c.error = piece.status();
        break;
      }
      c.pending.text += piece.value();
      if (c.text->stopped()) {
        c.done = true;
        c.reason = "stop";
      }
    }
    if (!c.done && a.finished) {
      if (c.text) c.pending.text += c.text->finish();
      c.done = true;
      c.reason = a.finish_reason;
      c.error = a.error;
      if (!c.error.ok() && c.reason != "error") c.reason = "error";
    }
  }
  // A choice that ended here (a stop string, an error) may still run in the engine.
  for (ChoiceState& c : ex.choices) {
    if (c.done && !c.engine_done) {
      engine_.cancel(c.request_id);
      c.engine_done = true;
    }
  }
}

namespace {

// Moves a choice's unsent output out, with the legacy text_offset where it starts.
ChoiceOutput take_pending(const Tokenizer* tokenizer, ChoiceState& c) {
  ChoiceOutput out = std::move(c.pending);
  out.text_offset = c.next_text_offset;
  c.next_text_offset += logprob_text_length(tokenizer, out.logprobs);
  c.pending = ChoiceOutput();
  c.pending.index = out.index;
  c.pending.with_logprobs = out.with_logprobs;
  return out;
}

}  // namespace

void HttpServer::respond_when_finished(Exchange& ex, httplib::Response& res) {
  while (true) {
    {
      MutexLock lock(ex.mu);
      ex.cv.wait_for(lock, kPollInterval,
                     [&]() REQUIRES(ex.mu) { return ex.dirty || stopping_.load(); });
    }
    absorb(ex);
    if (ex.all_done()) break;
    if (stopping_) {
      cancel_unfinished(ex);
      send_json(res, 503, shutting_down_json());
      finish_exchange(ex, "abort");
      return;
    }
  }
  for (const ChoiceState& c : ex.choices) {
    if (!c.error.ok() || c.reason == "error") {
      const Status cause = c.error.ok() ? internal_error("the engine failed the request") : c.error;
      // Unavailable (a degraded group, a shutdown): 503, which clients retry; else 500.
      send_json(res, cause.code() == StatusCode::kUnavailable ? 503 : 500,
                error_json(cause.message(), "server_error", "",
                           std::string(status_code_name(cause.code()))));
      finish_exchange(ex, "error");
      return;
    }
  }
  for (const ChoiceState& c : ex.choices) {
    if (c.reason == "abort") {
      // The engine shut down under the request: an error status, so that a client
      // checking only the status does not take a cut answer for a whole one.
      send_json(res, 503, shutting_down_json());
      finish_exchange(ex, "abort");
      return;
    }
  }
  std::vector<ChoiceOutput> outputs;
  size_t completion_tokens = 0;
  for (ChoiceState& c : ex.choices) {
    outputs.push_back(take_pending(ex.tokenizer, c));
    outputs.back().finish_reason = c.reason;
    completion_tokens += c.completion_tokens;
  }
  send_json(
      res, 200,
      ex.chat ? chat_response(ex.header, outputs, ex.prompt_tokens, completion_tokens, ex.tokenizer)
              : completion_response(ex.header, outputs, ex.prompt_tokens, completion_tokens,
                                    ex.tokenizer));
  finish_exchange(ex, "ok");
}

bool HttpServer::stream_step(Exchange& ex, httplib::DataSink& sink) {
  {
    MutexLock lock(ex.mu);
    ex.cv.wait_for(lock, kPollInterval,
                   [&]() REQUIRES(ex.mu) { return ex.dirty || stopping_.load(); });
  }
  absorb(ex);
  observe_tokens(ex);
  if (stopping_ && !ex.all_done()) {
    cancel_unfinished(ex);
    for (ChoiceState& c : ex.choices) {
      if (c.done) continue;
      c.done = true;
      c.reason = "abort";
      c.error = unavailable("the server is shutting down");
    }
  }
  auto chunk = [&](const ChoiceOutput& choice, bool role, const Status& error) {
    return sse_event(dump_json(ex.chat ? chat_chunk(ex.header, choice, role, ex.tokenizer, error)
                                       : completion_chunk(ex.header, choice, ex.tokenizer, error)));
  };
  std::string out;
  if (ex.chat && !ex.role_sent) {
    for (const ChoiceState& c : ex.choices) {
      ChoiceOutput role;
      role.index = c.pending.index;
      out += chunk(role, /*role=*/true, Status());
    }
    ex.role_sent = true;
  }
  for (ChoiceState& c : ex.choices) {
    if (c.final_sent) continue;
    if (!c.pending.text.empty() || !c.pending.tokens.empty()) {
      out += chunk(take_pending(ex.tokenizer, c), false, Status());
    }
    if (c.done) {
      // The error event carries no tokens: they went in the chunk above, so that a client
      // that throws on the error has them (docs/ARCHITECTURE.md, "Text in, text out").
      ChoiceOutput last;
      last.index = c.pending.index;
      last.with_logprobs = false;
      last.finish_reason = c.reason;
      out += chunk(last, false, c.error);
      c.final_sent = true;
    }
  }
  std::string outcome;
  if (ex.all_done()) {
    outcome = "ok";
    for (const ChoiceState& c : ex.choices) {
      if (c.reason == "abort" && outcome == "ok") outcome = "abort";
      if (c.reason == "error") outcome = "error";
    }
    if (ex.include_usage) {
      size_t completion_tokens = 0;
      for (const ChoiceState& c : ex.choices) completion_tokens += c.completion_tokens;
      nlohmann::json usage = {{"id", ex.header.id},
                              {"object", ex.chat ? "chat.completion.chunk" : "text_completion"},
                              {"created", ex.header.created},
                              {"model", ex.header.model},
                              {"choices", nlohmann::json::array()},
                              {"usage", usage_json(ex.prompt_tokens, completion_tokens)}};
      out += sse_event(dump_json(usage));
    }
    out += sse_event("[DONE]");
    // Counted before the write, so that a client that has read [DONE] sees its request
    // in /metrics.
    ex.outcome = outcome;
    finish_exchange(ex, outcome);
  }
  if (out.empty()) return true;  // Nothing new yet: httplib calls again.
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
    MutexLock lock(ex.mu);
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
