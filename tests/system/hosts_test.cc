// SPDX-License-Identifier: Apache-2.0
// Workers on other "hosts" (docs/deployment.md): three network namespaces on a bridge, the
// front end in one (--control-host on its bridge address, --no-spawn), two hand-started
// workers in each of the others, the ucx transport over UCX_TLS=tcp. Reference tokens through
// HTTP, then every worker of one host killed under load: no request fails and the survivors
// serve on (--min-ranks 2: their slots hold every expert). Needs root (ip netns, veth,
// bridge); skipped without it, or without the ucx backend. Also a worker's SIGTERM (a
// graceful leave) across hosts, and a scale 4 -> 6 with joiners on both hosts followed by one
// host cut off with nftables (silence only) under load, healed, and rejoined.
#include <fcntl.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "elastic_util.h"
#include "server_fixture.h"

namespace {

using namespace flexpert_test;

int sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

// Namespaces fxf<pid> (the front end, bridge fxbr 10.78.0.1), fxa<pid> (10.78.0.2) and
// fxb<pid> (10.78.0.3), each host on the bridge through a veth named fxv0 (one
// UCX_NET_DEVICES for all). The calling thread enters the front end's namespace, so
// that the serve child and the HTTP clients started after it live there too; the
// destructor leaves it and deletes every namespace, whatever the test did.
class Hosts {
 public:
  Hosts() {
    const std::string id = std::to_string(getpid());
    fe_ = "fxf" + id;
    hosts_ = {"fxa" + id, "fxb" + id};
    cleanup();
    // Root in a sandbox may still lack CAP_SYS_ADMIN: no namespace at all is a skip.
    allowed_ = sh("ip netns add " + fe_) == 0;
    ok_ = allowed_;
    for (const std::string& ns : hosts_) ok_ &= sh("ip netns add " + ns) == 0;
    ok_ &= sh("ip -n " + fe_ + " link add fxbr type bridge") == 0;
    ok_ &= sh("ip -n " + fe_ + " addr add 10.78.0.1/24 dev fxbr") == 0;
    ok_ &= sh("ip -n " + fe_ + " link set fxbr up") == 0;
    ok_ &= sh("ip -n " + fe_ + " link set lo up") == 0;
    for (size_t i = 0; i < hosts_.size(); ++i) {
      const std::string& ns = hosts_[i];
      const std::string port = "fxp" + std::to_string(i);
      ok_ &= sh("ip link add fxv0 netns " + ns + " type veth peer name " + port + " netns " +
                fe_) == 0;
      ok_ &= sh("ip -n " + fe_ + " link set " + port + " master fxbr") == 0;
      ok_ &= sh("ip -n " + fe_ + " link set " + port + " up") == 0;
      ok_ &= sh("ip -n " + ns + " addr add " + address(i) + "/24 dev fxv0") == 0;
      ok_ &= sh("ip -n " + ns + " link set fxv0 up") == 0;
      ok_ &= sh("ip -n " + ns + " link set lo up") == 0;
    }
    // UCX takes only links that are up with a carrier; the bridge forwards once ready.
    const std::string up = "ip -n " + hosts_[0] + " link show fxv0 | grep -q 'state UP' && ip -n " +
                           hosts_[1] + " link show fxv0 | grep -q 'state UP'";
    for (int i = 0; ok_ && i < 50 && sh(up) != 0; ++i) pause_ms(100);
    home_ = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (ok_) ok_ = enter(fe_);
  }
  ~Hosts() {
    if (home_ >= 0) {
      setns(home_, CLONE_NEWNET);
      close(home_);
    }
    cleanup();
  }
  bool allowed() const { return allowed_; }  // The kernel let us create a namespace.
  bool ok() const { return ok_; }
  static std::string address(size_t host) { return "10.78.0." + std::to_string(host + 2); }
  const std::string& host(size_t i) const { return hosts_[i]; }

