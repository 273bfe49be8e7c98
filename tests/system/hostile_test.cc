// SPDX-License-Identifier: Apache-2.0
// Hostile input against the real binary (docs/ARCHITECTURE.md, "Trust boundaries"):
// each case gets a clear 4xx or exit code 2, and the service afterwards answers the
// same greedy tokens as before.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

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
  const json status = server.get_json("/v1/status");  // Kept: the loop reads into it.
  for (const auto& r : status["ranks"]) pids.push_back(r["pid"]);
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

// A raw TCP connection to the server, for clients that misbehave on purpose.
int connect_raw(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// What the server sends on `fd` before closing it (or `timeout_s` passing).
std::string read_all(int fd, int timeout_s) {
  timeval tv{timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

// Slow clients hold no thread: /health and /metrics answer while 100 connections
// trickle their headers, a client over its cap gets 503 (yet may still probe
// /health), and the slow ones get 408 at the request deadline.
TEST(HostileHttp, SlowClientsDoNotStarveHealth) {
  const Reference ref = load_reference();
  Server server({"--ranks", "2", "--threads-per-worker", "1", "--http-request-timeout-ms", "3000",
                 "--http-max-connections-per-client", "100"});
  ASSERT_TRUE(server.up());
  std::vector<int> slow;
  for (int i = 0; i < 100; ++i) {
    const int fd = connect_raw(server.port());
    ASSERT_GE(fd, 0);
    const std::string partial = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n";
    ASSERT_EQ(::send(fd, partial.data(), partial.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(partial.size()));
    slow.push_back(fd);
  }
  for (const char* path : {"/health", "/metrics"}) {
    httplib::Client c("127.0.0.1", server.port());
    c.set_read_timeout(2, 0);  // Was: blocked until the slow clients finished.
    auto res = c.Get(path);
    ASSERT_TRUE(res) << path << ": " << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 200) << path;
  }
  // Over the per-client cap: a completion is refused with a JSON 503.
  {
    httplib::Client c("127.0.0.1", server.port());
    auto res = c.Post("/v1/completions", R"({"prompt": [1], "max_tokens": 1})", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 503) << res->body;
    EXPECT_EQ(res->get_header_value("Retry-After"), "1");
    const json body = json::parse(res->body, nullptr, false);
    EXPECT_NE(body["error"]["message"].get<std::string>().find("per client"), std::string::npos)
        << res->body;
  }
  // The deadline: each slow client gets 408 and its connection closes.
  const std::string answer = read_all(slow[0], 10);
  EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
  for (int fd : slow) ::close(fd);
  check_reference(server, ref, 1);
  EXPECT_EQ(server.stop(), 0);
}

// What the gate answers itself, before any thread is involved, and keep-alive
// pipelining through it.
TEST(HostileHttp, GateRefusesOversizedAndChunkedRequests) {
  Server server({"--ranks", "1", "--threads-per-worker", "1"});
  ASSERT_TRUE(server.up());
  auto exchange = [&](const std::string& bytes) {
    const int fd = connect_raw(server.port());
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
    std::string answer = read_all(fd, 10);
    ::close(fd);
    return answer;
  };
  std::string answer = exchange(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{}");
  EXPECT_EQ(answer.rfind("HTTP/1.1 411", 0), 0u) << answer;
  EXPECT_NE(answer.find("\"error\""), std::string::npos) << answer;
  answer = exchange("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'a'));
  EXPECT_EQ(answer.rfind("HTTP/1.1 431", 0), 0u) << answer;
  // Refused from the header alone: the 2 MB body is never sent.
  answer = exchange("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n");
  EXPECT_EQ(answer.rfind("HTTP/1.1 413", 0), 0u) << answer;
  // Two requests in one write: both answered, in order, on one connection.
  const std::string body = R"({"prompt": [1, 2], "max_tokens": 2, "temperature": 0})";
  answer = exchange(
      "GET /health HTTP/1.1\r\nHost: x\r\n\r\nPOST /v1/completions HTTP/1.1\r\n"
      "Host: x\r\nConnection: close\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
  EXPECT_NE(answer.find("HTTP/1.1 200", 1), std::string::npos) << answer;
  EXPECT_NE(answer.find("\"token_ids\""), std::string::npos) << answer;
  EXPECT_EQ(server.stop(), 0);
}

TEST(HostileHttp, AdminKeyFromFileOrEnvironmentGuardsStatus) {
  TempModel tmp;  // Only for a private directory to hold the key file.
  const std::string key_file = tmp.dir() + "/admin.key";
  std::ofstream(key_file) << "s3cret-from-file\n";
  for (const bool from_env : {false, true}) {
    if (from_env) ::setenv("FLEXPERT_ADMIN_KEY", "s3cret-from-env", 1);
    Server server(from_env
                      ? std::vector<std::string>{"--ranks", "1"}
                      : std::vector<std::string>{"--ranks", "1", "--admin-key-file", key_file});
    ::unsetenv("FLEXPERT_ADMIN_KEY");
    ASSERT_TRUE(server.up());
    const std::string key = from_env ? "s3cret-from-env" : "s3cret-from-file";
    std::ifstream cmdline("/proc/" + std::to_string(server.pid()) + "/cmdline");
    const std::string args((std::istreambuf_iterator<char>(cmdline)), {});
    EXPECT_EQ(args.find(key), std::string::npos);

    httplib::Client c("127.0.0.1", server.port());
    auto open = c.Get("/v1/status");
    ASSERT_TRUE(open);
    EXPECT_EQ(open->status, 200);
    const json public_view = json::parse(open->body);
    EXPECT_FALSE(public_view.contains("ranks")) << open->body;  // No pids, no errors.
    EXPECT_TRUE(public_view.contains("vocab_size")) << open->body;
    auto guarded = c.Get("/v1/status", {{"Authorization", "Bearer " + key}});
    ASSERT_TRUE(guarded);
    EXPECT_TRUE(json::parse(guarded->body)["ranks"][0].contains("pid")) << guarded->body;
    auto scale = c.Post("/v1/scale", R"({"ranks": 1})", "application/json");
    ASSERT_TRUE(scale);
    EXPECT_EQ(scale->status, 401);
    EXPECT_EQ(server.stop(), 0);
  }
  // An empty key file is bad input, not "no key".
  std::ofstream(key_file, std::ios::trunc) << "\n";
  CliRun r = run_flexpert("serve --model " + kModel + " --admin-key-file " + key_file);
  EXPECT_EQ(r.exit_code, 2) << r.out;
}

// A group of hand-started workers without a key would let anyone take a rank.
TEST(HostileWorker, NoSpawnWithoutAClusterKeyIsRefused) {
  ASSERT_EQ(std::getenv("FLEXPERT_CLUSTER_KEY"), nullptr);
  const CliRun r = run_flexpert("serve --model " + kModel + " --no-spawn --ranks 1 --port 0");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("cluster key"), std::string::npos) << r.out;
}

// A control plane that other machines can reach needs the key too, spawned workers or not.
TEST(HostileWorker, ControlHostOffLoopbackWithoutAClusterKeyIsRefused) {
  ASSERT_EQ(std::getenv("FLEXPERT_CLUSTER_KEY"), nullptr);
  for (const char* host : {"0.0.0.0", "10.1.2.3"}) {
    // No such model: were the flag let through, the start fails on it instead (no hang).
    const CliRun r = run_flexpert("serve --model /no/such/model --control-host " +
                                  std::string(host) + " --ranks 1 --port 0");
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find("cluster key"), std::string::npos) << r.out;
  }
}

// Joining takes the group's key, not a pid: a hand-started worker without it is
// refused, one with it joins; spawned workers get theirs through the environment.
TEST(HostileWorker, JoiningNeedsTheClusterKey) {
  const Reference ref = load_reference();
  ::setenv("FLEXPERT_CLUSTER_KEY", "group-secret", 1);  // Inherited by the fixture's workers.
  Server server({"--no-spawn", "--ranks", "1", "--max-ranks", "2", "--threads-per-worker", "1",
                 "--start-timeout-ms", "30000"},
                {0});
  ASSERT_TRUE(server.up());
  std::thread scale;
  Reply scaled;
  scale = std::thread([&] { scaled = post_text(server, "/v1/scale", R"({"ranks": 2})"); });
  ::unsetenv("FLEXPERT_CLUSTER_KEY");
  for (const char* key : {"", "--cluster-key wrong-secret"}) {
    CliRun bad = run_flexpert("worker --join " + server.join_address() + " --rank 1 " + key);
    EXPECT_NE(bad.exit_code, 0) << bad.out;
    EXPECT_NE(bad.out.find("cluster key"), std::string::npos) << bad.out;
  }
  ::setenv("FLEXPERT_CLUSTER_KEY", "group-secret", 1);
  server.join_worker(1);
  ::unsetenv("FLEXPERT_CLUSTER_KEY");
  scale.join();
  EXPECT_EQ(scaled.status, 200) << scaled.body.dump();
  EXPECT_EQ(server.get_json("/v1/status")["members"].size(), 2u);
  check_reference(server, ref, 1);
  EXPECT_EQ(server.stop(), 0);

  // Spawned workers: the key is in their environment, never on their command line.
  Server spawned({"--ranks", "1", "--threads-per-worker", "1"});
  ASSERT_TRUE(spawned.up());
  const int pid = spawned.get_json("/v1/status")["ranks"][0]["pid"];
  std::ifstream cmdline("/proc/" + std::to_string(pid) + "/cmdline");
  const std::string args((std::istreambuf_iterator<char>(cmdline)), {});
  std::ifstream environ_file("/proc/" + std::to_string(pid) + "/environ");
  const std::string env((std::istreambuf_iterator<char>(environ_file)), {});
  EXPECT_NE(env.find("FLEXPERT_CLUSTER_KEY="), std::string::npos);
  EXPECT_EQ(args.find("key"), std::string::npos) << args;
  check_reference(spawned, ref, 1);
  EXPECT_EQ(spawned.stop(), 0);
}

// Recovery reloads a lost rank's experts from the checkpoint (PullCommand
// kFromCheckpoint): from a truncated file that is a clear error, never a signal in
// the survivor that reads it.
TEST(HostileCheckpoint, ReloadFromATruncatedFileIsAnErrorNotASignal) {
  TempModel model;
  // One replica: slots for one rank would take a second replica of every expert (auto).
  Server server(
      {"--ranks", "2", "--min-ranks", "1", "--min-replicas", "1", "--threads-per-worker", "1"}, {},
      model.dir());
  ASSERT_TRUE(server.up());
  const json status = server.get_json("/v1/status");
  const int survivor = status["ranks"][0]["pid"], victim = status["ranks"][1]["pid"];
  const std::string weights = model.dir() + "/model.safetensors";
  ASSERT_EQ(::truncate(weights.c_str(), std::filesystem::file_size(weights) / 2), 0);
  ::kill(victim, SIGKILL);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // Recovery runs meanwhile.
  EXPECT_TRUE(process_alive(survivor));
  auto health = server.client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_TRUE(health->status == 200 || health->status == 503) << health->status;
  const Reply r = post_text(server, "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 2})");
  EXPECT_TRUE(r.status == 200 || (r.status >= 500 && r.body.contains("error")))
      << r.status << " " << r.body.dump();
  EXPECT_TRUE(process_alive(survivor));
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
