// SPDX-License-Identifier: Apache-2.0
// A group that heals itself (docs/ARCHITECTURE.md, "Membership, epochs, failure"):
// with default flags any one worker may die under load, and the group comes back to
// its size with no failed request and every answer equal to the reference; also two
// deaths at once, every worker at once, a stopped (silent) worker, a worker whose device fails
// for good (it exits), one stuck in a step while its heartbeat goes on (it ends itself), deaths
// that overlap a scale-up, a replacement's own preparation and a rebalance, and a group left
// without capacity, which answers 503 until a scale repairs it.
#include <random>

#include "elastic_util.h"
#include "server_fixture.h"

namespace {

using namespace flexpert_test;

struct Snapshot {
  int children = 0;
  size_t segments = 0;
};

Snapshot snapshot(Server& server) {
  return {child_processes(server.pid()), shm_segments(server.pid()).size()};
}

// The last recovery committed an epoch.
bool recovered_ok(const nlohmann::json& status) {
  return status["reconfiguration"]["last_recovery"].value("status", "") == "ok";
}

uint64_t recoveries(Server& server, const std::string& outcome) {
  return server.get_json("/v1/status")["reconfiguration"]["recoveries"][outcome].get<uint64_t>();
}

class KillAnyOneWorker : public ::testing::TestWithParam<int> {};

TEST_P(KillAnyOneWorker, DefaultFlagsLoseNoRequest) {
  const int n = GetParam();
  // Default flags: --max-ranks = --ranks, slots sized for n ranks (no spare capacity
  // for a lost rank's experts on the survivors): a replacement takes its place.
  Server server({"--ranks", std::to_string(n), "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const Snapshot before = snapshot(server);
  const uint64_t seed = std::random_device{}();
  const int victim = static_cast<int>(seed % static_cast<uint64_t>(n));
  std::printf("seed %llu: killing rank %d of %d\n", static_cast<unsigned long long>(seed), victim,
              n);
  Load load(server, 6);
  pause_ms(400);
  const int pid = rank_pid(server, victim);
  ASSERT_GT(pid, 0);
  kill(pid, SIGKILL);
  ASSERT_TRUE(wait_status(server, [&](const nlohmann::json& s) {
    return serving_with(s, static_cast<size_t>(n)) &&
           s["reconfiguration"]["recoveries"]["replacement"] == 1;
  })) << server.get_json("/v1/status").dump();
  pause_ms(300);  // Traffic on the healed group.
  EXPECT_TRUE(load.stop_and_check(10));
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["reconfiguration"]["last_recovery"]["replacements"], nlohmann::json({victim}))
      << status.dump();
  EXPECT_EQ(recoveries(server, "failed"), 0u);
  check_reference(server, load_reference(), 1);
  // Nothing leaked: one process and the same shm segments per rank as before.
  const Snapshot after = snapshot(server);
  EXPECT_EQ(after.children, before.children);
  EXPECT_EQ(after.segments, before.segments);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

INSTANTIATE_TEST_SUITE_P(Ranks, KillAnyOneWorker, ::testing::Values(2, 3, 4));

TEST(HealingTest, TwoOfFourKilledAtOnce) {
  Server server({"--ranks", "4", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  Load load(server, 6);
  pause_ms(400);
  const int a = rank_pid(server, 1), b = rank_pid(server, 2);
  kill(a, SIGKILL);
  kill(b, SIGKILL);
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 4) && s["reconfiguration"]["recoveries"]["failed"] == 0 &&
           recovered_ok(s) &&
           s["reconfiguration"]["last_recovery"].value("members", nlohmann::json::array()).size() ==
               4;
  })) << server.get_json("/v1/status").dump();
  pause_ms(300);
  EXPECT_TRUE(load.stop_and_check(10));
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(HealingTest, EveryWorkerKilledAtOnce) {
  // No survivor holds anything: every expert is reloaded from the checkpoint into
  // replacements at the freed ids, and the held requests re-run there.
  Server server({"--ranks", "3", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const Snapshot before = snapshot(server);
  Load load(server, 6);
  pause_ms(400);
  std::vector<int> pids;
  for (int r = 0; r < 3; ++r) pids.push_back(rank_pid(server, r));
  for (int pid : pids) {
    ASSERT_GT(pid, 0);
    kill(pid, SIGKILL);
  }
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 3) && recovered_ok(s) &&
           s["reconfiguration"]["last_recovery"].value("members", nlohmann::json::array()).size() ==
               3;
  })) << server.get_json("/v1/status").dump();
  pause_ms(300);  // Traffic on the new group.
  EXPECT_TRUE(load.stop_and_check(10));
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["reconfiguration"]["recoveries"]["failed"], 0) << status.dump();
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(std::count(pids.begin(), pids.end(), rank_pid(server, r)), 0);
  check_reference(server, load_reference(), 1);
  const Snapshot after = snapshot(server);
  EXPECT_EQ(after.children, before.children);
  EXPECT_EQ(after.segments, before.segments);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

