// SPDX-License-Identifier: Apache-2.0
// Hostile input against the real binary (docs/ARCHITECTURE.md, "Trust boundaries"):
// each case gets a clear 4xx or exit code 2, and the service afterwards answers the
// same greedy tokens as before.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "../common/run_flexpert.h"
#include "server_fixture.h"

namespace flexpert_test {
namespace {

using nlohmann::json;

std::string nested_ids(int depth) {
  return std::string(depth, '[') + "1" + std::string(depth, ']');
}

struct Reply {
  int status = -1;
  json body;
};

Reply post_text(Server& server, const std::string& path, const std::string& text) {
  httplib::Client c("127.0.0.1", server.port());
  c.set_read_timeout(60, 0);
  auto res = c.Post(path.c_str(), text, "application/json");
  if (!res) return {};
  return {res->status, json::parse(res->body, nullptr, false)};
}

void expect_400(const Reply& r, const std::string& what) {
  EXPECT_EQ(r.status, 400) << what << ": " << r.body.dump();
  ASSERT_TRUE(r.body.is_object()) << what;
  EXPECT_TRUE(r.body["error"]["message"].is_string()) << what << ": " << r.body.dump();
}

class TempModel {
 public:
  TempModel() {
    std::string pattern = ::testing::TempDir() + "flexpert_hostile_XXXXXX";
    EXPECT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    for (const auto& e : std::filesystem::directory_iterator(kModel)) {
      std::filesystem::copy(e.path(), dir_ + "/" + e.path().filename().string());
    }
  }
  ~TempModel() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

TEST(HostileHttp, BadBodiesAre400AndTheServiceIsUnchanged) {
  const Reference ref = load_reference();
  Server server({"--ranks", "2", "--max-ranks", "3", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  check_reference(server, ref, 1);

  // 60,000-deep arrays in prompt[0] and stop_token_ids[0] (a ~240 KB body).
  expect_400(post_text(server, "/v1/completions",
                       R"({"prompt": [)" + nested_ids(60000) + R"(], "max_tokens": 4})"),
             "deep prompt");
  expect_400(post_text(server, "/v1/completions",
                       R"({"prompt": [1, 2], "stop_token_ids": [)" + nested_ids(60000) + "]}"),
             "deep stop_token_ids");
  expect_400(post_text(server, "/v1/scale", R"({"remove": [)" + nested_ids(60000) + "]}"),
             "deep admin body");
  // A nesting within the limit but not token ids names the type, not the value.
  const Reply shallow = post_text(server, "/v1/completions", R"({"prompt": [[[[1]]]]})");
  expect_400(shallow, "shallow nesting");

  // Integers are range-checked before narrowing: 2^32 + 1 is not rank 1.
  expect_400(post_text(server, "/v1/scale", R"({"remove": [4294967297]})"), "remove 2^32+1");
  expect_400(post_text(server, "/v1/scale", R"({"ranks": -4294967294})"), "ranks -2^32+2");
  expect_400(post_text(server, "/v1/scale", R"({"ranks": 18446744073709551615})"), "ranks 2^64-1");
  expect_400(post_text(server, "/v1/eplb/drain", R"({"cancel": "yes"})"), "drain cancel type");
  expect_400(post_text(server, "/v1/completions", R"({"prompt": [1], "top_p": 1e-300})"),
             "top_p rounds to 0");

  const json status = server.get_json("/v1/status");
  EXPECT_EQ(status["members"].size(), 2u) << status.dump();
  check_reference(server, ref, 2);
  EXPECT_EQ(server.stop(), 0);
}

// Weights are read into private memory, never mapped: a checkpoint truncated while
// the group serves changes nothing for running workers, and a joiner that would
// load the cut file fails cleanly (the scale is refused, the old group serves on).
TEST(HostileCheckpoint, TruncatedWhileServingKillsNobody) {
  const Reference ref = load_reference();
  TempModel model;
  Server server({"--ranks", "2", "--max-ranks", "3", "--threads-per-worker", "1",
                 "--start-timeout-ms", "20000"},
                {}, model.dir());
  ASSERT_TRUE(server.up());
  check_reference(server, ref, 1);
  std::vector<int> pids;
  for (const auto& r : server.get_json("/v1/status")["ranks"]) pids.push_back(r["pid"]);
  const std::string weights = model.dir() + "/model.safetensors";
  ASSERT_EQ(::truncate(weights.c_str(), std::filesystem::file_size(weights) / 2), 0);

  check_reference(server, ref, 2);
  for (int pid : pids) EXPECT_TRUE(process_alive(pid)) << pid;
  const Reply scale = post_text(server, "/v1/scale", R"({"ranks": 3})");
  EXPECT_NE(scale.status, 200) << scale.body.dump();
  EXPECT_TRUE(scale.body.is_object() && scale.body.contains("error")) << scale.body.dump();
  for (int pid : pids) EXPECT_TRUE(process_alive(pid)) << pid;
  EXPECT_EQ(server.get_json("/v1/status")["members"].size(), 2u);
  check_reference(server, ref, 1);
  EXPECT_EQ(server.stop(), 0);
}

TEST(HostileCli, CorruptOrSpecialFilesExitWithTwo) {
  TempModel model;
  const std::string gen = "generate --model " + model.dir() + " --prompt-ids 1,2,3 --max-tokens 2";
  // A safetensors header nesting 100,000 deep in __metadata__.
  {
    const std::string header =
        R"({"__metadata__":{"x":)" + std::string(100000, '[') + std::string(100000, ']') + "}}";
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(header.size() >> (8 * i));
    std::ofstream(model.dir() + "/model.safetensors", std::ios::binary | std::ios::trunc)
        << bytes << header;
    CliRun r = run_flexpert(gen);
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find("deeper than"), std::string::npos) << r.out;
  }
  // Truncated weights: DataLoss, which is bad input.
  {
    std::filesystem::copy_file(kModel + "/model.safetensors", model.dir() + "/model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    const std::string weights = model.dir() + "/model.safetensors";
    ASSERT_EQ(::truncate(weights.c_str(), std::filesystem::file_size(weights) - 1000), 0);
    CliRun r = run_flexpert(gen);
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find("DATA_LOSS"), std::string::npos) << r.out;
  }
  // config.json as a FIFO: refused at once (open() used to wait for a writer forever).
  {
    std::filesystem::remove(model.dir() + "/config.json");
    ASSERT_EQ(::mkfifo((model.dir() + "/config.json").c_str(), 0600), 0);
    CliRun r = run_flexpert("generate --model " + model.dir() + " --prompt-ids 1 --max-tokens 1");
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find("not a regular file"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace flexpert_test
