// SPDX-License-Identifier: Apache-2.0
// Expert load balancing while serving: under a skewed workload with requests in
// flight, rebalances move expert weights between ranks and every completion
// still equals the Hugging Face reference; no request fails.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>

#include "elastic_util.h"
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

// One expert slot of testdata/qwen3moe-tiny on a CPU rank (hidden 128, moe_intermediate 64,
// f32): what one expert copy moves.
constexpr uint64_t kSlotBytes = 3 * 128 * 64 * sizeof(float);

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
    // Every slot copy moves one expert's slot: gate, up and down of 128 x 64 in f32.
    EXPECT_EQ(report["moved_bytes"].get<uint64_t>(),
              report["moved_slots"].get<uint64_t>() * kSlotBytes)
        << report.dump();
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

// The test's own reference: mean / max load of `ranks`, an expert's load split evenly over its
// replicas on them (rank r holds slots [r * spr, (r + 1) * spr)).
double balancedness_by_hand(const std::vector<double>& load, const std::vector<int>& map, int ranks,
                            int spr) {
  std::vector<int> replicas(load.size(), 0);
  for (size_t s = 0; s < static_cast<size_t>(ranks * spr); ++s) {
    if (map[s] >= 0) ++replicas[static_cast<size_t>(map[s])];
  }
  std::vector<double> rank_load(static_cast<size_t>(ranks), 0);
  for (size_t s = 0; s < static_cast<size_t>(ranks * spr); ++s) {
    if (map[s] >= 0) {
      rank_load[s / spr] +=
          load[static_cast<size_t>(map[s])] / replicas[static_cast<size_t>(map[s])];
    }
  }
  double sum = 0, max = 0;
  for (double x : rank_load) {
    sum += x;
    max = std::max(max, x);
  }
  return max > 0 ? sum / ranks / max : 1.0;
}

// A scale plans on the load the rebalances smooth (window shares averaged with the kept ones), not
// on the last window, and the skip threshold, which stops every rebalance here, does not stop it.
TEST(EplbServeTest, MembershipChangesPlanOnTheSmoothedLoad) {
  Server server({"--ranks", "2", "--max-ranks", "3", "--threads-per-worker", "1", "--eplb-window-s",
                 "600", "--eplb-smoothing", "0.8", "--eplb-min-gain", "2", "--admin-key",
                 "sesame"});
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  ASSERT_GE(ref.prompts.size(), 2u);
  auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(800)); };
  // One prompt only, then a rebalance: the kept shares are that prompt's routing.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(server.complete(ref.prompts[0], 16), ref.greedy[0]);
  settle();
  const auto skipped = post_json(server, "/v1/eplb/rebalance", "sesame");
  ASSERT_EQ(skipped["_status"], 200) << skipped.dump();
  EXPECT_EQ(skipped["moved_bytes"].get<uint64_t>(), 0u) << skipped.dump();
  // Then the other prompts: the window now differs from the kept shares.
  for (size_t p = 1; p < ref.prompts.size(); ++p) {
    EXPECT_EQ(server.complete(ref.prompts[p], 16), ref.greedy[p]);
  }
  settle();
  const auto before = server.get_json("/v1/eplb");
  std::map<int, std::vector<double>> planned;  // layer -> smoothed load
  double largest_change = 0;
  for (const auto& layer : before["layers"]) {
    const auto window = layer["window_load"].get<std::vector<double>>();
    const auto shares = layer["smoothed_shares"].get<std::vector<double>>();
    const auto got = layer["planned_load"].get<std::vector<double>>();
    ASSERT_EQ(shares.size(), window.size()) << layer.dump();
    ASSERT_EQ(got.size(), window.size());
    double total = 0;
    for (double x : window) total += x;
    ASSERT_GT(total, 0) << layer.dump();
    for (size_t e = 0; e < window.size(); ++e) {
      const double want = (0.8 * shares[e] + 0.2 * window[e] / total) * total;
      EXPECT_NEAR(got[e], want, 1e-9 * total) << "layer " << layer["layer"] << " expert " << e;
      largest_change = std::max(largest_change, std::abs(want - window[e]) / total);
    }
    planned[layer["layer"].get<int>()] = got;
  }
  EXPECT_GT(largest_change, 0.01) << "the smoothing changed nothing: the test proves nothing";

  // Scale-up: its per-layer balancedness is that of its placement on the smoothed load + 1 per
  // expert (the prior a scale adds); copied to the joiner despite --eplb-min-gain.
  auto check_scale = [&](const nlohmann::json& body, int ranks, nlohmann::json* report) {
    const Answer a = post(server, "/v1/scale", body, "sesame");
    *report = a.body;
    ASSERT_EQ(a.status, 200) << a.body.dump();
    EXPECT_FALSE(a.body.contains("converge_status")) << a.body.dump();
    const auto after = server.get_json("/v1/eplb");
    const int spr = after["slots_per_rank"];
    const auto& planned_b = a.body["balancedness_planned"];
    for (const auto& layer : after["layers"]) {
      const int l = layer["layer"];
      std::vector<double> load = planned[l];
      for (double& x : load) x += 1.0;
      const auto map = layer["slot_to_expert"].get<std::vector<int>>();
      EXPECT_NEAR(planned_b[static_cast<size_t>(l)].get<double>(),
                  balancedness_by_hand(load, map, ranks, spr), 1e-9)
          << "layer " << l << " " << a.body.dump();
      for (size_t s = static_cast<size_t>(ranks * spr); s < map.size(); ++s) {
        EXPECT_EQ(map[s], -1) << "slot " << s << " of a non-member";
      }
    }
  };
  nlohmann::json up, down;
  check_scale({{"ranks", 3}}, 3, &up);
  EXPECT_GT(up.value("copied_bytes", int64_t{0}), 0) << up.dump();
  EXPECT_EQ(up["copied_bytes"].get<uint64_t>(), up["expert_copies"].get<uint64_t>() * kSlotBytes);
  EXPECT_EQ(up["converge_moved_bytes"].get<uint64_t>(),
            up["converge_moved_slots"].get<uint64_t>() * kSlotBytes);
  check_scale({{"remove", {2}}}, 2, &down);
  for (size_t p = 0; p < ref.prompts.size(); ++p) {
    EXPECT_EQ(server.complete(ref.prompts[p], 16), ref.greedy[p]);
  }
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
