// SPDX-License-Identifier: Apache-2.0
// `flexpert eplb plan` as a user runs it: files in and out, both planners, load windows with
// smoothing, the skip threshold, exit code 2 and a message for bad input.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "../common/run_flexpert.h"
#include "../common/scratch_dir.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using flexpert_test::CliRun;

CliRun run(const std::string& args) { return flexpert_test::run_flexpert(args); }

class EplbCliTest : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& text) {
    return scratch_.write(name, text);
  }
  flexpert_test::ScratchDir scratch_{"flexpert_eplb_cli"};
  const fs::path& dir_ = scratch_.path();
};

const char kCases[] = R"({"cases": [
  {"name": "readme", "weight": [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                                [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]],
   "num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 8},
  {"name": "shrink", "weight": [[5, 1, 1, 1, 1, 1]], "num_replicas": 9, "num_groups": 1,
   "num_nodes": 1, "num_gpus": 3, "prev_phy2log": [[0, 1, 2, 3, 4, 5, 0, 0]], "prev_num_gpus": 4}
]})";

TEST_F(EplbCliTest, PlansWithBothPlanners) {
  const std::string input = write("cases.json", kCases);
  const std::string output = (dir_ / "plans.json").string();
  CliRun r = run("eplb plan --input " + input + " --output " + output);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("readme"), std::string::npos);  // the summary table
  std::ifstream in(output);
  const json plans = json::parse(in);
  ASSERT_EQ(plans["cases"].size(), 2u);
  EXPECT_EQ(plans["cases"][0]["name"], "readme");
  EXPECT_EQ(plans["cases"][0]["phy2log"].size(), 2u);
  EXPECT_EQ(plans["cases"][0]["phy2log"][0].size(), 16u);
  EXPECT_EQ(plans["cases"][1]["phy2log"][0].size(), 9u);
  EXPECT_GE(plans["cases"][0]["time_s"].get<double>(), 0.0);

  r = run("eplb plan --planner deepseek --input " + input + " --output -");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json ds = json::parse(r.out.substr(r.out.find("{\"cases\"")));
  EXPECT_EQ(ds["cases"][0]["phy2log"][0],
            json::parse("[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]"));
  EXPECT_EQ(ds["cases"][0]["policy"][0], "hierarchical");

  r = run("eplb plan --policy global --input " + input + " --output " + output);
  ASSERT_EQ(r.exit_code, 0) << r.out;
}

