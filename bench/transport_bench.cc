// SPDX-License-Identifier: Apache-2.0
// transport_bench: all_gather latency and exchange bandwidth of a transport backend, with
// ranks as forked processes on this host.
//
//   transport_bench [--backend shm] [--ranks 2,4] [--gather-sizes 8,64,512,4096]
//                   [--exchange-sizes 4096,65536,1048576,4194304] [--gather-iters 20000]
//                   [--exchange-mb 512] [--death-mb 0,1024,4096] [--json out.json]
// (--ranks '' --death-mb ...: only the death runs.)
//
// all_gather: µs per op (slowest rank's average over the timed loop, after a warm-up).
// exchange: every rank sends `size` bytes to every other rank per op; GB/s per rank counts
// the bytes one rank sends per second ((ranks - 1) * size / time per op); aggregate = x ranks.
// memcpy GB/s is one thread copying `size` bytes in this process, for reference.
// death (--death-mb): two ranks exchange 4 KiB in a loop, rank 1 holding `MB` of touched
// private memory, until the parent SIGKILLs rank 1; "reported" is when rank 0's exchange
// failed with the death, "exited" when the parent's waitpid returned (the kernel has torn
// the victim's memory down; a GPU context adds tens of ms more).
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "bench/forked_ranks.h"
#include "transport/shm/shm_transport.h"
#include "transport/transport.h"

namespace flexpert {
namespace {

constexpr int kMaxRanks = 16;
constexpr int kMaxResults = 64;

double now_s() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Result_ {
  int is_exchange;
  int ranks;
  size_t bytes;
  int iters;
  double us_per_op;
};

// Shared by the parent and the ranks of one run.
struct Shared {
  bench::RankAddresses<kMaxRanks> ranks;
  std::atomic<int> num_results;
  Result_ results[kMaxResults];
  char error[512];
  // --death-mb: rounds done by rank 0, when the victim was killed / the death reported.
  std::atomic<int64_t> rounds, killed_ns, reported_ns;
  char reported[256];
};

struct Config {
  std::string backend = "shm";
  std::vector<int> ranks = {2, 4};
  std::vector<size_t> gather_sizes = {8, 64, 512, 4096};
  std::vector<size_t> exchange_sizes = {4096, 65536, 1 << 20, 4 << 20};
  int gather_iters = 20000;
  size_t exchange_mb = 512;      // Bytes each rank sends per exchange size, roughly.
  std::vector<size_t> death_mb;  // Victim sizes of the death runs (none: skipped).
  std::string json_path;
};

std::vector<size_t> parse_list(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::strtoull(item.c_str(), nullptr, 10));
  return out;
}

// Slowest rank's µs per op: every rank contributes its own figure.
Status slowest(Transport& t, const Group& g, double mine, double* out) {
  FLEX_ASSIGN_OR_RETURN(auto spans, t.all_gather(g, ByteSpan{&mine, sizeof(mine)}));
  *out = 0;
  for (int r : g.ranks) {
    double v = 0;
    std::memcpy(&v, spans[r].data, sizeof(v));
    *out = std::max(*out, v);
  }
  return Status();
}

Status run_rank(const Config& cfg, int n, int rank, const std::string& session, Shared* shared) {
  const size_t max_exchange =
      *std::max_element(cfg.exchange_sizes.begin(), cfg.exchange_sizes.end());
  TransportOptions o;
  o.session = session;
  o.rank = rank;
  o.max_ranks = n;
  o.max_gather_bytes =
      std::max<size_t>(64, *std::max_element(cfg.gather_sizes.begin(), cfg.gather_sizes.end()));
  o.max_exchange_bytes = max_exchange;
  o.timeout_ms = 30000;
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, create_transport(cfg.backend, o));
  FLEX_RETURN_IF_ERROR(shared->ranks.connect_all(*t, rank, n));
  Group g;
  g.epoch = 1;
  for (int r = 0; r < n; ++r) g.ranks.push_back(r);
  auto record = [&](int is_exchange, size_t bytes, int iters, double us) {
    if (rank != 0) return;
    const int idx = shared->num_results.fetch_add(1);
    if (idx < kMaxResults) shared->results[idx] = Result_{is_exchange, n, bytes, iters, us};
  };

