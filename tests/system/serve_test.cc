// SPDX-License-Identifier: Apache-2.0
// `flexpert serve` as users run it: a front end process with N worker processes,
// spoken to over HTTP by a real client. Checks the Hugging Face reference tokens
// through 1-4 ranks (also with replicated experts and 32 requests in flight), a
// worker killed with SIGKILL, and a clean stop (no process, no shm segment left).
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "serve/bench_serve.h"
#include "server_fixture.h"

namespace {

using namespace flexpert_test;

class ServeRanksTest : public ::testing::TestWithParam<int> {};

TEST_P(ServeRanksTest, ReferenceTokensThroughHttp) {
  const int ranks = GetParam();
  Server server({"--ranks", std::to_string(ranks), "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  check_reference(server, ref, 1);
  check_reference(server, ref, 8);  // 32 requests in flight.
  auto status = server.get_json("/v1/status");
  ASSERT_TRUE(status.is_object());
  EXPECT_EQ(status["members"].size(), static_cast<size_t>(ranks));
  EXPECT_EQ(status["epoch"], 1);
  for (const auto& rank : status["ranks"]) {
    EXPECT_FALSE(rank.contains("total_exchange_ms")) << "timed without --step-timing";
  }
  EXPECT_EQ(server.stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ServeRanksTest, ::testing::Values(1, 2, 3, 4));

// `serve --step-timing`: every rank reports its MoE exchange time beside its step time, and
// `bench serve` (bench_serve()) turns the totals into a per-step breakdown. With peers the
// exchange takes time and never more than the step holding it; alone no row crosses a rank
// and it reports none (docs/benchmarks.md "Serving with GPU ranks").
TEST(ServeTest, StepTimingReportsTheExchangePerRank) {
  for (int ranks : {1, 2}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    Server server({"--ranks", std::to_string(ranks), "--threads-per-worker", "1", "--step-timing"});
    ASSERT_TRUE(server.up());
    flexpert::BenchServeOptions options;
    options.url = "http://127.0.0.1:" + std::to_string(server.port());
    options.concurrency = 4 * ranks;
    options.num_requests = 8 * ranks;
    options.prompt_len = 6;
    options.max_tokens = 8;
    auto result = flexpert::bench_serve(options);
    ASSERT_TRUE(result.ok()) << result.status().to_string();
    const nlohmann::json& r = result.value();
    EXPECT_EQ(r["failed"], 0) << r.dump(2);
    ASSERT_TRUE(r.contains("steps")) << r.dump(2);
    const nlohmann::json& steps = r["steps"];
    ASSERT_EQ(steps["ranks"].size(), static_cast<size_t>(ranks)) << steps.dump(2);
    for (const auto& rank : steps["ranks"]) {
      // Each request's 8 tokens take at least 7 decode steps after its prefill.
      EXPECT_GE(rank["steps"].get<int64_t>(), 8) << rank.dump();
      const double step_ms = rank["step_ms"].get<double>();
      const double exchange_ms = rank["exchange_ms"].get<double>();
      EXPECT_GT(step_ms, 0) << rank.dump();
      EXPECT_GE(rank["header_ms"].get<double>(), 0) << rank.dump();
      if (ranks == 1) {
        EXPECT_EQ(exchange_ms, 0) << rank.dump();
      } else {
        EXPECT_GT(exchange_ms, 0) << rank.dump();
      }
      EXPECT_LE(exchange_ms, step_ms) << rank.dump();
      EXPECT_DOUBLE_EQ(rank["exchange_share"].get<double>(), exchange_ms / step_ms);
    }
    EXPECT_TRUE(steps["all"].contains("exchange_ms")) << steps.dump(2);
    // The totals behind it, as /v1/status and /metrics show them.
    const nlohmann::json status = server.get_json("/v1/status");
    for (const auto& rank : status["ranks"]) {
      ASSERT_TRUE(rank.contains("total_exchange_ms")) << rank.dump();
      EXPECT_LE(rank["total_exchange_ms"].get<double>(), rank["total_step_ms"].get<double>());
    }
    const std::string table = flexpert::format_bench_table(r);
    EXPECT_NE(table.find("exch. ms"), std::string::npos) << table;
    EXPECT_EQ(server.stop(), 0);
  }
}

// `bench serve` against a server with keys: the API key for its completions, the admin key
// for the per-rank detail of /v1/status that its step breakdown reads.
TEST(ServeTest, BenchServeSendsTheServersKeys) {
  Server server({"--ranks", "2", "--threads-per-worker", "1", "--api-key", "open-sesame",
                 "--admin-key", "sesame"});
  ASSERT_TRUE(server.up());
  flexpert::BenchServeOptions options;
  options.url = "http://127.0.0.1:" + std::to_string(server.port());
  options.concurrency = 2;
  options.num_requests = 4;
  options.prompt_len = 4;
  options.max_tokens = 4;
  options.vocab_size = 100;
  auto refused = flexpert::bench_serve(options);
  ASSERT_TRUE(refused.ok()) << refused.status().to_string();
  EXPECT_EQ(refused.value()["failed"], 4) << "served without the API key";
  options.api_key = "open-sesame";
  auto served = flexpert::bench_serve(options);
  ASSERT_TRUE(served.ok()) << served.status().to_string();
  EXPECT_EQ(served.value()["failed"], 0) << served.value().dump(2);
  EXPECT_FALSE(served.value().contains("steps")) << "per-rank detail without the admin key";
  options.admin_key = "sesame";
  auto detailed = flexpert::bench_serve(options);
  ASSERT_TRUE(detailed.ok()) << detailed.status().to_string();
  EXPECT_EQ(detailed.value()["failed"], 0) << detailed.value().dump(2);
  ASSERT_TRUE(detailed.value().contains("steps")) << detailed.value().dump(2);
  EXPECT_EQ(detailed.value()["steps"]["ranks"].size(), 2u) << detailed.value().dump(2);
  EXPECT_EQ(server.stop(), 0);
}

TEST(ServeTest, ReplicatedExpertsAcrossRanks) {
  // 16 experts + 16 replicas over 4 ranks: hot and cold replicas on different ranks.
  Server server({"--ranks", "4", "--placement", "replicate:16:5", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["slots_per_rank"], 9);  // (16 + 16) / 4 + one spare slot for EPLB.
  check_reference(server, load_reference(), 8);
  EXPECT_EQ(server.stop(), 0);
}

// Sampling fields through the cluster protocol (AddRequest's SamplingParams, TokenBatch's
// logprobs) on 2 ranks: logprobs on leave greedy tokens as the reference, one entry per
// token; a logit_bias of +100 is obeyed.
TEST(ServeTest, LogprobsAndLogitBiasAcrossRanks) {
  Server server({"--ranks", "2", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  httplib::Client c("127.0.0.1", server.port());
  c.set_read_timeout(60, 0);
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    nlohmann::json body = {
        {"prompt", ref.prompts[i]}, {"max_tokens", 16}, {"temperature", 0}, {"logprobs", 3}};
    auto res = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "no answer");
    const auto choice = nlohmann::json::parse(res->body)["choices"][0];
    EXPECT_EQ(choice["token_ids"].get<std::vector<int>>(), ref.greedy[i]);
    ASSERT_EQ(choice["logprobs"]["tokens"].size(), ref.greedy[i].size());
    for (size_t t = 0; t < ref.greedy[i].size(); ++t) {
      EXPECT_EQ(choice["logprobs"]["tokens"][t], "token_id:" + std::to_string(ref.greedy[i][t]));
      EXPECT_EQ(choice["logprobs"]["top_logprobs"][t].size(), 3u);
    }
  }
  nlohmann::json body = {{"prompt", ref.prompts[0]},
                         {"max_tokens", 6},
                         {"temperature", 0.8},
                         {"logit_bias", {{"77", 100}}}};
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "no answer");
  EXPECT_EQ(nlohmann::json::parse(res->body)["choices"][0]["token_ids"].get<std::vector<int>>(),
            std::vector<int>(6, 77));
  EXPECT_EQ(server.stop(), 0);
}

TEST(ServeTest, HandStartedWorkersJoin) {
  // `flexpert worker --join HOST:PORT --rank R`, the path other hosts will use.
  Server server({"--ranks", "2", "--no-spawn"}, {0, 1});
  ASSERT_TRUE(server.up());
  check_reference(server, load_reference(), 2);
  auto status = server.get_json("/v1/status");
  EXPECT_EQ(status["members"].size(), 2u);
  EXPECT_EQ(server.stop(), 0);
}

TEST(ServeTest, KilledWorkerLeavesFrontEndServing) {
  Server server({"--ranks", "3", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  auto status = server.get_json("/v1/status");
  const int victim = status["ranks"][1]["pid"];
  const uint64_t incarnation = status["ranks"][1]["incarnation"];
  ASSERT_TRUE(process_alive(victim));
  kill(victim, SIGKILL);
  // The front end notices within its check interval: the rank is dead, or (the healer
  // is quick: it is dead for ~20 ms) already replaced by a new incarnation of its id.
  nlohmann::json rank1;
  for (int i = 0; i < 200; ++i) {
    status = server.get_json("/v1/status");
    rank1 = status["ranks"][1];
    if (rank1["state"] == "dead" || rank1["incarnation"].get<uint64_t>() > incarnation) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(rank1["state"] == "dead" || rank1["incarnation"].get<uint64_t>() > incarnation)
      << rank1.dump();
  auto health = server.client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_TRUE(health->status == 200 || health->status == 503) << health->status;
  // Requests get an answer (an error naming the lost rank, not a hang).
  nlohmann::json body = {{"prompt", {1, 2, 3}}, {"max_tokens", 4}, {"temperature", 0}};
  auto res = server.client().Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_TRUE(res->status == 200 || res->status >= 500) << res->status << " " << res->body;
  const pid_t front = server.pid();
  EXPECT_EQ(server.stop(), 0);
  EXPECT_TRUE(shm_segments(front).empty());
}

TEST(ServeTest, StopLeavesNoProcessOrSegment) {
  Server server({"--ranks", "2", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  auto status = server.get_json("/v1/status");
  std::vector<int> pids;
  for (const auto& r : status["ranks"]) pids.push_back(r["pid"]);
  const pid_t front = server.pid();
  EXPECT_FALSE(shm_segments(front).empty());
  // A long request in flight when the stop comes still gets a final response.
  std::thread slow([&] {
    nlohmann::json body = {{"prompt", {1, 2, 3}}, {"max_tokens", 900}, {"temperature", 0}};
    httplib::Client c("127.0.0.1", server.port());
    c.set_read_timeout(60, 0);
    auto res = c.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res) << "no final response";
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(server.stop(), 0);
  slow.join();
  for (int pid : pids) EXPECT_FALSE(process_alive(pid)) << "worker " << pid << " survived";
  EXPECT_TRUE(shm_segments(front).empty());
}

}  // namespace