// DeepSeek's format (the default) fills every slot; flexpert's may leave some free (-1), here
// the shrink case's: 9 slots for 6 experts where extra replicas gain nothing.
TEST_F(EplbCliTest, FormatDeepSeekFillsEverySlot) {
  const std::string input = write("cases.json", kCases);
  auto free_slots = [&](const std::string& flags) {
    CliRun r = run("eplb plan --input " + input + " --output - --threads 2 " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    const json plans = json::parse(r.out.substr(r.out.find("{\"cases\"")));
    int n = 0;
    for (const auto& c : plans["cases"]) {
      for (const auto& row : c["phy2log"])
        n += static_cast<int>(std::count(row.begin(), row.end(), -1));
    }
    return n;
  };
  EXPECT_EQ(free_slots(""), 0);
  EXPECT_EQ(free_slots("--format deepseek"), 0);
  EXPECT_EQ(free_slots("--tolerance-after-change"), 0);  // the second case changes GPU count
  EXPECT_GT(free_slots("--format flexpert"), 0);
}

json plans_of(const CliRun& r) {
  const size_t at = r.out.find("{\"cases\"");
  if (at == std::string::npos) ADD_FAILURE() << r.out;
  return json::parse(r.out.substr(at == std::string::npos ? 0 : at));
}

// The test's own reference: mean / max GPU load, an expert's load split evenly over its
// replicas (GPU g holds slots [g * slots, (g + 1) * slots)).
double balancedness_by_hand(const std::vector<double>& load, const std::vector<int>& phy2log,
                            int num_gpus) {
  const size_t slots = phy2log.size() / static_cast<size_t>(num_gpus);
  std::vector<double> gpu(static_cast<size_t>(num_gpus), 0);
  for (size_t s = 0; s < phy2log.size(); ++s) {
    const int e = phy2log[s];
    if (e < 0) continue;
    gpu[s / slots] += load[static_cast<size_t>(e)] /
                      static_cast<double>(std::count(phy2log.begin(), phy2log.end(), e));
  }
  double sum = 0, max = 0;
  for (double x : gpu) {
    sum += x;
    max = std::max(max, x);
  }
  return max > 0 ? sum / static_cast<double>(num_gpus) / max : 1.0;
}

// Two windows: expert 0 was hot, then expert 5. Smoothed with weight 0.75 (shares of each
// window: w * earlier + (1 - w) * last, scaled to the last window's total), expert 0 is still
// the hottest, so it gets the most replicas; on the last window alone expert 5 does.
TEST_F(EplbCliTest, SmoothingPlansOnTheWindowsAveraged) {
  const std::vector<double> w1 = {100, 4, 4, 4, 4, 4}, w2 = {4, 4, 4, 4, 4, 100};
  const json one = {
      {"name", "drift"}, {"windows", {{w1}, {w2}}}, {"num_replicas", 12}, {"num_gpus", 6}};
  const std::string input = write("windows.json", json{{"cases", {one}}}.dump());
  const double w = 0.75;
  std::vector<double> smoothed(6);
  for (size_t e = 0; e < 6; ++e) smoothed[e] = (w * w1[e] / 120 + (1 - w) * w2[e] / 120) * 120;

  auto replicas = [](const json& row, int e) { return std::count(row.begin(), row.end(), e); };
  for (const char* format : {"deepseek", "flexpert"}) {
    SCOPED_TRACE(format);
    CliRun r = run("eplb plan --smoothing 0.75 --output - --format " + std::string(format) +
                   " --input " + input);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const json c = plans_of(r)["cases"][0];
    const std::vector<int> row = c["phy2log"][0].get<std::vector<int>>();
    EXPECT_GT(replicas(c["phy2log"][0], 0), replicas(c["phy2log"][0], 5)) << c.dump();
    // Balancedness is scored on the smoothed load, not on either window.
    EXPECT_NEAR(c["balancedness"][0].get<double>(), balancedness_by_hand(smoothed, row, 6), 1e-9);
    EXPECT_FALSE(c["skipped"].get<bool>());
  }
  // The DeepSeek port plans on the smoothed load as well.
  CliRun ds = run("eplb plan --planner deepseek --smoothing 0.75 --output - --input " + input);
  ASSERT_EQ(ds.exit_code, 0) << ds.out;
  const json ds_row = plans_of(ds)["cases"][0]["phy2log"][0];
  EXPECT_GT(replicas(ds_row, 0), replicas(ds_row, 5)) << ds_row.dump();

  // Without smoothing the last window alone counts: expert 5 is the hot one.
  CliRun last = run("eplb plan --output - --input " + input);
  ASSERT_EQ(last.exit_code, 0) << last.out;
  const json c = plans_of(last)["cases"][0];
  EXPECT_GT(replicas(c["phy2log"][0], 5), replicas(c["phy2log"][0], 0)) << c.dump();
  EXPECT_NEAR(c["balancedness"][0].get<double>(),
              balancedness_by_hand(w2, c["phy2log"][0].get<std::vector<int>>(), 6), 1e-9);

  // One window ("weight", the single-window format) smoothed is that window.
  const json single = {{"name", "one"}, {"weight", {w2}}, {"num_replicas", 12}, {"num_gpus", 6}};
  const std::string one_window = write("one.json", json{{"cases", {single}}}.dump());
  CliRun a = run("eplb plan --output - --input " + one_window);
  CliRun b = run("eplb plan --smoothing 0.5 --output - --input " + one_window);
  ASSERT_EQ(a.exit_code, 0) << a.out;
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_EQ(plans_of(a)["cases"][0]["phy2log"], plans_of(b)["cases"][0]["phy2log"]);
  EXPECT_EQ(plans_of(b)["cases"][0]["phy2log"], c["phy2log"]);
}

// prev_phy2log puts experts 0 and 1 (70 of 100) on GPU 0: balancedness 50 / 70. A plan that
// pairs 0 with 3 and 1 with 2 reaches 1; the gain is checked by hand, then used as threshold.
TEST_F(EplbCliTest, MinGainKeepsThePreviousPlan) {
  const std::vector<double> load = {40, 30, 20, 10};
  const std::vector<int> prev = {0, 1, 2, 3};
  const json one = {{"name", "skew"},
                    {"weight", {load}},
                    {"num_replicas", 4},
                    {"num_gpus", 2},
                    {"prev_phy2log", {prev}}};
  const std::string input = write("skew.json", json{{"cases", {one}}}.dump());
  const std::string output = (dir_ / "plans.json").string();

  CliRun r = run("eplb plan --output - --input " + input);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json planned = plans_of(r)["cases"][0];
  const std::vector<int> row = planned["phy2log"][0].get<std::vector<int>>();
  const double gain = balancedness_by_hand(load, row, 2) - balancedness_by_hand(load, prev, 2);
  ASSERT_GT(gain, 0.2);  // 1 - 50 / 70
  EXPECT_NEAR(planned["balancedness_gain"].get<double>(), gain, 1e-9);
  EXPECT_FALSE(planned["skipped"].get<bool>());
  EXPECT_GT(planned["moved_slots"].get<int>(), 0);

  // Above the gain: exit 0, the table says so, the file keeps prev_phy2log and says skipped.
  r = run("eplb plan --min-gain " + std::to_string(gain + 0.05) + " --output " + output +
          " --input " + input);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("skipped"), std::string::npos) << r.out;
  std::ifstream in(output);
  const json kept = json::parse(in)["cases"][0];
  EXPECT_TRUE(kept["skipped"].get<bool>());
  EXPECT_EQ(kept["phy2log"][0].get<std::vector<int>>(), prev);
  EXPECT_EQ(kept["moved_slots"].get<int>(), 0);
  EXPECT_NEAR(kept["balancedness"][0].get<double>(), balancedness_by_hand(load, prev, 2), 1e-9);

  // Below it: planned as without a threshold.
  r = run("eplb plan --min-gain " + std::to_string(gain - 0.05) + " --output - --input " + input);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("skipped:"), std::string::npos) << r.out;
  EXPECT_FALSE(plans_of(r)["cases"][0]["skipped"].get<bool>());
  EXPECT_EQ(plans_of(r)["cases"][0]["phy2log"], planned["phy2log"]);
}

