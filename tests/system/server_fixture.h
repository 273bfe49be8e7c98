// SPDX-License-Identifier: Apache-2.0
// Test helpers for system tests: a `flexpert serve` child process with an HTTP
// client, the fixture's reference, shm and process probes, log files.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace flexpert_test {

// The cluster key of --no-spawn groups and their hand-started workers where a test sets
// none of its own (FLEXPERT_CLUSTER_KEY in the environment wins).
inline constexpr const char* kTestClusterKey = "flexpert-test-cluster-key";

inline const std::string kModel = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

struct Reference {
  std::vector<std::vector<int>> prompts, greedy;
};

inline Reference load_reference(const std::string& model = kModel) {
  std::ifstream in(model + "/reference.json");
  auto j = nlohmann::json::parse(in);
  Reference ref;
  for (const auto& p : j["prompts"]) {
    ref.prompts.push_back(p["input_ids"].get<std::vector<int>>());
    ref.greedy.push_back(p["greedy"].get<std::vector<int>>());
  }
  return ref;
}

// A `flexpert serve` child process and a client for it.
class Server {
 public:
  // Starts a hand-started worker: (join address, rank) -> its pid (default: start_worker).
  using Launcher = std::function<pid_t(const std::string&, int)>;

  explicit Server(const std::vector<std::string>& extra_args, std::vector<int> hand_started = {},
                  const std::string& model = kModel, Launcher launcher = nullptr)
      : hand_started_(std::move(hand_started)), launcher_(std::move(launcher)) {
    int out[2];
    EXPECT_EQ(pipe(out), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      std::vector<std::string> args = {
          FLEXPERT_BINARY,          "serve", "--model", model, "--port", "0",
          "--transport-timeout-ms", "2000"};
      args.insert(args.end(), extra_args.begin(), extra_args.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      setenv("FLEXPERT_CLUSTER_KEY", kTestClusterKey, /*overwrite=*/0);  // --no-spawn needs one.
      execv(FLEXPERT_BINARY, argv.data());
      _exit(127);
    }
    close(out[1]);
    // The first stdout line names the address: "serving on http://127.0.0.1:PORT (...)".
    FILE* f = fdopen(out[0], "r");
    char line[512] = {0};
    while (fgets(line, sizeof(line), f) != nullptr) {
      int port = 0;
      // With --no-spawn the front end first says where workers join; start them.
      char join[128];
      if (std::sscanf(line, "waiting for %*d workers: flexpert worker --join %127s", join) == 1) {
        join_ = join;
        for (int rank : hand_started_) {
          workers_.push_back(launcher_ ? launcher_(join, rank) : start_worker(join, rank));
        }
        continue;
      }
      if (std::sscanf(line, "serving on http://127.0.0.1:%d", &port) == 1) {
        port_ = port;
        break;
      }
    }
    stdout_ = f;
    client_ = std::make_unique<httplib::Client>("127.0.0.1", port_);
    client_->set_read_timeout(60, 0);
  }

  ~Server() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    for (pid_t w : workers_) {
      kill(w, SIGKILL);
      waitpid(w, nullptr, 0);
    }
    if (stdout_) fclose(stdout_);
  }

