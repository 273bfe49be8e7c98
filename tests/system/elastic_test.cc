// SPDX-License-Identifier: Apache-2.0
// Elastic membership while serving: scale up and down under continuous load, a
// worker killed under load, a joiner that crashes during its preparation, and
// many scale cycles without leaks. Every completion must equal the Hugging Face
// reference and no request may fail.
#include <atomic>
#include <set>

#include "../common/run_flexpert.h"
#include "elastic_util.h"
#include "server_fixture.h"

namespace {

using namespace flexpert_test;

TEST(ElasticTest, ScaleUpAndDownUnderLoadKeepsEveryAnswer) {
  Server server({"--ranks", "2", "--max-ranks", "4", "--min-ranks", "1", "--threads-per-worker",
                 "1", "--admin-key", "sesame"});
  ASSERT_TRUE(server.up());
  Load load(server, 6);
  pause_ms(300);
  EXPECT_EQ(post(server, "/v1/scale", {{"ranks", 4}}).status, 401);  // No key.
  for (int target : {4, 3, 1, 3}) {
    const Answer a = post(server, "/v1/scale", {{"ranks", target}}, "sesame");
    ASSERT_EQ(a.status, 200) << a.body.dump();
    EXPECT_EQ(a.body["status"], "ok");
    EXPECT_EQ(a.body["members"].size(), static_cast<size_t>(target)) << a.body.dump();
    EXPECT_EQ(members(server).size(), static_cast<size_t>(target));
    pause_ms(400);  // Traffic on the new topology.
  }
  EXPECT_TRUE(load.stop_and_check(30));
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["phase"], "serving");
  EXPECT_EQ(status["epoch"], 5);  // Start + four commits.
  // The experts spread over the members: every member holds some, others none.
  const auto eplb = server.get_json("/v1/eplb");
  const int spr = eplb["slots_per_rank"];
  const std::set<int> now(status["members"].begin(), status["members"].end());
  for (const auto& layer : eplb["layers"]) {
    std::set<int> experts;
    const auto map = layer["slot_to_expert"].get<std::vector<int>>();
    for (size_t s = 0; s < map.size(); ++s) {
      if (map[s] < 0) continue;
      EXPECT_TRUE(now.count(static_cast<int>(s) / spr)) << "slot " << s << " of a non-member";
      experts.insert(map[s]);
    }
    EXPECT_EQ(experts.size(), 16u);
  }
  EXPECT_EQ(server.stop(), 0);
}

// A scale-down lets the leavers finish what they run (--leave-drain-ms) before it commits;
// without the drain (0) their unfinished requests re-run on the survivor (prompt + streamed
// tokens prefilled again). Long requests on the leavers at the scale, three replicas of
// every expert (nothing to move: the commit would follow at once); every answer equals the
// one the same request got alone.
class LeaverDrain : public ::testing::TestWithParam<bool> {};