// Three ranks whose rank 1 meets `fault` (FLEXPERT_FAULT, and FLEXPERT_STUCK_STEP_MS if
// given, inherited by the server and its workers) under load: its worker ends, a
// replacement takes its place, no request fails and the answers equal the reference.
void expect_replaced_after(const char* fault, const char* stuck_step_ms = nullptr) {
  setenv("FLEXPERT_FAULT", fault, 1);
  if (stuck_step_ms != nullptr) setenv("FLEXPERT_STUCK_STEP_MS", stuck_step_ms, 1);
  Server server({"--ranks", "3", "--threads-per-worker", "1"});
  unsetenv("FLEXPERT_FAULT");
  unsetenv("FLEXPERT_STUCK_STEP_MS");
  ASSERT_TRUE(server.up());
  const int pid = rank_pid(server, 1);
  Load load(server, 6);
  ASSERT_TRUE(wait_status(server, [&](const nlohmann::json& s) {
    return serving_with(s, 3) && s["reconfiguration"]["recoveries"]["replacement"] == 1;
  })) << server.get_json("/v1/status").dump();
  pause_ms(300);  // Traffic on the healed group.
  EXPECT_TRUE(load.stop_and_check(10));
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["reconfiguration"]["last_recovery"]["replacements"], nlohmann::json({1}))
      << status.dump();
  EXPECT_NE(rank_pid(server, 1), pid);
  EXPECT_EQ(recoveries(server, "failed"), 0u);
  check_reference(server, load_reference(), 1);
  EXPECT_EQ(server.stop(), 0);
}

TEST(HealingTest, AWorkerWhoseDeviceFailsExitsAndIsReplaced) {
  // A device that can run nothing more (a GPU context with a sticky error) fails every
  // step: the worker exits instead of halting its group again and again, and a
  // replacement takes its place (here injected on CPU ranks after 30 busy steps).
  expect_replaced_after("device-lost:1:30");
}

TEST(HealingTest, AWorkerStuckInAStepEndsAndIsReplaced) {
  // A stepping thread that never returns (on a GPU: held in a driver call) while the
  // heartbeat goes on: the heartbeat thread ends the worker once the step has run past the
  // limit (here 3 s; without it the peers would wait for the 30 s transport timeout, past
  // this test's 20 s), and the group recovers as from any death.
  expect_replaced_after("step-hang:1:30", "3000");
}

TEST(HealingTest, StoppedWorkerIsFencedAndReplaced) {
  Server server({"--ranks", "3", "--threads-per-worker", "1", "--heartbeat-timeout-ms", "1000"});
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  const int pid = rank_pid(server, 2);
  kill(pid, SIGSTOP);  // Silent: no exit for waitpid or the transport to see.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 3) && s["reconfiguration"]["recoveries"]["replacement"] == 1;
  })) << server.get_json("/v1/status").dump();
  const double healed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  kill(pid, SIGCONT);  // Too late: it was fenced (killed) and replaced.
  pause_ms(300);
  EXPECT_TRUE(load.stop_and_check());
  EXPECT_FALSE(process_alive(pid));
  EXPECT_LT(healed_s, 15.0);
  const auto status = server.get_json("/v1/status");
  for (const auto& r : status["ranks"]) {
    if (r["rank"] == 2) {
      EXPECT_EQ(r["incarnation"], 2) << status.dump();
    }
  }
  EXPECT_EQ(server.stop(), 0);
}

