// SPDX-License-Identifier: Apache-2.0
// Transport conformance, healthy path: collectives, groups, epochs, one-sided reads and input
// errors, on 2, 3 and 4 ranks that are real processes. Every backend must pass it unchanged;
// the failure scenarios are in conformance_fault_test.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "conformance_harness.h"

namespace flexpert::conformance {
namespace {

void sleep_us(int64_t us) { std::this_thread::sleep_for(std::chrono::microseconds(us)); }

// Checks a returned span vector's shape and that ranks outside `members` got nothing.
Status expect_only_members(const std::vector<ByteSpan>& got, const RankContext& ctx,
                           const std::vector<int>& members) {
  CT_REQUIRE(got.size() == static_cast<size_t>(ctx.options.max_ranks), "got ", got.size());
  for (int r = 0; r < ctx.options.max_ranks; ++r) {
    if (std::find(members.begin(), members.end(), r) == members.end()) {
      CT_REQUIRE(got[r].num_bytes == 0, "non-member rank ", r, " has ", got[r].num_bytes, " bytes");
    }
  }
  return Status();
}

size_t exchange_size(uint64_t round, int src, int dst, size_t capacity) {
  const uint64_t h = seed_of(round, src, dst, 11);
  switch (h % 5) {
    case 0:
      return 0;
    case 1:
      return capacity;
    default:
      return (h >> 8) % (capacity + 1);
  }
}

// One exchange round among `members` in `epoch`, contents checked. seed_base separates phases.
Status exchange_round(RankContext& ctx, const Group& g, uint64_t seed_base, uint64_t round) {
  const size_t capacity = ctx.options.max_exchange_bytes;
  std::vector<Buffer> buffers;
  buffers.reserve(g.ranks.size());
  std::vector<ByteSpan> send(static_cast<size_t>(ctx.options.max_ranks));
  for (int dst : g.ranks) {
    const size_t n = exchange_size(seed_base + round, ctx.rank, dst, capacity);
    buffers.push_back(ctx.buffer(pattern(seed_of(seed_base, round, ctx.rank, dst), n)));
    send[dst] = buffers.back().span();
  }
  CT_ASSIGN(std::vector<ByteSpan> got, ctx.t().exchange(g, send));
  CT_REQUIRE_OK(expect_only_members(got, ctx, g.ranks));
  for (int src : g.ranks) {
    const size_t n = exchange_size(seed_base + round, src, ctx.rank, capacity);
    CT_REQUIRE_OK(ctx.expect_bytes(got[src], seed_of(seed_base, round, src, ctx.rank), n,
                                   cat("exchange round ", round, " from rank ", src)));
  }
  return Status();
}

// One all_gather among `g`, contents checked; the result is returned for further checks.
Result<std::vector<ByteSpan>> gather_round(RankContext& ctx, const Group& g, uint64_t seed_base,
                                           uint64_t op, size_t num_bytes) {
  Buffer in = ctx.buffer(pattern(seed_of(seed_base, op, ctx.rank), num_bytes));
  CT_ASSIGN(std::vector<ByteSpan> got, ctx.t().all_gather(g, in.span()));
  CT_REQUIRE_OK(expect_only_members(got, ctx, g.ranks));
  for (int r : g.ranks) {
    CT_REQUIRE_OK(ctx.expect_bytes(got[r], seed_of(seed_base, op, r), num_bytes,
                                   cat("all_gather op ", op, " from rank ", r)));
  }
  return got;
}

class CollectiveConformanceTest : public ConformanceTest {};

// Thousands of back-to-back ops with sizes 0..capacity: a mailbox reused too early shows up
// as a wrong byte. Every 97th op the rank lingers before checking, so peers race ahead.
TEST_P(CollectiveConformanceTest, AllGatherThousandsOfOpsBackToBack) {
  ClusterSpec s = spec(10000);
  s.options.max_gather_bytes = 256;
  run_ok(s, [](RankContext& ctx) -> Status {
    const Group g = ctx.group(1);
    for (uint64_t op = 0; op < 3000; ++op) {
      const size_t n = (op * 37) % 257;
      Buffer in = ctx.buffer(pattern(seed_of(1, op, ctx.rank), n));
      CT_ASSIGN(std::vector<ByteSpan> got, ctx.t().all_gather(g, in.span()));
      if (op % 97 == 0) sleep_us(1000);
      CT_REQUIRE_OK(expect_only_members(got, ctx, g.ranks));
      for (int r : g.ranks) {
        CT_REQUIRE_OK(
            ctx.expect_bytes(got[r], seed_of(1, op, r), n, cat("op ", op, " from rank ", r)));
      }
    }
    return Status();
  });
}

TEST_P(CollectiveConformanceTest, BarrierReleasesNobodyEarly) {
  run_ok(spec(10000), [](RankContext& ctx) -> Status {
    std::mt19937 rng(static_cast<unsigned>(ctx.rank) + 1);
    std::atomic<int64_t>& arrivals = ctx.shared->values[0];
    for (int64_t round = 0; round < 200; ++round) {
      if (rng() % 4 == 0) sleep_us(rng() % 300);
      arrivals.fetch_add(1);
      CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));
      const int64_t seen = arrivals.load();
      CT_REQUIRE(seen >= (round + 1) * ctx.num_ranks, "round ", round, ": left the barrier with ",
                 seen, " arrivals");
    }
    return Status();
  });
}

