// SPDX-License-Identifier: Apache-2.0
// Expert parallelism on one GPU: `flexpert serve --device cuda --cuda-dtype f32 --ranks 4`
// (four worker processes sharing the GPU; run it under NVIDIA MPS) answers with the
// Hugging Face reference tokens, before and after an EPLB map switch and a membership
// change 4 -> 3 -> 4 under light load, and no rank that lives through them captures
// another CUDA graph (flexpert_rank_graph_captures in /metrics: every rank, a joiner too,
// captures all its graphs while it loads); DeepSeek-V3 over four
// ranks answers with its reference tokens around a rebalance; a rank SIGKILLed under
// load is recovered from and replaced; GPU ranks over ucx (no shared memory between
// them) keep the reference tokens across scales, and so do GPU ranks over hier on two
// "hosts" (cuda_ipc within one, ucx between them); DeepSeek with FP8 experts over four ranks
// answers as one process does around a rebalance and a scale-down; with --step-timing two
// GPU ranks keep the reference tokens and report exchange time within their steps. Skips
// without a GPU.
#include <fcntl.h>
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <sstream>
#include <thread>

#include "../common/run_flexpert.h"
#include "cuda/device.h"
#include "cuda/fp8_experts.h"
#include "serve/bench_serve.h"
#include "server_fixture.h"

namespace flexpert_test {
namespace {

struct Answer {
  int status = 0;
  nlohmann::json body;
};

Answer post(Server& server, const std::string& path, const nlohmann::json& body) {
  httplib::Client c("127.0.0.1", server.port());
  c.set_read_timeout(300, 0);
  auto res = c.Post(path.c_str(), body.dump(), "application/json");
  if (!res) return {};
  return {res->status, nlohmann::json::parse(res->body, nullptr, false)};
}

void pause_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// pid of each serving rank -> the graphs it has captured (ranks report ~5 times a second).
std::map<int, int64_t> captures_by_pid(Server& server) {
  pause_ms(800);
  std::map<int, int> pid_of;
  const auto status = server.get_json("/v1/status");
  for (const auto& r : status["ranks"]) pid_of[r["rank"].get<int>()] = r["pid"].get<int>();
  std::map<int, int64_t> out;
  auto res = server.client().Get("/metrics");
  if (!res) return out;
  std::istringstream in(res->body);
  std::string line;
  for (int member : status["members"].get<std::vector<int>>()) {
    in.clear();
    in.seekg(0);
    while (std::getline(in, line)) {
      int rank = -1;
      long long n = 0;
      if (std::sscanf(line.c_str(), "flexpert_rank_graph_captures{rank=\"%d\"} %lld", &rank, &n) ==
              2 &&
          rank == member) {
        out[pid_of[rank]] = n;
      }
    }
  }
  return out;
}

// Ranks present in both samples must not have captured anything in between.
void expect_no_recapture(const std::map<int, int64_t>& before, const std::map<int, int64_t>& after,
                         const std::string& what) {
  int common = 0;
  for (const auto& [pid, n] : after) {
    auto it = before.find(pid);
    if (it == before.end()) continue;
    ++common;
    EXPECT_EQ(n, it->second) << "worker pid " << pid << " captured graphs across " << what;
  }
  EXPECT_GE(common, 3) << what;
  std::printf("graph captures around %s:", what.c_str());
  for (const auto& [pid, n] : after) std::printf(" pid %d: %lld", pid, static_cast<long long>(n));
  std::printf("\n");
}

// Every prompt in flight at once with different lengths, so each rank's decode batch
// shrinks one by one and every bucket (1, 2, 4 with --max-sequences 4) runs.
void warm_up(Server& server, const Reference& ref, int rounds) {
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::thread> threads;
    for (int i = 0; i < 16; ++i) {
      threads.emplace_back([&, i] {
        const size_t p = (i + round) % ref.prompts.size();
        const int max_tokens = 2 + 3 * ((i + round) % 5);
        const std::vector<int> got = server.complete(ref.prompts[p], max_tokens);
        ASSERT_FALSE(got.empty());
        const std::vector<int> want(ref.greedy[p].begin(), ref.greedy[p].begin() + got.size());
        EXPECT_EQ(got, want) << "prompt " << p;
      });
    }
    for (auto& t : threads) t.join();
  }
}

// Two clients repeating the reference prompts until stopped.
class LightLoad {
 public:
  LightLoad(Server& server, const Reference& ref) {
    for (int c = 0; c < 2; ++c) {
      threads_.emplace_back([&, c] {
        for (int i = 0; !done_.load(); ++i) {
          const size_t p = (c + 2 * i) % ref.prompts.size();
          const std::vector<int> got = server.complete(ref.prompts[p], 16);
          (got == ref.greedy[p] ? ok_ : wrong_)++;
        }
      });
    }
  }
  ~LightLoad() { stop(); }
  void stop() {
    done_.store(true);
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  int ok() const { return ok_.load(); }
  int wrong() const { return wrong_.load(); }

 private:
  std::atomic<bool> done_{false};
  std::atomic<int> ok_{0}, wrong_{0};
  std::vector<std::thread> threads_;
};

TEST(CudaServeTest, FourRanksOnOneGpuKeepReferenceTokensWithoutRecapture) {
  if (!flexpert::cuda::device_available()) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)";
  }
  Server server({"--device",
                 "cuda",
                 "--cuda-dtype",
                 "f32",
                 "--ranks",
                 "4",
                 "--max-ranks",
                 "4",
                 "--min-ranks",
                 "3",
                 "--max-sequences",
                 "4",
                 "--eplb-spare-slots",
                 "2",
                 "--eplb-window-s",
                 "5",
                 "--transport-timeout-ms",
                 "30000",
                 "--start-timeout-ms",
                 "300000"});
  ASSERT_TRUE(server.up());
  // Every rank captured each bucket's graphs while it loaded (Model::warm_up), before
  // any request: requests, a map switch and epochs capture nothing more.
  const auto warm = captures_by_pid(server);
  ASSERT_EQ(warm.size(), 4u);
  const int64_t per_rank = warm.begin()->second;
  EXPECT_GT(per_rank, 0) << "no rank captured a graph while loading";
  for (const auto& [pid, n] : warm) EXPECT_EQ(n, per_rank) << "worker pid " << pid;
  const Reference ref = load_reference();
  check_reference(server, ref, 2);
  warm_up(server, ref, 4);
  expect_no_recapture(warm, captures_by_pid(server), "requests in every bucket");

