// SPDX-License-Identifier: Apache-2.0
#include "serve/bench_serve.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace flexpert {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr int kDefaultVocab = 1000;
constexpr size_t kMaxErrorsReported = 5;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct RequestRecord {
  bool ok = false;
  std::string error;
  double ttft_s = 0.0;
  double latency_s = 0.0;
  std::vector<double> itl_s;
  size_t output_tokens = 0;
};

void configure(httplib::Client& client, const BenchServeOptions& options) {
  client.set_connection_timeout(10);
  client.set_read_timeout(options.request_timeout_s);
  client.set_write_timeout(options.request_timeout_s);
  client.set_keep_alive(true);
  // httplib writes headers and body separately; with Nagle the body would wait for
  // the server's delayed ACK (~40 ms) and inflate every TTFT.
  client.set_tcp_nodelay(true);
}

std::string request_body(const BenchServeOptions& options, int vocab_size, int index) {
  // A prompt depends only on (seed, index): runs with the same options send the same load.
  std::mt19937_64 rng(options.seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(index));
  std::uniform_int_distribution<int> id(0, vocab_size - 1);
  std::vector<int> prompt(static_cast<size_t>(options.prompt_len));
  for (int& t : prompt) t = id(rng);
  return json{{"prompt", prompt},
              {"max_tokens", options.max_tokens},
              {"temperature", 0},
              {"ignore_eos", true},
              {"stream", options.stream}}
      .dump();
}

// One streamed request: parses server-sent events as they arrive and times them.
void run_streaming(httplib::Client& client, const std::string& body, RequestRecord* rec) {
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  bool done = false;
  std::string buffer;
  std::string error;
  auto on_event = [&](const std::string& event) {
    if (event.rfind("data: ", 0) != 0) return;  // Comments and other fields.
    const std::string data = event.substr(6);
    if (data == "[DONE]") {
      done = true;
      return;
    }
    const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (chunk.is_discarded()) {
      error = "unparsable event: " + data.substr(0, 200);
      return;
    }
    if (chunk.contains("error")) error = chunk["error"].dump();
    if (!chunk.contains("choices") || !chunk["choices"].is_array() || chunk["choices"].empty()) {
      return;  // E.g. the usage chunk.
    }
    const json& ids = chunk["choices"][0]["token_ids"];
    if (!ids.is_array() || ids.empty()) return;
    const Clock::time_point now = Clock::now();
    if (rec->output_tokens == 0) {
      rec->ttft_s = seconds_between(start, now);
    } else {
      const double gap = seconds_between(last, now) / static_cast<double>(ids.size());
      rec->itl_s.insert(rec->itl_s.end(), ids.size(), gap);
    }
    last = now;
    rec->output_tokens += ids.size();
  };

  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  req.body = body;
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    buffer.append(data, len);
    for (size_t pos; (pos = buffer.find("\n\n")) != std::string::npos;) {
      on_event(buffer.substr(0, pos));
      buffer.erase(0, pos + 2);
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client.send(req, res, err);
  rec->latency_s = seconds_between(start, Clock::now());
  if (!sent) {
    rec->error = "transport error: " + httplib::to_string(err);
  } else if (res.status != 200) {
    rec->error = "HTTP " + std::to_string(res.status) + ": " + buffer.substr(0, 300);
  } else if (!error.empty()) {
    rec->error = error;
  } else if (!done) {
    rec->error = "the stream ended without [DONE]";
  }
}

void run_plain(httplib::Client& client, const std::string& body, RequestRecord* rec) {
  const Clock::time_point start = Clock::now();
  httplib::Result res = client.Post("/v1/completions", body, "application/json");
  rec->latency_s = seconds_between(start, Clock::now());
  rec->ttft_s = rec->latency_s;  // Nothing arrives before the whole answer.
  if (!res) {
    rec->error = "transport error: " + httplib::to_string(res.error());
    return;
  }
  if (res->status != 200) {
    rec->error = "HTTP " + std::to_string(res->status) + ": " + res->body.substr(0, 300);
    return;
  }
  const json j = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("choices") || !j["choices"].is_array() ||
      j["choices"].empty() || !j["choices"][0]["token_ids"].is_array()) {
    rec->error = "unexpected response: " + res->body.substr(0, 300);
    return;
  }
  rec->output_tokens = j["choices"][0]["token_ids"].size();
}

json summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  // Linear interpolation between closest ranks (numpy's default).
  auto pct = [&](double p) {
    if (v.empty()) return 0.0;
    const double idx = p * static_cast<double>(v.size() - 1);
    const size_t lo = static_cast<size_t>(std::floor(idx));
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
  };
  double sum = 0.0;
  for (double x : v) sum += x;
  return {{"count", v.size()}, {"mean", v.empty() ? 0.0 : sum / static_cast<double>(v.size())},
          {"p50", pct(0.50)},  {"p90", pct(0.90)},
          {"p99", pct(0.99)},  {"max", v.empty() ? 0.0 : v.back()}};
}

// GET /v1/status with the admin key, if any (the per-rank detail needs it).
httplib::Result get_status(httplib::Client& client, const BenchServeOptions& options) {
  if (!options.admin_key.empty()) client.set_bearer_token_auth(options.admin_key);
  return client.Get("/v1/status");
}

// vocab_size from GET /v1/status. Unavailable when the server cannot be reached.
Result<int> probe_vocab(const BenchServeOptions& options) {
  httplib::Client client(options.url);
  if (!client.is_valid()) return invalid_argument("cannot use URL " + options.url);
  configure(client, options);
  httplib::Result res = get_status(client, options);
  if (!res) {
    return unavailable("cannot reach " + options.url + ": " + httplib::to_string(res.error()));
  }
  if (res->status == 200) {
    const json status = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
    if (status.is_object() && status.contains("vocab_size") &&
        status["vocab_size"].is_number_integer() && status["vocab_size"].get<int64_t>() > 0) {
      return static_cast<int>(std::min<int64_t>(status["vocab_size"].get<int64_t>(), INT32_MAX));
    }
  }
  return kDefaultVocab;
}

// GET /v1/status, or null when it cannot be had (a server that is not flexpert's).
json fetch_status(const BenchServeOptions& options) {
  httplib::Client client(options.url);
  if (!client.is_valid()) return nullptr;
  configure(client, options);
  httplib::Result res = get_status(client, options);
  if (!res || res->status != 200) return nullptr;
  json status = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
  return status.is_discarded() ? json(nullptr) : status;
}

// The rank's entry in a /v1/status answer with the step totals, or null.
const json* rank_entry(const json& status, int64_t rank) {
  if (!status.is_object() || !status.contains("ranks") || !status["ranks"].is_array()) {
    return nullptr;
  }
  for (const json& r : status["ranks"]) {
    if (r.is_object() && r.value("rank", int64_t{-1}) == rank && r.contains("steps") &&
        r.contains("total_step_ms") && r.contains("total_header_ms")) {
      return &r;
    }
  }
  return nullptr;
}

bool has_step_totals(const json& status) {
  if (!status.is_object() || !status.contains("ranks") || !status["ranks"].is_array()) {
    return false;
  }
  for (const json& r : status["ranks"]) {
    if (r.is_object() && r.contains("total_step_ms")) return true;
  }
  return false;
}

// Waits out a StepReport interval (the workers report every 200 ms) so that the status
// counts the run's last steps.
constexpr int kReportWaitMs = 500;

}  // namespace

