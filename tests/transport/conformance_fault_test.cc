// SPDX-License-Identifier: Apache-2.0
// Transport conformance, failure path: a rank killed mid-exchange, a silent rank, a rank in
// a newer epoch, a rank that shuts down, a rank that comes back as a new incarnation, and
// injected faults. The contract: an error with the right code within the timeout (plus a
// scheduling margin), never a hang, and the group can continue in a new epoch.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "conformance_harness.h"

namespace flexpert::conformance {
namespace {

// Slack on a loaded 2-core machine (sanitizers included) on top of the transport timeout.
constexpr double kMarginMs = 1500;

// A transport error comes back as is (its code matters here); a content error as Internal.
Status all_gather_checked(RankContext& ctx, const Group& g, uint64_t seed_base, uint64_t op) {
  Buffer in = ctx.buffer(pattern(seed_of(seed_base, op, ctx.rank), 24));
  auto result = ctx.t().all_gather(g, in.span());
  if (!result.ok()) return result.status();
  const std::vector<ByteSpan>& got = *result;
  for (int r : g.ranks) {
    CT_REQUIRE_OK(ctx.expect_bytes(got[r], seed_of(seed_base, op, r), 24,
                                   cat("epoch ", g.epoch, " op ", op, " from rank ", r)));
  }
  return Status();
}

// Called by every rank after a collective: the victim SIGKILLs itself once the others have
// returned from it too (shared value `idx` counts them). Returning from a
// collective does not mean this rank's messages reached the others: over ucx a completed send
// may still be on its way (docs/ARCHITECTURE.md, the ucx transport's shutdown), and a peer
// still waiting for it sees the death inside that collective instead.
Status die_after_others_returned(RankContext& ctx, int victim, int idx) {
  if (ctx.rank != victim) {
    ctx.shared->values[idx].fetch_add(1);
    return Status();
  }
  CT_REQUIRE_OK(ctx.await_value(idx, ctx.num_ranks - 1));
  ::raise(SIGKILL);
  return Status();
}

// No hang; the victim ended by SIGKILL, every other rank exited cleanly.
void expect_only_victim_killed(const RunResult& result, int num_ranks, int victim) {
  EXPECT_FALSE(result.timed_out) << "hang";
  for (int r = 0; r < num_ranks; ++r) {
    if (r == victim) {
      EXPECT_TRUE(WIFSIGNALED(result.wait_status[r]) && WTERMSIG(result.wait_status[r]) == SIGKILL)
          << describe_wait_status(result.wait_status[r]);
    } else {
      EXPECT_TRUE(exited_ok(result.wait_status[r]))
          << "rank " << r << ": " << describe_wait_status(result.wait_status[r]);
    }
  }
}

class FaultConformanceTest : public ConformanceTest {};

// The last rank is SIGKILLed by the parent while all ranks exchange 64 KiB per pair in a
// loop: every survivor gets Unavailable (or DeadlineExceeded) soon after the death.
TEST_P(FaultConformanceTest, PeerKilledMidExchange) {
  ClusterSpec s = spec(1000);
  s.options.max_exchange_bytes = 64 << 10;
  const int victim = num_ranks() - 1;
  bool killed = false;
  s.parent_step = [&](ParentView& view) {
    // values[1]: rounds done by rank 0; values[2]: when the victim was killed.
    if (killed || view.shared->values[1].load() < 200) return;
    view.shared->values[2].store(mono_now_ns());
    ::kill(view.pids[victim], SIGKILL);
    killed = true;
  };
  const RunResult result = run_cluster(backend(), s, [victim](RankContext& ctx) -> Status {
    std::vector<uint8_t> bytes = pattern(seed_of(ctx.rank, 5), ctx.options.max_exchange_bytes);
    Buffer payload = ctx.buffer(bytes);
    std::vector<ByteSpan> send(static_cast<size_t>(ctx.options.max_ranks));
    for (int r = 0; r < ctx.num_ranks; ++r) send[r] = payload.span();
    for (uint64_t round = 0; round < 10'000'000; ++round) {
      auto got = ctx.t().exchange(ctx.group(1), send);
      if (got.ok()) {
        if (ctx.rank == 0) ctx.shared->values[1].fetch_add(1);
        continue;
      }
      const int64_t killed_at = ctx.shared->values[2].load();
      CT_REQUIRE(ctx.rank != victim, "the victim failed first: ", got.status().to_string());
      CT_REQUIRE(killed_at > 0, "failed before the kill: ", got.status().to_string());
      const double after_ms = ms_since(killed_at);
      const StatusCode code = got.status().code();
      CT_REQUIRE(code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded,
                 got.status().to_string());
      CT_REQUIRE(after_ms < ctx.options.timeout_ms + kMarginMs, "noticed after ", after_ms, " ms");
      std::fprintf(stderr, "[rank %d] %.1f ms after the kill: %s\n", ctx.rank, after_ms,
                   got.status().to_string().c_str());
      return Status();
    }
    return internal_error("the exchange loop ended without an error");
  });
  expect_only_victim_killed(result, num_ranks(), victim);
  // The victim could not clean up; the survivors did. A supervisor removes the rest.
  for (const std::string& name : leftover_segments(result.session)) {
    EXPECT_NE(name.find("-r" + std::to_string(victim) + "-"), std::string::npos) << name;
  }
  cleanup_session(backend(), result.session);
  EXPECT_TRUE(leftover_segments(result.session).empty());
}

// Transport::peer_status, outside any collective (what a device exchange polls while its
// kernels wait): OK for live peers, then Unavailable "rank R (pid P) died" soon after the
// last rank's process ends; timeout_ms() is the option's.
TEST_P(FaultConformanceTest, PeerStatusSeesADeathOutsideCollectives) {
  const int victim = num_ranks() - 1;
  const RunResult result = run_cluster(backend(), spec(1500), [victim](RankContext& ctx) -> Status {
    CT_REQUIRE(ctx.t().timeout_ms() == ctx.options.timeout_ms, ctx.t().timeout_ms());
    for (int r = 0; r < ctx.num_ranks; ++r) CT_REQUIRE_OK(ctx.t().peer_status(r));
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));  // Everyone looked before the death.
    CT_REQUIRE_OK(die_after_others_returned(ctx, victim, 0));
    const int64_t start = mono_now_ns();
    for (;;) {
      const Status st = ctx.t().peer_status(victim);
      if (!st.ok()) {
        CT_REQUIRE(st.code() == StatusCode::kUnavailable, st.to_string());
        CT_REQUIRE(st.message().rfind(cat("rank ", victim, " (pid "), 0) == 0 &&
                       st.message().find(") died") != std::string::npos,
                   st.to_string());
        // The dead rank travels as a number (WorkerError::dead_rank), not as text.
        CT_REQUIRE(st.dead_rank() == victim, st.dead_rank());
        std::fprintf(stderr, "[rank %d] %.1f ms after the barrier: %s\n", ctx.rank, ms_since(start),
                     st.to_string().c_str());
        break;
      }
      CT_REQUIRE(ms_since(start) < 3000, "no death seen after ", ms_since(start), " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Group survivors{2, {}};
    for (int r = 0; r < ctx.num_ranks; ++r) {
      if (r == victim) continue;
      CT_REQUIRE_OK(ctx.t().peer_status(r));
      survivors.ranks.push_back(r);
    }
    return ctx.t().barrier(survivors);  // Nobody shuts down before all have looked.
  });
  expect_only_victim_killed(result, num_ranks(), victim);
  cleanup_session(backend(), result.session);
}

// The last rank stays alive but stops calling: the others get DeadlineExceeded naming it,
// after about timeout_ms.
TEST_P(FaultConformanceTest, SilentPeerTimesOut) {
  run_ok(spec(600), [](RankContext& ctx) -> Status {
    const int silent = ctx.num_ranks - 1;
    for (uint64_t op = 0; op < 20; ++op)
      CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(1), 1, op));
    if (ctx.rank == silent) return ctx.await_value(0, ctx.num_ranks - 1);
    const int64_t start = mono_now_ns();
    const Status st = ctx.t().barrier(ctx.group(1));
    const double waited_ms = ms_since(start);
    ctx.shared->values[0].fetch_add(1);
    CT_REQUIRE(st.code() == StatusCode::kDeadlineExceeded, st.to_string());
    CT_REQUIRE(st.message().find("rank " + std::to_string(silent)) != std::string::npos,
               "does not name the silent rank: ", st.to_string());
    CT_REQUIRE(
        waited_ms >= ctx.options.timeout_ms - 5 && waited_ms < ctx.options.timeout_ms + kMarginMs,
        "waited ", waited_ms, " ms");
    return Status();
  });
}

