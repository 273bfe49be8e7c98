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
const std::string kDeepseekV3 = std::string(FLEXPERT_TESTDATA_DIR) + "/configs/deepseek-v3";

TEST(CliTest, GenerateMatchesReference) {
  std::ifstream in(kModel + "/reference.json");
  const auto ref = nlohmann::json::parse(in)["prompts"];
  for (const auto& p : ref) {
    std::string ids;
    for (int id : p["input_ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(id);
    CliRun r = flexpert_test::run_flexpert(
        "generate --model " + kModel + " --prompt-ids " + ids + " --max-tokens 16 --json",
        /*stdout_only=*/true);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["choices"][0]["token_ids"], p["greedy"]);
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  }
  // Plain output: one comma-separated line per prompt.
  CliRun r = flexpert_test::run_flexpert(
      "generate --model " + kModel + " --prompt-ids 197,435,400,195 --max-tokens 4",
      /*stdout_only=*/true);
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
      {"generate --model " + kModel + " --prompt-ids 1 --quantization fp8", "dequantizes"},
      {"generate --model " + kModel + " --prompt-ids 1 --quantization int4", "--quantization"},
      {"synth --preset nope --out /tmp/x", "preset"},
      {"bench generate --batches 0", "batches"},
      {"bench generate --temperature -1", "--temperature"},
      {"bench generate --quantization bf16,int4", "--quantization"},
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
      {"worker --join 127.0.0.1:1 --rank first", "--rank"},
      {"serve --model " + kModel + " --transport tcp --port 0", "--transport"},
      {"serve --model " + kModel + " --quantization fp8 --port 0", "dequantizes"},
      {"serve --model " + kModel + " --local --device cuda --quantization fp8 --port 0",
       "dequantizes"},
      {"serve --model " + kModel + " --device cuda --quantization int4 --port 0", "--quantization"},
      {"bench serve --concurrency x", "integer"},
      {"plan-memory --ranks 8", "--model"},
      {"plan-memory --model /no/such/dir", "/no/such/dir"},
      {"plan-memory --model " + kDeepseekV3 + " --ranks 0", "--ranks"},
      {"plan-memory --model " + kDeepseekV3 + " --ranks 2 --max-ranks 1", "--max-ranks"},
      {"plan-memory --model " + kDeepseekV3 + " --ranks 2 --spare-ranks 1", "--spare-ranks"},
      {"plan-memory --model " + kDeepseekV3 + " --quantization int4", "--quantization"},
      {"plan-memory --model " + kDeepseekV3 + " --device cpu --quantization fp8", "dequantizes"},
      {"plan-memory --model " + kDeepseekV3 + " --device tpu", "--device"},
      {"plan-memory --model " + kDeepseekV3 + " --gpu-memory-gib -1", "--gpu-memory-gib"},
      {"plan-memory --model " + kDeepseekV3 + " --max-context x", "integer"},
      {"plan-memory --model " + kDeepseekV3 + " --ranks 8 --slots-per-rank 31", "cannot hold"},
      {"plan-memory --model " + kDeepseekV3 + " --bogus 1", "unknown flag"},
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
  // --quantization: a list loads and measures the model once per item (here a block-FP8
  // synthesis, dequantized each time: the CPU has no fp8 experts and says so).
  const std::string fp8 = "bench generate --preset deepseek-tiny --layers 2 --fp8 --cache " + dir +
                          " --batches 1,2 --prompt-len 4 --gen-tokens 2";
  CliRun q = run(fp8 + " --quantization bf16,bf16 --json " + json);
  ASSERT_EQ(q.exit_code, 0) << q.out;
  std::ifstream qin(json);
  auto qj = nlohmann::json::parse(qin);
  EXPECT_EQ(qj["quantization"], "bf16,bf16");
  ASSERT_EQ(qj["runs"].size(), 4u);
  EXPECT_EQ(qj["runs"][3]["batch"], 2);
  EXPECT_EQ(qj["runs"][3]["quantization"], "bf16");
  CliRun cpu_fp8 = run(fp8 + " --quantization bf16,fp8");
  EXPECT_EQ(cpu_fp8.exit_code, 2) << cpu_fp8.out;
  EXPECT_NE(cpu_fp8.out.find("dequantizes"), std::string::npos) << cpu_fp8.out;
  std::filesystem::remove_all(dir);
}

// bench generate --agreement: the greedy tokens of 64 prompts per item against a reference.
// The CPU dequantizes a block-FP8 checkpoint at load, so it must agree with its dequantized
// twin (synth --fp8-dequantized) on every prompt; the unquantized model of the same seed
// (weights off by FP8's rounding) and a model of another seed must not.
TEST(CliTest, BenchAgreementComparesGreedyTokens) {
  const std::string dir = ::testing::TempDir() + "/flexpert-agreement";
  std::filesystem::remove_all(dir);
  const std::string synth = "synth --preset tiny --layers 2 --seed 3";
  ASSERT_EQ(run(synth + " --fp8 --out " + dir + "/fp8").exit_code, 0);
  ASSERT_EQ(run(synth + " --fp8 --fp8-dequantized --out " + dir + "/twin").exit_code, 0);
  ASSERT_EQ(run(synth + " --out " + dir + "/unquantized").exit_code, 0);
  ASSERT_EQ(run("synth --preset tiny --layers 2 --seed 4 --out " + dir + "/other").exit_code, 0);
  const std::string json = dir + "/agreement.json";
  auto agreement = [&](const std::string& reference) {
    CliRun r = run("bench generate --model " + dir + "/fp8 --batches 1 --prompt-len 16 " +
                   "--gen-tokens 32 --agreement 64 --reference " + dir + "/" + reference +
                   " --quantization bf16,bf16 --json " + json);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    std::ifstream in(json);
    return nlohmann::json::parse(in)["agreement"];
  };
  const auto twin = agreement("twin");
  EXPECT_EQ(twin["prompts"], 64);
  EXPECT_EQ(twin["gen_tokens"], 32);
  ASSERT_EQ(twin["items"].size(), 2u);  // Each item against the reference.
  for (const auto& item : twin["items"]) {
    EXPECT_EQ(item["equal_prompts"], 64);
    EXPECT_EQ(item["equal_share"], 1.0);
    EXPECT_EQ(item["mean_common_prefix"], 32.0);
  }
  const auto unquantized = agreement("unquantized")["items"][0];
  EXPECT_LT(unquantized["equal_prompts"].get<int>(), 64);
  EXPECT_LT(unquantized["mean_common_prefix"].get<double>(), 32.0);
  const auto other = agreement("other")["items"][0];
  EXPECT_LT(other["equal_prompts"].get<int>(), 64);
  // Without --reference the first item is the reference; the second agrees with it.
  CliRun same = run("bench generate --model " + dir + "/fp8 --batches 1 --gen-tokens 8 " +
                    "--agreement 16 --quantization bf16,bf16");
  ASSERT_EQ(same.exit_code, 0) << same.out;
  EXPECT_NE(same.out.find("agreement (bf16 against quantization bf16): 16 of 16 prompts"),
            std::string::npos)
      << same.out;
  EXPECT_EQ(run("bench generate --model " + dir + "/fp8 --reference " + dir + "/twin").exit_code,
            2);
  EXPECT_EQ(run("synth --preset tiny --fp8-dequantized --out " + dir + "/x").exit_code, 2);
  ASSERT_EQ(run(synth + " --vocab-size 1000 --out " + dir + "/vocab1000").exit_code, 0);
  CliRun vocab = run("bench generate --model " + dir + "/fp8 --batches 1 --agreement 4 " +
                     "--reference " + dir + "/vocab1000");
  EXPECT_EQ(vocab.exit_code, 2) << vocab.out;
  EXPECT_NE(vocab.out.find("another vocabulary"), std::string::npos) << vocab.out;
  std::filesystem::remove_all(dir);
}

// plan-memory reads config.json only: a directory holding nothing else plans DeepSeek-V3 on
// eight H200s, which fits in FP8 (the checkpoint's quantization) and not in bf16.
TEST(CliTest, PlanMemoryFromConfigAlone) {
  const std::string dir = ::testing::TempDir() + "/flexpert-plan-config-only";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(kDeepseekV3 + "/config.json", dir + "/config.json");
  CliRun fp8 = run("plan-memory --model " + dir + " --ranks 8 --json");
  ASSERT_EQ(fp8.exit_code, 0) << fp8.out;
  const auto j = nlohmann::json::parse(fp8.out);
  EXPECT_EQ(j["quantization"], "fp8");
  EXPECT_EQ(j["slots_per_rank"], 33);
  EXPECT_NEAR(j["params"]["total"].get<double>(), 671e9, 1e9);
  EXPECT_TRUE(j["per_rank"]["fits"].get<bool>());
  EXPECT_GT(j["largest"]["max_seq_len_at_max_sequences"].get<int>(), 4096);
  EXPECT_EQ(j["per_rank"]["total"].get<uint64_t>(),
            j["per_rank"]["dense"].get<uint64_t>() + j["per_rank"]["expert_slots"].get<uint64_t>() +
                j["per_rank"]["kv_cache"].get<uint64_t>() +
                j["per_rank"]["workspaces"].get<uint64_t>());
  CliRun bf16 = run("plan-memory --model " + dir + " --ranks 8 --quantization bf16");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.out;
  EXPECT_NE(bf16.out.find("DOES NOT FIT"), std::string::npos) << bf16.out;
  EXPECT_NE(bf16.out.find("largest context at 32 sequences: 0 tokens"), std::string::npos)
      << bf16.out;
  // The transport a worker runs (Worker::load): cuda_ipc on a GPU rank, shm on a CPU one.
  EXPECT_NE(bf16.out.find("a GPU worker's transport is cuda_ipc"), std::string::npos) << bf16.out;
  CliRun cpu = run("plan-memory --model " + dir + " --ranks 8 --device cpu --quantization bf16");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.out;
  EXPECT_NE(cpu.out.find("(the worker's transport is shm)"), std::string::npos) << cpu.out;
  EXPECT_EQ(cpu.out.find("cuda_ipc"), std::string::npos) << cpu.out;
  std::filesystem::remove_all(dir);
}

}  // namespace