  {  // An EPLB map switch under light load.
    LightLoad load(server, ref);
    pause_ms(500);
    const Answer a = post(server, "/v1/eplb/rebalance", nlohmann::json::object());
    EXPECT_EQ(a.status, 200) << a.body.dump();
    std::printf("rebalance: %s\n", a.body.dump().c_str());
    pause_ms(500);
    load.stop();
    EXPECT_GT(load.ok(), 0);
    EXPECT_EQ(load.wrong(), 0);
  }
  check_reference(server, ref, 2);
  expect_no_recapture(warm, captures_by_pid(server), "the rebalance");

  for (int target : {3, 4}) {  // Membership epochs under light load.
    LightLoad load(server, ref);
    pause_ms(300);
    const Answer a = post(server, "/v1/scale", {{"ranks", target}});
    ASSERT_EQ(a.status, 200) << a.body.dump();
    EXPECT_EQ(a.body["members"].size(), static_cast<size_t>(target)) << a.body.dump();
    pause_ms(500);
    load.stop();
    EXPECT_GT(load.ok(), 0);
    EXPECT_EQ(load.wrong(), 0);
    check_reference(server, ref, 2);
    const auto after = captures_by_pid(server);
    expect_no_recapture(warm, after, "the scale to " + std::to_string(target) + " ranks");
    // A joiner captured all of its graphs during the preparation, none once serving.
    for (const auto& [pid, n] : after) EXPECT_EQ(n, per_rank) << "worker pid " << pid;
  }