// Transport::mark_peer_lost, as the front end's heartbeat calls it for a peer that went silent
// (a stopped process or a dropped link, which a network backend does not see for minutes): a
// wait on that peer ends at once with Unavailable naming it and the reason, peer_status() says
// so too, and the others continue in a new epoch without it. A backend without it answers
// Unimplemented, and then the wait times out as in SilentPeerTimesOut.
TEST_P(FaultConformanceTest, MarkPeerLostEndsWaitOnSilentPeer) {
  run_ok(spec(2000), [](RankContext& ctx) -> Status {
    const int silent = ctx.num_ranks - 1;
    for (uint64_t op = 0; op < 5; ++op) CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(1), 9, op));
    if (ctx.rank == silent) return ctx.await_value(0, ctx.num_ranks - 1);
    Status reported;
    std::thread heartbeat([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      reported = ctx.t().mark_peer_lost(silent, "missed 3 heartbeats");
    });
    const int64_t start = mono_now_ns();
    const Status st = ctx.t().barrier(ctx.group(1));
    const double waited_ms = ms_since(start);
    heartbeat.join();
    ctx.shared->values[0].fetch_add(1);
    if (reported.code() == StatusCode::kUnimplemented) {
      CT_REQUIRE(st.code() == StatusCode::kDeadlineExceeded, st.to_string());
      return Status();
    }
    CT_REQUIRE_OK(reported);
    CT_REQUIRE(st.code() == StatusCode::kUnavailable, st.to_string());
    CT_REQUIRE(st.message().find(cat("rank ", silent, " (pid ")) != std::string::npos &&
                   st.message().find("missed 3 heartbeats") != std::string::npos,
               st.to_string());
    CT_REQUIRE(waited_ms >= 90 && waited_ms < 100 + kMarginMs, "waited ", waited_ms, " ms");
    const Status seen = ctx.t().peer_status(silent);
    CT_REQUIRE(seen.code() == StatusCode::kUnavailable &&
                   seen.message().find("missed 3 heartbeats") != std::string::npos,
               seen.to_string());
    Group survivors{2, {}};
    for (int r = 0; r < ctx.num_ranks; ++r) {
      if (r != silent) survivors.ranks.push_back(r);
    }
    for (uint64_t op = 0; op < 10; ++op) CT_REQUIRE_OK(all_gather_checked(ctx, survivors, 10, op));
    return Status();
  });
}

