// SPDX-License-Identifier: Apache-2.0
// The flexpert binary as a user runs it: output, JSON, exit codes for bad input,
// and synth -> generate round trips.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "../common/run_flexpert.h"

namespace {

using flexpert_test::CliRun;

CliRun run(const std::string& args) { return flexpert_test::run_flexpert(args); }

const std::string kModel = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

TEST(CliTest, GenerateMatchesReference) {
  std::ifstream in(kModel + "/reference.json");
  const auto ref = nlohmann::json::parse(in)["prompts"];
  for (const auto& p : ref) {
    std::string ids;
    for (int id : p["input_ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(id);
    CliRun r =
        run("generate --model " + kModel + " --prompt-ids " + ids + " --max-tokens 16 --json");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["choices"][0]["token_ids"], p["greedy"]);
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  }
  // Plain output: one comma-separated line per prompt.
  CliRun r = run("generate --model " + kModel + " --prompt-ids 197,435,400,195 --max-tokens 4");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "400,101,215,507\n");
}

TEST(CliTest, BadInputExitsWithTwoAndAMessage) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "usage"},
      {"frobnicate", "unknown command"},
      {"generate --model " + kModel, "--prompt-ids"},
      {"generate --model " + kModel + " --prompt-ids 1,x", "integer"},
      {"generate --model " + kModel + " --prompt-ids 1,512", "vocabulary"},
      {"generate --model " + kModel + " --prompt-ids 1 --max-tokens 0", "max_tokens"},
      {"generate --model " + kModel + " --prompt-ids 1 --bogus 3", "unknown flag"},
      {"generate --model /no/such/dir --prompt-ids 1", "/no/such/dir"},
      {"generate --model " + kModel + " --prompt-ids 1 --placement replicate:q", "placement"},
      {"synth --preset nope --out /tmp/x", "preset"},
      {"bench generate --batches 0", "batches"},
      {"bench generate --temperature -1", "--temperature"},
      {"bench elastic --device tpu", "--device"},
      {"bench elastic --gpus 2", "--gpus"},
      {"demo --cuda-dtype f16", "--cuda-dtype"},
      {"serve --model /no/such/dir --port 0", "/no/such/dir"},
      {"serve --model " + kModel + " --ranks 0 --port 0", "--ranks"},
      {"serve --model " + kModel + " --ranks 2 --max-ranks 1 --port 0", "--max-ranks"},
      {"serve --model " + kModel + " --placement replicate:x --port 0", "placement"},
      {"serve --model " + kModel + " --gpus 2 --port 0", "--device cuda"},
      {"serve --model " + kModel + " --device cuda --gpus 0 --port 0", "--gpus"},
      {"worker --rank 0", "--join"},
      {"bench serve --concurrency x", "integer"},
  };
  for (const auto& [args, needle] : cases) {
    CliRun r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
  }
}

TEST(CliTest, SynthThenGenerate) {
  const std::string dir = ::testing::TempDir() + "/flexpert-synth-tiny";
  std::filesystem::remove_all(dir);
  CliRun s = run("synth --preset tiny --out " + dir + " --layers 2 --dtype bf16 --seed 3");
  ASSERT_EQ(s.exit_code, 0) << s.out;
  CliRun g = run("generate --model " + dir + " --prompt-ids 1,2,3 --max-tokens 5 --json");
  ASSERT_EQ(g.exit_code, 0) << g.out;
  auto j = nlohmann::json::parse(g.out);
  EXPECT_EQ(j["choices"][0]["token_ids"].size(), 5u);
  // The same seed writes the same model: the same tokens again.
  std::filesystem::remove_all(dir);
  ASSERT_EQ(run("synth --preset tiny --out " + dir + " --layers 2 --dtype bf16 --seed 3").exit_code,
            0);
  CliRun g2 = run("generate --model " + dir + " --prompt-ids 1,2,3 --max-tokens 5 --json");
  EXPECT_EQ(nlohmann::json::parse(g2.out)["choices"], j["choices"]);
  std::filesystem::remove_all(dir);
}

// `synth --generation-config`: its eos_token_id extends the model's EOS set, which ends
// generation; a bad one fails the synth naming the field.
TEST(CliTest, SynthWritesGenerationConfig) {
  const std::string dir = ::testing::TempDir() + "/flexpert-synth-genconfig";
  std::filesystem::remove_all(dir);
  const std::string synth = "synth --preset tiny --out " + dir + " --layers 2 --seed 5";
  ASSERT_EQ(run(synth).exit_code, 0);
  CliRun g = run("generate --model " + dir + " --prompt-ids 1,2,3 --max-tokens 6 --json");
  ASSERT_EQ(g.exit_code, 0) << g.out;
  const auto tokens =
      nlohmann::json::parse(g.out)["choices"][0]["token_ids"].get<std::vector<int>>();
  ASSERT_EQ(tokens.size(), 6u);
  const int eos = tokens[2];
  const size_t first = std::find(tokens.begin(), tokens.end(), eos) - tokens.begin();
  CliRun s = run(synth + " --generation-config '{\"eos_token_id\": [" + std::to_string(eos) +
                 "], \"temperature\": 0.6}'");
  ASSERT_EQ(s.exit_code, 0) << s.out;
  g = run("generate --model " + dir + " --prompt-ids 1,2,3 --max-tokens 6 --json");
  ASSERT_EQ(g.exit_code, 0) << g.out;
  const auto choice = nlohmann::json::parse(g.out)["choices"][0];
  EXPECT_EQ(choice["token_ids"].get<std::vector<int>>(),
            std::vector<int>(tokens.begin(), tokens.begin() + first + 1));
  EXPECT_EQ(choice["finish_reason"], "stop");
  CliRun bad = run(synth + " --generation-config '{\"eos_token_id\": 99999}'");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.out.find("eos_token_id"), std::string::npos) << bad.out;
  std::filesystem::remove_all(dir);
}

TEST(CliTest, BenchGenerateWritesJson) {
  const std::string dir = ::testing::TempDir() + "/flexpert-bench";
  std::filesystem::remove_all(dir);
  const std::string json = dir + "/bench.json";
  std::filesystem::create_directories(dir);
  CliRun r = run("bench generate --preset tiny --layers 2 --cache " + dir +
                 " --batches 1,3 --prompt-len 8 --gen-tokens 4 --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::ifstream in(json);
  auto j = nlohmann::json::parse(in);
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_GT(j["runs"][1]["decode_tokens_per_s"].get<double>(), 0.0);
  // Sampled decoding: the draws are taken by the model (or on the host) and reported.
  for (const char* where : {"", " --sample-on-host"}) {
    CliRun t =
        run("bench generate --preset tiny --layers 2 --cache " + dir +
            " --batches 2 --prompt-len 8 --gen-tokens 4 --temperature 0.7 --json " + json + where);
    ASSERT_EQ(t.exit_code, 0) << t.out;
    std::ifstream tin(json);
    auto tj = nlohmann::json::parse(tin);
    EXPECT_EQ(tj["temperature"].get<double>(), 0.7);
    EXPECT_EQ(tj["sample_on_host"].get<bool>(), where[0] != '\0');
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