  {  // A rank SIGKILLed under light load: the survivors recover (they close their
     // mappings of its buffers once it has exited), and its id rejoins afresh.
    const auto before_kill = captures_by_pid(server);
    LightLoad load(server, ref);
    pause_ms(300);
    const auto before = server.get_json("/v1/status");
    std::vector<int> members = before["members"].get<std::vector<int>>();
    ASSERT_EQ(members.size(), 4u) << before.dump();
    const int lost = members[2];
    int victim = 0;
    for (const auto& r : before["ranks"]) {
      if (r["rank"].get<int>() == lost) victim = r["pid"].get<int>();
    }
    ASSERT_GT(victim, 0) << before.dump();
    ::kill(victim, SIGKILL);
    // Recovered on the three survivors (slots for --min-ranks 3), then healed back to
    // four ranks by a live scale-up that reuses the lost id.
    nlohmann::json status;
    for (int i = 0; i < 600; ++i) {
      pause_ms(100);
      status = server.get_json("/v1/status");
      const auto& last = status["reconfiguration"]["last"];
      if (status["phase"] == "serving" && status["members"].size() == 4 && last.is_object() &&
          last.value("kind", "") == "heal") {
        break;
      }
    }
    EXPECT_EQ(status["members"].get<std::vector<int>>(), before["members"].get<std::vector<int>>())
        << status.dump();
    EXPECT_EQ(status["reconfiguration"]["last_recovery"]["status"], "ok") << status.dump();
    EXPECT_EQ(status["reconfiguration"]["recoveries"]["in_place"], 1) << status.dump();
    EXPECT_EQ(status["reconfiguration"]["last"]["joined"], nlohmann::json({lost})) << status.dump();
    pause_ms(300);
    load.stop();
    EXPECT_GT(load.ok(), 0);
    EXPECT_EQ(load.wrong(), 0);  // A failed request counts as wrong too.
    check_reference(server, ref, 2);
    const auto after = captures_by_pid(server);
    expect_no_recapture(before_kill, after, "a killed rank and its replacement");
    for (const auto& [pid, n] : after) EXPECT_EQ(n, per_rank) << "worker pid " << pid;
  }
  EXPECT_EQ(server.stop(), 0);
}

// FLEXPERT_UCX_CUDA=on in the test's environment (a run with a CUDA-aware UCX on
// LD_LIBRARY_PATH): the workers must register device memory with UCX (else they fail to start)
// and UCX must have a transport for it; docs/ARCHITECTURE.md "GPU ranks on different hosts".
bool ucx_cuda_on() {
  const char* knob = std::getenv("FLEXPERT_UCX_CUDA");
  return knob != nullptr && std::string(knob) == "on";
}
// What the UCX of the GPU tests' workers runs on: loopback TCP standing for a network, and
// cuda_copy for device memory where FLEXPERT_UCX_CUDA=on.
std::string ucx_tls() { return ucx_cuda_on() ? "tcp,cuda_copy" : "tcp"; }

// GPU ranks that share no memory (as on different hosts): `--transport ucx` over TCP. The
// ucx backend maps no peer buffers, so the rows of each MoE layer go through pinned host
// memory (the host exchange), and so do the weights a scale moves (slot loads from the peers'
// host regions), Debian's UCX having no CUDA support (docs/ARCHITECTURE.md, "GPU ranks on
// different hosts"). Reference tokens before and after a scale 2 -> 3 that moves experts to
// the joiner, a rebalance, and a scale back to 2. With FLEXPERT_UCX_CUDA=on in the test's
// environment and a CUDA-aware UCX on LD_LIBRARY_PATH, the weights move device to device
// instead (UCX gets of the peers' registered slot buffers): the scale report counts them.
TEST(CudaServeTest, GpuRanksOverUcxStageThroughHostMemory) {
#ifndef FLEXPERT_TEST_WITH_UCX
  GTEST_SKIP() << "this build has no ucx backend";
#endif
  if (!flexpert::cuda::device_available()) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)";
  }
  const bool direct = ucx_cuda_on();
  // Inherited by the workers: loopback TCP stands for a network.
  setenv("UCX_TLS", ucx_tls().c_str(), 1);
  setenv("UCX_NET_DEVICES", "lo", 1);
  Server server({"--device", "cuda", "--cuda-dtype", "f32", "--transport", "ucx", "--ranks", "2",
                 "--max-ranks", "3", "--max-sequences", "4", "--eplb-spare-slots", "2",
                 "--transport-timeout-ms", "30000", "--start-timeout-ms", "300000"});
  unsetenv("UCX_TLS");
  unsetenv("UCX_NET_DEVICES");
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  check_reference(server, ref, 2);
  for (int target : {3, 2}) {
    LightLoad load(server, ref);
    pause_ms(300);
    const Answer a = post(server, "/v1/scale", {{"ranks", target}});
    ASSERT_EQ(a.status, 200) << a.body.dump();
    std::printf("scale to %d over ucx: %s\n", target, a.body.dump().c_str());
    EXPECT_EQ(a.body["members"].size(), static_cast<size_t>(target)) << a.body.dump();
    if (target == 3) {
      const int64_t copies = a.body.value("expert_copies", int64_t{0});
      const int64_t device = a.body.value("device_copies", int64_t{-1});
      EXPECT_GT(copies, 0) << a.body.dump();
      if (direct) {
        EXPECT_EQ(device, copies) << "device to device over a CUDA-aware UCX " << a.body.dump();
      } else {
        EXPECT_EQ(device, 0) << "staged through the host regions " << a.body.dump();
      }
    }
    pause_ms(300);
    load.stop();
    EXPECT_GT(load.ok(), 0);
    EXPECT_EQ(load.wrong(), 0);
    check_reference(server, ref, 2);
    if (target == 3) {
      const Answer r = post(server, "/v1/eplb/rebalance", nlohmann::json::object());
      EXPECT_EQ(r.status, 200) << r.body.dump();
      check_reference(server, ref, 2);
    }
  }
  EXPECT_EQ(server.stop(), 0);
}

