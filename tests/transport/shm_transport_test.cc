// SPDX-License-Identifier: Apache-2.0
// What only the shm backend promises: segment names and cleanup, option validation, the
// checks connect() makes, stale-segment reclaim, layout arithmetic; plus the factory and
// Group. In-process (two transports on two threads where a collective needs a peer).
#include "transport/shm/shm_transport.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm/shm_layout.h"
#include "transport/shm/shm_segment.h"

namespace flexpert {
namespace {

std::string unique_session() {
  static std::atomic<int> counter{0};
  return "shmt" + std::to_string(::getpid()) + "x" + std::to_string(counter.fetch_add(1));
}

bool shm_exists(const std::string& name) {
  struct stat st {};
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

TransportOptions options_for(const std::string& session, int rank, int max_ranks = 2) {
  TransportOptions o;
  o.session = session;
  o.rank = rank;
  o.max_ranks = max_ranks;
  o.max_gather_bytes = 256;
  o.max_exchange_bytes = 4096;
  o.timeout_ms = 2000;
  return o;
}

std::unique_ptr<Transport> make(const TransportOptions& o) {
  auto t = create_transport("shm", o);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? std::move(t).value() : nullptr;
}

TEST(TransportFactoryTest, UnknownBackendListsTheKnownOnes) {
  auto t = create_transport("carrier-pigeon", TransportOptions{});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("shm"), std::string::npos) << t.status().message();
}

TEST(TransportFactoryTest, GroupContains) {
  Group g{3, {0, 2, 5}};
  EXPECT_TRUE(g.contains(2));
  EXPECT_TRUE(g.contains(5));
  EXPECT_FALSE(g.contains(1));
  EXPECT_FALSE(Group{}.contains(0));
}

TEST(ShmTransportTest, AddressNamesTheSegmentAndShutdownRemovesEverything) {
  const std::string session = unique_session();
  TransportOptions o = options_for(session, 1, 3);
  o.incarnation = 7;
  auto t = make(o);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->address(), "/flexpert-" + session + "-r1-i7");
  EXPECT_TRUE(shm_exists(t->address()));
  EXPECT_EQ(t->rank(), 1);
  EXPECT_EQ(t->max_ranks(), 3);
  const TransportCapabilities caps = t->capabilities();
  EXPECT_TRUE(caps.one_sided_read);
  EXPECT_FALSE(caps.device_memory);
  EXPECT_FALSE(caps.cross_host);
  EXPECT_FALSE(caps.mapped_peer_buffers);
  EXPECT_EQ(caps.max_gather_bytes, 256u);
  EXPECT_EQ(caps.max_exchange_bytes, 4096u);
  auto region = t->allocate_region(3, 100);
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  EXPECT_TRUE(shm_exists(t->address() + "-g3"));
  for (size_t i = 0; i < 100; ++i) ASSERT_EQ(static_cast<char*>(region->data)[i], 0);
  const std::string address = t->address();
  ASSERT_TRUE(t->shutdown().ok());
  EXPECT_FALSE(shm_exists(address));
  EXPECT_FALSE(shm_exists(address + "-g3"));
  EXPECT_TRUE(t->shutdown().ok());  // Idempotent.
  EXPECT_EQ(t->allocate_region(4, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(t->barrier(Group{0, {1}}).code(), StatusCode::kFailedPrecondition);
}

TEST(ShmTransportTest, DestructorWithoutShutdownUnlinks) {
  const std::string session = unique_session();
  std::string address;
  {
    auto t = make(options_for(session, 0));
    ASSERT_NE(t, nullptr);
    address = t->address();
    ASSERT_TRUE(t->allocate_region(0, 10).ok());
  }
  EXPECT_FALSE(shm_exists(address));
  EXPECT_FALSE(shm_exists(address + "-g0"));
}

TEST(ShmTransportTest, RejectsBadOptions) {
  const std::string session = unique_session();
  auto code = [](const TransportOptions& o) { return create_transport("shm", o).status().code(); };
  TransportOptions o = options_for(session, 0);
  o.session = "a/b";
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
  o.session = "";
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
  o.session = std::string(200, 'x');
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
  o = options_for(session, 2);  // rank >= max_ranks
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
  o = options_for(session, 0);
  o.timeout_ms = 0;
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
  o = options_for(session, 0, 0);
  o.rank = 0;
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
  o = options_for(session, 0);
  o.max_exchange_bytes = size_t{1} << 50;
  EXPECT_EQ(code(o), StatusCode::kInvalidArgument);
}

TEST(ShmTransportTest, SameIdentityTwiceWhileAliveIsRefused) {
  const std::string session = unique_session();
  auto first = make(options_for(session, 0));
  ASSERT_NE(first, nullptr);
  auto second = create_transport("shm", options_for(session, 0));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("live pid"), std::string::npos);
}

TEST(ShmTransportTest, StaleSegmentOfAKilledRankIsReclaimed) {
  const std::string session = unique_session();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto t = create_transport("shm", options_for(session, 0));
    if (t.ok()) (void)(*t)->allocate_region(2, 64);
    ::raise(SIGKILL);  // No destructor, no shutdown: the segments stay.
    ::_exit(1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));
  const std::string address = "/flexpert-" + session + "-r0-i0";
  ASSERT_TRUE(shm_exists(address));
  auto t = make(options_for(session, 0));
  ASSERT_NE(t, nullptr);
  auto region = t->allocate_region(2, 64);  // The dead one's region name is reused too.
  EXPECT_TRUE(region.ok()) << region.status().to_string();
  ASSERT_TRUE(t->shutdown().ok());
  EXPECT_FALSE(shm_exists(address));
}

TEST(ShmTransportTest, ConnectValidatesThePeer) {
  const std::string session = unique_session();
  auto a = make(options_for(session, 0));
  auto b = make(options_for(session, 1));
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(a->connect(0, a->address()).ok());  // Self.
  EXPECT_EQ(a->connect(0, b->address()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->connect(2, b->address()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->connect(1, "not-an-address").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->connect(1, "/flexpert-" + session + "-r1-i9").code(), StatusCode::kUnavailable);
  EXPECT_EQ(a->connect(1, a->address()).code(), StatusCode::kInvalidArgument);  // Rank 0's.
  EXPECT_TRUE(a->connect(1, b->address()).ok());
  EXPECT_TRUE(a->connect(1, b->address()).ok());  // Idempotent.

  // A peer created with other capacities cannot share mailboxes with us.
  const std::string other_session = unique_session();
  TransportOptions big = options_for(other_session, 1);
  big.max_exchange_bytes = 8192;
  auto c = make(big);
  TransportOptions small = options_for(other_session, 0);
  auto d = make(small);
  ASSERT_TRUE(c && d);
  const Status mismatch = d->connect(1, c->address());
  EXPECT_EQ(mismatch.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.message().find("max_exchange_bytes=8192"), std::string::npos)
      << mismatch.message();

  // A peer that has shut down is Unavailable (its segment is gone).
  const std::string b_address = b->address();
  ASSERT_TRUE(b->shutdown().ok());
  auto e = make(options_for(unique_session(), 0));
  EXPECT_EQ(e->connect(1, b_address).code(), StatusCode::kUnavailable);
}

// Two ranks in one process: collectives on two threads, reads in between.
TEST(ShmTransportTest, InProcessPairCollectivesAndReads) {
  const std::string session = unique_session();
  auto a = make(options_for(session, 0));
  auto b = make(options_for(session, 1));
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->connect(1, b->address()).ok());
  ASSERT_TRUE(b->connect(0, a->address()).ok());
  auto region = b->allocate_region(4, 1000);
  ASSERT_TRUE(region.ok());
  std::memset(region->data, 0x5a, 1000);
  char buf[16] = {};
  ASSERT_TRUE(a->read(1, 4, 990, buf, 10).ok());
  EXPECT_EQ(buf[0], 0x5a);
  EXPECT_EQ(a->read(1, 4, 995, buf, 10).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->read(1, 5, 0, buf, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(a->read(1, 4, 0, nullptr, 1).code(), StatusCode::kInvalidArgument);

  const Group g{0, {0, 1}};
  auto run = [&](Transport* t, uint8_t value, std::vector<uint8_t>* seen) {
    for (int op = 0; op < 500; ++op) {
      uint8_t mine[8];
      std::memset(mine, value + op % 7, sizeof(mine));
      auto got = t->all_gather(g, ByteSpan{mine, sizeof(mine)});
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      seen->push_back(static_cast<const uint8_t*>((*got)[0].data)[0]);
      seen->push_back(static_cast<const uint8_t*>((*got)[1].data)[7]);
    }
  };
  std::vector<uint8_t> seen_a, seen_b;
  std::thread tb([&] { run(b.get(), 100, &seen_b); });
  run(a.get(), 10, &seen_a);
  tb.join();
  EXPECT_EQ(seen_a, seen_b);
  ASSERT_EQ(seen_a.size(), 1000u);
  EXPECT_EQ(seen_a[2 * 499], 10 + 499 % 7);
  EXPECT_EQ(seen_a[2 * 499 + 1], 100 + 499 % 7);

  ASSERT_TRUE(a->disconnect(1).ok());
  EXPECT_EQ(a->read(1, 4, 0, buf, 1).code(), StatusCode::kUnavailable);
  EXPECT_EQ(a->barrier(g).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(a->connect(1, b->address()).ok());
  ASSERT_TRUE(b->shutdown().ok());
  EXPECT_EQ(a->read(1, 4, 0, buf, 1).code(), StatusCode::kUnavailable);
  // A lone member needs nobody.
  auto alone = a->all_gather(Group{5, {0}}, ByteSpan{buf, 4});
  ASSERT_TRUE(alone.ok()) << alone.status().to_string();
  EXPECT_EQ((*alone)[0].num_bytes, 4u);
  EXPECT_EQ((*alone)[1].num_bytes, 0u);
}

TEST(ShmTransportTest, RemoveSessionMatchesExactly) {
  const std::string session = unique_session();
  auto a = make(options_for(session, 0));
  auto other = make(options_for(session + "-r0-i0", 1));  // Names start like a's.
  ASSERT_TRUE(a && other);
  ASSERT_TRUE(a->allocate_region(1, 8).ok());
  auto removed = remove_shm_session(session);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 2);
  EXPECT_FALSE(shm_exists(a->address()));
  EXPECT_TRUE(shm_exists(other->address()));
  EXPECT_TRUE(a->shutdown().ok());  // Already unlinked by the supervisor: still fine.
}

TEST(ShmLayoutTest, SessionSegmentNamesParseExactly) {
  using shm::is_session_segment;
  EXPECT_TRUE(is_session_segment("flexpert-s-r0-i0", "s"));
  EXPECT_TRUE(is_session_segment("flexpert-s-r12-i3-g7", "s"));
  EXPECT_FALSE(is_session_segment("flexpert-s-r0-i0-r1-i0", "s"));
  EXPECT_TRUE(is_session_segment("flexpert-s-r0-i0-r1-i0", "s-r0-i0"));
  EXPECT_FALSE(is_session_segment("flexpert-s-r0-i0", "s-r0-i0"));
  EXPECT_FALSE(is_session_segment("flexpert-s-r-i0", "s"));
  EXPECT_FALSE(is_session_segment("flexpert-s-r0-i0-g", "s"));
  EXPECT_FALSE(is_session_segment("flexpert-st-r0-i0", "s"));
}

TEST(ShmLayoutTest, MailboxesAreDisjointAndAligned) {
  auto layout = shm::Layout::compute(3, 100, 1000);
  ASSERT_TRUE(layout.ok());
  std::byte* base = nullptr;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (int exchange = 0; exchange < 2; ++exchange) {
    for (int src = 0; src < 3; ++src) {
      for (int op = 0; op < 2; ++op) {
        auto* mb = layout->mailbox(base, exchange != 0, src, op);
        const auto begin = reinterpret_cast<uintptr_t>(mb);
        EXPECT_EQ(begin % shm::kCacheLineBytes, 0u);
        spans.push_back({begin, begin + sizeof(shm::MailboxHeader) + (exchange ? 1000 : 100)});
      }
    }
  }
  std::sort(spans.begin(), spans.end());
  EXPECT_GE(spans.front().first, sizeof(shm::SegmentHeader));
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);
  EXPECT_LE(spans.back().second, layout->total_bytes);
  EXPECT_EQ(layout->total_bytes % 4096, 0u);
  EXPECT_FALSE(shm::Layout::compute(0, 1, 1).ok());
  EXPECT_FALSE(shm::Layout::compute(1 << 20, 1, 1).ok());
}

// /proc/<pid>/stat lines as the kernel writes them: the name may hold spaces and ')'.
TEST(ProcessWatchTest, ParsesStateFlagsAndStartTime) {
  shm::ProcStat st;
  ASSERT_TRUE(shm::parse_proc_stat(
      "4242 (flexpert worker) S 1 4242 4242 0 -1 4194560 120 0 0 0 3 1 0 0 20 0 3 0 "
      "987654 1000 200\n",
      &st));
  EXPECT_EQ(st.state, 'S');
  EXPECT_EQ(st.flags, 4194560u);  // PF_RANDOMIZE | PF_SUPERPRIV: not exiting.
  EXPECT_FALSE(shm::proc_stat_exiting(st));
  EXPECT_EQ(st.start_time, 987654u);
  // Killed: still running (R) or sleeping in the teardown (D), but PF_EXITING.
  ASSERT_TRUE(shm::parse_proc_stat(
      "77 (a) b) (c) R 1 77 77 0 -1 4194564 0 0 0 0 0 0 0 0 20 0 1 0 31337 0 0", &st));
  EXPECT_EQ(st.state, 'R');
  EXPECT_TRUE(shm::proc_stat_exiting(st));
  EXPECT_EQ(st.start_time, 31337u);
  ASSERT_TRUE(shm::parse_proc_stat("9 (z) Z 1 9 9 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 5", &st));
  EXPECT_TRUE(shm::proc_stat_exiting(st));  // A zombie, whatever its flags.
  EXPECT_FALSE(shm::parse_proc_stat("77 (short) R 1 77", &st));
  EXPECT_FALSE(shm::parse_proc_stat("no name here", &st));
  EXPECT_FALSE(shm::parse_proc_stat("7 (x) R 1 7 7 0 -1 flags 0 0 0 0 0 0 0 0 20 0 1 0 5", &st));
}

// A process whose main thread has gone through exit (a zombie leader, PF_EXITING) while
// another thread still runs has not ended: only a process all of whose threads are in
// the exit path has (as after a SIGKILL, while the kernel tears its memory down).
TEST(ProcessWatchTest, ALeaderLeavingAloneIsNoEnd) {
  const shm::ProcessWatch self =
      shm::ProcessWatch::watch(::getpid(), shm::process_start_time(::getpid()));
  ASSERT_TRUE(self.watching());
  EXPECT_FALSE(self.exited());
  EXPECT_FALSE(self.ended());
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::thread([] {
      for (;;) ::pause();
    }).detach();
    ::syscall(SYS_exit, 0);  // This thread only; the other keeps the process.
    ::_exit(3);
  }
  const shm::ProcessWatch watch = shm::ProcessWatch::watch(pid, shm::process_start_time(pid));
  ASSERT_TRUE(watch.watching());
  // Wait until the leader's own entry says it is exiting.
  const std::string stat_path = "/proc/" + std::to_string(pid) + "/stat";
  bool leader_gone = false;
  for (int i = 0; i < 5000 && !leader_gone; ++i) {
    std::ifstream in(stat_path);
    std::string line;
    shm::ProcStat st;
    leader_gone =
        std::getline(in, line) && shm::parse_proc_stat(line, &st) && shm::proc_stat_exiting(st);
    if (!leader_gone) ::usleep(1000);
  }
  ASSERT_TRUE(leader_gone);
  EXPECT_FALSE(watch.ended());  // Its other thread runs on.
  if (watch.has_pidfd()) {
    EXPECT_FALSE(watch.exited());
  }
  ::kill(pid, SIGKILL);
  bool ended = false;
  for (int i = 0; i < 5000 && !ended; ++i) {
    ended = watch.ended();  // Before or after the kernel finished the exit.
    if (!ended) ::usleep(1000);
  }
  EXPECT_TRUE(ended);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(watch.exited());
  EXPECT_TRUE(watch.ended());
}

}  // namespace
}  // namespace flexpert