  bool up() const { return port_ > 0; }
  // With --no-spawn: starts `flexpert worker --join` for `rank` (e.g. a scale-up's joiner).
  void join_worker(int rank) { workers_.push_back(start_worker(join_, rank)); }
  // SIGKILLs (and reaps) the i-th hand-started worker; stop() no longer waits for it.
  void kill_worker(size_t i) {
    ASSERT_LT(i, workers_.size());
    kill(workers_[i], SIGKILL);
    waitpid(workers_[i], nullptr, 0);
    workers_.erase(workers_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  // A worker the caller started (e.g. a scale-up's joiner): stop() waits for it like the others.
  void adopt_worker(pid_t pid) { workers_.push_back(pid); }
  // The index of a hand-started worker's pid (for take_worker).
  size_t index_of(pid_t pid) const {
    return static_cast<size_t>(std::find(workers_.begin(), workers_.end(), pid) - workers_.begin());
  }
  // Hands the i-th hand-started worker to the caller (who signals and reaps it).
  pid_t take_worker(size_t i) {
    const pid_t pid = workers_.at(i);
    workers_.erase(workers_.begin() + static_cast<std::ptrdiff_t>(i));
    return pid;
  }
  const std::string& join_address() const { return join_; }  // With --no-spawn.
  httplib::Client& client() { return *client_; }
  pid_t pid() const { return pid_; }
  int port() const { return port_; }

  nlohmann::json get_json(const std::string& path) {
    auto res = client_->Get(path.c_str());
    if (!res) return nullptr;
    return nlohmann::json::parse(res->body, nullptr, false);
  }

  // Greedy completion; returns the token ids or an empty list on failure.
  std::vector<int> complete(const std::vector<int>& prompt, int max_tokens) {
    nlohmann::json body = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    auto res = c.Post("/v1/completions", body.dump(), "application/json");
    if (!res || res->status != 200) return {};
    return nlohmann::json::parse(res->body)["choices"][0]["token_ids"].get<std::vector<int>>();
  }

  // SIGTERM and wait; returns the exit status. Hand-started workers must exit too.
  int stop() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    for (pid_t w : workers_) {
      int ws = 0;
      waitpid(w, &ws, 0);
      EXPECT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0) << "worker " << w << " status " << ws;
    }
    workers_.clear();
    return status;
  }

  static pid_t start_worker(const std::string& join, int rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string r = std::to_string(rank);
      setenv("FLEXPERT_CLUSTER_KEY", kTestClusterKey, /*overwrite=*/0);  // The server's.
      execl(FLEXPERT_BINARY, FLEXPERT_BINARY, "worker", "--join", join.c_str(), "--rank", r.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    return pid;
  }

 private:
  std::vector<int> hand_started_;
  Launcher launcher_;
  std::vector<pid_t> workers_;
  std::string join_;
  pid_t pid_ = -1;
  int port_ = 0;
  FILE* stdout_ = nullptr;
  std::unique_ptr<httplib::Client> client_;
};

inline std::vector<std::string> shm_segments(pid_t front_end) {
  std::vector<std::string> out;
  const std::string prefix = "flexpert-" + std::to_string(front_end) + "-";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  return out;
}

inline bool process_alive(int pid) { return pid > 0 && kill(pid, 0) == 0; }

// A fresh directory under /tmp (kept when the test fails: its logs are worth reading).
inline std::string temp_dir(const std::string& name) {
  std::string path = "/tmp/flexpert-" + name + "-XXXXXX";
  return mkdtemp(path.data()) != nullptr ? path : "/tmp";
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The number in `log` right before `suffix` on the line starting at `prefix` (-1: none).
inline long long figure_before(const std::string& log, const std::string& prefix,
                               const std::string& suffix) {
  const size_t at = log.find(prefix);
  if (at == std::string::npos) return -1;
  const size_t end = log.find(suffix, at);
  if (end == std::string::npos) return -1;
  size_t begin = end;
  while (begin > at && std::isdigit(static_cast<unsigned char>(log[begin - 1]))) --begin;
  return begin == end ? -1 : std::stoll(log.substr(begin, end - begin));
}

inline void check_reference(Server& server, const Reference& ref, int copies) {
  // copies x every prompt, all in flight at once.
  const size_t n = ref.prompts.size() * static_cast<size_t>(copies);
  std::vector<std::vector<int>> got(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back(
        [&, i] { got[i] = server.complete(ref.prompts[i % ref.prompts.size()], 16); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < n; ++i)
    EXPECT_EQ(got[i], ref.greedy[i % ref.prompts.size()]) << "request " << i;
}

}  // namespace flexpert_test