// Per-pair sizes from 0 to exactly the capacity (not a multiple of 64), many rounds, mixed
// with all_gathers so the two mailbox kinds interleave.
TEST_P(CollectiveConformanceTest, ExchangeRandomSizesIncludingZeroAndMax) {
  ClusterSpec s = spec(10000);
  s.options.max_exchange_bytes = 16411;
  run_ok(s, [](RankContext& ctx) -> Status {
    const Group g = ctx.group(1);
    for (uint64_t round = 0; round < 300; ++round) {
      CT_REQUIRE_OK(exchange_round(ctx, g, 100, round));
      if (round % 10 == 0) CT_REQUIRE_OK(gather_round(ctx, g, 200, round, 64));
    }
    return Status();
  });
}

// A group of some ranks: the others call nothing and must not be waited on. Afterwards all
// ranks continue together in a new epoch (a member set is fixed per epoch).
TEST_P(CollectiveConformanceTest, SubsetGroupLeavesNonMembersIdle) {
  run_ok(spec(10000), [](RankContext& ctx) -> Status {
    const std::vector<int> members =
        ctx.num_ranks == 2 ? std::vector<int>{0} : std::vector<int>{0, ctx.num_ranks - 1};
    const Group sub = RankContext::group(1, members);
    if (sub.contains(ctx.rank)) {
      for (uint64_t op = 0; op < 200; ++op) {
        CT_REQUIRE_OK(gather_round(ctx, sub, 300, op, 48));
        CT_REQUIRE_OK(exchange_round(ctx, sub, 400, op));
      }
      ctx.shared->values[0].fetch_add(1);
    } else {
      CT_REQUIRE_OK(ctx.await_value(0, static_cast<int64_t>(members.size())));
    }
    const Group all = ctx.group(2);
    CT_REQUIRE_OK(ctx.t().barrier(all));
    for (uint64_t op = 0; op < 20; ++op) CT_REQUIRE_OK(gather_round(ctx, all, 500, op, 100));
    return Status();
  });
}

