// SPDX-License-Identifier: Apache-2.0
// The external launcher with an orchestrator's command (docs/ARCHITECTURE.md, "Front end";
// docs/deployment.md): `serve --no-spawn --launch-command` starts the initial ranks, a
// scale-up's joiner and a lost rank's replacement through the command, which starts
// `flexpert worker --join $FLEXPERT_JOIN --rank $FLEXPERT_RANK` in the background; a
// command that exits non-zero is a failed start (503), and the next scale goes through.
// Every worker killed while the command refuses: held requests, then 503 with Retry-After
// while degraded; the healer retries until the command works again.
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "../common/run_flexpert.h"
#include "elastic_util.h"
#include "server_fixture.h"

namespace {

using namespace flexpert_test;

// A scratch directory with the launch script; kills the workers the script started (the
// orchestrator's, not the front end's children) when the test ends.
class LaunchDir {
 public:
  LaunchDir() {
    dir_ = std::filesystem::temp_directory_path() /
           ("flexpert-launch-" + std::to_string(getpid()) + "-" + std::to_string(next_++));
    std::filesystem::create_directories(dir_);
    std::ofstream script(dir_ / "launch.sh");
    // Refuses while a file "fail" exists; records the rank it was asked for and the pid it
    // started. The key comes through the environment (FLEXPERT_CLUSTER_KEY), never argv.
    script << "set -e\n"
           << "test -z \"$FLEXPERT_CLUSTER_KEY\" && exit 3\n"
           << "test -e '" << path("fail") << "' && { echo refusing rank $FLEXPERT_RANK; exit 1; }\n"
           << "echo $FLEXPERT_RANK >> '" << path("launched") << "'\n"
           << "'" << FLEXPERT_BINARY
           << "' worker --join \"$FLEXPERT_JOIN\" --rank \"$FLEXPERT_RANK\""
           << " > '" << path("worker-") << "'$FLEXPERT_RANK.log 2>&1 &\n"
           << "echo $! >> '" << path("pids") << "'\n";
  }
  ~LaunchDir() {
    for (int pid : read_ints("pids")) kill(pid, SIGKILL);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string command() const { return "sh '" + path("launch.sh") + "'"; }
  // The ranks the command was run for, in the order they ran (commands started together may
  // finish in any order).
  std::vector<int> launched() const { return read_ints("launched"); }
  std::vector<int> launched_sorted() const {
    std::vector<int> v = launched();
    std::sort(v.begin(), v.end());
    return v;
  }
  // Whether every worker the script started has exited (or does within 10 s). They are not
  // our children: gone, or a zombie of whoever adopted them.
  bool workers_exit() const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int pid : read_ints("pids")) {
      for (;;) {
        std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
        std::string id, comm, state;
        if (!(in >> id >> comm >> state) || state == "Z") break;
        if (std::chrono::steady_clock::now() > deadline) return false;
        pause_ms(20);
      }
    }
    return true;
  }
  // The pids of every worker the script started.
  std::vector<int> pids() const { return read_ints("pids"); }
  void set_failing(bool failing) const {
    if (failing) {
      std::ofstream(path("fail")) << "1\n";
    } else {
      std::filesystem::remove(path("fail"));
    }
  }

 private:
  std::vector<int> read_ints(const std::string& name) const {
    std::ifstream in(path(name));
    std::vector<int> out;
    for (int v = 0; in >> v;) out.push_back(v);
    return out;
  }
  static inline int next_ = 0;
  std::filesystem::path dir_;
};