  std::vector<uint8_t> in(o.max_gather_bytes, static_cast<uint8_t>(rank));
  for (size_t size : cfg.gather_sizes) {
    for (int i = 0; i < std::max(100, cfg.gather_iters / 20); ++i) {
      FLEX_RETURN_IF_ERROR(t->all_gather(g, ByteSpan{in.data(), size}).status());
    }
    FLEX_RETURN_IF_ERROR(t->barrier(g));
    const double start = now_s();
    for (int i = 0; i < cfg.gather_iters; ++i) {
      FLEX_RETURN_IF_ERROR(t->all_gather(g, ByteSpan{in.data(), size}).status());
    }
    double us = 0;
    FLEX_RETURN_IF_ERROR(slowest(*t, g, (now_s() - start) * 1e6 / cfg.gather_iters, &us));
    record(0, size, cfg.gather_iters, us);
  }

  std::vector<uint8_t> payload(max_exchange, static_cast<uint8_t>(rank + 1));
  for (size_t size : cfg.exchange_sizes) {
    std::vector<ByteSpan> send(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) send[r] = ByteSpan{payload.data(), size};
    const size_t per_op = size * static_cast<size_t>(std::max(1, n - 1));
    const int iters = static_cast<int>(
        std::clamp<size_t>((cfg.exchange_mb << 20) / std::max<size_t>(per_op, 1), 20, 20000));
    for (int i = 0; i < std::max(5, iters / 10); ++i) {
      FLEX_RETURN_IF_ERROR(t->exchange(g, send).status());
    }
    FLEX_RETURN_IF_ERROR(t->barrier(g));
    const double start = now_s();
    for (int i = 0; i < iters; ++i) FLEX_RETURN_IF_ERROR(t->exchange(g, send).status());
    double us = 0;
    FLEX_RETURN_IF_ERROR(slowest(*t, g, (now_s() - start) * 1e6 / iters, &us));
    record(1, size, iters, us);
  }
  FLEX_RETURN_IF_ERROR(t->barrier(g));
  return t->shutdown();
}

// A Shared in memory the forked ranks share (munmap it after); null if none.
Shared* map_shared() {
  void* mem =
      ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return mem == MAP_FAILED ? nullptr : new (mem) Shared();
}