// The last rank moves to epoch 2 while the others still run epoch 1: they get Aborted
// quickly (not at the timeout), redo the step in epoch 2, and everyone continues.
TEST_P(FaultConformanceTest, PeerInNewerEpochAborts) {
  run_ok(spec(5000), [](RankContext& ctx) -> Status {
    const int ahead = ctx.num_ranks - 1;
    for (uint64_t op = 0; op < 20; ++op)
      CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(1), 2, op));
    if (ctx.rank != ahead) {
      const int64_t start = mono_now_ns();
      const Status st = all_gather_checked(ctx, ctx.group(1), 2, 20);
      CT_REQUIRE(st.code() == StatusCode::kAborted, st.to_string());
      CT_REQUIRE(ms_since(start) < 1000, "Aborted only after ", ms_since(start), " ms");
    }
    for (uint64_t op = 0; op < 20; ++op)
      CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(2), 3, op));
    return Status();
  });
}

// A rank that shuts down is reported as Unavailable at once, not at the timeout.
TEST_P(FaultConformanceTest, PeerShutdownIsUnavailable) {
  run_ok(spec(5000), [](RankContext& ctx) -> Status {
    const int leaving = ctx.num_ranks - 1;
    for (uint64_t op = 0; op < 10; ++op)
      CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(1), 4, op));
    if (ctx.rank == leaving) {
      CT_REQUIRE_OK(ctx.t().shutdown());
      CT_REQUIRE_OK(ctx.t().shutdown());  // Idempotent.
      CT_REQUIRE(ctx.t().barrier(ctx.group(1)).code() == StatusCode::kFailedPrecondition);
      return ctx.await_value(0, ctx.num_ranks - 1);
    }
    const int64_t start = mono_now_ns();
    const Status st = ctx.t().barrier(ctx.group(1));
    ctx.shared->values[0].fetch_add(1);
    CT_REQUIRE(st.code() == StatusCode::kUnavailable, st.to_string());
    CT_REQUIRE(ms_since(start) < 1000, "noticed after ", ms_since(start), " ms");
    return Status();
  });
}