// Epoch 1 (all ranks) -> epoch 2 (another member set) -> epoch 7 (all again). Rank 0 holds
// the spans of epoch 1's last op while the others start epoch 2, whose first op writes the
// same mailbox parity: the spans must stay intact until rank 0's next collective.
TEST_P(CollectiveConformanceTest, EpochChangeWithNewMemberSet) {
  ClusterSpec s = spec(10000);
  s.options.max_exchange_bytes = 4096;
  run_ok(s, [](RankContext& ctx) -> Status {
    const int n = ctx.num_ranks;
    std::vector<ByteSpan> last;
    for (uint64_t op = 0; op < 101; ++op) {
      CT_ASSIGN(last, gather_round(ctx, ctx.group(1), 600, op, 200));
    }
    if (ctx.rank == 0) {
      sleep_us(100'000);
      for (int r = 0; r < n; ++r) {
        CT_REQUIRE_OK(ctx.expect_bytes(last[r], seed_of(600, 100, r), 200,
                                       cat("held span of rank ", r, " after the others moved on")));
      }
    }
    std::vector<int> second;
    for (int r = 0; r < n; ++r) {
      if (n == 2 || r != n - 1) second.push_back(r);
    }
    const Group g2 = RankContext::group(2, second);
    if (g2.contains(ctx.rank)) {
      for (uint64_t op = 0; op < 51; ++op) {
        CT_REQUIRE_OK(exchange_round(ctx, g2, 700, op));
        CT_REQUIRE_OK(gather_round(ctx, g2, 800, op, 32));
      }
    }
    for (uint64_t op = 0; op < 20; ++op) {
      CT_REQUIRE_OK(gather_round(ctx, ctx.group(7), 900, op, 16));
      CT_REQUIRE_OK(exchange_round(ctx, ctx.group(7), 1000, op));
    }
    return Status();
  });
}

// Many epoch switches right after large exchanges: a rank still copying its sends has not
// taken the messages that fast peers sent it, and those peers' first op of the next epoch
// maps to the same mailbox. No message may be lost or overwritten (a spurious Aborted or a
// wrong byte here means a writer raced a reader across the epoch boundary).
TEST_P(CollectiveConformanceTest, BackToBackEpochSwitchesAfterLargeExchanges) {
  ClusterSpec s = spec(10000);
  s.options.max_exchange_bytes = 256 << 10;
  run_ok(s, [](RankContext& ctx) -> Status {
    for (uint64_t epoch = 1; epoch <= 40; ++epoch) {
      const Group g = ctx.group(epoch * 3);  // Increasing, not consecutive.
      for (uint64_t op = 0; op < 3; ++op) CT_REQUIRE_OK(exchange_round(ctx, g, epoch << 8, op));
    }
    return Status();
  });
}

// Regions with known contents, read at random offsets and sizes from every rank (itself
// included), then from a second thread while the main thread runs collectives.
TEST_P(CollectiveConformanceTest, ReadPeerRegionsAlsoFromASecondThread) {
  run_ok(spec(10000), [](RankContext& ctx) -> Status {
    if (!ctx.t().capabilities().one_sided_read) return Status();
    const std::vector<std::pair<int, size_t>> regions = {{0, 64 << 10}, {5, (1 << 20) + 13}};
    auto region_seed = [](int rank, int id) { return seed_of(rank, id, 77); };
    for (const auto& [id, size] : regions) {
      CT_ASSIGN(Region region, ctx.t().allocate_region(id, size));
      CT_REQUIRE(region.id == id && region.num_bytes == size && region.data != nullptr);
      const std::vector<uint8_t> bytes = pattern(region_seed(ctx.rank, id), size);
      ctx.memory->copy_in(region.data, bytes.data(), size);
    }
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));

    // Expected contents of every rank's regions, computed once.
    std::vector<std::vector<std::vector<uint8_t>>> want(ctx.num_ranks);
    for (int r = 0; r < ctx.num_ranks; ++r) {
      for (const auto& [id, size] : regions) want[r].push_back(pattern(region_seed(r, id), size));
    }
    auto random_reads = [&](uint64_t seed, int count) -> Status {
      std::mt19937_64 rng(seed);
      std::vector<uint8_t> host;
      for (int i = 0; i < count; ++i) {
        const int peer = static_cast<int>(rng() % ctx.num_ranks);
        const size_t which = rng() % regions.size();
        const size_t size = regions[which].second;
        const size_t offset = rng() % (size + 1);
        const size_t n = std::min<size_t>(size - offset, rng() % 3 == 0 ? size : rng() % 5000);
        Buffer dst = ctx.buffer(std::vector<uint8_t>(n));
        CT_REQUIRE_OK(ctx.t().read(peer, regions[which].first, offset,
                                   const_cast<void*>(dst.span().data), n));
        host = ctx.download(dst.span());
        CT_REQUIRE(std::equal(host.begin(), host.end(), want[peer][which].begin() + offset),
                   "read of rank ", peer, " region ", regions[which].first, " [", offset, ", +", n,
                   ") differs");
      }
      return Status();
    };
    CT_REQUIRE_OK(random_reads(seed_of(ctx.rank, 1), 200));

    std::atomic<bool> stop{false};
    std::atomic<int> reads_done{0};
    Status reader_status;
    std::thread reader([&] {
      for (uint64_t i = 0; !stop.load() && reader_status.ok(); ++i) {
        reader_status = random_reads(seed_of(ctx.rank, 2, i), 5);
        reads_done.fetch_add(5);
      }
    });
    // The reader has started reading before the collectives begin (on a loaded machine
    // it could otherwise be scheduled only after them).
    while (reads_done.load() == 0) std::this_thread::yield();  // Counted even on failure.
    Status main_status;
    for (uint64_t op = 0; op < 300 && main_status.ok(); ++op) {
      main_status = gather_round(ctx, ctx.group(1), 1100, op, 128).status();
    }
    stop.store(true);
    reader.join();
    CT_REQUIRE_OK(main_status);
    CT_REQUIRE_OK(reader_status);
    CT_REQUIRE(reads_done.load() > 0);

    // A region allocated after peers connected is found too (peers map regions lazily).
    CT_ASSIGN(Region late, ctx.t().allocate_region(9, 4097));
    const std::vector<uint8_t> late_bytes = pattern(region_seed(ctx.rank, 9), 4097);
    ctx.memory->copy_in(late.data, late_bytes.data(), late_bytes.size());
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));
    for (int peer = 0; peer < ctx.num_ranks; ++peer) {
      Buffer dst = ctx.buffer(std::vector<uint8_t>(4097));
      CT_REQUIRE_OK(ctx.t().read(peer, 9, 0, const_cast<void*>(dst.span().data), 4097));
      CT_REQUIRE(ctx.download(dst.span()) == pattern(region_seed(peer, 9), 4097));
    }
    // Nobody shuts down (unlinking its regions) while another rank may still read them.
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));
    return Status();
  });
}