TEST(LauncherTest, LaunchCommandStartsScalesAndHeals) {
  LaunchDir launch;
  Server server({"--ranks", "2", "--max-ranks", "3", "--no-spawn", "--threads-per-worker", "1",
                 "--launch-command", launch.command()});
  ASSERT_TRUE(server.up());
  EXPECT_EQ(launch.launched_sorted(), std::vector<int>({0, 1}));
  EXPECT_EQ(child_processes(server.pid()), 0);  // The workers are not the front end's.
  const Reference ref = load_reference();
  check_reference(server, ref, 1);

  // A scale-up: its joiner comes from the command.
  const Answer up = post(server, "/v1/scale", {{"ranks", 3}});
  ASSERT_EQ(up.status, 200) << up.body.dump();
  EXPECT_EQ(up.body["members"], nlohmann::json({0, 1, 2}));
  EXPECT_EQ(launch.launched_sorted(), std::vector<int>({0, 1, 2}));
  EXPECT_EQ(launch.launched().back(), 2);
  check_reference(server, ref, 1);

  // A kill: the group recovers and the healer restores three ranks through the command.
  const int pid = rank_pid(server, 1);
  ASSERT_GT(pid, 0);
  kill(pid, SIGKILL);
  ASSERT_TRUE(wait_status(
      server,
      [&](const nlohmann::json& s) { return serving_with(s, 3) && launch.launched().size() == 4; },
      60000))
      << server.get_json("/v1/status").dump();
  const auto status = server.get_json("/v1/status");
  EXPECT_NE(rank_pid(server, launch.launched().back()), pid) << status.dump();
  EXPECT_EQ(status["reconfiguration"]["recoveries"]["failed"], 0) << status.dump();
  check_reference(server, ref, 1);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(launch.workers_exit());  // Told to stop by the front end, not killed.
}

TEST(LauncherTest, FailingLaunchCommandIsAFailedStart) {
  LaunchDir launch;
  Server server({"--ranks", "1", "--max-ranks", "2", "--no-spawn", "--threads-per-worker", "1",
                 "--start-timeout-ms", "30000", "--launch-command", launch.command()});
  ASSERT_TRUE(server.up());
  launch.set_failing(true);
  const Answer refused = post(server, "/v1/scale", {{"ranks", 2}});
  EXPECT_EQ(refused.status, 503) << refused.body.dump();
  EXPECT_NE(refused.body.dump().find("launch command exited with code 1"), std::string::npos)
      << refused.body.dump();
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) { return serving_with(s, 1); }));
  const Reference ref = load_reference();
  check_reference(server, ref, 1);
  // The orchestrator recovers: the same id starts on the next try.
  launch.set_failing(false);
  const Answer up = post(server, "/v1/scale", {{"ranks", 2}});
  ASSERT_EQ(up.status, 200) << up.body.dump();
  EXPECT_EQ(up.body["members"], nlohmann::json({0, 1}));
  EXPECT_EQ(launch.launched(), std::vector<int>({0, 1}));
  check_reference(server, ref, 1);
  // A kill while the orchestrator refuses: the survivor holds every expert, and the healer
  // retries the replacement (with its backoff) until the command succeeds again.
  launch.set_failing(true);
  kill(rank_pid(server, 1), SIGKILL);
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 1) && s["reconfiguration"]["recoveries"]["in_place"] == 1;
  })) << server.get_json("/v1/status").dump();
  pause_ms(1000);  // At least one refused heal.
  EXPECT_TRUE(serving_with(server.get_json("/v1/status"), 1));
  launch.set_failing(false);
  ASSERT_TRUE(wait_status(
      server, [](const nlohmann::json& s) { return serving_with(s, 2); }, 60000))
      << server.get_json("/v1/status").dump();
  EXPECT_EQ(launch.launched(), std::vector<int>({0, 1, 1}));
  check_reference(server, ref, 1);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(launch.workers_exit());
}

// Retry-After as a 503 carries it: whole seconds, 1 to 30 (the healer's longest backoff); 0
// when absent or not a number.
int retry_after_s(const httplib::Response& res) {
  const std::string v = res.get_header_value("Retry-After");
  if (v.empty() || v.size() > 2 || !std::all_of(v.begin(), v.end(), ::isdigit)) return 0;
  const int s = std::stoi(v);
  return s >= 1 && s <= 30 ? s : 0;
}

