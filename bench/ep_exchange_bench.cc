// SPDX-License-Identifier: Apache-2.0
// ep_exchange_bench: the device expert-parallel exchange (cuda/ep_exchange.h) between GPU
// ranks as forked processes, at a model's shapes (default DeepSeek-V3: hidden 7168, top-8,
// 256 experts, bf16): dispatch (publish, wait, gather: every owner pulls its pairs' token
// rows from the sources' memory through CUDA IPC) and combine (done, wait, combine: every
// source pulls its pairs' result rows from the owners and sums them per token).
//
//   ep_exchange_bench [--ranks 2] [--gpus 2] [--tokens 128,4096] [--hidden 7168]
//                     [--top-k 8] [--experts 256] [--iters 50] [--json out.json]
//
// Rank r runs on cuda:(r mod gpus). Each token picks top-k distinct experts uniformly at
// random; expert e lives on rank e / (experts / ranks) (no replicas). The owners' "experts"
// are the identity (y = the gathered rows), so every combined row must equal
// (sum of its weights) x its own row: the bench checks that for every token (f32 math on
// the host, the device's k order) and fails otherwise.
// Reported per rank, averaged over the timed iterations (events around each phase, so the
// figures include waiting for the slowest peer): dispatch and combine time, the row bytes
// each moved into this GPU from other GPUs ("remote", over NVLink) and from ranks of the
// same GPU (MPS), and GB/s = those bytes over the phase's time. Also the time to map each
// peer's five buffers, as a membership change does.
// The ranks map each other's buffers as a model's device exchange does (src/cuda/ep_moe.cc):
// through the cuda_ipc transport's mapped peer buffers (register_buffer, map_peer_buffer:
// docs/ARCHITECTURE.md), with its collectives in host memory (host_collectives, as a GPU
// worker runs it).
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/forked_ranks.h"
#include "cuda/ep_exchange.h"
#include "transport/transport.h"