// Starts `flexpert worker --join` for `rank` (a number, or "auto" for a joiner) as a process
// of host `host` (FLEXPERT_HOST_ID: hier's host identity), its log (info) to `log_path`, with
// loopback TCP for UCX. The child only dup2s and execs: client threads may run meanwhile.
pid_t start_on_host(const std::string& host, const std::string& join, const std::string& rank,
                    const std::string& log_path) {
  std::vector<std::string> env = {"FLEXPERT_LOG=info", "FLEXPERT_HOST_ID=" + host,
                                  "UCX_TLS=" + ucx_tls(), "UCX_NET_DEVICES=lo"};
  if (std::getenv("FLEXPERT_CLUSTER_KEY") == nullptr) {
    env.push_back(std::string("FLEXPERT_CLUSTER_KEY=") + kTestClusterKey);  // The server's.
  }
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name != "FLEXPERT_LOG" && name != "FLEXPERT_HOST_ID" && name != "UCX_TLS" &&
        name != "UCX_NET_DEVICES") {
      env.push_back(kv);
    }
  }
  std::vector<std::string> args = {FLEXPERT_BINARY, "worker", "--join", join, "--rank", rank};
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const pid_t pid = fork();
  if (pid == 0) {
    if (fd < 0 || dup2(fd, 2) < 0) _exit(126);
    execve(FLEXPERT_BINARY, argv.data(), envp.data());
    _exit(127);
  }
  if (fd >= 0) close(fd);
  return pid;
}

// A scale-up to `target` ranks whose joiner starts on `host` once the front end waits for it.
Answer scale_up_on(Server& server, int target, const std::string& host,
                   const std::string& log_path) {
  Answer answer;
  std::thread scale([&] { answer = post(server, "/v1/scale", {{"ranks", target}}); });
  for (int i = 0; i < 400 && server.get_json("/v1/status")["phase"] != "scaling"; ++i) {
    pause_ms(25);
  }
  server.adopt_worker(start_on_host(host, server.join_address(), "auto", log_path));
  scale.join();
  return answer;
}