// A rank that is not in any collective (a joiner being attached, a halted survivor) but calls
// progress() while it waits serves reads of its regions: over UCX's TCP a read is messages
// the owner must take. Rank 0 reads rank 1 while rank 1 only progresses.
TEST_P(CollectiveConformanceTest, ReadsOfARankThatOnlyProgresses) {
  run_ok(spec(2000), [](RankContext& ctx) -> Status {
    if (!ctx.t().capabilities().one_sided_read) return Status();
    constexpr size_t kBytes = 4096;
    CT_ASSIGN(Region region, ctx.t().allocate_region(3, kBytes));
    const std::vector<uint8_t> bytes = pattern(seed_of(ctx.rank, 3), kBytes);
    ctx.memory->copy_in(region.data, bytes.data(), kBytes);
    std::atomic<int64_t>& reads_done = ctx.shared->values[0];
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));
    if (ctx.rank == 1) {
      while (reads_done.load() == 0) {
        ctx.t().progress();
        sleep_us(500);  // A worker's wait for its next command.
      }
    } else if (ctx.rank == 0) {
      auto reads = [&]() -> Status {
        for (int i = 0; i < 20; ++i) {
          Buffer dst = ctx.buffer(std::vector<uint8_t>(kBytes));
          CT_REQUIRE_OK(ctx.t().read(1, 3, 0, const_cast<void*>(dst.span().data), kBytes));
          CT_REQUIRE(ctx.download(dst.span()) == pattern(seed_of(1, 3), kBytes), "read ", i,
                     " differs");
        }
        return Status();
      };
      const Status s = reads();
      reads_done.store(1);  // Also on failure: rank 1 stops waiting.
      CT_REQUIRE_OK(s);
    } else {
      while (reads_done.load() == 0) sleep_us(500);
    }
    return ctx.t().barrier(ctx.group(1));
  });
}