// Runs one configuration; false when a rank failed.
bool run_ranks(const Config& cfg, int n, std::vector<Result_>* results) {
  Shared* shared = map_shared();
  if (shared == nullptr) return false;
  const std::string session = "bench" + std::to_string(::getpid()) + "n" + std::to_string(n);
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const Status s = run_rank(cfg, n, r, session, shared);
      if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", r, s.to_string().c_str());
      std::fflush(nullptr);
      ::_exit(s.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  const int count = std::min(shared->num_results.load(), kMaxResults);
  results->insert(results->end(), shared->results, shared->results + count);
  ::munmap(shared, sizeof(Shared));
  return ok;
}

int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

Status run_death_rank(const Config& cfg, int rank, size_t victim_mb, const std::string& session,
                      Shared* shared) {
  if (rank == 1 && victim_mb > 0) {
    const size_t bytes = victim_mb << 20;
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return resource_exhausted("cannot map the victim's memory");
    for (size_t i = 0; i < bytes; i += 4096) static_cast<volatile char*>(m)[i] = 1;
  }
  TransportOptions o;
  o.session = session;
  o.rank = rank;
  o.max_ranks = 2;
  o.max_gather_bytes = 64;
  o.max_exchange_bytes = 4096;
  o.timeout_ms = 10000;
  FLEX_ASSIGN_OR_RETURN(auto t, create_transport(cfg.backend, o));
  FLEX_RETURN_IF_ERROR(shared->ranks.connect_all(*t, rank, 2));
  Group g;
  g.epoch = 1;
  g.ranks = {0, 1};
  std::vector<uint8_t> payload(4096, static_cast<uint8_t>(rank));
  std::vector<ByteSpan> send = {ByteSpan{payload.data(), 4096}, ByteSpan{payload.data(), 4096}};
  for (;;) {
    auto got = t->exchange(g, send);
    if (!got.ok()) {
      shared->reported_ns.store(mono_ns());
      std::snprintf(shared->reported, sizeof(shared->reported), "%s",
                    got.status().to_string().c_str());
      return t->shutdown();
    }
    if (rank == 0) shared->rounds.fetch_add(1);
  }
}

// Kill-to-report and kill-to-exit in ms for a victim of `mb` MB; false on a failure.
bool run_death(const Config& cfg, size_t mb, double* reported_ms, double* exited_ms,
               std::string* what) {
  Shared* shared = map_shared();
  if (shared == nullptr) return false;
  const std::string session = "death" + std::to_string(::getpid()) + "m" + std::to_string(mb);
  std::fflush(nullptr);
  pid_t pids[2] = {-1, -1};
  for (int r = 0; r < 2; ++r) {
    pids[r] = ::fork();
    if (pids[r] < 0) break;
    if (pids[r] == 0) {
      const Status s = run_death_rank(cfg, r, mb, session, shared);
      if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", r, s.to_string().c_str());
      std::fflush(nullptr);
      ::_exit(s.ok() ? 0 : 1);
    }
  }
  // Kill the victim once rank 0 has exchanged a while; give up on a rank that ended
  // (failed to start) or after 60 s.
  const int64_t deadline = mono_ns() + 60'000'000'000;
  bool running = pids[0] > 0 && pids[1] > 0;
  int status = 0;
  while (running && shared->rounds.load() < 1000 && shared->reported_ns.load() == 0) {
    for (pid_t p : pids) running = running && ::waitpid(p, &status, WNOHANG) == 0;
    running = running && mono_ns() < deadline;
    if (running) ::usleep(1000);
  }
  const int64_t killed = mono_ns();
  if (running) {
    ::kill(pids[1], SIGKILL);
  } else {
    for (pid_t p : pids) {
      if (p > 0) ::kill(p, SIGKILL);  // The run did not get going: both.
    }
  }
  if (pids[1] > 0) ::waitpid(pids[1], &status, 0);
  const int64_t exited = mono_ns();
  status = 0;
  if (pids[0] > 0) ::waitpid(pids[0], &status, 0);
  const bool ok =
      running && WIFEXITED(status) && WEXITSTATUS(status) == 0 && shared->reported_ns.load() > 0;
  *reported_ms = static_cast<double>(shared->reported_ns.load() - killed) / 1e6;
  *exited_ms = static_cast<double>(exited - killed) / 1e6;
  *what = shared->reported;
  (void)remove_shm_session(session);  // The victim's segments (both host backends).
  ::munmap(shared, sizeof(Shared));
  return ok;
}

double memcpy_gbps(size_t size) {
  std::vector<uint8_t> a(size, 1), b(size, 2);
  const int iters = static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / size, 10, 100000));
  const double start = now_s();
  for (int i = 0; i < iters; ++i) {
    std::memcpy(b.data(), a.data(), size);
    asm volatile("" : : "r"(b.data()) : "memory");
  }
  return static_cast<double>(size) * iters / (now_s() - start) / 1e9;
}

}  // namespace
}  // namespace flexpert

