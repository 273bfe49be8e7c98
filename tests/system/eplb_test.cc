// SPDX-License-Identifier: Apache-2.0
// Expert load balancing while serving: under a skewed workload with requests in
// flight, rebalances move expert weights between ranks and every completion
// still equals the Hugging Face reference; no request fails.
#include <atomic>

#include "server_fixture.h"

namespace {

using namespace flexpert_test;

nlohmann::json post_json(Server& server, const std::string& path, const std::string& key = "") {
  httplib::Headers headers;
  if (!key.empty()) headers.emplace("Authorization", "Bearer " + key);
  auto res = server.client().Post(path.c_str(), headers, "{}", "application/json");
  if (!res) return nullptr;
  auto j = nlohmann::json::parse(res->body, nullptr, false);
  j["_status"] = res->status;
  return j;
}

TEST(EplbServeTest, RebalancesUnderLoadKeepReferenceTokens) {
  Server server({"--ranks", "3", "--threads-per-worker", "1", "--eplb-spare-slots", "2",
                 "--eplb-window-s", "2", "--admin-key", "sesame"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  std::atomic<bool> done{false};
  std::atomic<int> completed{0}, wrong{0};
  // Skewed load that drifts: each client thread repeats one prompt (prompts route
  // to different experts), and the mix changes over time.
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; !done.load(); ++i) {
        const size_t p = (c + (i / 8)) % ref.prompts.size();
        if (server.complete(ref.prompts[p], 16) == ref.greedy[p]) {
          ++completed;
        } else {
          ++wrong;
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Without the key: 401, nothing moves.
  EXPECT_EQ(post_json(server, "/v1/eplb/rebalance")["_status"], 401);
  uint64_t moved = 0;
  for (int round = 0; round < 5; ++round) {
    auto report = post_json(server, "/v1/eplb/rebalance", "sesame");
    EXPECT_EQ(report["_status"], 200) << report.dump();
    if (report["_status"] != 200) break;
    EXPECT_EQ(report["status"], "ok");
    // The ranks step under this load: the longest step reported around the moves.
    EXPECT_GT(report["max_step_ms_during"].get<double>(), 0.0) << report.dump();
    // The movers' copy time of what moved.
    if (report["moved_bytes"].get<uint64_t>() > 0) {
      EXPECT_GT(report["pull_s"].get<double>(), 0.0);
    }
    moved += report["moved_bytes"].get<uint64_t>();
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
  }
  done.store(true);
  for (auto& t : clients) t.join();
  EXPECT_GT(moved, 0u) << "no rebalance moved any expert";
  EXPECT_GT(completed.load(), 20);
  EXPECT_EQ(wrong.load(), 0);
  auto status = server.get_json("/v1/eplb");
  EXPECT_GE(status["rebalances"].get<int>(), 5);
  EXPECT_GT(status["map_version"].get<int>(), 0);
  for (const auto& layer : status["layers"]) {
    // Every expert keeps a replica; none twice on one rank.
    const auto map = layer["slot_to_expert"].get<std::vector<int>>();
    const int spr = status["slots_per_rank"];
    std::vector<int> count(16, 0);
    for (size_t s = 0; s < map.size(); ++s) {
      if (map[s] < 0) continue;
      ++count[map[s]];
      for (size_t t = s + 1;
           t < map.size() && static_cast<int>(t) / spr == static_cast<int>(s) / spr; ++t) {
        EXPECT_NE(map[s], map[t]) << "expert twice on rank " << s / spr;
      }
    }
    for (int e = 0; e < 16; ++e) EXPECT_GE(count[e], 1) << "expert " << e;
  }
  // Drain with nothing in flight answers at once; a cancel during a rebalance
  // stops it between map switches and leaves a valid, serving placement.
  auto drained = post_json(server, "/v1/eplb/drain", "sesame");
  EXPECT_EQ(drained["_status"], 200);
  EXPECT_EQ(drained["was_running"], false);
  std::thread rebalancer([&] { post_json(server, "/v1/eplb/rebalance", "sesame"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  httplib::Headers auth = {{"Authorization", "Bearer sesame"}};
  auto cancel =
      server.client().Post("/v1/eplb/drain", auth, R"({"cancel": true})", "application/json");
  rebalancer.join();
  ASSERT_TRUE(cancel);
  EXPECT_EQ(cancel->status, 200);
  EXPECT_EQ(server.complete(ref.prompts[0], 16), ref.greedy[0]);
  // The load statistics are exposed.
  auto metrics = server.client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("flexpert_slot_tokens_total{layer=\"0\""), std::string::npos);
  EXPECT_NE(metrics->body.find("flexpert_eplb_rebalances_total"), std::string::npos);
  EXPECT_EQ(server.stop(), 0);
}

// With smoothing and a skip threshold above any possible gain (balancedness is <= 1): the
// rebalances run and plan, but move nothing.
TEST(EplbServeTest, AutomaticRebalancing) {
  Server server({"--ranks", "2", "--threads-per-worker", "1", "--eplb", "--eplb-interval-s", "0.3",
                 "--eplb-window-s", "1", "--eplb-smoothing", "0.5", "--eplb-min-gain", "2"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  for (int round = 0; round < 6; ++round) {
    check_reference(server, ref, 2);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  auto status = server.get_json("/v1/eplb");
  EXPECT_GE(status["rebalances"].get<int>(), 1);
  EXPECT_EQ(status["smoothing"].get<double>(), 0.5);
  const auto& last = status["last_rebalance"];
  EXPECT_EQ(last["moved_bytes"].get<uint64_t>(), 0u) << last.dump();
  EXPECT_TRUE(last["skipped"].get<bool>() || last["planned_moved_slots"].get<int64_t>() == 0)
      << last.dump();
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