// Mapped peer buffers (capabilities().mapped_peer_buffers): each rank registers buffers it
// allocated in its backend memory and wrote; every rank maps every rank's (itself included) and
// reads them through the returned pointer, then again after the owners rewrote them (a
// mapping, not a copy). Backends without the capability answer Unimplemented. The buffers are
// device memory (RankContext::device_memory) whatever memory the collectives use.
TEST_P(CollectiveConformanceTest, MappedPeerBuffersReadThroughThePeersPointer) {
  run_ok(spec(10000), [](RankContext& ctx) -> Status {
    Transport& t = ctx.t();
    if (!t.capabilities().mapped_peer_buffers) {
      std::vector<uint8_t> host(16);
      CT_REQUIRE(t.register_buffer(3, host.data(), host.size()).code() ==
                 StatusCode::kUnimplemented);
      CT_REQUIRE(
          t.map_peer_buffer((ctx.rank + 1) % ctx.num_ranks, 3, MapMode::kMap).status().code() ==
          StatusCode::kUnimplemented);
      return t.barrier(ctx.group(1));  // Nobody shuts down before the others connected.
    }
    CT_REQUIRE(ctx.device_memory != nullptr, "no device memory for registered buffers");
    BackendMemory& device = *ctx.device_memory;
    const std::vector<std::pair<int, size_t>> buffers = {{3, 4096}, {1 << 20, (256 << 10) + 7}};
    auto seed = [](int rank, int id, int phase) { return seed_of(rank, id, phase, 91); };
    std::vector<void*> memory;
    for (const auto& [id, size] : buffers) {
      memory.push_back(device.allocate(size));
      const std::vector<uint8_t> bytes = pattern(seed(ctx.rank, id, 0), size);
      device.copy_in(memory.back(), bytes.data(), size);
      CT_REQUIRE_OK(t.register_buffer(id, memory.back(), size));
    }
    CT_REQUIRE(t.register_buffer(3, memory[0], 16).code() == StatusCode::kInvalidArgument);
    CT_REQUIRE(t.register_buffer(-1, memory[0], 16).code() == StatusCode::kInvalidArgument);
    CT_REQUIRE(t.register_buffer(4, nullptr, 16).code() == StatusCode::kInvalidArgument);
    CT_REQUIRE_OK(t.barrier(ctx.group(1)));

    // Reads `size` bytes through a mapped pointer and compares them with the owner's pattern.
    auto check = [&](const PeerBuffer& b, int owner, int id, size_t size, int phase) -> Status {
      CT_REQUIRE(b.data != nullptr && b.num_bytes == size, "buffer ", id, " of rank ", owner, ": ",
                 b.num_bytes, " bytes");
      std::vector<uint8_t> host(size);
      device.copy_out(host.data(), b.data, size);
      CT_REQUIRE(host == pattern(seed(owner, id, phase), size), "buffer ", id, " of rank ", owner,
                 " read through its mapping differs (phase ", phase, ")");
      return Status();
    };
    std::vector<std::vector<PeerBuffer>> mapped(ctx.num_ranks);
    for (int r = 0; r < ctx.num_ranks; ++r) {
      for (const auto& [id, size] : buffers) {
        CT_ASSIGN(PeerBuffer looked, t.map_peer_buffer(r, id, MapMode::kLookup));
        CT_REQUIRE(looked.incarnation == 0, looked.incarnation);
        CT_REQUIRE(r != ctx.rank || looked.data == memory[mapped[r].size()],
                   "own buffer not at its address");
        CT_ASSIGN(PeerBuffer b, t.map_peer_buffer(r, id, MapMode::kMap));
        CT_REQUIRE_OK(check(b, r, id, size, 0));
        CT_ASSIGN(PeerBuffer again, t.map_peer_buffer(r, id, MapMode::kLookup));
        CT_REQUIRE(again.data == b.data, "a second call maps buffer ", id, " of rank ", r,
                   " again");
        mapped[r].push_back(std::move(b));
      }
      CT_REQUIRE(t.map_peer_buffer(r, 42, MapMode::kMap).status().code() == StatusCode::kNotFound);
      // A registered buffer is a region too (where regions are device memory).
      if (!t.capabilities().device_memory) continue;
      std::vector<uint8_t> head(64);
      Buffer dst = ctx.buffer(head);
      CT_REQUIRE_OK(t.read(r, 3, 100, const_cast<void*>(dst.span().data), head.size()));
      const std::vector<uint8_t> want = pattern(seed(r, 3, 0), 4096);
      CT_REQUIRE(ctx.download(dst.span()) ==
                 std::vector<uint8_t>(want.begin() + 100, want.begin() + 164));
    }
    CT_REQUIRE(t.map_peer_buffer(ctx.options.max_ranks - 1, 3, MapMode::kMap).status().code() ==
               StatusCode::kUnavailable);  // Never connected.
    CT_REQUIRE(t.map_peer_buffer(-1, 3, MapMode::kMap).status().code() ==
               StatusCode::kInvalidArgument);
    CT_REQUIRE_OK(t.barrier(ctx.group(1)));  // Everyone read phase 0.

    for (size_t i = 0; i < buffers.size(); ++i) {
      const auto& [id, size] = buffers[i];
      const std::vector<uint8_t> bytes = pattern(seed(ctx.rank, id, 1), size);
      device.copy_in(memory[i], bytes.data(), size);
    }
    CT_REQUIRE_OK(t.barrier(ctx.group(1)));
    for (int r = 0; r < ctx.num_ranks; ++r) {
      for (size_t i = 0; i < buffers.size(); ++i) {
        CT_REQUIRE_OK(check(mapped[r][i], r, buffers[i].first, buffers[i].second, 1));
      }
    }
    mapped.clear();
    // Nobody shuts down (and frees) while another rank may still read its buffers.
    CT_REQUIRE_OK(t.barrier(ctx.group(1)));
    CT_REQUIRE_OK(t.shutdown());
    for (void* m : memory) device.release(m);
    return Status();
  });
}