// Rank 1 leaves and comes back as incarnation 1 (a new address); the others connect() to
// it, which replaces the old attachment, and all continue in a newer epoch.
TEST_P(FaultConformanceTest, RankRejoinsAsNewIncarnation) {
  run_ok(spec(5000), [](RankContext& ctx) -> Status {
    for (uint64_t op = 0; op < 10; ++op)
      CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(1), 5, op));
    if (ctx.rank == 1) {
      const std::string old_address = ctx.t().address();
      CT_REQUIRE_OK(ctx.t().shutdown());
      ctx.transport.reset();
      ctx.options.incarnation = 1;
      CT_ASSIGN(ctx.transport, create_transport(ctx.backend, ctx.options));
      CT_REQUIRE(ctx.t().address() != old_address);
      ctx.publish_address(2);
      CT_REQUIRE_OK(ctx.connect_all(1));
    } else {
      const std::string old_address(ctx.shared->addresses[1]);
      CT_ASSIGN(std::string address, ctx.await_address(1, 2));
      CT_REQUIRE(address != old_address);
      CT_REQUIRE_OK(ctx.t().connect(1, address));
      CT_REQUIRE_OK(ctx.t().connect(1, address));  // Idempotent.
    }
    for (uint64_t op = 0; op < 20; ++op)
      CT_REQUIRE_OK(all_gather_checked(ctx, ctx.group(2), 6, op));
    return Status();
  });
}