// GPU ranks over `--transport hier` on two "hosts" of one machine (hand-started workers with
// different FLEXPERT_HOST_ID): ranks 0, 1 on host a, a joiner on a (rank 2), then one on b
// (rank 3), a rebalance, and b's rank removed. Pairs on host a map each other's GPU memory
// through cuda_ipc (the device exchange; a joiner's expert copies device to device), pairs
// across hosts go through ucx (the host exchange while b is a member; b's joiner loads its
// experts from the host regions): the scale reports count the device copies, and the
// workers' logs name the backend of each pair, the mappings and the refusals. Reference
// tokens after every change.
TEST(CudaServeTest, GpuRanksOverHierUseCudaIpcWithinAHostAndUcxAcross) {
#ifndef FLEXPERT_TEST_WITH_UCX
  GTEST_SKIP() << "this build has no ucx backend (hier needs it)";
#endif
  if (!flexpert::cuda::device_available()) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)";
  }
  const std::string dir = temp_dir("cuda-hier");
  const std::string host_a = "gpu-host-a", host_b = "gpu-host-b";
  Server server({"--no-spawn", "--device", "cuda", "--cuda-dtype", "f32", "--transport", "hier",
                 "--ranks", "2", "--max-ranks", "4", "--max-sequences", "4", "--eplb-spare-slots",
                 "2", "--transport-timeout-ms", "30000", "--start-timeout-ms", "300000"},
                {0, 1}, kModel, [&](const std::string& join, int rank) {
                  const std::string r = std::to_string(rank);
                  return start_on_host(host_a, join, r, dir + "/worker" + r + ".log");
                });
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference();
  check_reference(server, ref, 2);
  // (host, joiner's expected rank): a's joiner copies from its host mates, b's from host a.
  for (const auto& [host, rank] : {std::pair{host_a, 2}, std::pair{host_b, 3}}) {
    LightLoad load(server, ref);
    pause_ms(300);
    const Answer a =
        scale_up_on(server, rank + 1, host, dir + "/worker" + std::to_string(rank) + ".log");
    ASSERT_EQ(a.status, 200) << a.body.dump();
    std::printf("scale to %d, joiner on %s: %s\n", rank + 1, host.c_str(), a.body.dump().c_str());
    ASSERT_EQ(a.body["joined"], nlohmann::json({rank})) << a.body.dump();
    pause_ms(300);
    load.stop();
    EXPECT_GT(load.ok(), 0);
    EXPECT_EQ(load.wrong(), 0);
    const int64_t copies = a.body.value("expert_copies", int64_t{0});
    const int64_t device = a.body.value("device_copies", int64_t{-1});
    EXPECT_GT(copies, 0) << a.body.dump();
    if (host == host_a) {
      EXPECT_GT(device, 0) << "same host: slots mapped through cuda_ipc " << a.body.dump();
    } else if (ucx_cuda_on()) {
      EXPECT_EQ(device, copies) << "across hosts: device reads over ucx " << a.body.dump();
    } else {
      EXPECT_EQ(device, 0) << "across hosts: host regions over ucx " << a.body.dump();
    }
    check_reference(server, ref, 2);
  }
  const Answer r = post(server, "/v1/eplb/rebalance", nlohmann::json::object());
  EXPECT_EQ(r.status, 200) << r.body.dump();
  std::printf("rebalance across hosts: %s\n", r.body.dump().c_str());
  check_reference(server, ref, 2);
  // Host a alone again: the device exchange.
  const Answer down = post(server, "/v1/scale", {{"remove", nlohmann::json::array({3})}});
  ASSERT_EQ(down.status, 200) << down.body.dump();
  EXPECT_EQ(down.body["members"], nlohmann::json({0, 1, 2})) << down.body.dump();
  check_reference(server, ref, 2);
  EXPECT_EQ(server.stop(), 0);

  const std::string me = "hier rank 0: ";
  const std::string log0 = read_text(dir + "/worker0.log");
  for (int mate : {1, 2}) {
    const std::string m = std::to_string(mate);
    EXPECT_NE(log0.find(me + "rank " + m + " on this host (cuda_ipc)"), std::string::npos) << log0;
    // The device exchange mapped its buffers (DeviceEpMoe::ready_for).
    EXPECT_NE(log0.find(": rank " + m + " mapped in "), std::string::npos) << log0;
  }
  EXPECT_NE(log0.find(me + "rank 3 on host " + host_b + " (ucx)"), std::string::npos) << log0;
  // While rank 3 was a member: the host exchange, its buffers not mappable.
  EXPECT_NE(log0.find(": host exchange, "), std::string::npos) << log0;
  EXPECT_NE(log0.find("rank 3 is on host " + host_b), std::string::npos) << log0;
  const long long mapped = figure_before(log0, me, " peer buffers mapped over cuda_ipc");
  const long long refused = figure_before(log0, me + std::to_string(mapped) + " peer buffers",
                                          " refused (peers on other hosts)");
  const long long ucx = figure_before(log0, me, " over ucx");
  std::printf(
      "rank 0: %lld peer buffers mapped over cuda_ipc, %lld refused, %lld bytes over "
      "ucx\n",
      mapped, refused, ucx);
  EXPECT_GT(mapped, 0) << log0;
  EXPECT_GT(refused, 0) << log0;
  EXPECT_GT(ucx, 0) << log0;
  const std::string log3 = read_text(dir + "/worker3.log");
  for (int far : {0, 1, 2}) {
    EXPECT_NE(
        log3.find("hier rank 3: rank " + std::to_string(far) + " on host " + host_a + " (ucx)"),
        std::string::npos)
        << log3;
  }
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

