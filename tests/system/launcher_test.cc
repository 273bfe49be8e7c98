// SPDX-License-Identifier: Apache-2.0
// The external launcher with an orchestrator's command (docs/ARCHITECTURE.md, "Front end";
// docs/deployment.md): `serve --no-spawn --launch-command` starts the initial ranks, a
// scale-up's joiner and a lost rank's replacement through the command, which starts
// `flexpert worker --join $FLEXPERT_JOIN --rank $FLEXPERT_RANK` in the background; a
// command that exits non-zero is a failed start (503), and the next scale goes through.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

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

TEST(LauncherTest, LaunchCommandNeedsTheExternalLauncher) {
  const CliRun r = run_flexpert("serve --model " + kModel + " --launch-command true --port 0");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--launch-command needs --no-spawn"), std::string::npos) << r.out;
}

}  // namespace