  // Starts `flexpert worker --join` for `rank` (a number, or "auto") in host namespace `i`,
  // its stderr (the log, at info) to `log_path` when set.
  pid_t start_worker(size_t i, const std::string& join, const std::string& rank,
                     const std::string& log_path = "") const {
    const std::string ns = hosts_[i];
    const pid_t pid = fork();
    if (pid == 0) {
      if (!log_path.empty()) {
        const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0 || dup2(fd, 2) < 0) _exit(126);
        setenv("FLEXPERT_LOG", "info", 1);
      }
      setenv("UCX_TLS", "tcp", 1);
      setenv("UCX_NET_DEVICES", "fxv0", 1);
      setenv("FLEXPERT_CLUSTER_KEY", kTestClusterKey, 0);
      const std::string& r = rank;
      // NOTE: `ip netns exec` (which execs in place: this pid) and not a bare setns(): it
      // also mounts the namespace's /sys, where UCX looks for the device's carrier.
      execlp("ip", "ip", "netns", "exec", ns.c_str(), FLEXPERT_BINARY, "worker", "--join",
             join.c_str(), "--rank", r.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    return pid;
  }

  // Cuts host `i` off the network (every packet in or out of its namespace dropped, its own
  // loopback too): a link or switch failure, not a process one. lift() undoes it; deleting
  // the namespace (the destructor) takes the table with it.
  bool cut(size_t i) const {
    return sh("ip netns exec " + hosts_[i] +
              " nft 'add table inet fx; "
              "add chain inet fx in { type filter hook input priority 0; policy drop; }; "
              "add chain inet fx out { type filter hook output priority 0; policy drop; }'") == 0;
  }
  bool lift(size_t i) const {
    return sh("ip netns exec " + hosts_[i] + " nft delete table inet fx") == 0;
  }

 private:
  static bool enter(const std::string& ns) {
    const int fd = open(("/var/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool entered = setns(fd, CLONE_NEWNET) == 0;
    close(fd);
    return entered;
  }
  void cleanup() const {
    for (const std::string& ns : {fe_, hosts_[0], hosts_[1]}) sh("ip netns del " + ns);
  }

  std::string fe_;
  std::vector<std::string> hosts_;
  int home_ = -1;
  bool allowed_ = false;
  bool ok_ = true;
};

// Why this machine cannot run a hosts test ("" when it can); `nft`: it also cuts links.
std::string missing_prerequisite(bool nft) {
#ifndef FLEXPERT_TEST_WITH_UCX
  (void)nft;
  return "the ucx transport backend is not in this build (CMake did not find UCX)";
#else
  if (geteuid() != 0) return "needs root (ip netns, veth, bridge, nft)";
  if (sh("ip -V") != 0) return "needs iproute2 (ip)";
  if (nft && sh("nft --version") != 0) return "needs nftables (nft)";
  return "";
#endif
}

// Ranks 0, 1 on host a and 2, 3 on host b over `transport`; reference tokens, then both
// workers of host b killed under load: no request fails and ranks 0, 1 serve on. Each worker's
// log goes to `log_dir`/worker<rank>.log when `log_dir` is set.
void lose_a_host(Hosts& hosts, const std::string& transport, const std::string& log_dir) {
  Server server(
      {"--no-spawn", "--ranks", "4", "--min-ranks", "2", "--threads-per-worker", "1", "--transport",
       transport, "--control-host", "10.78.0.1", "--start-timeout-ms", "30000"},
      {0, 1, 2, 3}, kModel, [&](const std::string& join, int rank) {
        const std::string log =
            log_dir.empty() ? "" : log_dir + "/worker" + std::to_string(rank) + ".log";
        return hosts.start_worker(rank < 2 ? 0 : 1, join, std::to_string(rank), log);
      });
  ASSERT_TRUE(server.up()) << "the group did not start";
  EXPECT_EQ(server.join_address().rfind("10.78.0.1:", 0), 0u) << server.join_address();
  check_reference(server, load_reference(), 2);
  Load load(server, 6);
  pause_ms(500);
  const pid_t b1 = server.take_worker(3);
  const pid_t b0 = server.take_worker(2);
  kill(b0, SIGKILL);
  kill(b1, SIGKILL);
  waitpid(b0, nullptr, 0);
  waitpid(b1, nullptr, 0);
  EXPECT_TRUE(wait_status(
      server, [](const nlohmann::json& s) { return serving_with(s, 2); }, 30000))
      << server.get_json("/v1/status").dump();
  pause_ms(500);  // Traffic on the survivors.
  EXPECT_TRUE(load.stop_and_check(10));
  const auto s = server.get_json("/v1/status");
  EXPECT_EQ(s["members"], nlohmann::json({0, 1})) << s.dump();
  check_reference(server, load_reference(), 1);
  EXPECT_EQ(server.stop(), 0);
}

TEST(HostsTest, UcxAcrossNamespacesLosesAHostWithoutFailingARequest) {
  if (const std::string why = missing_prerequisite(false); !why.empty()) GTEST_SKIP() << why;
  Hosts hosts;
  if (!hosts.allowed()) GTEST_SKIP() << "ip netns add was refused (no CAP_SYS_ADMIN?)";
  ASSERT_TRUE(hosts.ok()) << "could not set up the namespaces";
  lose_a_host(hosts, "ucx", "");
}

// The same over --transport hier: two workers per host, whose pairs go through shm (their
// logs say so when they connect, and count the bytes each backend carried at shutdown),
// the pairs across hosts through ucx.
TEST(HostsTest, HierKeepsShmWithinAHostAndUcxAcrossHosts) {
  if (const std::string why = missing_prerequisite(false); !why.empty()) GTEST_SKIP() << why;
  Hosts hosts;
  if (!hosts.allowed()) GTEST_SKIP() << "ip netns add was refused (no CAP_SYS_ADMIN?)";
  ASSERT_TRUE(hosts.ok()) << "could not set up the namespaces";
  const std::string dir = temp_dir("hosts-hier");
  lose_a_host(hosts, "hier", dir);
  for (int rank : {0, 1}) {
    const std::string log = read_text(dir + "/worker" + std::to_string(rank) + ".log");
    const std::string me = "hier rank " + std::to_string(rank) + ": ";
    const int mate = 1 - rank;
    EXPECT_NE(log.find(me + "rank " + std::to_string(mate) + " on this host (shm)"),
              std::string::npos)
        << log;
    for (int far : {2, 3}) {
      const std::string line = me + "rank " + std::to_string(far) + " on host ";
      const size_t at = log.find(line);
      ASSERT_NE(at, std::string::npos) << log;
      EXPECT_NE(log.find("(ucx)", at), std::string::npos) << log;
    }
    // Rows to its host mate went through shm, rows to host b through ucx.
    const long long shm = figure_before(log, me, " bytes over shm");
    const long long ucx = figure_before(log, me + std::to_string(shm), " over ucx");
    std::printf("rank %d: %lld bytes over shm, %lld over ucx\n", rank, shm, ucx);
    EXPECT_GT(shm, 0) << log;
    EXPECT_GT(ucx, 0) << log;
  }
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

// Hosts a (index 0) and b (1) by the workers' pids: rank -> host index, for the ranks of
// `status` whose pid is one of `pids[h]`.
std::vector<int> ranks_on(const nlohmann::json& status, const std::vector<pid_t>& pids) {
  std::vector<int> out;
  for (const auto& r : status["ranks"]) {
    if (std::find(pids.begin(), pids.end(), r["pid"].get<pid_t>()) != pids.end()) {
      out.push_back(r["rank"].get<int>());
    }
  }
  return out;
}

// Streaming clients that time every chunk of tokens (SSE events): the longest gap between two
// chunks of one request that ended in [from, to] is that window's stall (a figure, no assert;
// the bench elastic definition: minus the steady gap).
class StreamGaps {
 public:
  using Clock = std::chrono::steady_clock;
  StreamGaps(Server& server, int clients) {
    const Reference ref = load_reference();
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, &server, c, ref] {
        for (int i = 0; !done_.load(); ++i) {
          const nlohmann::json body = {{"prompt", ref.prompts[(c + i) % ref.prompts.size()]},
                                       {"max_tokens", 48},
                                       {"temperature", 0},
                                       {"stream", true}};
          httplib::Client client("127.0.0.1", server.port());
          client.set_read_timeout(60, 0);
          httplib::Request req;
          req.method = "POST";
          req.path = "/v1/completions";
          req.body = body.dump();
          req.set_header("Content-Type", "application/json");
          Clock::time_point last{};
          req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
            const Clock::time_point now = Clock::now();
            if (last != Clock::time_point{}) {
              std::lock_guard<std::mutex> lock(mu_);
              gaps_.push_back({last, now});
            }
            last = now;
            return true;
          };
          httplib::Response res;
          httplib::Error error = httplib::Error::Success;
          (void)client.send(req, res, error);
        }
      });
    }
  }
  ~StreamGaps() { stop(); }
  void stop() {
    done_.store(true);
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  // The longest gap (ms) that ended in [from, to].
  double max_gap_ms(Clock::time_point from, Clock::time_point to) {
    std::lock_guard<std::mutex> lock(mu_);
    double out = 0;
    for (const auto& [a, b] : gaps_) {
      if (b >= from && b <= to) {
        out = std::max(out, std::chrono::duration<double, std::milli>(b - a).count());
      }
    }
    return out;
  }

 private:
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::vector<std::pair<Clock::time_point, Clock::time_point>> gaps_;
  std::vector<std::thread> threads_;
};

// POST /v1/scale {"ranks": target}, with one `flexpert worker --join ... --rank auto` started
// in host namespace `joiner_hosts[i]` for each joiner once the front end is scaling (an id
// opens only then). The joiners' pids go to `pids[host]` and to the server (stop() waits).
Answer scale_with_joiners(Server& server, const Hosts& hosts, int target,
                          const std::vector<size_t>& joiner_hosts,
                          std::vector<std::vector<pid_t>>* pids) {
  Answer answer;
  std::thread scale([&] { answer = post(server, "/v1/scale", {{"ranks", target}}); });
  EXPECT_TRUE(wait_status(
      server, [](const nlohmann::json& s) { return s["phase"] == "scaling"; }, 10000));
  for (size_t h : joiner_hosts) {
    const pid_t pid = hosts.start_worker(h, server.join_address(), "auto");
    (*pids)[h].push_back(pid);
    server.adopt_worker(pid);
  }
  scale.join();
  return answer;
}

// Scale 4 -> 6 across hosts (joiners with --rank auto in both host namespaces), then host b
// cut off with nftables under load: its silence is the only sign (UCX reports no error for a
// dropped link), the heartbeat declares its ranks lost, the survivors' collectives end at
// that word (PeerLost -> mark_peer_lost) and they heal in place; no request fails. Once the
// cut is lifted, b's old incarnations wake up fenced and exit 4 on their own; a scale back
// to 6 joins new incarnations there, and greedy outputs stay the reference's throughout.
// Prints the figures of docs/deployment.md ("Measured").
TEST(HostsTest, UcxScalesAcrossHostsAndHealsACutHost) {
  if (const std::string why = missing_prerequisite(true); !why.empty()) GTEST_SKIP() << why;
  Hosts hosts;
  if (!hosts.allowed()) GTEST_SKIP() << "ip netns add was refused (no CAP_SYS_ADMIN?)";
  ASSERT_TRUE(hosts.ok()) << "could not set up the namespaces";
  constexpr int kHeartbeatTimeoutMs = 1000;  // Below the fixture's --transport-timeout-ms 2000.
  std::vector<std::vector<pid_t>> pids(2);   // Per host.
  // Ranks 0, 1 on host a; 2, 3 on host b. --min-ranks 2: any two ranks hold every expert.
  Server server(
      {"--no-spawn", "--ranks", "4", "--max-ranks", "8", "--min-ranks", "2", "--threads-per-worker",
       "1", "--transport", "ucx", "--control-host", "10.78.0.1", "--start-timeout-ms", "30000",
       "--heartbeat-timeout-ms", std::to_string(kHeartbeatTimeoutMs)},
      {0, 1, 2, 3}, kModel, [&](const std::string& join, int rank) {
        const size_t h = rank < 2 ? 0 : 1;
        const pid_t pid = hosts.start_worker(h, join, std::to_string(rank));
        pids[h].push_back(pid);
        return pid;
      });
  ASSERT_TRUE(server.up()) << "the group did not start";
  const Reference ref = load_reference();
  check_reference(server, ref, 1);

  // 4 -> 6: one joiner on each host, under load (checked answers and timed streams).
  {
    Load load(server, 3);
    StreamGaps streams(server, 2);
    const auto t0 = StreamGaps::Clock::now();
    pause_ms(600);
    const auto t_scale = StreamGaps::Clock::now();
    const Answer up = scale_with_joiners(server, hosts, 6, {0, 1}, &pids);
    const auto t_done = StreamGaps::Clock::now();
    ASSERT_EQ(up.status, 200) << up.body.dump();
    EXPECT_EQ(up.body["members"], nlohmann::json({0, 1, 2, 3, 4, 5})) << up.body.dump();
    pause_ms(300);
    EXPECT_TRUE(load.stop_and_check(0));
    streams.stop();
    const double steady = streams.max_gap_ms(t0, t_scale);
    const double during = streams.max_gap_ms(t_scale, t_done);
    std::printf(
        "[hosts] scale 4 -> 6: prepare %.0f ms, commit %.1f ms, stall %.1f ms (longest "
        "token gap %.1f, steady %.1f), longest request %lld ms\n",
        up.body.value("prepare_s", 0.0) * 1e3, up.body.value("commit_s", 0.0) * 1e3,
        std::max(0.0, during - steady), during, steady, static_cast<long long>(load.max_ms()));
  }
  check_reference(server, ref, 1);
  const std::vector<int> b_ranks = ranks_on(server.get_json("/v1/status"), pids[1]);
  ASSERT_EQ(b_ranks.size(), 3u) << server.get_json("/v1/status").dump();

  // Host b cut off under load.
  auto none_of_b = [&](const nlohmann::json& s) {
    for (int r : s["members"].get<std::vector<int>>()) {
      if (std::find(b_ranks.begin(), b_ranks.end(), r) != b_ranks.end()) return false;
    }
    return true;
  };
  {
    Load load(server, 4);
    pause_ms(300);
    const auto t_cut = std::chrono::steady_clock::now();
    ASSERT_TRUE(hosts.cut(1)) << "nft refused the cut";
    EXPECT_TRUE(wait_status(server, none_of_b, 15000)) << server.get_json("/v1/status").dump();
    const auto detect_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - t_cut)
                               .count();
    EXPECT_TRUE(wait_status(
        server, [](const nlohmann::json& s) { return serving_with(s, 3); }, 20000))
        << server.get_json("/v1/status").dump();
    const auto healed_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - t_cut)
                               .count();
    const nlohmann::json s = server.get_json("/v1/status");
    for (const auto& r : s["ranks"]) {
      const bool on_b =
          std::find(b_ranks.begin(), b_ranks.end(), r["rank"].get<int>()) != b_ranks.end();
      if (on_b) {
        // Lost to silence: no process exit or peer report could have told the front end.
        EXPECT_NE(r.value("last_error", "").find("no heartbeat"), std::string::npos) << r.dump();
      } else if (r["state"] == "serving") {
        // A survivor's step with b ended on the front end's word (PeerLost), not at its
        // --transport-timeout-ms (2000, twice the heartbeat timeout).
        EXPECT_NE(r.value("last_error", "").find("the front end declared it lost"),
                  std::string::npos)
            << r.dump();
      }
    }
    pause_ms(500);  // Traffic on the survivors.
    EXPECT_TRUE(load.stop_and_check(0));
    std::printf(
        "[hosts] cut host b (--heartbeat-timeout-ms %d): lost after %lld ms, serving on "
        "3 ranks after %lld ms, longest request %lld ms\n",
        kHeartbeatTimeoutMs, static_cast<long long>(detect_ms), static_cast<long long>(healed_ms),
        static_cast<long long>(load.max_ms()));
  }
  std::vector<int> survivors;
  for (int r = 0; r < 6; ++r) {
    if (std::find(b_ranks.begin(), b_ranks.end(), r) == b_ranks.end()) survivors.push_back(r);
  }
  EXPECT_EQ(members(server), survivors);