// Mapped peer buffers of an incarnation that ended are refused: rank 1 shuts down and comes
// back as incarnation 1 with new contents (peers refuse the old one, then map the new one
// afresh once connect() attached it); the last rank is SIGKILLed (peers refuse its buffers,
// even those they had mapped, and owner_exited and owner_ending of a mapping held since before
// turn true).
// Backends without the capability only lose the last rank.
TEST_P(FaultConformanceTest, MappedBuffersOfAnEndedIncarnationAreRefused) {
  const int victim = num_ranks() - 1;
  const RunResult result = run_cluster(backend(), spec(3000), [victim](RankContext& ctx) -> Status {
    if (!ctx.t().capabilities().mapped_peer_buffers) {
      CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));
      return die_after_others_returned(ctx, victim, 0);
    }
    CT_REQUIRE(ctx.device_memory != nullptr, "no device memory for registered buffers");
    constexpr int kId = 3;
    constexpr size_t kBytes = 8192;
    auto seed = [](int rank, uint64_t incarnation) { return seed_of(rank, incarnation, 57); };
    auto register_own = [&]() -> Status {
      void* memory = ctx.device_memory->allocate(kBytes);  // Kept until the process ends.
      const std::vector<uint8_t> bytes = pattern(seed(ctx.rank, ctx.options.incarnation), kBytes);
      ctx.device_memory->copy_in(memory, bytes.data(), kBytes);
      return ctx.t().register_buffer(kId, memory, kBytes);
    };
    auto check = [&](int owner, uint64_t incarnation) -> Result<PeerBuffer> {
      CT_ASSIGN(PeerBuffer b, ctx.t().map_peer_buffer(owner, kId, MapMode::kMap));
      CT_REQUIRE(b.incarnation == incarnation, "rank ", owner, ": incarnation ", b.incarnation);
      CT_REQUIRE(b.num_bytes == kBytes && b.mapping != nullptr);
      std::vector<uint8_t> host(kBytes);
      ctx.device_memory->copy_out(host.data(), b.data, kBytes);
      CT_REQUIRE(host == pattern(seed(owner, incarnation), kBytes), "rank ", owner, " incarnation ",
                 incarnation, ": contents differ");
      return b;
    };
    CT_REQUIRE_OK(register_own());
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));
    std::vector<PeerBuffer> held;
    for (int r = 0; r < ctx.num_ranks; ++r) {
      CT_ASSIGN(PeerBuffer b, check(r, 0));
      // Peers' processes are watched (every rank is a process of its own) and all live now.
      if (r == ctx.rank) {
        CT_REQUIRE(!b.owner_exited, "this rank's own buffer has an owner watch");
        CT_REQUIRE(!b.owner_ending, "this rank's own buffer has an owner watch");
      } else {
        CT_REQUIRE(b.owner_exited && b.owner_ending, "rank ", r, "'s buffer has no owner watch");
        CT_REQUIRE(!b.owner_exited(), "rank ", r, "'s process counted as exited");
        CT_REQUIRE(!b.owner_ending(), "rank ", r, "'s process counted as on its way out");
      }
      held.push_back(std::move(b));
    }
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(1)));

    // Rank 1 leaves and rejoins as incarnation 1.
    if (ctx.rank == 1) {
      held.clear();
      CT_REQUIRE_OK(ctx.t().shutdown());
      ctx.shared->values[0].store(1);
      CT_REQUIRE_OK(ctx.await_value(1, ctx.num_ranks - 1));  // Everyone saw the refusal.
      ctx.transport.reset();
      ctx.options.incarnation = 1;
      CT_ASSIGN(ctx.transport, create_transport(ctx.backend, ctx.options));
      CT_REQUIRE_OK(register_own());
      ctx.publish_address(2);
      CT_REQUIRE_OK(ctx.connect_all(1));
    } else {
      CT_REQUIRE_OK(ctx.await_value(0, 1));
      const Status refused = ctx.t().map_peer_buffer(1, kId, MapMode::kMap).status();
      CT_REQUIRE(refused.code() == StatusCode::kUnavailable, refused.to_string());
      ctx.shared->values[1].fetch_add(1);
      CT_ASSIGN(std::string address, ctx.await_address(1, 2));
      CT_REQUIRE_OK(ctx.t().connect(1, address));
      CT_ASSIGN(PeerBuffer fresh, check(1, 1));
      CT_REQUIRE(fresh.mapping != held[1].mapping, "incarnation 1 reuses incarnation 0's mapping");
    }
    CT_REQUIRE_OK(ctx.t().barrier(ctx.group(2)));

    // The last rank dies; its buffers are refused from then on.
    CT_REQUIRE_OK(die_after_others_returned(ctx, victim, 2));
    const int64_t start = mono_now_ns();
    for (;;) {
      const auto mapped = ctx.t().map_peer_buffer(victim, kId, MapMode::kLookup);
      if (!mapped.ok()) {
        CT_REQUIRE(mapped.status().code() == StatusCode::kUnavailable, mapped.status().to_string());
        CT_REQUIRE(mapped.status().message().find(") died") != std::string::npos,
                   mapped.status().to_string());
        break;
      }
      CT_REQUIRE(ms_since(start) < 3000, "buffers of a dead rank still handed out after ",
                 ms_since(start), " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Rank 1 let go of its mappings when it shut down; the others still hold the victim's.
    if (ctx.rank != 1) {
      while (!held[victim].owner_exited()) {
        CT_REQUIRE(ms_since(start) < 3000, "the dead rank's process not seen exited after ",
                   ms_since(start), " ms");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      CT_REQUIRE(held[victim].owner_ending(), "the dead rank's process exited but not ending");
    }
    Group survivors{3, {}};
    for (int r = 0; r < ctx.num_ranks; ++r) {
      if (r != victim) survivors.ranks.push_back(r);
    }
    return ctx.t().barrier(survivors);  // Nobody shuts down before all have looked.
  });
  expect_only_victim_killed(result, num_ranks(), victim);
  cleanup_session(backend(), result.session);
}