// Bad input gets a clear error, never a crash, and consumes nothing: the collective after
// the errors still pairs with the peers' next collective.
TEST_P(CollectiveConformanceTest, InvalidCallsFailCleanlyAndConsumeNothing) {
  ClusterSpec s = spec(10000);
  s.options.max_gather_bytes = 128;
  s.options.max_exchange_bytes = 1024;
  run_ok(s, [](RankContext& ctx) -> Status {
    Transport& t = ctx.t();
    const int n = ctx.num_ranks;
    const int peer = (ctx.rank + 1) % n;
    const Group g = ctx.group(3);
    const bool reads = t.capabilities().one_sided_read;
    if (reads) CT_REQUIRE_OK(t.allocate_region(0, 1000));
    CT_REQUIRE_OK(t.barrier(g));
    auto code_of = [](const Status& st) { return st.code(); };

    if (reads) {
      Buffer dst = ctx.buffer(std::vector<uint8_t>(64));
      void* d = const_cast<void*>(dst.span().data);
      CT_REQUIRE_OK(t.read(peer, 0, 990, d, 10));
      CT_REQUIRE_OK(t.read(peer, 0, 1000, d, 0));
      CT_REQUIRE(code_of(t.read(peer, 0, 990, d, 11)) == StatusCode::kInvalidArgument);
      CT_REQUIRE(code_of(t.read(peer, 0, 1001, d, 0)) == StatusCode::kInvalidArgument);
      CT_REQUIRE(code_of(t.read(peer, 0, SIZE_MAX - 2, d, 8)) == StatusCode::kInvalidArgument);
      CT_REQUIRE(code_of(t.read(peer, 42, 0, d, 1)) == StatusCode::kNotFound);
      CT_REQUIRE(code_of(t.read(ctx.rank, 42, 0, d, 1)) == StatusCode::kNotFound);
      CT_REQUIRE(code_of(t.read(-1, 0, 0, d, 1)) == StatusCode::kInvalidArgument);
      CT_REQUIRE(code_of(t.read(ctx.options.max_ranks, 0, 0, d, 1)) ==
                 StatusCode::kInvalidArgument);
      CT_REQUIRE(code_of(t.allocate_region(0, 10).status()) == StatusCode::kInvalidArgument);
      CT_REQUIRE(code_of(t.allocate_region(-1, 10).status()) == StatusCode::kInvalidArgument);
    }
    const std::vector<uint8_t> too_big(ctx.options.max_exchange_bytes + 1, 1);
    Buffer big = ctx.buffer(too_big);
    ByteSpan over_gather{big.span().data, ctx.options.max_gather_bytes + 1};
    CT_REQUIRE(code_of(t.all_gather(g, over_gather).status()) == StatusCode::kInvalidArgument);
    std::vector<ByteSpan> send(static_cast<size_t>(ctx.options.max_ranks));
    send[peer] = big.span();
    CT_REQUIRE(code_of(t.exchange(g, send).status()) == StatusCode::kInvalidArgument);
    send[peer] = ByteSpan{};
    send[n] = ByteSpan{big.span().data, 1};  // Rank n exists (max_ranks) but is no member.
    CT_REQUIRE(code_of(t.exchange(g, send).status()) == StatusCode::kInvalidArgument);
    CT_REQUIRE(code_of(t.exchange(g, std::vector<ByteSpan>(n - 1)).status()) ==
               StatusCode::kInvalidArgument);
    std::vector<int> without_me;
    for (int r = 0; r < n; ++r) {
      if (r != ctx.rank) without_me.push_back(r);
    }
    CT_REQUIRE(code_of(t.barrier(RankContext::group(3, without_me))) ==
               StatusCode::kFailedPrecondition);
    std::vector<int> unsorted = g.ranks;
    std::reverse(unsorted.begin(), unsorted.end());
    CT_REQUIRE(code_of(t.barrier(RankContext::group(3, unsorted))) == StatusCode::kInvalidArgument);
    std::vector<int> with_stranger = g.ranks;
    with_stranger.push_back(n);  // Never connected.
    CT_REQUIRE(code_of(t.barrier(RankContext::group(3, with_stranger))) ==
               StatusCode::kFailedPrecondition);
    CT_REQUIRE(code_of(t.barrier(ctx.group(2))) == StatusCode::kAborted);  // Older epoch.

    // Exactly at capacity works, and pairs with the peers' next op.
    for (uint64_t op = 0; op < 3; ++op) {
      CT_REQUIRE_OK(gather_round(ctx, g, 1200, op, ctx.options.max_gather_bytes));
    }
    CT_REQUIRE_OK(t.barrier(g));  // Peers may still read our region until here.
    return Status();
  });
}

CT_INSTANTIATE(CollectiveConformanceTest);

}  // namespace
}  // namespace flexpert::conformance
