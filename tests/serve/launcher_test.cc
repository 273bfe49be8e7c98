// SPDX-License-Identifier: Apache-2.0
// The launchers without a front end (src/serve/launcher.h): what a launch command sees in
// its environment, a refusing command reported as a failed launch, a forked process reaped.
#include "serve/launcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>

namespace flexpert {
namespace {

LaunchConfig config(const std::string& command) {
  LaunchConfig c;
  c.endpoint = "tcp://127.0.0.1:9";
  c.cluster_key = "k3y";
  c.threads = 2;
  c.command = command;
  return c;
}

// Polls until the launcher's commands have all ended (at most 10 s).
std::vector<FailedLaunch> wait_failed(Launcher& launcher, size_t want) {
  std::vector<FailedLaunch> all;
  for (int i = 0; i < 1000 && all.size() < want; ++i) {
    for (FailedLaunch& f : launcher.poll_failed()) all.push_back(std::move(f));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return all;
}

TEST(LauncherTest, EnvironmentSetsKeyThreadsAndExtrasOnce) {
  setenv("FLEXPERT_CLUSTER_KEY", "other", 1);
  setenv("FLEXPERT_RANK", "99", 1);
  const std::vector<std::string> env = launch_environment(config(""), {"FLEXPERT_RANK=4"});
  unsetenv("FLEXPERT_CLUSTER_KEY");
  unsetenv("FLEXPERT_RANK");
  auto count = [&](const std::string& prefix) {
    return std::count_if(env.begin(), env.end(),
                         [&](const std::string& e) { return e.rfind(prefix, 0) == 0; });
  };
  EXPECT_EQ(count("FLEXPERT_CLUSTER_KEY="), 1);
  EXPECT_EQ(count("FLEXPERT_RANK="), 1);
  EXPECT_NE(std::find(env.begin(), env.end(), "FLEXPERT_CLUSTER_KEY=k3y"), env.end());
  EXPECT_NE(std::find(env.begin(), env.end(), "FLEXPERT_RANK=4"), env.end());
  EXPECT_NE(std::find(env.begin(), env.end(), "FLEXPERT_THREADS=2"), env.end());
}

TEST(LauncherTest, CommandSeesRankJoinAndKeyAndItsExitCodeCounts) {
  // Exits 0 only with the expected environment, else 7; rank 3's command then exits 1.
  ExternalLauncher launcher(config(
      "test \"$FLEXPERT_JOIN\" = 127.0.0.1:9 && test \"$FLEXPERT_CLUSTER_KEY\" = k3y || exit 7; "
      "test \"$FLEXPERT_RANK\" = 3 && exit 1; exit 0"));
  EXPECT_TRUE(launcher.starts_workers());
  EXPECT_FALSE(launcher.owns_workers());
  auto ok = launcher.launch(2, 11);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok.value(), 0);  // The worker is not ours.
  ASSERT_TRUE(launcher.launch(3, 12).ok());
  const std::vector<FailedLaunch> failed = wait_failed(launcher, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(launcher.poll_failed().empty());  // Rank 2's command succeeded.
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].rank, 3);
  EXPECT_EQ(failed[0].incarnation, 12u);
  EXPECT_EQ(failed[0].why, "launch command exited with code 1");
}

TEST(LauncherTest, WithoutACommandNothingStarts) {
  ExternalLauncher launcher(config(""));
  EXPECT_FALSE(launcher.starts_workers());
  auto pid = launcher.launch(1, 1);
  ASSERT_TRUE(pid.ok());
  EXPECT_EQ(pid.value(), 0);
  EXPECT_TRUE(launcher.poll_failed().empty());
}

TEST(LauncherTest, ForkLauncherOwnsAndReapsItsProcess) {
  LaunchConfig c = config("");
  c.binary = "/bin/false";  // Ignores `worker --join ...` and exits 1.
  ForkLauncher launcher(c);
  EXPECT_TRUE(launcher.owns_workers());
  auto pid = launcher.launch(0, 1);
  ASSERT_TRUE(pid.ok()) << pid.status().to_string();
  ASSERT_GT(pid.value(), 0);
  std::optional<std::string> exit;
  for (int i = 0; i < 1000 && !exit; ++i) {
    exit = launcher.reap(pid.value());
    if (!exit) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(exit, std::optional<std::string>("exited with code 1"));
  EXPECT_EQ(launcher.reap(pid.value()), std::optional<std::string>(""));  // Reaped already.
  c.binary = "/no/such/binary";
  EXPECT_FALSE(ForkLauncher(c).launch(0, 1).ok());
}

}  // namespace
}  // namespace flexpert