TEST_P(LeaverDrain, LongRequestsOnTheLeaversKeepTheirAnswers) {
  const bool drain = GetParam();
  Server server({"--ranks", "3", "--max-ranks", "3", "--min-ranks", "1", "--min-replicas", "3",
                 "--threads-per-worker", "1", "--leave-drain-ms", drain ? "60000" : "0"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  constexpr int kTokens = 600;  // Several hundred ms: running when the scale commits.
  std::vector<std::vector<int>> want(3), got(3);
  for (size_t i = 0; i < 3; ++i) {
    want[i] = server.complete(ref.prompts[i], kTokens);
    ASSERT_EQ(want[i].size(), static_cast<size_t>(kTokens));
  }
  std::vector<std::thread> clients;
  for (size_t i = 0; i < 3; ++i) {
    clients.emplace_back([&, i] { got[i] = server.complete(ref.prompts[i], kTokens); });
  }
  // One request on each rank (placed on the least loaded): ranks 1 and 2 leave with theirs.
  const bool placed = wait_status(server, [](const nlohmann::json& s) {
    int on_leavers = 0;
    for (const auto& r : s["ranks"]) on_leavers += r["rank"] != 0 && r["in_flight"] > 0;
    return on_leavers > 0;
  });
  const Answer a = post(server, "/v1/scale", {{"remove", {1, 2}}});
  for (auto& t : clients) t.join();
  ASSERT_TRUE(placed) << "no request ran on ranks 1 or 2";
  ASSERT_EQ(a.status, 200) << a.body.dump();
  EXPECT_EQ(a.body["members"], nlohmann::json({0})) << a.body.dump();
  if (drain) {
    EXPECT_EQ(a.body["rerun_requests"], 0) << a.body.dump();
    EXPECT_GT(a.body["drain_s"].get<double>(), 0.0) << a.body.dump();
  } else {
    EXPECT_GE(a.body["rerun_requests"].get<int>(), 1) << a.body.dump();
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
  EXPECT_EQ(server.stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(Drain, LeaverDrain, ::testing::Bool());

TEST(ElasticTest, HandStartedJoinerAndScaleCommandErrors) {
  // --no-spawn: the scale-up waits for `flexpert worker --join ... --rank 1`.
  Server server({"--ranks", "1", "--max-ranks", "2", "--no-spawn", "--threads-per-worker", "1"},
                {0});
  ASSERT_TRUE(server.up());
  const std::string url = "--url http://127.0.0.1:" + std::to_string(server.port());
  Answer answer;
  std::thread scale([&] { answer = post(server, "/v1/scale", {{"ranks", 2}}); });
  pause_ms(300);
  EXPECT_EQ(server.get_json("/v1/status")["phase"], "scaling");
  server.join_worker(1);
  scale.join();
  ASSERT_EQ(answer.status, 200) << answer.body.dump();
  EXPECT_EQ(answer.body["members"], nlohmann::json({0, 1}));
  const Reference ref = load_reference();
  check_reference(server, ref, 1);
  auto bad = run_flexpert("scale " + url + " --to 0");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  bad = run_flexpert("scale " + url);
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  bad = run_flexpert("scale " + url + " --remove 0,1");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;  // HTTP 400: cannot remove every member.
  EXPECT_NE(bad.out.find("every member"), std::string::npos) << bad.out;
  EXPECT_EQ(server.stop(), 0);
}

TEST(ElasticTest, ScaleCommandReportsTheCommit) {
  Server server({"--ranks", "1", "--max-ranks", "2", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const auto run =
      run_flexpert("scale --url http://127.0.0.1:" + std::to_string(server.port()) + " --to 2");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto report = nlohmann::json::parse(run.out.substr(run.out.find('{')), nullptr, false);
  EXPECT_EQ(report["members"], nlohmann::json({0, 1})) << run.out;
  EXPECT_EQ(report["kind"], "scale-up");
  EXPECT_GT(report["copied_bytes"].get<int64_t>(), 0);
  const Reference ref = load_reference();
  check_reference(server, ref, 2);
  EXPECT_EQ(server.stop(), 0);
}

TEST(ElasticTest, DeepSeekGroupScalesAndRebalancesUnderLoad) {
  const std::string model = std::string(FLEXPERT_TESTDATA_DIR) + "/deepseekv3-tiny";
  Server server({"--ranks", "2", "--max-ranks", "4", "--min-ranks", "1", "--threads-per-worker",
                 "1", "--eplb-window-s", "2"},
                {}, model);
  ASSERT_TRUE(server.up());
  Load load(server, 4, model);
  pause_ms(300);
  ASSERT_EQ(post(server, "/v1/scale", {{"ranks", 4}}).status, 200);
  pause_ms(300);
  const Answer rebalance = post(server, "/v1/eplb/rebalance", nlohmann::json::object());
  EXPECT_EQ(rebalance.status, 200) << rebalance.body.dump();
  ASSERT_EQ(post(server, "/v1/scale", {{"remove", {0, 2}}}).status, 200);
  pause_ms(300);
  EXPECT_EQ(members(server), std::vector<int>({1, 3}));
  // A loss with a dense first layer (first_k_dense_replace, whose map is not routed):
  // recovered on rank 1 alone, then healed back to two ranks.
  kill(rank_pid(server, 3), SIGKILL);
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 2) && last_kind(s) == "heal";
  })) << server.get_json("/v1/status").dump();
  EXPECT_TRUE(load.stop_and_check(10));
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["reconfiguration"]["recoveries"]["in_place"], 1) << status.dump();
  EXPECT_EQ(server.stop(), 0);
}

TEST(ElasticTest, BadScaleRequestsGetClearErrors) {
  Server server({"--ranks", "2", "--max-ranks", "3", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  for (const nlohmann::json& body :
       {nlohmann::json{{"ranks", 0}}, nlohmann::json{{"ranks", 4}}, nlohmann::json{{"ranks", "2"}},
        nlohmann::json{{"ranks", 2.5}}, nlohmann::json{{"remove", {7}}},
        nlohmann::json{{"remove", {0, 1}}}, nlohmann::json::object(),
        nlohmann::json{{"ranks", 2}, {"remove", {1}}}}) {
    const Answer a = post(server, "/v1/scale", body);
    EXPECT_EQ(a.status, 400) << body.dump() << " -> " << a.body.dump();
    EXPECT_TRUE(a.body["error"]["message"].is_string()) << a.body.dump();
  }
  // Shrinking below what the slots can hold (sized for --ranks 2 by default).
  EXPECT_EQ(post(server, "/v1/scale", {{"ranks", 1}}).status, 400);
  EXPECT_EQ(members(server).size(), 2u);
  EXPECT_EQ(post(server, "/v1/scale", {{"remove", {1}}}).status, 400);
  EXPECT_EQ(server.stop(), 0);
}

TEST(ElasticTest, KilledWorkerUnderLoadLosesNoRequest) {
  // One replica per expert: the lost rank's experts are reloaded from the checkpoint
  // into the survivors' free slots (sized for 2 ranks by --min-ranks); then the healer
  // scales back to 3 with a joiner reusing the freed id (a new incarnation).
  Server server(
      {"--ranks", "3", "--max-ranks", "3", "--min-ranks", "2", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  Load load(server, 6);
  pause_ms(400);
  const int victim = rank_pid(server, 1);
  ASSERT_GT(victim, 0);
  kill(victim, SIGKILL);
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 3) && last_kind(s) == "heal";
  })) << server.get_json("/v1/status").dump();
  pause_ms(300);
  EXPECT_TRUE(load.stop_and_check(20));
  const auto after = server.get_json("/v1/status");
  EXPECT_EQ(after["reconfiguration"]["recoveries"]["in_place"], 1) << after.dump();
  EXPECT_EQ(after["reconfiguration"]["recoveries"]["replacement"], 0) << after.dump();
  EXPECT_EQ(after["reconfiguration"]["last"]["joined"], nlohmann::json({1}));
  for (const auto& r : after["ranks"]) {
    if (r["rank"] == 1) {
      EXPECT_EQ(r["incarnation"], 2);
      EXPECT_EQ(r["state"], "serving");
    }
  }
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

// A request with logit processing moved to another rank (its rank killed mid-answer) is
// re-run as prompt + streamed tokens: the penalties must count the streamed tokens as
// output (AddRequest::num_generated) and min_tokens what is left, so the answer equals
// the one an unmoved run gives; logprobs stay one per token.
TEST(ElasticTest, ProcessedRequestsMovedByAKillKeepTheirAnswer) {
  Server server(
      {"--ranks", "3", "--max-ranks", "3", "--min-ranks", "2", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  auto body_for = [&](size_t p) {
    return nlohmann::json{{"prompt", ref.prompts[p]}, {"max_tokens", 48},
                          {"temperature", 0},         {"frequency_penalty", 0.7},
                          {"presence_penalty", 0.4},  {"repetition_penalty", 1.3},
                          {"min_tokens", 40},         {"logprobs", 1}};
  };
  std::vector<std::vector<int>> want(ref.prompts.size());
  for (size_t p = 0; p < ref.prompts.size(); ++p) {
    const Answer a = post(server, "/v1/completions", body_for(p));
    ASSERT_EQ(a.status, 200) << a.body.dump();
    want[p] = a.body["choices"][0]["token_ids"].get<std::vector<int>>();
    ASSERT_GE(want[p].size(), 40u);
  }
  std::atomic<bool> done{false};
  std::atomic<int> ok{0}, wrong{0}, failed{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c) {
    clients.emplace_back([&, c] {
      for (size_t i = c; !done.load(); ++i) {
        const size_t p = i % ref.prompts.size();
        const Answer a = post(server, "/v1/completions", body_for(p));
        if (a.status != 200) {
          ++failed;
          continue;
        }
        const auto& choice = a.body["choices"][0];
        const bool same = choice["token_ids"].get<std::vector<int>>() == want[p] &&
                          choice["logprobs"]["tokens"].size() == want[p].size();
        ++(same ? ok : wrong);
      }
    });
  }
  pause_ms(400);
  kill(rank_pid(server, 1), SIGKILL);
  const bool healed = wait_status(
      server, [](const nlohmann::json& s) { return serving_with(s, 3) && last_kind(s) == "heal"; });
  pause_ms(300);
  done.store(true);
  for (auto& t : clients) t.join();
  ASSERT_TRUE(healed) << server.get_json("/v1/status").dump();
  EXPECT_GT(ok.load(), 10);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  httplib::Client c("127.0.0.1", server.port());
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  const size_t at = metrics->body.find("\nflexpert_requests_rerun_total ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GT(std::stod(metrics->body.substr(at + 31)), 0.0);  // Some request did move.
  EXPECT_EQ(server.stop(), 0);
}

TEST(ElasticTest, KilledWorkerWithReplicasNeedsNoReload) {
  Server server({"--ranks", "3", "--max-ranks", "3", "--threads-per-worker", "1", "--min-replicas",
                 "2", "--placement", "replicate:16"});
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  kill(rank_pid(server, 2), SIGKILL);
  ASSERT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 3) && last_kind(s) == "heal";
  })) << server.get_json("/v1/status").dump();
  EXPECT_TRUE(load.stop_and_check());
  const auto last = server.get_json("/v1/status")["reconfiguration"]["last_recovery"];
  EXPECT_EQ(last["kind"], "recovery");
  EXPECT_EQ(last["status"], "ok");
  EXPECT_EQ(last["reloaded_experts"], 0) << last.dump();
  EXPECT_FALSE(last.contains("replacements")) << last.dump();
}

TEST(ElasticTest, JoinerCrashingDuringPreparationRollsBack) {
  setenv("FLEXPERT_FAULT", "join-crash", 1);  // Inherited by the server and its workers.
  Server server({"--ranks", "2", "--max-ranks", "4", "--threads-per-worker", "1"});
  unsetenv("FLEXPERT_FAULT");
  ASSERT_TRUE(server.up());
  Load load(server, 4);
  pause_ms(300);
  const Answer a = post(server, "/v1/scale", {{"ranks", 3}});
  EXPECT_EQ(a.status, 503) << a.body.dump();
  pause_ms(300);
  EXPECT_TRUE(load.stop_and_check(10));
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["members"], nlohmann::json({0, 1}));
  EXPECT_EQ(status["phase"], "serving");
  EXPECT_EQ(status["reconfiguration"]["last"]["rolled_back"], true);
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(server.pid()).empty());
}