TEST(HealingTest, StoppedAndContinuedWithinTheTimeoutStaysAMember) {
  Server server({"--ranks", "2", "--threads-per-worker", "1", "--heartbeat-timeout-ms", "3000"});
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  const int pid = rank_pid(server, 1);
  kill(pid, SIGSTOP);
  pause_ms(800);
  kill(pid, SIGCONT);
  pause_ms(800);
  EXPECT_TRUE(load.stop_and_check());
  EXPECT_EQ(rank_pid(server, 1), pid);
  EXPECT_EQ(recoveries(server, "replacement") + recoveries(server, "in_place"), 0u);
  EXPECT_EQ(server.stop(), 0);
}

TEST(HealingTest, KillDuringAScaleUpsPreparation) {
  setenv("FLEXPERT_FAULT", "join-delay:1500", 1);  // Joiners linger while they connect.
  Server server({"--ranks", "2", "--max-ranks", "4", "--threads-per-worker", "1"});
  unsetenv("FLEXPERT_FAULT");
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  Answer scale;
  std::thread t([&] { scale = post(server, "/v1/scale", {{"ranks", 4}}); });
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return s["reconfiguration"]["step"] == "connecting";
  })) << server.get_json("/v1/status").dump();
  kill(rank_pid(server, 0), SIGKILL);
  t.join();
  EXPECT_NE(scale.status, 200) << scale.body.dump();  // Rolled back: the group changed.
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 2) && recovered_ok(s);
  })) << server.get_json("/v1/status").dump();
  EXPECT_TRUE(load.stop_and_check());
  // The operator's scale-up, again: it goes through now.
  EXPECT_EQ(post(server, "/v1/scale", {{"ranks", 4}}).status, 200);
  check_reference(server, load_reference(), 1);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(HealingTest, ReplacementKilledDuringItsPreparation) {
  setenv("FLEXPERT_FAULT", "join-delay:1500", 1);
  Server server({"--ranks", "2", "--threads-per-worker", "1"});
  unsetenv("FLEXPERT_FAULT");
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  kill(rank_pid(server, 1), SIGKILL);
  // The replacement (incarnation 2) connects slowly: kill it too.
  int replacement = 0;
  ASSERT_TRUE(wait_status(server, [&](const nlohmann::json& s) {
    for (const auto& r : s["ranks"]) {
      if (r["rank"] == 1 && r["incarnation"] == 2 && r.value("joining", false) && r["pid"] > 0) {
        replacement = r["pid"];
        return s["reconfiguration"]["step"] == "connecting replacements";
      }
    }
    return false;
  })) << server.get_json("/v1/status").dump();
  kill(replacement, SIGKILL);
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 2) && recovered_ok(s);
  })) << server.get_json("/v1/status").dump();
  EXPECT_TRUE(load.stop_and_check());
  const auto status = server.get_json("/v1/status");
  for (const auto& r : status["ranks"]) {
    if (r["rank"] == 1) {
      EXPECT_EQ(r["incarnation"], 3) << status.dump();
    }
  }
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(HealingTest, KillDuringARebalance) {
  Server server({"--ranks", "3", "--threads-per-worker", "1", "--eplb-window-s", "2"});
  ASSERT_TRUE(server.up());
  Load load(server, 6);
  pause_ms(600);  // Some load in the window.
  Answer rebalance;
  std::thread t([&] { rebalance = post(server, "/v1/eplb/rebalance", nlohmann::json::object()); });
  pause_ms(5);
  kill(rank_pid(server, 2), SIGKILL);
  t.join();
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 3) && recovered_ok(s);
  })) << server.get_json("/v1/status").dump();
  EXPECT_TRUE(load.stop_and_check());
  check_reference(server, load_reference(), 1);
  EXPECT_EQ(server.stop(), 0);
}