// `serve --step-timing` on two GPU ranks (the device exchange once both have mapped each
// other; docs/cuda.md "Step timing"): the events change no token, and each rank's exchange
// time is positive and within its steps' time.
TEST(CudaServeTest, StepTimingTimesTheDeviceExchangeWithinTheStep) {
  if (!flexpert::cuda::device_available()) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)";
  }
  Server server({"--device", "cuda", "--cuda-dtype", "f32", "--ranks", "2", "--step-timing",
                 "--transport-timeout-ms", "30000", "--start-timeout-ms", "300000"});
  ASSERT_TRUE(server.up());
  check_reference(server, load_reference(), 2);
  flexpert::BenchServeOptions options;
  options.url = "http://127.0.0.1:" + std::to_string(server.port());
  options.concurrency = 8;
  options.num_requests = 16;
  options.prompt_len = 8;
  options.max_tokens = 16;
  auto result = flexpert::bench_serve(options);
  ASSERT_TRUE(result.ok()) << result.status().to_string();
  const nlohmann::json& r = result.value();
  EXPECT_EQ(r["failed"], 0) << r.dump(2);
  ASSERT_TRUE(r.contains("steps")) << r.dump(2);
  std::printf("step timing, 2 GPU ranks:\n%s", flexpert::format_bench_table(r).c_str());
  ASSERT_EQ(r["steps"]["ranks"].size(), 2u) << r["steps"].dump(2);
  for (const auto& rank : r["steps"]["ranks"]) {
    EXPECT_GT(rank["exchange_ms"].get<double>(), 0) << rank.dump();
    EXPECT_LE(rank["exchange_ms"].get<double>(), rank["step_ms"].get<double>()) << rank.dump();
  }
  EXPECT_EQ(server.stop(), 0);
}

TEST(CudaServeTest, DeepseekFourRanksKeepReferenceTokensAcrossARebalance) {
  if (!flexpert::cuda::device_available()) {
    GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)";
  }
  const std::string model = std::string(FLEXPERT_TESTDATA_DIR) + "/deepseekv3-tiny";
  Server server({"--device", "cuda", "--cuda-dtype", "f32", "--ranks", "4", "--max-sequences", "4",
                 "--eplb-spare-slots", "2", "--transport-timeout-ms", "30000", "--start-timeout-ms",
                 "300000"},
                {}, model);
  ASSERT_TRUE(server.up());
  const Reference ref = load_reference(model);
  check_reference(server, ref, 2);
  const Answer a = post(server, "/v1/eplb/rebalance", nlohmann::json::object());
  EXPECT_EQ(a.status, 200) << a.body.dump();
  std::printf("deepseek rebalance: %s\n", a.body.dump().c_str());
  check_reference(server, ref, 2);
  EXPECT_EQ(server.stop(), 0);
}