TEST_F(EplbCliTest, BadInputExitsWithTwoAndAMessage) {
  const std::string good = write("good.json", kCases);
  const std::string bad = write("bad.json", R"({"cases": [{"name": "x"}]})");
  const std::string both = write("both.json", R"({"cases": [{"name": "x", "weight": [[1, 2]],
      "windows": [[[1, 2]]], "num_replicas": 2, "num_gpus": 1}]})");
  const std::string ragged = write("ragged.json", R"({"cases": [{"name": "x",
      "windows": [[[1, 2]], [[1, 2, 3]]], "num_replicas": 3, "num_gpus": 1}]})");
  const std::string out = (dir_ / "o.json").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"eplb", "usage"},
      {"eplb frobnicate", "unknown subcommand"},
      {"eplb plan --output " + out, "--input"},
      {"eplb plan --input " + good, "--output"},
      {"eplb plan --input /nonexistent/cases.json --output " + out, "cannot read"},
      {"eplb plan --input " + bad + " --output " + out, "\"weight\""},
      {"eplb plan --input " + good + " --output " + out + " --planner magic", "planner"},
      {"eplb plan --input " + good + " --output " + out + " --policy best", "policy"},
      {"eplb plan --input " + good + " --output " + out + " --tolerance -1", "tolerance"},
      {"eplb plan --input " + good + " --output " + out + " --min-replicas 0", "min-replicas"},
      {"eplb plan --input " + good + " --output " + out + " --bogus 1", "unknown flag"},
      {"eplb plan --input " + good + " --output " + out + " --format csv", "format"},
      {"eplb plan --input " + good + " --output " + out + " --threads -1", "threads"},
      {"eplb plan --input " + good + " --output " + out + " --smoothing 1", "--smoothing"},
      {"eplb plan --input " + good + " --output " + out + " --smoothing -0.5", "--smoothing"},
      {"eplb plan --input " + good + " --output " + out + " --smoothing half", "smoothing"},
      {"eplb plan --input " + good + " --output " + out + " --min-gain -0.1", "--min-gain"},
      {"eplb plan --input " + good + " --output " + out + " --min-gain 2", "--min-gain"},
      {"eplb plan --input " + good + " --output " + out + " --min-gain 0.1 --planner deepseek",
       "--planner flexpert"},
      {"eplb plan --input " + both + " --output " + out, "either"},
      {"eplb plan --input " + ragged + " --output " + out, "shape"},
  };
  for (const auto& [args, expected] : cases) {
    CliRun r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(expected), std::string::npos) << args << "\n" << r.out;
  }
  CliRun help = run("eplb plan --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--planner"), std::string::npos);
}

}  // namespace