// The FaultInjectingTransport on every rank; rank 0 gets the faults. A fault that runs the
// inner collective leaves the group in step; one that skips it makes rank 0 silent, and the
// group recovers in a new epoch. A delay on rank 0 slows everyone's collective.
TEST_P(FaultConformanceTest, InjectedFaultsAndDelays) {
  ClusterSpec s = spec(800);
  s.inject_faults = true;
  run_ok(s, [](RankContext& ctx) -> Status {
    CT_REQUIRE(ctx.faults != nullptr);
    const Group g1 = ctx.group(1);
    if (ctx.rank == 0) {
      ctx.faults->fail_collective(5, unavailable("injected"), /*run_inner=*/true);
      ctx.faults->fail_collective(12, Status(StatusCode::kAborted, "injected"));
    }
    for (uint64_t op = 0; op < 12; ++op) {
      const Status st = all_gather_checked(ctx, g1, 7, op);
      if (ctx.rank == 0 && op == 5) {
        CT_REQUIRE(st.code() == StatusCode::kUnavailable && st.message() == "injected",
                   st.to_string());
      } else {
        CT_REQUIRE_OK(st);
      }
    }
    const int64_t start = mono_now_ns();
    const Status st = ctx.t().barrier(g1);
    if (ctx.rank == 0) {
      CT_REQUIRE(st.code() == StatusCode::kAborted && ms_since(start) < 500, st.to_string());
      CT_REQUIRE_OK(ctx.await_value(0, ctx.num_ranks - 1));  // Let the others time out.
      CT_REQUIRE(ctx.faults->num_collectives() == 13);
    } else {
      CT_REQUIRE(st.code() == StatusCode::kDeadlineExceeded, st.to_string());
      CT_REQUIRE(ms_since(start) < ctx.options.timeout_ms + kMarginMs);
      ctx.shared->values[0].fetch_add(1);
    }
    const Group g2 = ctx.group(2);
    for (uint64_t op = 0; op < 10; ++op) CT_REQUIRE_OK(all_gather_checked(ctx, g2, 8, op));
    if (ctx.rank == 0) ctx.faults->set_collective_delay_ms(30);
    const int64_t delayed_start = mono_now_ns();
    for (uint64_t op = 10; op < 13; ++op) CT_REQUIRE_OK(all_gather_checked(ctx, g2, 8, op));
    // 3 x 30 ms on rank 0, minus the skew between the ranks' starts.
    CT_REQUIRE(ms_since(delayed_start) >= 60, "3 delayed ops took ", ms_since(delayed_start));
    if (ctx.rank == 0) ctx.faults->clear_faults();
    for (uint64_t op = 13; op < 20; ++op) CT_REQUIRE_OK(all_gather_checked(ctx, g2, 8, op));
    return Status();
  });
}

CT_INSTANTIATE(FaultConformanceTest);

}  // namespace
}  // namespace flexpert::conformance
