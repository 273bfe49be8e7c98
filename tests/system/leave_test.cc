// SPDX-License-Identifier: Apache-2.0
// A worker's SIGTERM is a graceful leave (docs/deployment.md): it asks the front end to
// remove it, the group scales down live without it, and it exits 0 with no request failed;
// its id opens again for a later scale-up.
// Also `--rank auto`: hand-started workers that let the front end pick their ids.
#include "elastic_util.h"
#include "server_fixture.h"

namespace {

using namespace flexpert_test;

// Waits up to timeout_ms for `pid` to exit; its wait status, or -1 if it did not.
int wait_exit(pid_t pid, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    pause_ms(20);
  }
  return -1;
}

TEST(LeaveTest, SigtermLeavesWithoutFailingARequest) {
  // Hand-started workers, so that the test reaps the leaver and sees its exit status;
  // --min-ranks 2 sizes the slots so that two ranks hold every expert.
  Server server({"--no-spawn", "--ranks", "3", "--min-ranks", "2", "--threads-per-worker", "1"},
                {0, 1, 2});
  ASSERT_TRUE(server.up());
  Load load(server, 6);
  pause_ms(400);
  const pid_t leaver = server.take_worker(1);  // Rank 1.
  ASSERT_EQ(kill(leaver, SIGTERM), 0);
  const int status = wait_exit(leaver, 30000);
  if (status == -1) kill(leaver, SIGKILL), waitpid(leaver, nullptr, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
  EXPECT_TRUE(wait_status(server, [](const nlohmann::json& s) { return serving_with(s, 2); }))
      << server.get_json("/v1/status").dump();
  pause_ms(300);  // Traffic on the smaller group.
  EXPECT_TRUE(load.stop_and_check(10));
  const auto s = server.get_json("/v1/status");
  EXPECT_EQ(s["members"], nlohmann::json({0, 2})) << s.dump();
  EXPECT_EQ(last_kind(s), "leave") << s.dump();
  EXPECT_EQ(s["reconfiguration"]["recoveries"]["replacement"], 0) << s.dump();
  check_reference(server, load_reference(), 1);
  // The leaver's id is open again (its exit is not the front end's to see): a scale back to
  // 3 (= --max-ranks) takes it with a new worker.
  Answer up;
  std::thread scale([&] { up = post(server, "/v1/scale", {{"ranks", 3}}); });
  EXPECT_TRUE(wait_status(
      server, [](const nlohmann::json& st) { return st["phase"] == "scaling"; }, 10000));
  server.join_worker(1);
  scale.join();
  EXPECT_EQ(up.status, 200) << up.body.dump();
  EXPECT_EQ(members(server), std::vector<int>({0, 1, 2}));
  check_reference(server, load_reference(), 1);
  EXPECT_EQ(server.stop(), 0);
}

// A spawned worker (the front end's child, reaped there) leaves the same way: not a loss.
TEST(LeaveTest, SpawnedWorkerLeavesOnSigterm) {
  Server server({"--ranks", "3", "--min-ranks", "2", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  const int pid = rank_pid(server, 2);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  EXPECT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 2) && last_kind(s) == "leave";
  })) << server.get_json("/v1/status").dump();
  for (int i = 0; i < 100 && process_alive(pid); ++i) pause_ms(50);  // Reaped by the front end.
  EXPECT_FALSE(process_alive(pid));
  pause_ms(300);
  EXPECT_TRUE(load.stop_and_check(5));
  const auto s = server.get_json("/v1/status");
  EXPECT_EQ(s["members"], nlohmann::json({0, 1})) << s.dump();
  EXPECT_EQ(s["reconfiguration"]["recoveries"]["replacement"], 0) << s.dump();
  EXPECT_EQ(s["reconfiguration"]["recoveries"]["in_place"], 0) << s.dump();
  EXPECT_EQ(server.stop(), 0);
}

// `flexpert worker --join HOST:PORT --rank auto`: the front end assigns each an open id.
pid_t start_auto_worker(const std::string& join) {
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("FLEXPERT_CLUSTER_KEY", kTestClusterKey, /*overwrite=*/0);
    execl(FLEXPERT_BINARY, FLEXPERT_BINARY, "worker", "--join", join.c_str(), "--rank", "auto",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

TEST(LeaveTest, AutoRanksJoinAndAnExtraOneIsRefused) {
  Server server({"--no-spawn", "--ranks", "2", "--threads-per-worker", "1"}, {0, 1}, kModel,
                [](const std::string& join, int) { return start_auto_worker(join); });
  ASSERT_TRUE(server.up());
  EXPECT_EQ(members(server), std::vector<int>({0, 1}));
  check_reference(server, load_reference(), 1);
  // No id is open any more: a third one is refused and exits non-zero.
  const pid_t extra = start_auto_worker(server.join_address());
  const int status = wait_exit(extra, 20000);
  if (status == -1) kill(extra, SIGKILL), waitpid(extra, nullptr, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "wait status " << status;
  EXPECT_EQ(members(server), std::vector<int>({0, 1}));
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
