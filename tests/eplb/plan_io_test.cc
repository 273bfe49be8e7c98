// SPDX-License-Identifier: Apache-2.0
// The DeepSeek-compatible JSON interface: cases in, plans out, previous plans on another number
// of GPUs, and the errors malformed input gets.
#include "eplb/plan_io.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "eplb_test_util.h"

namespace flexpert::eplb {
namespace {

using nlohmann::json;

json case_json(const std::string& name, const std::vector<std::vector<double>>& weight,
               int replicas, int groups, int nodes, int gpus) {
  return {{"name", name},         {"weight", weight},   {"num_replicas", replicas},
          {"num_groups", groups}, {"num_nodes", nodes}, {"num_gpus", gpus}};
}

TEST(PlanIoTest, RoundTripBothPlanners) {
  const auto weight = testing::zipf_loads(3, 32, 1.0, 4);
  json input = {
      {"cases", {case_json("a", weight, 48, 4, 2, 8), case_json("b", weight, 40, 4, 3, 5)}}};
  auto cases = parse_cases(input.dump());
  ASSERT_TRUE(cases.ok()) << cases.status().to_string();
  ASSERT_EQ(cases->size(), 2u);
  EXPECT_EQ((*cases)[0].name, "a");
  EXPECT_EQ((*cases)[1].num_nodes, 3);
  EXPECT_TRUE((*cases)[0].prev_phy2log.empty());

  for (Planner planner : {Planner::kFlexpert, Planner::kDeepSeek}) {
    std::vector<CaseResult> results;
    for (const PlanCase& c : *cases) {
      RunOptions options;
      options.planner = planner;
      auto r = run_case(c, options);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      ASSERT_EQ(r->phy2log.size(), 3u);
      EXPECT_EQ(r->phy2log[0].size(), static_cast<size_t>(c.num_replicas));
      EXPECT_EQ(r->balancedness.size(), 3u);
      const int slots = c.num_replicas / c.num_gpus;
      EXPECT_EQ(r->moved_slots, count_receives({}, slots, r->phy2log, slots));  // no previous plan
      if (planner == Planner::kFlexpert) {  // the default format: DeepSeek's, no free slot
        for (const auto& row : r->phy2log) EXPECT_EQ(std::count(row.begin(), row.end(), -1), 0);
      }
      r->time_s = 0.25;
      results.push_back(*r);
    }
    const json out = json::parse(results_to_json(results));
    ASSERT_EQ(out["cases"].size(), 2u);
    EXPECT_EQ(out["cases"][0]["name"], "a");
    EXPECT_EQ(out["cases"][1]["phy2log"].get<std::vector<std::vector<int>>>(), results[1].phy2log);
    EXPECT_DOUBLE_EQ(out["cases"][0]["time_s"].get<double>(), 0.25);
    EXPECT_EQ(out["cases"][0]["moved_slots"].get<int64_t>(), results[0].moved_slots);
    EXPECT_EQ(out["cases"][0]["balancedness"].size(), 3u);
    EXPECT_EQ(out["cases"][0]["policy"].size(), 3u);
  }
}

TEST(PlanIoTest, PreviousPlanGivesZeroMovesOnSameLoads) {
  const auto weight = testing::zipf_loads(2, 32, 1.2, 8);
  PlanCase c;
  c.name = "x";
  c.weight = weight;
  c.num_replicas = 48;
  c.num_groups = 4;
  c.num_nodes = 2;
  c.num_gpus = 8;
  auto first = run_case(c, {});
  ASSERT_TRUE(first.ok());
  c.prev_phy2log = first->phy2log;
  auto second = run_case(c, {});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->moved_slots, 0);
  EXPECT_EQ(second->phy2log, first->phy2log);
  // DeepSeek ignores it, but its moves are counted against it.
  RunOptions ds;
  ds.planner = Planner::kDeepSeek;
  auto ds_plan = run_case(c, ds);
  ASSERT_TRUE(ds_plan.ok());
  EXPECT_EQ(ds_plan->moved_slots, count_receives(first->phy2log, 6, ds_plan->phy2log, 6));
}

TEST(PlanIoTest, PreviousPlanOnAnotherNumberOfGpus) {
  const auto weight = testing::zipf_loads(2, 12, 1.0, 2);
  PlanCase c;
  c.name = "resize";
  c.weight = weight;
  // Scale-down: 4 GPUs x 4 slots -> 3 GPUs x 4 slots. GPUs 0-2 keep their slots; GPU 3 is gone.
  std::vector<int> prev(16);
  for (int s = 0; s < 16; ++s) prev[s] = s % 12;
  c.prev_phy2log = {prev, prev};
  c.prev_num_gpus = 4;
  c.num_gpus = 3;
  c.num_replicas = 12;
  auto mapped = map_previous(c);
  ASSERT_EQ(mapped.size(), 2u);
  EXPECT_EQ(mapped[0], std::vector<int>(prev.begin(), prev.begin() + 12));
  EXPECT_EQ(previous_slots_per_gpu(c), 4);
  auto down = run_case(c, {});
  ASSERT_TRUE(down.ok()) << down.status().to_string();
  EXPECT_EQ(down->moved_slots, count_receives(mapped, 4, down->phy2log, 4));
  for (const auto& row : down->phy2log) {
    for (int e = 0; e < 12; ++e) EXPECT_EQ(std::count(row.begin(), row.end(), e), 1);
  }

  // Scale-up with fewer slots per GPU: 2 GPUs x 8 slots -> 4 GPUs x 4 slots. GPUs 0-1 keep all
  // their 8 experts as the current placement (the planner picks the 4 each keeps), GPUs 2-3
  // start empty; every slot gets an expert (DeepSeek's format).
  c.prev_num_gpus = 2;
  c.num_gpus = 4;
  c.num_replicas = 16;
  mapped = map_previous(c);
  EXPECT_EQ(previous_slots_per_gpu(c), 8);
  ASSERT_EQ(mapped[1].size(), 32u);
  for (int s = 0; s < 16; ++s) EXPECT_EQ(mapped[1][s], prev[s]);
  for (int s = 16; s < 32; ++s) EXPECT_EQ(mapped[1][s], -1);
  auto up = run_case(c, {});
  ASSERT_TRUE(up.ok()) << up.status().to_string();
  EXPECT_EQ(up->moved_slots, count_receives(mapped, 8, up->phy2log, 4));
  EXPECT_GE(up->moved_slots, 2 * 8);  // GPUs 2-3 receive all their slots, in both layers
  for (const auto& row : up->phy2log) {
    for (int e = 0; e < 12; ++e) EXPECT_GE(std::count(row.begin(), row.end(), e), 1);
    EXPECT_EQ(std::count(row.begin(), row.end(), -1), 0);
  }
  // With --format flexpert, slots may stay free.
  RunOptions keep_free;
  keep_free.format = Format::kFlexpert;
  auto free_up = run_case(c, keep_free);
  ASSERT_TRUE(free_up.ok());
  EXPECT_LE(free_up->moved_slots, up->moved_slots);
}

// "windows" in the file: the last is the case's weight, the others come before it, oldest first;
// planned_load folds them in order, w * earlier shares + (1 - w) * window shares, at the last
// window's total (checked against the recurrence written out by hand).
TEST(PlanIoTest, WindowsAreSmoothedOldestFirst) {
  auto cases = parse_cases(R"({"cases": [{"name": "w", "num_replicas": 2, "num_gpus": 1,
      "windows": [[[3, 1], [1, 1]], [[1, 1], [2, 2]], [[0, 4], [1, 3]]]}]})");
  ASSERT_TRUE(cases.ok()) << cases.status().to_string();
  const PlanCase& c = (*cases)[0];
  ASSERT_EQ(c.earlier_windows.size(), 2u);
  EXPECT_EQ(c.earlier_windows[0][0], (std::vector<double>{3, 1}));
  EXPECT_EQ(c.weight[1], (std::vector<double>{1, 3}));
  EXPECT_EQ(planned_load(c, 0), c.weight);  // no smoothing: the last window
  const std::vector<std::vector<double>> got = planned_load(c, 0.5);
  // Layer 0: shares 0.75/0.25, then 0.5/0.5 -> 0.625/0.375, then 0/1 -> 0.3125/0.6875, x 4.
  EXPECT_NEAR(got[0][0], 0.3125 * 4, 1e-12);
  EXPECT_NEAR(got[0][1], 0.6875 * 4, 1e-12);
  // Layer 1: shares 0.5/0.5, then 0.5/0.5 -> 0.5/0.5, then 0.25/0.75 -> 0.375/0.625, x 4.
  EXPECT_NEAR(got[1][0], 0.375 * 4, 1e-12);
  EXPECT_NEAR(got[1][1], 0.625 * 4, 1e-12);
}