TEST(ElasticTest, SecondReconfigurationGetsConflict) {
  setenv("FLEXPERT_FAULT", "join-delay:1500", 1);
  Server server({"--ranks", "1", "--max-ranks", "3", "--threads-per-worker", "1"});
  unsetenv("FLEXPERT_FAULT");
  ASSERT_TRUE(server.up());
  std::thread first([&] { EXPECT_EQ(post(server, "/v1/scale", {{"ranks", 2}}).status, 200); });
  pause_ms(500);
  const auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["phase"], "scaling");
  EXPECT_EQ(status["reconfiguration"]["in_progress"], true);
  EXPECT_EQ(post(server, "/v1/scale", {{"ranks", 3}}).status, 409);
  EXPECT_EQ(post(server, "/v1/eplb/rebalance", nlohmann::json::object()).status, 409);
  // Requests are served during the preparation (never 503).
  const Reference ref = load_reference();
  EXPECT_EQ(server.complete(ref.prompts[0], 16), ref.greedy[0]);
  first.join();
  EXPECT_EQ(members(server), std::vector<int>({0, 1}));
}

long rss_kb(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  long value = 0;
  while (in >> key) {
    if (key == "VmRSS:") {
      in >> value;
      return value;
    }
    in.ignore(4096, '\n');
  }
  return 0;
}

