// SPDX-License-Identifier: Apache-2.0
// Helpers of the elastic and healing system tests: admin posts, a client load that
// checks every answer against the reference, status and process probes.
#pragma once

#include <atomic>
#include <functional>

#include "server_fixture.h"

namespace flexpert_test {

struct Answer {
  int status = 0;
  nlohmann::json body;
};

inline Answer post(Server& server, const std::string& path, const nlohmann::json& body,
                   const std::string& key = "") {
  httplib::Client c("127.0.0.1", server.port());
  c.set_read_timeout(120, 0);
  httplib::Headers headers;
  if (!key.empty()) headers.emplace("Authorization", "Bearer " + key);
  auto res = c.Post(path.c_str(), headers, body.dump(), "application/json");
  if (!res) return {};
  return {res->status, nlohmann::json::parse(res->body, nullptr, false)};
}

// Client threads that send the reference prompts in a loop and check each answer.
class Load {
 public:
  Load(Server& server, int clients, const std::string& model = kModel)
      : ref_(load_reference(model)) {
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, &server, c] {
        for (int i = 0; !done_.load(); ++i) {
          const size_t p = (c + i) % ref_.prompts.size();
          const auto t0 = std::chrono::steady_clock::now();
          const std::vector<int> got = server.complete(ref_.prompts[p], 16);
          const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::steady_clock::now() - t0)
                                 .count();
          for (int64_t m = max_ms_.load(); ms > m && !max_ms_.compare_exchange_weak(m, ms);) {
          }
          if (got.empty()) {
            ++failed_;
          } else if (got != ref_.greedy[p]) {
            ++wrong_;
          } else {
            ++ok_;
          }
        }
      });
    }
  }
  ~Load() { stop(); }
  void stop() {
    done_.store(true);
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  int ok() const { return ok_.load(); }
  int failed() const { return failed_.load(); }
  int wrong() const { return wrong_.load(); }
  int64_t max_ms() const { return max_ms_.load(); }  // The longest request (a figure, no assert).
  // Stops the clients and checks what they saw: none failed (no answer, or an error), none
  // got other tokens than the reference's, and more than `more_than_ok` got them (default: any
  // number). EXPECT_TRUE(load.stop_and_check(10)) reports every count at the caller's line.
  [[nodiscard]] ::testing::AssertionResult stop_and_check(int more_than_ok = -1) {
    stop();
    const bool good = failed() == 0 && wrong() == 0 && ok() > more_than_ok;
    auto result = good ? ::testing::AssertionSuccess() : ::testing::AssertionFailure();
    result << "load of " << threads_.size() << " clients: " << ok() << " answered the reference";
    if (more_than_ok >= 0) result << " (more than " << more_than_ok << " expected)";
    return result << ", " << failed() << " failed, " << wrong() << " answered other tokens"
                  << "; longest request " << max_ms() << " ms";
  }

 private:
  Reference ref_;
  std::atomic<bool> done_{false};
  std::atomic<int> ok_{0}, failed_{0}, wrong_{0};
  std::atomic<int64_t> max_ms_{0};
  std::vector<std::thread> threads_;
};

inline std::vector<int> members(Server& server) {
  return server.get_json("/v1/status")["members"].get<std::vector<int>>();
}

inline int rank_pid(Server& server, int rank) {
  const auto status = server.get_json("/v1/status");
  for (const auto& r : status["ranks"]) {
    if (r["rank"] == rank) return r["pid"];
  }
  return 0;
}

inline void pause_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

inline int child_processes(pid_t parent) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::ifstream in(e.path() / "stat");
    std::string pid, comm, state;
    int ppid = 0;
    if (in >> pid >> comm >> state >> ppid && ppid == parent) ++n;
  }
  return n;
}

// Polls /v1/status until `done` holds (true) or `timeout_ms` passes (false).
inline bool wait_status(Server& server, const std::function<bool(const nlohmann::json&)>& done,
                        int timeout_ms = 20000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    const nlohmann::json status = server.get_json("/v1/status");
    if (status.is_object() && done(status)) return true;
    pause_ms(50);
  }
  return false;
}

// The kind of the last reconfiguration ("" before the first).
inline std::string last_kind(const nlohmann::json& status) {
  const nlohmann::json& last = status["reconfiguration"]["last"];
  return last.is_object() ? last.value("kind", "") : "";
}

// Serving with `n` members.
inline bool serving_with(const nlohmann::json& status, size_t n) {
  return status["phase"] == "serving" && status["members"].size() == n &&
         !status["reconfiguration"]["in_progress"].get<bool>();
}

}  // namespace flexpert_test
