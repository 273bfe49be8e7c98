// SPDX-License-Identifier: Apache-2.0
// `flexpert eplb plan` as a user runs it: files in and out, both planners, exit code 2 and a
// message for bad input.
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

TEST_F(EplbCliTest, BadInputExitsWithTwoAndAMessage) {
  const std::string good = write("good.json", kCases);
  const std::string bad = write("bad.json", R"({"cases": [{"name": "x"}]})");
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