// A synth preset (H 128, I 64) with its routed experts kept in FP8 (`--quantization fp8`:
// e4m3 slots with their block scales) over four ranks: greedy tokens equal one process's
// (`flexpert generate --device cuda --quantization fp8`, one prompt a run: no exchange) up to
// near-ties, before and after a rebalance and a scale to three ranks, which move whole FP8
// slots between ranks. The prompts are deepseekv3-tiny's (both presets have 512 tokens).
void fp8_experts_over_four_ranks_match_one_process(const std::string& preset) {
  int device = 0;
  if (!flexpert::cuda::device_available() || cudaGetDevice(&device) != cudaSuccess ||
      !flexpert::cuda::fp8_device_supported(device)) {
    GTEST_SKIP() << "no GPU of compute capability 8.9 or newer: GPU test skipped";
  }
  const std::string dir =
      ::testing::TempDir() + "/cuda-serve-fp8-" + preset + "-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  const CliRun synth = run_flexpert("synth --preset " + preset + " --fp8 --seed 5 --out " + dir);
  ASSERT_EQ(synth.exit_code, 0) << synth.out;
  const Reference ref = load_reference(std::string(FLEXPERT_TESTDATA_DIR) + "/deepseekv3-tiny");
  constexpr int kTokens = 12;
  std::vector<std::vector<int>> want;
  for (const auto& prompt : ref.prompts) {
    std::string ids;
    for (int id : prompt) {
      if (!ids.empty()) ids += ",";
      ids += std::to_string(id);
    }
    const CliRun g = run_flexpert("generate --model " + dir +
                                  " --device cuda --quantization fp8 --json --max-tokens " +
                                  std::to_string(kTokens) + " --prompt-ids " + ids);
    ASSERT_EQ(g.exit_code, 0) << g.out;
    const size_t at = g.out.find("{\"choices\"");
    ASSERT_NE(at, std::string::npos) << g.out;
    const auto j = nlohmann::json::parse(g.out.substr(at));
    want.push_back(j["choices"][0]["token_ids"].get<std::vector<int>>());
  }
  // One process's tokens, but for a near-tie: the paths round an expert's output apart (the
  // device exchange hands it over in bf16; one process's decode kernels sum it in f32), so
  // where the tokens part, one process's token must be among the served top 5 within
  // kNearTie nats of the served one (the continuations part from there).
  constexpr double kNearTie = 0.05;
  auto check = [&](Server& server, const std::string& when) {
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE(when + ", prompt " + std::to_string(i));
      const Answer r = post(server, "/v1/completions",
                            {{"prompt", ref.prompts[i]},
                             {"max_tokens", kTokens},
                             {"temperature", 0},
                             {"logprobs", 5}});
      ASSERT_EQ(r.status, 200) << r.body.dump();
      const auto& choice = r.body["choices"][0];
      const auto got = choice["token_ids"].get<std::vector<int>>();
      size_t p = 0;
      while (p < got.size() && p < want[i].size() && got[p] == want[i][p]) ++p;
      if (got == want[i]) continue;
      ASSERT_LT(p, std::min(got.size(), want[i].size())) << r.body.dump();
      const auto& top = choice["logprobs"]["top_logprobs"][p];
      const std::string theirs = "token_id:" + std::to_string(want[i][p]);
      ASSERT_TRUE(top.contains(theirs)) << "position " << p << ": " << r.body.dump();
      const double gap =
          choice["logprobs"]["token_logprobs"][p].get<double>() - top[theirs].get<double>();
      std::printf("%s, prompt %zu: parted at %zu, a near-tie of %.3g nats\n", when.c_str(), i, p,
                  gap);
      EXPECT_LT(gap, kNearTie) << "position " << p << ": " << r.body.dump();
    }
  };
  Server server({"--device", "cuda", "--quantization", "fp8", "--ranks", "4", "--max-ranks", "4",
                 "--min-ranks", "3", "--max-sequences", "4", "--eplb-spare-slots", "2",
                 "--transport-timeout-ms", "30000", "--start-timeout-ms", "300000"},
                {}, dir);
  ASSERT_TRUE(server.up());
  check(server, "at start");
  const Answer a = post(server, "/v1/eplb/rebalance", nlohmann::json::object());
  EXPECT_EQ(a.status, 200) << a.body.dump();
  std::printf("fp8 rebalance: %s\n", a.body.dump().c_str());
  // Moves pull whole FP8 slots (H 128, I 64), scales included.
  const int64_t slot_bytes = flexpert::cuda::fp8_slot_layout(128, 64).slot_bytes();
  EXPECT_EQ(a.body.value("moved_bytes", int64_t{-1}) % slot_bytes, 0) << a.body.dump();
  check(server, "after the rebalance");
  const Answer scaled = post(server, "/v1/scale", {{"ranks", 3}});
  ASSERT_EQ(scaled.status, 200) << scaled.body.dump();
  std::printf("fp8 scale to 3: %s\n", scaled.body.dump().c_str());
  // The leaving rank's experts moved to the others.
  const int64_t moved = scaled.body.value("moved_bytes", int64_t{0});
  EXPECT_GT(moved, 0) << scaled.body.dump();
  EXPECT_EQ(moved % slot_bytes, 0) << scaled.body.dump();
  check(server, "on three ranks");
  EXPECT_EQ(server.stop(), 0);
  std::filesystem::remove_all(dir);
}

TEST(CudaServeTest, DeepseekFp8ExpertsOverFourRanksMatchOneProcess) {
  fp8_experts_over_four_ranks_match_one_process("deepseek-tiny");
}

// Qwen3's softmax routing (run_moe's router stages) over the same FP8 slots.
TEST(CudaServeTest, Qwen3Fp8ExpertsOverFourRanksMatchOneProcess) {
  fp8_experts_over_four_ranks_match_one_process("tiny");
}

}  // namespace
}  // namespace flexpert_test