// One client's answers while the group loses every worker: each is 200 with the reference
// tokens, or 503 with Retry-After and a JSON error; none is another status or no answer.
class Prober {
 public:
  Prober(Server& server, int clients) : ref_(load_reference()) {
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, &server, c] {
        for (int i = 0; !done_.load(); ++i) {
          const size_t p = (c + i) % ref_.prompts.size();
          const nlohmann::json body = {
              {"prompt", ref_.prompts[p]}, {"max_tokens", 16}, {"temperature", 0}};
          httplib::Client client("127.0.0.1", server.port());
          client.set_read_timeout(120, 0);  // A bound far above the hold: no answer is a hang.
          auto res = client.Post("/v1/completions", body.dump(), "application/json");
          if (res && res->status == 503) pause_ms(20);  // No spin on refusals.
          std::lock_guard<std::mutex> lock(mutex_);
          if (!res) {
            ++unanswered_;
            continue;
          }
          const auto j = nlohmann::json::parse(res->body, nullptr, false);
          if (res->status == 200) {
            ok_ += j["choices"][0]["token_ids"].get<std::vector<int>>() == ref_.greedy[p];
            wrong_ += j["choices"][0]["token_ids"].get<std::vector<int>>() != ref_.greedy[p];
          } else if (res->status == 503 && retry_after_s(*res) > 0 && j.is_object() &&
                     j["error"]["message"].is_string()) {
            ++unavailable_;
          } else {
            bad_.push_back(std::to_string(res->status) + " " + res->body);
          }
        }
      });
    }
  }
  ~Prober() { stop(); }
  void stop() {
    done_.store(true);
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  int ok() const { return ok_; }
  int wrong() const { return wrong_; }
  int unavailable() const { return unavailable_; }
  int unanswered() const { return unanswered_; }
  const std::vector<std::string>& bad() const { return bad_; }

 private:
  Reference ref_;
  std::atomic<bool> done_{false};
  std::mutex mutex_;
  int ok_ = 0, wrong_ = 0, unavailable_ = 0, unanswered_ = 0;
  std::vector<std::string> bad_;
  std::vector<std::thread> threads_;
};

// Degraded, a 503 says when the healer tries next: Retry-After is /v1/status's retry_in_s
// rounded up, read before and after the answer. Samples until one lands with no retry in
// between (the same degraded_retries on both sides) and the healer more than 1 s away, where
// a fixed "1" would be wrong.
void expect_retry_after_is_the_healers(Server& server, const nlohmann::json& request) {
  for (int sample = 0; sample < 100; ++sample) {
    const auto before = server.get_json("/v1/status");
    auto res = server.client().Post("/v1/completions", request.dump(), "application/json");
    const auto after = server.get_json("/v1/status");
    const auto& b = before["reconfiguration"];
    const auto& a = after["reconfiguration"];
    if (before["phase"] != "degraded" || after["phase"] != "degraded" ||
        !b.contains("retry_in_s") || !a.contains("retry_in_s") ||
        b.value("degraded_retries", 0) != a.value("degraded_retries", 0) ||
        a["retry_in_s"].get<double>() <= 1.0) {
      pause_ms(100);
      continue;
    }
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 503) << res->body;
    const int retry_after = retry_after_s(*res);
    EXPECT_GE(retry_after, static_cast<int>(std::ceil(a["retry_in_s"].get<double>())))
        << res->get_header_value("Retry-After") << " " << after.dump();
    EXPECT_LE(retry_after, static_cast<int>(std::ceil(b["retry_in_s"].get<double>())))
        << res->get_header_value("Retry-After") << " " << before.dump();
    return;
  }
  ADD_FAILURE() << "no 503 while the healer's next retry was over 1 s away: "
                << server.get_json("/v1/status").dump();
}