TEST(HealingTest, SpareTakesALostRanksPlace) {
  Server server(
      {"--ranks", "2", "--max-ranks", "3", "--spare-ranks", "1", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  auto spare_ready = [](const nlohmann::json& s, int rank) {
    for (const auto& r : s["ranks"]) {
      if (r["rank"] == rank && r.value("spare", false) && r["state"] == "ready") return true;
    }
    return false;
  };
  ASSERT_TRUE(wait_status(server, [&](const nlohmann::json& s) { return spare_ready(s, 2); }))
      << server.get_json("/v1/status").dump();
  Load load(server, 4);
  pause_ms(300);
  kill(rank_pid(server, 0), SIGKILL);
  // The spare (rank 2) replaces rank 0 at once; a new spare starts at the freed id 0.
  ASSERT_TRUE(wait_status(server, [&](const nlohmann::json& s) {
    return serving_with(s, 2) && recovered_ok(s) && spare_ready(s, 0);
  })) << server.get_json("/v1/status").dump();
  EXPECT_TRUE(load.stop_and_check());
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["members"], nlohmann::json({1, 2})) << status.dump();
  EXPECT_EQ(status["reconfiguration"]["last_recovery"]["replacements"], nlohmann::json({2}));
  check_reference(server, load_reference(), 1);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(HealingTest, NoCapacityAnswers503UntilAScaleRepairsIt) {
  // Hand-started workers: a replacement must be started by someone; none comes in time.
  Server server(
      {"--ranks", "2", "--no-spawn", "--threads-per-worker", "1", "--start-timeout-ms", "1500"},
      {0, 1});
  ASSERT_TRUE(server.up());
  server.kill_worker(1);  // Rank 1: its experts do not fit on rank 0's slots.
  ASSERT_TRUE(wait_status(
      server, [](const nlohmann::json& s) { return s["phase"] == "degraded"; }, 30000))
      << server.get_json("/v1/status").dump();
  const auto status = server.get_json("/v1/status");
  EXPECT_TRUE(status["degraded_reason"].is_string()) << status.dump();
  const Reference ref = load_reference();
  nlohmann::json body = {{"prompt", ref.prompts[0]}, {"max_tokens", 4}, {"temperature", 0}};
  auto res = server.client().Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503) << res->body;
  // Hand-started workers: no healer retry to wait for (only an operator's scale), so 1 s.
  EXPECT_FALSE(status["reconfiguration"].contains("retry_in_s")) << status.dump();
  EXPECT_EQ(res->get_header_value("Retry-After"), "1");
  // The operator starts a worker and asks for two ranks: the group recovers.
  Answer scale;
  std::thread t([&] { scale = post(server, "/v1/scale", {{"ranks", 2}}); });
  pause_ms(200);
  server.join_worker(1);
  t.join();
  EXPECT_EQ(scale.status, 200) << scale.body.dump();
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) { return serving_with(s, 2); }));
  // The answer is the report of the recovery the scale waited for, not the failed one
  // before it: the epoch it committed, with rank 1 back as its replacement.
  const auto repaired = server.get_json("/v1/status");
  EXPECT_EQ(scale.body.value("kind", ""), "recovery") << scale.body.dump();
  EXPECT_EQ(scale.body.value("status", ""), "ok") << scale.body.dump();
  EXPECT_EQ(scale.body["replacements"], nlohmann::json({1})) << scale.body.dump();
  EXPECT_EQ(scale.body["members"], nlohmann::json({0, 1})) << scale.body.dump();
  EXPECT_EQ(scale.body["epoch"], repaired["epoch"]) << scale.body.dump() << repaired.dump();
  EXPECT_EQ(scale.body, repaired["reconfiguration"]["last_recovery"]) << repaired.dump();
  check_reference(server, ref, 1);
  EXPECT_EQ(recoveries(server, "failed"), 1u);
  EXPECT_EQ(recoveries(server, "replacement"), 1u);
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