TEST(PlanIoTest, MalformedInput) {
  const std::string ok_case =
      R"("name": "c", "weight": [[1, 2, 3, 4]], "num_replicas": 4, "num_gpus": 2)";
  auto with = [&](const std::string& extra) { return R"({"cases": [{)" + ok_case + extra + "}]}"; };
  ASSERT_TRUE(parse_cases(with("")).ok());
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not valid JSON"},
      {"{}", "\"cases\" array"},
      {R"({"cases": [1]})", "not an object"},
      {R"({"cases": [{"weight": [[1]], "num_replicas": 1, "num_gpus": 1}]})", "\"name\""},
      {R"({"cases": [{"name": "c", "num_replicas": 1, "num_gpus": 1}]})", "\"weight\""},
      {R"({"cases": [{"name": "c", "weight": [[1, 2], [3]], "num_replicas": 2, "num_gpus": 1}]})",
       "differ in length"},
      {R"({"cases": [{"name": "c", "weight": [[1, -2]], "num_replicas": 2, "num_gpus": 1}]})",
       ">= 0"},
      {R"({"cases": [{"name": "c", "weight": [["x"]], "num_replicas": 2, "num_gpus": 1}]})",
       ">= 0"},
      {R"({"cases": [{"name": "c", "weight": [[1, 2]], "num_gpus": 1}]})", "num_replicas"},
      {R"({"cases": [{"name": "c", "weight": [[1, 2]], "num_replicas": 2.5, "num_gpus": 1}]})",
       "positive integer"},
      {R"({"cases": [{"name": "c", "weight": [[1, 2]], "num_replicas": 3, "num_gpus": 2}]})",
       "multiple of num_gpus"},
      {R"({"cases": [{"name": "c", "weight": [[1, 2, 3]], "num_replicas": 2, "num_gpus": 2}]})",
       "smaller than the number of experts"},
      {with(R"(, "num_nodes": 0)"), "num_nodes"},
      {with(R"(, "prev_phy2log": [[0, 1, 2, 3], [0, 1, 2, 3]])"), "one row per layer"},
      {with(R"(, "prev_phy2log": [[0, 1, 2]])"), "multiple of prev_num_gpus"},
      {with(R"(, "prev_phy2log": [[0, 1, 2, 4]])"), "experts or -1"},
      {with(R"(, "prev_num_gpus": 2)"), "without"},
  };
  for (const auto& [text, expected] : cases) {
    auto parsed = parse_cases(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(parsed.status().message().find(expected), std::string::npos)
        << text << " -> " << parsed.status().message();
  }
  EXPECT_FALSE(parse_planner("random").ok());
}

TEST(PlanIoTest, PlannerErrorsNameTheCase) {
  auto cases = parse_cases(
      R"({"cases": [{"name": "tight", "weight": [[1, 2, 3, 4]], "num_replicas": 4, "num_gpus": 2}]})");
  ASSERT_TRUE(cases.ok());
  RunOptions options;
  options.min_replicas = 3;  // 3 replicas of each expert on 2 GPUs
  auto r = run_case((*cases)[0], options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("case 'tight'"), std::string::npos);
}

}  // namespace
}  // namespace flexpert::eplb