TEST(LauncherTest, EveryWorkerKilledWhileTheCommandRefuses) {
  LaunchDir launch;
  Server server({"--ranks", "2", "--no-spawn", "--threads-per-worker", "1",
                 "--heartbeat-timeout-ms", "1000", "--launch-command", launch.command()});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  check_reference(server, ref, 1);
  Prober load(server, 4);
  pause_ms(300);
  launch.set_failing(true);
  for (int pid : launch.pids()) kill(pid, SIGKILL);
  // Every replacement refused: held, then degraded, with why and when the healer retries.
  ASSERT_TRUE(wait_status(
      server, [](const nlohmann::json& s) { return s["phase"] == "degraded"; }, 30000))
      << server.get_json("/v1/status").dump();
  auto status = server.get_json("/v1/status");
  EXPECT_NE(status.value("degraded_reason", "").find("launch command exited with code 1"),
            std::string::npos)
      << status.dump();
  EXPECT_TRUE(status["reconfiguration"]["retry_in_s"].is_number()) << status.dump();
  // The operator's scale is accepted: it tries once more and says why it failed.
  const Answer refused = post(server, "/v1/scale", {{"ranks", 2}});
  EXPECT_EQ(refused.status, 503) << refused.body.dump();
  EXPECT_NE(refused.body.dump().find("launch command exited with code 1"), std::string::npos)
      << refused.body.dump();
  // The healer tries again on its own, and again after a longer wait.
  ASSERT_TRUE(wait_status(
      server,
      [](const nlohmann::json& s) {
        return s["phase"] == "degraded" && s["reconfiguration"].value("degraded_retries", 0) >= 2;
      },
      60000))
      << server.get_json("/v1/status").dump();
  // The healer now waits at least 4 s between retries (1, 2, 4 s, ...): a 503 says how long.
  expect_retry_after_is_the_healers(
      server, {{"prompt", ref.prompts[0]}, {"max_tokens", 4}, {"temperature", 0}});
  load.stop();
  EXPECT_GT(load.unavailable(), 0);
  // The orchestrator recovers: the healer's next retry brings the group back.
  launch.set_failing(false);
  Prober after(server, 4);
  ASSERT_TRUE(wait_status(
      server,
      [](const nlohmann::json& s) {
        return serving_with(s, 2) &&
               s["reconfiguration"]["last_recovery"].value("status", "") == "ok";
      },
      60000))
      << server.get_json("/v1/status").dump();
  pause_ms(300);  // Traffic on the new group.
  after.stop();
  for (const Prober* p : {&load, &after}) {
    EXPECT_EQ(p->wrong(), 0);
    EXPECT_EQ(p->unanswered(), 0);
    EXPECT_TRUE(p->bad().empty()) << p->bad().front();
  }
  EXPECT_GT(load.ok(), 0);
  EXPECT_GT(after.ok(), 0);
  status = server.get_json("/v1/status");
  EXPECT_FALSE(status.contains("degraded_reason")) << status.dump();
  check_reference(server, ref, 2);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(launch.workers_exit());
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(LauncherTest, StopsCleanlyWhileDegraded) {
  LaunchDir launch;
  Server server({"--ranks", "2", "--no-spawn", "--threads-per-worker", "1",
                 "--heartbeat-timeout-ms", "1000", "--launch-command", launch.command()});
  ASSERT_TRUE(server.up());
  launch.set_failing(true);
  for (int pid : launch.pids()) kill(pid, SIGKILL);
  ASSERT_TRUE(wait_status(
      server, [](const nlohmann::json& s) { return s["phase"] == "degraded"; }, 30000))
      << server.get_json("/v1/status").dump();
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(LauncherTest, LaunchCommandNeedsTheExternalLauncher) {
  const CliRun r = run_flexpert("serve --model " + kModel + " --launch-command true --port 0");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--launch-command needs --no-spawn"), std::string::npos) << r.out;
}

}  // namespace