  // The cut lifted: b's old incarnations hear they are fenced and exit (4) on their own.
  ASSERT_TRUE(hosts.lift(1));
  for (size_t i = 0; i < 3; ++i) {
    const pid_t old = server.take_worker(server.index_of(pids[1][i]));
    int status = -1;
    for (int t = 0; t < 600 && waitpid(old, &status, WNOHANG) != old; ++t) pause_ms(50);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 4)
        << "old incarnation " << old << ": wait status " << status;
    if (!WIFEXITED(status)) kill(old, SIGKILL), waitpid(old, nullptr, 0);
  }
  pids[1].clear();

  // New incarnations of b's ids through a scale back to 6, under load.
  {
    Load load(server, 4);
    const Answer up = scale_with_joiners(server, hosts, 6, {1, 1, 1}, &pids);
    ASSERT_EQ(up.status, 200) << up.body.dump();
    EXPECT_EQ(up.body["members"], nlohmann::json({0, 1, 2, 3, 4, 5})) << up.body.dump();
    pause_ms(300);
    EXPECT_TRUE(load.stop_and_check());
  }
  check_reference(server, ref, 1);
  EXPECT_EQ(server.stop(), 0);
}

// A graceful leave over ucx: SIGTERM to the worker of host b; it exits 0 once the group
// runs without it, and no request fails.
TEST(HostsTest, UcxWorkerLeavesOnSigterm) {
  if (const std::string why = missing_prerequisite(false); !why.empty()) GTEST_SKIP() << why;
  Hosts hosts;
  if (!hosts.allowed()) GTEST_SKIP() << "ip netns add was refused (no CAP_SYS_ADMIN?)";
  ASSERT_TRUE(hosts.ok()) << "could not set up the namespaces";
  // Ranks 0, 1 on host a; 2 on host b.
  Server server(
      {"--no-spawn", "--ranks", "3", "--min-ranks", "2", "--threads-per-worker", "1", "--transport",
       "ucx", "--control-host", "10.78.0.1", "--start-timeout-ms", "30000"},
      {0, 1, 2}, kModel, [&](const std::string& join, int rank) {
        return hosts.start_worker(rank < 2 ? 0 : 1, join, std::to_string(rank));
      });
  ASSERT_TRUE(server.up()) << "the group did not start";
  Load load(server, 6);
  pause_ms(500);
  const pid_t leaver = server.take_worker(2);
  ASSERT_EQ(kill(leaver, SIGTERM), 0);
  int status = -1;
  for (int i = 0; i < 600 && waitpid(leaver, &status, WNOHANG) != leaver; ++i) pause_ms(50);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
  if (!WIFEXITED(status)) kill(leaver, SIGKILL), waitpid(leaver, nullptr, 0);
  EXPECT_TRUE(wait_status(server, [](const nlohmann::json& s) {
    return serving_with(s, 2) && last_kind(s) == "leave";
  })) << server.get_json("/v1/status").dump();
  pause_ms(300);
  EXPECT_TRUE(load.stop_and_check(10));
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