namespace flexpert {
namespace {

using cuda::EpArgs;
using cuda::EpPeer;
using cuda::EpStatus;
using cuda::EpWindow;
using cuda::kEpMaxRanks;

constexpr int kMaxRanks = 16;
constexpr int kBuffers = 5;  // window (+ pos), h, slot, y, row_of_pair: what a model exports.

struct RankResult {
  int ok;
  int device;
  double dispatch_us, combine_us;
  double dispatch_remote_bytes, dispatch_local_bytes;  // Per iteration, into this rank.
  double combine_remote_bytes, combine_local_bytes;
  double open_us[kMaxRanks][kBuffers];  // Opening peer p's buffer b.
  double max_abs_err;
};

struct Shared {
  bench::RankAddresses<kMaxRanks> ranks;
  RankResult results[kMaxRanks];
  char error[kMaxRanks][256];
};

struct Config {
  int ranks = 2, gpus = 2;
  std::vector<int> tokens = {128, 4096};
  int hidden = 7168, top_k = 8, experts = 256, iters = 50;
  std::string json_path;
};

Status cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status();
  return internal_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define BENCH_CUDA(call) FLEX_RETURN_IF_ERROR(cuda_ok((call), #call))

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A rank's inputs, the same in every process (seeded by the rank): random bf16 rows
// [T, H], top-k distinct experts per token (global slot = expert), positive weights.
struct Inputs {
  std::vector<uint16_t> h;
  std::vector<int32_t> slot;
  std::vector<float> w;
};
Inputs make_inputs(const Config& cfg, int T, int rank) {
  const int K = cfg.top_k;
  Inputs in;
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> val(-1.f, 1.f);
  in.h.resize(static_cast<size_t>(T) * cfg.hidden);
  for (auto& x : in.h) {
    const float f = val(rng);
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    x = static_cast<uint16_t>(u >> 16);
  }
  in.slot.resize(static_cast<size_t>(T) * K);
  in.w.resize(in.slot.size());
  std::vector<int> perm(cfg.experts);
  for (int e = 0; e < cfg.experts; ++e) perm[e] = e;
  for (size_t p = 0; p < in.slot.size(); ++p) {
    const int k = static_cast<int>(p % K);
    std::uniform_int_distribution<int> pick(k, cfg.experts - 1);
    std::swap(perm[k], perm[pick(rng)]);
    in.slot[p] = perm[k];
    in.w[p] = 0.05f + 0.1f * static_cast<float>(k);
  }
  return in;
}

Status run_rank(const Config& cfg, int T, int rank, const std::string& session, Shared* shared) {
  const int n = cfg.ranks, H = cfg.hidden, K = cfg.top_k;
  const int device = rank % cfg.gpus;
  const int slots_per_rank = cfg.experts / n;
  const int64_t pairs = static_cast<int64_t>(T) * K;
  const int64_t bound = pairs * n;  // Every pair of every rank could come here.
  BENCH_CUDA(cudaSetDevice(device));

  TransportOptions o;
  o.session = session;
  o.rank = rank;
  o.max_ranks = n;
  o.max_exchange_bytes = 4096;  // No exchange: barriers only.
  o.timeout_ms = 60000;
  o.device = device;
  o.host_collectives = true;
  FLEX_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, create_transport("cuda_ipc", o));
  FLEX_RETURN_IF_ERROR(shared->ranks.connect_all(*t, rank, n));
  Group g;
  g.epoch = 1;
  for (int r = 0; r < n; ++r) g.ranks.push_back(r);

  // The exported buffers (separate allocations, as a model's are).
  void* buf[kBuffers] = {};
  const size_t P = static_cast<size_t>(pairs), R = static_cast<size_t>(bound);
  const size_t sizes[kBuffers] = {sizeof(EpWindow) + P * sizeof(int32_t),
                                  static_cast<size_t>(T) * H * 2, P * sizeof(int32_t), R * H * 2,
                                  R * sizeof(int32_t)};
  for (int b = 0; b < kBuffers; ++b) BENCH_CUDA(cudaMalloc(&buf[b], sizes[b]));
  BENCH_CUDA(cudaMemset(buf[0], 0, sizes[0]));
  void* rows = buf[3];  // Identity experts: the gathered rows are y.
  int32_t *local_slot, *num_rows;
  float *weight, *out;
  EpStatus* status;
  EpPeer* peers;
  BENCH_CUDA(cudaMalloc(&local_slot, bound * sizeof(int32_t)));
  BENCH_CUDA(cudaMalloc(&num_rows, sizeof(int32_t)));
  BENCH_CUDA(cudaMalloc(&weight, pairs * sizeof(float)));
  BENCH_CUDA(cudaMalloc(&out, static_cast<size_t>(T) * H * sizeof(float)));
  BENCH_CUDA(cudaMalloc(&status, sizeof(EpStatus)));
  BENCH_CUDA(cudaMemset(status, 0, sizeof(EpStatus)));
  BENCH_CUDA(cudaMalloc(&peers, kEpMaxRanks * sizeof(EpPeer)));
  int32_t* abort_flag;
  uint64_t* progress;
  BENCH_CUDA(cudaHostAlloc(&abort_flag, sizeof(int32_t), cudaHostAllocMapped));
  BENCH_CUDA(cudaHostAlloc(&progress, sizeof(uint64_t), cudaHostAllocMapped));
  *abort_flag = 0;
  *progress = 0;

  const Inputs in = make_inputs(cfg, T, rank);
  const std::vector<uint16_t>& h = in.h;
  const std::vector<int32_t>& slot = in.slot;
  const std::vector<float>& w = in.w;
  std::vector<int32_t> identity(bound);
  for (int64_t i = 0; i < bound; ++i) identity[i] = static_cast<int32_t>(i);
  BENCH_CUDA(cudaMemcpy(buf[1], h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(buf[2], slot.data(), pairs * sizeof(int32_t), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(buf[4], identity.data(), bound * sizeof(int32_t), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(weight, w.data(), pairs * sizeof(float), cudaMemcpyHostToDevice));

  // Register the buffers (ids 0..kBuffers-1); once every rank has, map every peer's, timing
  // each mapping (the transport imports it: cudaIpcOpenMemHandle).
  for (int b = 0; b < kBuffers; ++b) FLEX_RETURN_IF_ERROR(t->register_buffer(b, buf[b], sizes[b]));
  FLEX_RETURN_IF_ERROR(t->barrier(g));
  RankResult res{};
  res.device = device;
  std::vector<EpPeer> table(kEpMaxRanks);
  std::vector<PeerBuffer> mapped;  // Holds the mappings open until the end.
  for (int r = 0; r < n; ++r) {
    void* at[kBuffers];
    for (int b = 0; b < kBuffers; ++b) {
      const double t0 = now_us();
      FLEX_ASSIGN_OR_RETURN(PeerBuffer m, t->map_peer_buffer(r, b, MapMode::kMap));
      if (r != rank) res.open_us[r][b] = now_us() - t0;
      if (m.num_bytes != sizes[b]) {
        return internal_error("rank " + std::to_string(r) + "'s buffer " + std::to_string(b) +
                              " has " + std::to_string(m.num_bytes) + " bytes, expected " +
                              std::to_string(sizes[b]));
      }
      at[b] = m.data;
      mapped.push_back(std::move(m));
    }
    table[r].window = static_cast<EpWindow*>(at[0]);
    table[r].pos = reinterpret_cast<const int32_t*>(table[r].window + 1);
    table[r].h = at[1];
    table[r].slot = static_cast<const int32_t*>(at[2]);
    table[r].y = at[3];
    table[r].row_of_pair = static_cast<const int32_t*>(at[4]);
  }
  BENCH_CUDA(cudaMemcpy(peers, table.data(), kEpMaxRanks * sizeof(EpPeer), cudaMemcpyHostToDevice));

  // Bytes per iteration: rows this rank receives (dispatch) and reads back (combine), by
  // where they come from. Every rank's routing is known here from its seed.
  for (int src = 0; src < n; ++src) {
    const std::vector<int32_t> routed = src == rank ? slot : make_inputs(cfg, T, src).slot;
    for (const int32_t e : routed) {
      const int owner = e / slots_per_rank;
      const double bytes = 2.0 * H;
      if (owner == rank && src != rank) {
        (src % cfg.gpus == device ? res.dispatch_local_bytes : res.dispatch_remote_bytes) += bytes;
      }
      if (src == rank && owner != rank) {
        (owner % cfg.gpus == device ? res.combine_local_bytes : res.combine_remote_bytes) += bytes;
      }
    }
  }

  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EpArgs a;
  a.peers = peers;
  a.me = rank;
  for (int r = 0; r < n; ++r) a.members |= uint64_t{1} << r;
  a.slots_per_rank = slots_per_rank;
  a.top_k = K;
  a.hidden = H;
  a.dtype = DType::kBF16;
  a.status = status;
  a.abort = abort_flag;
  a.progress = progress;
  a.timeout_ns = int64_t{20} * 1'000'000'000;
  int32_t* pos = reinterpret_cast<int32_t*>(static_cast<EpWindow*>(buf[0]) + 1);
  const int warmup = std::max(3, cfg.iters / 10);
  std::vector<cudaEvent_t> ev(3 * cfg.iters);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  FLEX_RETURN_IF_ERROR(t->barrier(g));
  for (int it = 0; it < warmup + cfg.iters; ++it) {
    const int timed = it - warmup;
    a.value = (uint64_t{1} << 40) | static_cast<uint64_t>(it + 1);
    if (timed >= 0) BENCH_CUDA(cudaEventRecord(ev[3 * timed], stream));
    BENCH_CUDA(cuda::ep_publish(a, static_cast<int>(pairs), pos, stream));
    BENCH_CUDA(cuda::ep_wait(a, 0, stream));
    BENCH_CUDA(cuda::ep_gather(a, static_cast<int>(bound), rows, local_slot, num_rows, stream));
    if (timed >= 0) BENCH_CUDA(cudaEventRecord(ev[3 * timed + 1], stream));
    BENCH_CUDA(cuda::ep_signal_done(a, stream));
    BENCH_CUDA(cuda::ep_wait(a, 1, stream));
    BENCH_CUDA(cuda::ep_combine(a, weight, pos, T, T, out, stream));
    if (timed >= 0) BENCH_CUDA(cudaEventRecord(ev[3 * timed + 2], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  EpStatus st{};
  BENCH_CUDA(cudaMemcpy(&st, status, sizeof(st), cudaMemcpyDeviceToHost));
  if (st.failed != 0) {
    return internal_error("exchange failed: missing " + std::to_string(st.missing) + ", aborted " +
                          std::to_string(st.aborted) + ", overflow " + std::to_string(st.overflow));
  }
  for (int it = 0; it < cfg.iters; ++it) {
    float d = 0, c = 0;
    BENCH_CUDA(cudaEventElapsedTime(&d, ev[3 * it], ev[3 * it + 1]));
    BENCH_CUDA(cudaEventElapsedTime(&c, ev[3 * it + 1], ev[3 * it + 2]));
    res.dispatch_us += 1e3 * d / cfg.iters;
    res.combine_us += 1e3 * c / cfg.iters;
  }
  // Check: out[t] = sum_k w[t, k] * h[t] (the device's k order, fused multiply-add).
  std::vector<float> got(static_cast<size_t>(T) * H);
  BENCH_CUDA(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (int tk = 0; tk < T; ++tk) {
    for (int c = 0; c < H; ++c) {
      const float v = bf16_to_float(h[static_cast<size_t>(tk) * H + c]);
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc = std::fma(w[static_cast<size_t>(tk) * K + k], v, acc);
      res.max_abs_err =
          std::max(res.max_abs_err,
                   static_cast<double>(std::fabs(got[static_cast<size_t>(tk) * H + c] - acc)));
    }
  }
  res.ok = res.max_abs_err <= 1e-5 ? 1 : 0;
  shared->results[rank] = res;
  FLEX_RETURN_IF_ERROR(t->barrier(g));  // Nobody frees what a peer may still read.
  mapped.clear();  // This rank's references; shutdown() drops the transport's and closes them.
  for (auto& e : ev) (void)cudaEventDestroy(e);
  if (res.ok == 0) {
    return internal_error("combined rows differ from the reference by " +
                          std::to_string(res.max_abs_err));
  }
  return t->shutdown();
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "ep_exchange_bench: %s\nusage: ep_exchange_bench [--ranks N] [--gpus G] "
               "[--tokens 128,4096] [--hidden H] [--top-k K] [--experts E] [--iters I] "
               "[--json F]\n",
               why);
  return 2;
}

}  // namespace
}  // namespace flexpert

int main(int argc, char** argv) {
  using namespace flexpert;
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") return usage("the device expert-parallel exchange between GPU ranks");
    if (i + 1 >= argc) return usage(("missing value of " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--ranks") {
      cfg.ranks = std::atoi(v.c_str());
    } else if (a == "--gpus") {
      cfg.gpus = std::atoi(v.c_str());
    } else if (a == "--tokens") {
      cfg.tokens = parse_ints(v);
    } else if (a == "--hidden") {
      cfg.hidden = std::atoi(v.c_str());
    } else if (a == "--top-k") {
      cfg.top_k = std::atoi(v.c_str());
    } else if (a == "--experts") {
      cfg.experts = std::atoi(v.c_str());
    } else if (a == "--iters") {
      cfg.iters = std::atoi(v.c_str());
    } else if (a == "--json") {
      cfg.json_path = v;
    } else {
      return usage(("unknown flag " + a).c_str());
    }
  }
  if (cfg.ranks < 1 || cfg.ranks > kMaxRanks || cfg.gpus < 1 || cfg.iters < 1 ||
      cfg.hidden % 8 != 0 || cfg.top_k < 1 || cfg.experts % cfg.ranks != 0 ||
      cfg.top_k > cfg.experts || cfg.tokens.empty() ||
      std::any_of(cfg.tokens.begin(), cfg.tokens.end(), [](int t) { return t < 1; })) {
    return usage("bad flags (ranks 1-16 dividing the experts, hidden a multiple of 8)");
  }
  std::string json =
      "{\"ranks\": " + std::to_string(cfg.ranks) + ", \"gpus\": " + std::to_string(cfg.gpus) +
      ", \"hidden\": " + std::to_string(cfg.hidden) + ", \"top_k\": " + std::to_string(cfg.top_k) +
      ", \"experts\": " + std::to_string(cfg.experts) + ", \"runs\": [";
  std::printf("%d ranks on %d GPU(s), hidden %d, top-%d of %d experts, bf16 rows\n", cfg.ranks,
              cfg.gpus, cfg.hidden, cfg.top_k, cfg.experts);
  std::printf("%7s %5s %12s %12s %13s %13s %12s %12s\n", "tokens", "rank", "dispatch us",
              "combine us", "disp GB/s rem", "comb GB/s rem", "disp GB/s all", "open us/buf");
  bool all_ok = true;
  for (size_t ti = 0; ti < cfg.tokens.size(); ++ti) {
    const int T = cfg.tokens[ti];
    void* mem =
        ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return 1;
    Shared* shared = new (mem) Shared();
    const std::string session = "epb" + std::to_string(::getpid()) + "t" + std::to_string(T);
    std::fflush(nullptr);
    std::vector<pid_t> pids;
    for (int r = 0; r < cfg.ranks; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        const Status s = run_rank(cfg, T, r, session, shared);
        if (!s.ok()) std::snprintf(shared->error[r], 256, "%s", s.to_string().c_str());
        std::fflush(nullptr);
        ::_exit(s.ok() ? 0 : 1);
      }
      if (pid < 0) return 1;
      pids.push_back(pid);
    }
    bool ok = true;
    for (pid_t pid : pids) {
      int st = 0;
      ::waitpid(pid, &st, 0);
      ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    }
    for (int r = 0; r < cfg.ranks; ++r) {
      if (shared->error[r][0] != 0) std::fprintf(stderr, "rank %d: %s\n", r, shared->error[r]);
    }
    all_ok = all_ok && ok;
    for (int r = 0; r < cfg.ranks && ok; ++r) {
      const RankResult& x = shared->results[r];
      double open_sum = 0;
      int opens = 0;
      std::string open_list;
      for (int p = 0; p < cfg.ranks; ++p) {
        if (p == r) continue;
        for (int b = 0; b < kBuffers; ++b) {
          open_sum += x.open_us[p][b];
          ++opens;
          open_list += (open_list.empty() ? "" : ", ") + std::to_string(x.open_us[p][b]);
        }
      }
      const double disp_rem = x.dispatch_remote_bytes / (x.dispatch_us * 1e3);
      const double comb_rem = x.combine_remote_bytes / (x.combine_us * 1e3);
      const double disp_all =
          (x.dispatch_remote_bytes + x.dispatch_local_bytes) / (x.dispatch_us * 1e3);
      std::printf("%7d %5d %12.1f %12.1f %13.1f %13.1f %12.1f %12.1f\n", T, r, x.dispatch_us,
                  x.combine_us, disp_rem, comb_rem, disp_all, opens ? open_sum / opens : 0.0);
      char line[1024];
      std::snprintf(line, sizeof(line),
                    "%s{\"tokens\": %d, \"rank\": %d, \"device\": %d, \"dispatch_us\": %.3f, "
                    "\"combine_us\": %.3f, \"dispatch_remote_bytes\": %.0f, "
                    "\"dispatch_local_bytes\": %.0f, \"combine_remote_bytes\": %.0f, "
                    "\"combine_local_bytes\": %.0f, \"dispatch_remote_gbps\": %.2f, "
                    "\"combine_remote_gbps\": %.2f, \"max_abs_err\": %.3g, \"open_us\": [",
                    json.back() == '[' ? "" : ", ", T, r, x.device, x.dispatch_us, x.combine_us,
                    x.dispatch_remote_bytes, x.dispatch_local_bytes, x.combine_remote_bytes,
                    x.combine_local_bytes, disp_rem, comb_rem, x.max_abs_err);
      json += line + open_list + "]}";
    }
    ::munmap(mem, sizeof(Shared));
    if (!ok) std::fprintf(stderr, "tokens %d: a rank failed\n", T);
  }
  json += "]}\n";
  if (!cfg.json_path.empty()) {
    std::ofstream(cfg.json_path) << json;
  }
  return all_ok ? 0 : 1;
}