int main(int argc, char** argv) {
  using namespace flexpert;
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--backend") {
      cfg.backend = value();
    } else if (arg == "--ranks") {
      cfg.ranks.clear();
      for (size_t r : parse_list(value())) cfg.ranks.push_back(static_cast<int>(r));
    } else if (arg == "--gather-sizes") {
      cfg.gather_sizes = parse_list(value());
    } else if (arg == "--exchange-sizes") {
      cfg.exchange_sizes = parse_list(value());
    } else if (arg == "--gather-iters") {
      cfg.gather_iters = std::atoi(value().c_str());
    } else if (arg == "--exchange-mb") {
      cfg.exchange_mb = std::strtoull(value().c_str(), nullptr, 10);
    } else if (arg == "--death-mb") {
      cfg.death_mb = parse_list(value());
    } else if (arg == "--json") {
      cfg.json_path = value();
    } else {
      std::fprintf(stderr,
                   "usage: %s [--backend shm] [--ranks 2,4] [--gather-sizes a,b] "
                   "[--exchange-sizes a,b] [--gather-iters N] [--exchange-mb N] [--death-mb a,b] "
                   "[--json PATH]\n",
                   argv[0]);
      return 2;
    }
  }
  if ((cfg.ranks.empty() && cfg.death_mb.empty()) || cfg.gather_sizes.empty() ||
      cfg.exchange_sizes.empty() || cfg.gather_iters <= 0) {
    std::fprintf(stderr, "empty rank or size list\n");
    return 2;
  }
  for (int n : cfg.ranks) {
    if (n < 1 || n > kMaxRanks) {
      std::fprintf(stderr, "ranks must be in [1, %d]\n", kMaxRanks);
      return 2;
    }
  }
  std::vector<Result_> results;
  for (int n : cfg.ranks) {
    if (!run_ranks(cfg, n, &results)) {
      std::fprintf(stderr, "a rank failed with %d ranks\n", n);
      return 1;
    }
  }
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  std::printf("backend %s, %ld CPUs online\n\n", cfg.backend.c_str(), cpus);
  if (!results.empty()) {
    std::printf("%-10s %5s %12s %8s %12s %14s %14s %12s\n", "op", "ranks", "bytes", "iters",
                "us/op", "GB/s/rank", "GB/s total", "memcpy GB/s");
  }
  std::ostringstream json;
  json << "{\"backend\": \"" << cfg.backend << "\", \"cpus\": " << cpus << ", \"results\": [";
  bool first = true;
  for (const Result_& r : results) {
    const double per_rank =
        r.is_exchange ? static_cast<double>(r.bytes) * (r.ranks - 1) / (r.us_per_op * 1e3) : 0;
    const double mc = r.is_exchange ? memcpy_gbps(r.bytes) : 0;
    if (r.is_exchange) {
      std::printf("%-10s %5d %12zu %8d %12.2f %14.2f %14.2f %12.2f\n", "exchange", r.ranks, r.bytes,
                  r.iters, r.us_per_op, per_rank, per_rank * r.ranks, mc);
    } else {
      std::printf("%-10s %5d %12zu %8d %12.2f %14s %14s %12s\n", "all_gather", r.ranks, r.bytes,
                  r.iters, r.us_per_op, "-", "-", "-");
    }
    json << (first ? "" : ", ") << "{\"op\": \"" << (r.is_exchange ? "exchange" : "all_gather")
         << "\", \"ranks\": " << r.ranks << ", \"bytes\": " << r.bytes << ", \"iters\": " << r.iters
         << ", \"us_per_op\": " << r.us_per_op;
    if (r.is_exchange) {
      json << ", \"gbps_per_rank\": " << per_rank << ", \"gbps_total\": " << per_rank * r.ranks
           << ", \"memcpy_gbps\": " << mc;
    }
    json << "}";
    first = false;
  }
  json << "]";
  if (!cfg.death_mb.empty()) {
    std::printf("\n%-10s %10s %14s %14s  %s\n", "death", "victim MB", "reported ms", "exited ms",
                "what the survivor got");
    json << ", \"death\": [";
    for (size_t i = 0; i < cfg.death_mb.size(); ++i) {
      double reported = 0, exited = 0;
      std::string what;
      if (!run_death(cfg, cfg.death_mb[i], &reported, &exited, &what)) {
        std::fprintf(stderr, "the death run of %zu MB failed\n", cfg.death_mb[i]);
        return 1;
      }
      std::printf("%-10s %10zu %14.2f %14.2f  %s\n", "death", cfg.death_mb[i], reported, exited,
                  what.c_str());
      json << (i == 0 ? "" : ", ") << "{\"victim_mb\": " << cfg.death_mb[i]
           << ", \"reported_ms\": " << reported << ", \"exited_ms\": " << exited << "}";
    }
    json << "]";
  }
  json << "}\n";
  if (!cfg.json_path.empty()) {
    std::ofstream out(cfg.json_path);
    out << json.str();
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", cfg.json_path.c_str());
      return 1;
    }
    std::printf("\nwrote %s\n", cfg.json_path.c_str());
  }
  return 0;
}