json step_breakdown(const json& before, const json& after) {
  if (!after.is_object() || !after.contains("ranks") || !after["ranks"].is_array()) return nullptr;
  json ranks = json::array();
  double steps_all = 0, step_all = 0, header_all = 0, exchange_all = 0;
  bool timed_all = true;
  for (const json& a : after["ranks"]) {
    if (!a.is_object() || !a.contains("rank")) continue;
    const int64_t id = a.value("rank", int64_t{-1});
    const json* pa = rank_entry(after, id);
    const json* pb = rank_entry(before, id);
    if (pa == nullptr || pb == nullptr) continue;
    if (pa->value("incarnation", uint64_t{0}) != pb->value("incarnation", uint64_t{0})) continue;
    const double steps =
        static_cast<double>(pa->value("steps", uint64_t{0})) - pb->value("steps", uint64_t{0});
    if (!(steps > 0)) continue;
    const double step_ms = pa->value("total_step_ms", 0.0) - pb->value("total_step_ms", 0.0);
    const double header_ms = pa->value("total_header_ms", 0.0) - pb->value("total_header_ms", 0.0);
    json r = {{"rank", id},
              {"steps", static_cast<int64_t>(steps)},
              {"step_ms", step_ms / steps},
              {"header_ms", header_ms / steps}};
    const bool timed = pa->contains("total_exchange_ms") && pb->contains("total_exchange_ms");
    if (timed) {
      const double exchange_ms =
          pa->value("total_exchange_ms", 0.0) - pb->value("total_exchange_ms", 0.0);
      r["exchange_ms"] = exchange_ms / steps;
      r["exchange_share"] = step_ms > 0 ? exchange_ms / step_ms : 0.0;
      exchange_all += exchange_ms;
    }
    timed_all = timed_all && timed;
    steps_all += steps;
    step_all += step_ms;
    header_all += header_ms;
    ranks.push_back(std::move(r));
  }
  if (ranks.empty()) return nullptr;
  json all = {{"steps", static_cast<int64_t>(steps_all)},
              {"step_ms", step_all / steps_all},
              {"header_ms", header_all / steps_all}};
  if (timed_all) {
    all["exchange_ms"] = exchange_all / steps_all;
    all["exchange_share"] = step_all > 0 ? exchange_all / step_all : 0.0;
  }
  return json{{"ranks", std::move(ranks)}, {"all", std::move(all)}};
}

Result<nlohmann::json> bench_serve(const BenchServeOptions& options,
                                   std::function<void(int done, int total)> progress) {
  if (options.concurrency < 1) return invalid_argument("concurrency must be >= 1");
  if (options.num_requests < 1) return invalid_argument("num_requests must be >= 1");
  if (options.prompt_len < 1) return invalid_argument("prompt_len must be >= 1");
  if (options.max_tokens < 1) return invalid_argument("max_tokens must be >= 1");
  if (options.vocab_size < 0) return invalid_argument("vocab_size must be >= 0");
  if (options.request_timeout_s < 1) return invalid_argument("request_timeout_s must be >= 1");
  FLEX_ASSIGN_OR_RETURN(int probed_vocab, probe_vocab(options));
  const int vocab_size = options.vocab_size > 0 ? options.vocab_size : probed_vocab;

  const int total = options.num_requests;
  std::vector<RequestRecord> records(static_cast<size_t>(total));
  std::atomic<int> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;  // GUARDED_BY(mu)

  const json status_before = fetch_status(options);
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> workers;
  const int num_workers = std::min(options.concurrency, total);
  for (int w = 0; w < num_workers; ++w) {
    workers.emplace_back([&] {
      httplib::Client client(options.url);
      configure(client, options);
      if (!options.api_key.empty()) client.set_bearer_token_auth(options.api_key);
      for (int i; (i = next.fetch_add(1)) < total;) {
        RequestRecord& rec = records[static_cast<size_t>(i)];
        const std::string body = request_body(options, vocab_size, i);
        if (options.stream) {
          run_streaming(client, body, &rec);
        } else {
          run_plain(client, body, &rec);
        }
        if (rec.error.empty() && rec.output_tokens != static_cast<size_t>(options.max_tokens)) {
          rec.error = "got " + std::to_string(rec.output_tokens) + " tokens, expected " +
                      std::to_string(options.max_tokens);
        }
        rec.ok = rec.error.empty();
        {
          std::lock_guard<std::mutex> lock(mu);
          ++done;
        }
        cv.notify_one();
      }
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    int reported = 0;
    while (done < total) {
      cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return done != reported; });
      if (done == reported) continue;
      reported = done;
      if (progress) {
        lock.unlock();  // The callback may take its time (drawing); workers go on.
        progress(reported, total);
        lock.lock();
      }
    }
    if (progress && reported != total) progress(total, total);
  }
  for (auto& t : workers) t.join();
  const double duration_s = seconds_between(t0, Clock::now());
  json steps = nullptr;
  if (has_step_totals(status_before)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kReportWaitMs));
    steps = step_breakdown(status_before, fetch_status(options));
  }

  std::vector<double> ttft, itl, latency;
  json errors = json::array();
  int completed = 0;
  size_t output_tokens = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const RequestRecord& rec = records[i];
    output_tokens += rec.output_tokens;
    if (!rec.ok) {
      if (errors.size() < kMaxErrorsReported) {
        errors.push_back("request " + std::to_string(i) + ": " + rec.error);
      }
      continue;
    }
    ++completed;
    ttft.push_back(rec.ttft_s);
    latency.push_back(rec.latency_s);
    itl.insert(itl.end(), rec.itl_s.begin(), rec.itl_s.end());
  }
  json result = {{"url", options.url},
                 {"concurrency", options.concurrency},
                 {"num_requests", total},
                 {"prompt_len", options.prompt_len},
                 {"max_tokens", options.max_tokens},
                 {"stream", options.stream},
                 {"vocab_size", vocab_size},
                 {"completed", completed},
                 {"failed", total - completed},
                 {"errors", errors},
                 {"duration_s", duration_s},
                 {"requests_per_s", completed / duration_s},
                 {"prompt_tokens", static_cast<int64_t>(completed) * options.prompt_len},
                 {"output_tokens", output_tokens},
                 {"output_tokens_per_s", static_cast<double>(output_tokens) / duration_s},
                 {"ttft_s", summarize(ttft)},
                 {"itl_s", summarize(itl)},
                 {"latency_s", summarize(latency)}};
  if (!steps.is_null()) result["steps"] = std::move(steps);
  return result;
}