TEST(ElasticTest, FiftyScaleCyclesLeakNothing) {
  Server server(
      {"--ranks", "1", "--max-ranks", "2", "--min-ranks", "1", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  long rss_start = 0;
  size_t shm_start = 0;
  for (int cycle = 0; cycle < 50; ++cycle) {
    ASSERT_EQ(post(server, "/v1/scale", {{"ranks", 2}}).status, 200) << "cycle " << cycle;
    ASSERT_EQ(post(server, "/v1/scale", {{"ranks", 1}}).status, 200) << "cycle " << cycle;
    if (cycle == 4) {  // After warm-up (allocator pools, ZeroMQ buffers).
      pause_ms(200);
      rss_start = rss_kb(server.pid());
      shm_start = shm_segments(server.pid()).size();
    }
  }
  EXPECT_EQ(server.complete(ref.prompts[1], 16), ref.greedy[1]);
  pause_ms(300);  // The last leaver exits in the background.
  EXPECT_EQ(child_processes(server.pid()), 1);
  EXPECT_EQ(shm_segments(server.pid()).size(), shm_start);
  const long rss_end = rss_kb(server.pid());
#ifndef __SANITIZE_ADDRESS__
  EXPECT_LT(rss_end, rss_start + 8 * 1024) << "front end RSS " << rss_start << " -> " << rss_end;
#else
  // ASan keeps freed memory in its quarantine (up to 256 MiB), so RSS says nothing
  // here; LeakSanitizer checks the server's heap when it exits (server.stop()).
  (void)rss_start;
  (void)rss_end;
#endif
  EXPECT_EQ(server.get_json("/v1/status")["epoch"], 101);
  EXPECT_EQ(server.stop(), 0);
}

TEST(ElasticTest, StopTheWorldBaselineRebuildsTheGroup) {
  Server server({"--ranks", "2", "--max-ranks", "3", "--threads-per-worker", "1", "--reconfigure",
                 "stop-the-world"});
  ASSERT_TRUE(server.up());
  const Answer a = post(server, "/v1/scale", {{"ranks", 3}});
  ASSERT_EQ(a.status, 200) << a.body.dump();
  EXPECT_EQ(a.body["mode"], "stop-the-world");
  EXPECT_EQ(members(server).size(), 3u);
  const Reference ref = load_reference();
  check_reference(server, ref, 2);
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
