// SPDX-License-Identifier: Apache-2.0
// Helpers for the serve tests: an HTTP client wrapper that speaks JSON and
// server-sent events, the reference prompts, and FakeEngine, a scripted
// ServingEngine for failures a real model does not produce on demand.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "serve/serving_engine.h"

namespace flexpert::testing {

using nlohmann::json;

inline const std::string kTinyModelDir = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

struct RefPrompt {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> greedy;
};

inline std::vector<RefPrompt> load_reference() {
  std::ifstream in(kTinyModelDir + "/reference.json");
  const json j = json::parse(in);
  std::vector<RefPrompt> out;
  for (const auto& p : j["prompts"]) {
    out.push_back(
        {p["input_ids"].get<std::vector<int32_t>>(), p["greedy"].get<std::vector<int32_t>>()});
  }
  return out;
}

inline std::unique_ptr<httplib::Client> make_client(int port) {
  auto client = std::make_unique<httplib::Client>("127.0.0.1", port);
  client->set_read_timeout(60);
  client->set_write_timeout(60);
  client->set_tcp_nodelay(true);
  return client;
}

struct HttpReply {
  int status = 0;  // 0: transport error.
  json body;       // Discarded when the body is not JSON.
  std::string text;
  std::string content_type;
};

inline HttpReply to_reply(const httplib::Result& res) {
  HttpReply r;
  if (!res) return r;
  r.status = res->status;
  r.text = res->body;
  r.content_type = res->get_header_value("Content-Type");
  r.body = json::parse(res->body, nullptr, false);
  return r;
}

inline HttpReply post(httplib::Client& c, const std::string& path, const std::string& body) {
  return to_reply(c.Post(path.c_str(), body, "application/json"));
}
inline HttpReply post(httplib::Client& c, const std::string& path, const json& body) {
  return post(c, path, body.dump());
}
inline HttpReply get(httplib::Client& c, const std::string& path) {
  return to_reply(c.Get(path.c_str()));
}

struct StreamReply {
  int status = 0;
  std::string content_type;
  std::vector<json> chunks;  // Every JSON event, in order.
  std::vector<int32_t> tokens;
  bool done = false;       // [DONE] seen.
  bool done_last = false;  // ... and nothing after it.
  std::string raw;
};

// POSTs with "stream": true and parses the events. `stop_after_chunks` > 0 makes
// the client hang up after that many events (a disconnecting client).
inline StreamReply stream(httplib::Client& c, json body, int stop_after_chunks = 0) {
  body["stream"] = true;
  StreamReply r;
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body.dump();
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    r.raw.append(data, len);
    buffer.append(data, len);
    for (size_t pos; (pos = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, pos);
      buffer.erase(0, pos + 2);
      EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
      const std::string data_text = event.substr(6);
      if (data_text == "[DONE]") {
        r.done = true;
        continue;
      }
      EXPECT_FALSE(r.done) << "event after [DONE]: " << event;
      const json chunk = json::parse(data_text, nullptr, false);
      EXPECT_FALSE(chunk.is_discarded()) << event;
      r.chunks.push_back(chunk);
      if (chunk.contains("choices") && !chunk["choices"].empty()) {
        for (const auto& t : chunk["choices"][0]["token_ids"]) r.tokens.push_back(t.get<int32_t>());
      }
      if (stop_after_chunks > 0 && static_cast<int>(r.chunks.size()) >= stop_after_chunks) {
        return false;
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  c.send(req, res, err);
  r.status = res.status;
  r.content_type = res.get_header_value("Content-Type");
  r.done_last = r.done && buffer.empty();
  return r;
}

// A ServingEngine whose requests follow a script, each on its own thread.
class FakeEngine : public ServingEngine {
 public:
  enum class Mode {
    kEcho,        // Returns the prompt as tokens, then "length".
    kFailMidway,  // Two tokens, then finish_reason "error": "rank 2 died".
    kHang,        // Never finishes (until cancelled or shut down).
  };
  Mode mode = Mode::kEcho;
  Status submit_status;  // Non-OK: submit() returns it.
  std::atomic<bool> is_healthy{true};
  std::atomic<int> retry_after{1};  // retry_after_s(): what a 503's Retry-After should say.
  bool throw_in_status = false;
  std::atomic<int> num_cancelled{0};
  int vocab = 100;
  bool computes_logprobs = true;  // kEcho: logprobs when a request asks (false: none).

  ~FakeEngine() override { (void)shutdown(); }
  int vocab_size() const override { return vocab; }
  int max_context() const override { return 64; }

  Result<uint64_t> submit(CompletionRequest request, CompletionCallback cb) override {
    if (!submit_status.ok()) return submit_status;
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = ++next_id_;
    auto cancelled = std::make_shared<std::atomic<bool>>(false);  // Shared with the thread.
    cancelled_[id] = cancelled;
    threads_.emplace_back([this, request, cb, cancelled] {
      if (mode == Mode::kEcho) {
        for (int32_t t : request.prompt) {
          CompletionEvent ev{{t}, false, "", Status(), {}};
          // Made-up logprobs: the token at -0.25, then ids t+1, t+2, ... at -1.5, -2.5, ...
          if (request.params.logprobs >= 0 && computes_logprobs) {
            TokenLogprob lp{t, -0.25f, {}};
            for (int k = 0; k < request.params.logprobs; ++k) {
              lp.top.push_back({k == 0 ? t : t + k, k == 0 ? -0.25f : -0.5f - k});
            }
            ev.logprobs.push_back(lp);
          }
          cb(ev);
        }
        cb({{}, true, "length", Status(), {}});
      } else if (mode == Mode::kFailMidway) {
        cb({{1}, false, "", Status(), {}});
        cb({{2}, false, "", Status(), {}});
        cb({{}, true, "error", unavailable("rank 2 died"), {}});
      } else {
        cb({{7}, false, "", Status(), {}});
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || cancelled->load(); });
        if (!cancelled->load()) cb({{}, true, "abort", Status(), {}});
      }
    });
    return id;
  }
  void cancel(uint64_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cancelled_.find(id); it != cancelled_.end()) it->second->store(true);
    ++num_cancelled;
    cv_.notify_all();
  }
  bool healthy() const override { return is_healthy; }
  int retry_after_s() const override { return retry_after; }
  json status() const override {
    if (throw_in_status) throw std::runtime_error("status exploded");
    return {{"mode", "fake"}};
  }
  std::string metrics_text() const override { return "fake_engine_up 1\n"; }
  Status shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    return Status();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  uint64_t next_id_ = 0;
  std::map<uint64_t, std::shared_ptr<std::atomic<bool>>> cancelled_;
  std::vector<std::thread> threads_;
};

// Polls `pred` until it holds or `timeout` passes; returns its last value.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// The value of one sample line `name{labels} value` in a Prometheus text body; -1 if absent.
inline double metric_value(const std::string& text, const std::string& series) {
  const std::string needle = "\n" + series + " ";
  const std::string padded = "\n" + text;
  const size_t pos = padded.find(needle);
  if (pos == std::string::npos) return -1;
  return std::stod(padded.substr(pos + needle.size()));
}

}  // namespace flexpert::testing
