// SPDX-License-Identifier: Apache-2.0
// transport_exchange_bandwidth: exchange and one-sided read throughput of a transport backend
// over forked ranks, with buffers in the backend's memory (device memory for cuda_ipc). Uses
// the conformance harness to start ranks; the first exchange's contents are checked.
//
//   transport_exchange_bandwidth [--backend cuda_ipc] [--ranks 4] [--bytes 4194304]
//                                [--iters 50] [--json out.json] [--idle-owner-ms N]
//
// exchange: every rank sends `bytes` to every other rank (and itself) per op; GB/s per rank
// counts what one rank sends to the others ((ranks - 1) * bytes per op, slowest rank's time);
// aggregate = x ranks. read: each rank reads `bytes` of the next rank's region per op.
// --json writes the figures (and UCX_TLS, for the ucx backend) to a file as well.
// --idle-owner-ms N measures only whether read() is one-sided: rank 1 sleeps N ms outside any
// transport call while rank 0 reads `bytes` of its region for N / 2 ms (the first read's time
// and how many completed; a backend that needs the owner's help does one read, late).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "conformance_harness.h"

namespace flexpert::conformance {
namespace {

struct Args {
  std::string backend = "cuda_ipc";
  int ranks = 4;
  size_t bytes = size_t{4} << 20;
  int iters = 50;
  std::string json_path;
  int idle_owner_ms = 0;
};

constexpr int kWarmup = 5;

// values[0]: ns of the first read, [1]: reads done, [2]: ns they took.
Status run_idle_owner(RankContext& ctx, const Args& args) {
  const Group g = ctx.group(1);
  CT_ASSIGN(Region region, ctx.t().allocate_region(0, args.bytes));
  std::memset(region.data, 1, args.bytes);
  Buffer dst = ctx.buffer(std::vector<uint8_t>(args.bytes));
  void* d = const_cast<void*>(dst.span().data);
  CT_REQUIRE_OK(ctx.t().barrier(g));
  if (ctx.rank == 0) CT_REQUIRE_OK(ctx.t().read(1, 0, 0, d, args.bytes));  // Warm: wireup, rkey.
  CT_REQUIRE_OK(ctx.t().barrier(g));
  if (ctx.rank == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(args.idle_owner_ms));
  } else if (ctx.rank == 0) {
    const int64_t start = mono_now_ns();
    int64_t count = 0;
    while (mono_now_ns() - start < int64_t{args.idle_owner_ms} * 500'000) {
      const int64_t t = mono_now_ns();
      CT_REQUIRE_OK(ctx.t().read(1, 0, 0, d, args.bytes));
      if (count++ == 0) ctx.shared->values[0].store(mono_now_ns() - t);
    }
    ctx.shared->values[1].store(count);
    ctx.shared->values[2].store(mono_now_ns() - start);
  }
  return ctx.t().barrier(g);
}

Status run_rank(RankContext& ctx, const Args& args) {
  if (args.idle_owner_ms > 0) return run_idle_owner(ctx, args);
  const Group g = ctx.group(1);
  std::vector<Buffer> buffers;
  std::vector<ByteSpan> send(static_cast<size_t>(ctx.options.max_ranks));
  buffers.reserve(static_cast<size_t>(ctx.num_ranks));
  for (int dst = 0; dst < ctx.num_ranks; ++dst) {
    buffers.push_back(ctx.buffer(pattern(seed_of(ctx.rank, dst, 3), args.bytes)));
    send[dst] = buffers.back().span();
  }
  CT_ASSIGN(std::vector<ByteSpan> got, ctx.t().exchange(g, send));
  for (int src = 0; src < ctx.num_ranks; ++src) {
    CT_REQUIRE_OK(ctx.expect_bytes(got[src], seed_of(src, ctx.rank, 3), args.bytes,
                                   cat("exchange from rank ", src)));
  }
  for (int i = 0; i < kWarmup; ++i) CT_REQUIRE_OK(ctx.t().exchange(g, send));
  CT_REQUIRE_OK(ctx.t().barrier(g));
  int64_t start = mono_now_ns();
  for (int i = 0; i < args.iters; ++i) CT_REQUIRE_OK(ctx.t().exchange(g, send));
  ctx.shared->values[ctx.rank].store(mono_now_ns() - start);

  if (!ctx.t().capabilities().one_sided_read) return ctx.t().barrier(g);
  CT_ASSIGN(Region region, ctx.t().allocate_region(0, args.bytes));
  CT_REQUIRE(region.data != nullptr);
  Buffer dst = ctx.buffer(std::vector<uint8_t>(args.bytes));
  void* d = const_cast<void*>(dst.span().data);
  const int peer = (ctx.rank + 1) % ctx.num_ranks;
  CT_REQUIRE_OK(ctx.t().barrier(g));
  for (int i = 0; i < kWarmup; ++i) CT_REQUIRE_OK(ctx.t().read(peer, 0, 0, d, args.bytes));
  CT_REQUIRE_OK(ctx.t().barrier(g));
  start = mono_now_ns();
  for (int i = 0; i < args.iters; ++i) CT_REQUIRE_OK(ctx.t().read(peer, 0, 0, d, args.bytes));
  ctx.shared->values[SharedState::kMaxRanks + ctx.rank].store(mono_now_ns() - start);
  return ctx.t().barrier(g);  // Nobody frees its region while another rank reads it.
}

int main_impl(int argc, char** argv) {
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--backend") {
      args.backend = value;
    } else if (flag == "--ranks") {
      args.ranks = std::atoi(value);
    } else if (flag == "--bytes") {
      args.bytes = std::strtoull(value, nullptr, 10);
    } else if (flag == "--iters") {
      args.iters = std::atoi(value);
    } else if (flag == "--json") {
      args.json_path = value;
    } else if (flag == "--idle-owner-ms") {
      args.idle_owner_ms = std::atoi(value);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (args.ranks < 1 || args.ranks > SharedState::kMaxRanks || args.iters < 1 || args.bytes < 1) {
    std::fprintf(stderr, "bad --ranks, --iters or --bytes\n");
    return 2;
  }
  if (const std::string why = backend_unavailable_reason(args.backend); !why.empty()) {
    std::printf("%s: skipped, cannot run here: %s\n", args.backend.c_str(), why.c_str());
    return 0;
  }
  ClusterSpec spec;
  spec.num_ranks = args.ranks;
  spec.options.max_ranks = args.ranks;
  spec.options.max_gather_bytes = 64;
  spec.options.max_exchange_bytes = args.bytes;
  spec.options.timeout_ms = 10000;
  spec.deadline_ms = 120000;
  int64_t exchange_ns = 0;
  int64_t read_ns = 0;
  spec.parent_step = [&](ParentView& view) {
    for (int r = 0; r < args.ranks; ++r) {
      exchange_ns = std::max<int64_t>(exchange_ns, view.shared->values[r].load());
      read_ns = std::max<int64_t>(read_ns, view.shared->values[SharedState::kMaxRanks + r].load());
    }
  };
  if (args.idle_owner_ms > 0) {
    spec.options.timeout_ms = 2 * args.idle_owner_ms + 10000;
    if (args.ranks < 2) {
      std::fprintf(stderr, "--idle-owner-ms needs 2 ranks or more\n");
      return 2;
    }
  }
  int64_t idle[3] = {0, 0, 0};
  if (args.idle_owner_ms > 0) {
    spec.parent_step = [&](ParentView& view) {
      for (int i = 0; i < 3; ++i) idle[i] = std::max<int64_t>(idle[i], view.shared->values[i]);
    };
  }
  const RunResult result =
      run_cluster(args.backend, spec, [&](RankContext& ctx) { return run_rank(ctx, args); });
  cleanup_session(args.backend, result.session);
  bool ok = !result.timed_out;
  for (int status : result.wait_status) ok = ok && exited_ok(status);
  if (ok && args.idle_owner_ms > 0) {
    const double first_us = static_cast<double>(idle[0]) / 1e3;
    const double window_ms = static_cast<double>(idle[2]) / 1e6;
    std::printf("%s read of an idle owner: %.2f MiB, first %.1f us, %lld reads in %.1f ms\n",
                args.backend.c_str(), static_cast<double>(args.bytes) / (1 << 20), first_us,
                static_cast<long long>(idle[1]), window_ms);
    if (!args.json_path.empty()) {
      const char* tls = std::getenv("UCX_TLS");
      std::ofstream out(args.json_path);
      out << "{\"backend\": \"" << args.backend << "\", \"ucx_tls\": \"" << (tls ? tls : "")
          << "\", \"bytes\": " << args.bytes << ", \"idle_owner_ms\": " << args.idle_owner_ms
          << ", \"first_read_us\": " << first_us << ", \"reads\": " << idle[1]
          << ", \"window_ms\": " << window_ms << "}\n";
    }
    return 0;
  }
  if (!ok || exchange_ns == 0) {
    std::fprintf(stderr, "%s: a rank failed (see above)\n", args.backend.c_str());
    return 1;
  }
  const double mb = static_cast<double>(args.bytes) / (1 << 20);
  const double op_s = static_cast<double>(exchange_ns) * 1e-9 / args.iters;
  const double per_rank = static_cast<double>(args.ranks - 1) * args.bytes / op_s * 1e-9;
  std::printf(
      "%s exchange: %d ranks, %.2f MiB per peer: %.1f us/op, %.1f GB/s per rank, %.1f GB/s "
      "aggregate\n",
      args.backend.c_str(), args.ranks, mb, op_s * 1e6, per_rank, per_rank * args.ranks);
  const double read_s = static_cast<double>(read_ns) * 1e-9 / args.iters;
  if (read_ns > 0) {
    std::printf("%s read: %.2f MiB from the next rank: %.1f us/op, %.1f GB/s per rank\n",
                args.backend.c_str(), mb, read_s * 1e6, args.bytes / read_s * 1e-9);
  }
  if (!args.json_path.empty()) {
    const char* tls = std::getenv("UCX_TLS");
    std::ofstream out(args.json_path);
    out << "{\"backend\": \"" << args.backend << "\", \"ucx_tls\": \"" << (tls ? tls : "")
        << "\", \"ranks\": " << args.ranks << ", \"bytes\": " << args.bytes
        << ", \"iters\": " << args.iters << ", \"exchange_us\": " << op_s * 1e6
        << ", \"exchange_gbps_per_rank\": " << per_rank;
    if (read_ns > 0) {
      out << ", \"read_us\": " << read_s * 1e6 << ", \"read_gbps\": " << args.bytes / read_s * 1e-9;
    }
    out << "}\n";
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", args.json_path.c_str());
      return 1;
    }
    std::printf("wrote %s\n", args.json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace flexpert::conformance

int main(int argc, char** argv) { return flexpert::conformance::main_impl(argc, argv); }