std::string format_bench_table(const nlohmann::json& r) {
  char line[256];
  std::string out;
  std::snprintf(line, sizeof(line),
                "%d requests (%d failed), concurrency %d, prompt %d, max_tokens %d, %s\n",
                r.value("num_requests", 0), r.value("failed", 0), r.value("concurrency", 0),
                r.value("prompt_len", 0), r.value("max_tokens", 0),
                r.value("stream", false) ? "streaming" : "not streaming");
  out += line;
  std::snprintf(line, sizeof(line), "%.2f s: %.2f requests/s, %.1f output tokens/s\n",
                r.value("duration_s", 0.0), r.value("requests_per_s", 0.0),
                r.value("output_tokens_per_s", 0.0));
  out += line;
  std::snprintf(line, sizeof(line), "%-10s %9s %9s %9s %9s %9s\n", "ms", "mean", "p50", "p90",
                "p99", "max");
  out += line;
  for (const char* key : {"ttft_s", "itl_s", "latency_s"}) {
    if (!r.contains(key)) continue;
    const json& s = r[key];
    const std::string name = std::string(key) == "ttft_s"  ? "TTFT"
                             : std::string(key) == "itl_s" ? "ITL"
                                                           : "latency";
    std::snprintf(line, sizeof(line), "%-10s %9.2f %9.2f %9.2f %9.2f %9.2f\n", name.c_str(),
                  s.value("mean", 0.0) * 1e3, s.value("p50", 0.0) * 1e3, s.value("p90", 0.0) * 1e3,
                  s.value("p99", 0.0) * 1e3, s.value("max", 0.0) * 1e3);
    out += line;
  }
  if (r.contains("steps") && r["steps"].is_object()) {
    // Per rank's busy steps (step_breakdown); exchange columns with serve --step-timing.
    std::snprintf(line, sizeof(line), "%-10s %9s %9s %9s %9s %9s\n", "rank", "steps", "step ms",
                  "header ms", "exch. ms", "exch. %");
    out += line;
    auto row = [&](const std::string& name, const json& s) {
      if (s.contains("exchange_ms")) {
        std::snprintf(line, sizeof(line), "%-10s %9lld %9.3f %9.3f %9.3f %8.1f%%\n", name.c_str(),
                      static_cast<long long>(s.value("steps", int64_t{0})), s.value("step_ms", 0.0),
                      s.value("header_ms", 0.0), s.value("exchange_ms", 0.0),
                      100.0 * s.value("exchange_share", 0.0));
      } else {
        std::snprintf(line, sizeof(line), "%-10s %9lld %9.3f %9.3f %9s %9s\n", name.c_str(),
                      static_cast<long long>(s.value("steps", int64_t{0})), s.value("step_ms", 0.0),
                      s.value("header_ms", 0.0), "-", "-");
      }
      out += line;
    };
    for (const json& s : r["steps"]["ranks"]) {
      row(std::to_string(s.value("rank", int64_t{0})), s);
    }
    row("all", r["steps"]["all"]);
  }
  if (r.contains("errors")) {
    for (const auto& e : r["errors"]) out += "error: " + e.get<std::string>() + "\n";
  }
  return out;
}

}  // namespace flexpert
