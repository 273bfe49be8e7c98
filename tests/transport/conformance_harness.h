// SPDX-License-Identifier: Apache-2.0
// Harness of the transport conformance suite: runs one scenario on N ranks that are real
// forked processes, each with its own transport, and reports how each rank ended.
//
// The parent maps a small shared area (addresses, pids, scratch counters), forks the ranks
// (before any backend state exists in the parent: CUDA backends must initialize in the
// child), polls them with a deadline and SIGKILLs them when it passes. A rank creates its
// transport, publishes its address, connects to every other rank, runs the scenario and
// shuts down; the scenario returns a Status (CT_REQUIRE*), which becomes the exit code.
//
// A new backend joins the suite by adding its name to conformance_backends() ("cuda_ipc_host" is
// cuda_ipc with TransportOptions::host_collectives, "hier_gpu" hier so); when its
// buffers are not host memory (capabilities().device_memory), scenarios stage their bytes
// through the BackendMemory that make_backend_memory() picks from the capabilities. A backend
// that cannot run on this machine (create_transport says Unavailable or Unimplemented: a GPU
// backend without a GPU) is skipped with that message.
// FLEXPERT_CONFORMANCE_DEVICES=N places rank r on device r % N (default: options.device).
// FLEXPERT_CONFORMANCE_NETNS=A,B,... places rank r in the (r % count)-th namespace (needs root;
// scripts/netns_conformance.sh creates them).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "transport/fault_injecting_transport.h"
#include "transport/transport.h"

namespace flexpert::conformance {

// Backends every conformance test runs on.
std::vector<std::string> conformance_backends();

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  ((out << args), ...);
  return out.str();
}

Status failure(const char* file, int line, const char* what, const std::string& detail);
inline const Status& as_status(const Status& s) { return s; }
template <typename T>
const Status& as_status(const Result<T>& r) {
  return r.status();
}

#define CT_CONCAT_INNER_(a, b) a##b
#define CT_CONCAT_(a, b) CT_CONCAT_INNER_(a, b)
// In a scenario: fail this rank (return an error naming file:line) unless `cond` holds.
#define CT_REQUIRE(cond, ...)                                                             \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      return ::flexpert::conformance::failure(__FILE__, __LINE__, #cond,                  \
                                              ::flexpert::conformance::cat(__VA_ARGS__)); \
    }                                                                                     \
  } while (0)
#define CT_REQUIRE_OK(expr)                                                                       \
  do {                                                                                            \
    const auto& ct_value_ = (expr);                                                               \
    const ::flexpert::Status& ct_status_ = ::flexpert::conformance::as_status(ct_value_);         \
    if (!ct_status_.ok()) {                                                                       \
      return ::flexpert::conformance::failure(__FILE__, __LINE__, #expr, ct_status_.to_string()); \
    }                                                                                             \
  } while (0)
#define CT_ASSIGN(lhs, expr) CT_ASSIGN_IMPL_(CT_CONCAT_(ct_result_, __LINE__), lhs, expr)
#define CT_ASSIGN_IMPL_(tmp, lhs, expr)                                                           \
  auto tmp = (expr);                                                                              \
  if (!tmp.ok()) {                                                                                \
    return ::flexpert::conformance::failure(__FILE__, __LINE__, #expr, tmp.status().to_string()); \
  }                                                                                               \
  lhs = std::move(tmp).value()

// Memory the backend's collectives and regions use: host for shm, device for GPU backends.
class BackendMemory {
 public:
  virtual ~BackendMemory() = default;
  virtual void* allocate(size_t num_bytes) = 0;
  virtual void release(void* data) = 0;
  virtual void copy_in(void* backend_dst, const void* host_src, size_t num_bytes) = 0;
  virtual void copy_out(void* host_dst, const void* backend_src, size_t num_bytes) = 0;
};
// Host memory, or device `device`'s memory for a device-memory backend (CUDA builds only).
// Null when the suite does not know how to reach this backend's memory.
std::unique_ptr<BackendMemory> make_backend_memory(const TransportCapabilities& caps, int device);
// Device memory for registered buffers (capabilities().mapped_peer_buffers; CUDA builds only);
// null for backends without them.
std::unique_ptr<BackendMemory> make_device_memory(const TransportCapabilities& caps, int device);
// cudaMalloc / cudaMemcpy on `device` (conformance_device_memory.cc, CUDA builds only).
std::unique_ptr<BackendMemory> make_cuda_memory(int device);

// Why `backend` cannot run on this machine (empty: it can). Creates one transport in a
// forked child, never in this process: CUDA must not be initialized before ranks fork.
// Cached per backend.
std::string backend_unavailable_reason(const std::string& backend);

// A buffer in backend memory holding given bytes; what a scenario passes to a collective.
class Buffer {
 public:
  Buffer(BackendMemory* memory, const std::vector<uint8_t>& bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ByteSpan span() const { return ByteSpan{data_, num_bytes_}; }

 private:
  BackendMemory* memory_;
  void* data_;
  size_t num_bytes_;
};

// Deterministic bytes for a seed: what a rank sends and what a receiver expects.
std::vector<uint8_t> pattern(uint64_t seed, size_t num_bytes);
uint64_t mix64(uint64_t x);
inline uint64_t seed_of(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0) {
  return mix64(mix64(mix64(a) ^ b) ^ c) ^ d;
}

// Scratch shared by the parent and all ranks (anonymous MAP_SHARED, zeroed).
struct SharedState {
  static constexpr int kMaxRanks = 16;
  std::atomic<int32_t> address_gen[kMaxRanks];  // Generation of addresses[r] (0: none yet).
  char addresses[kMaxRanks][1024];  // ucx addresses carry a worker address (~300 chars).

  std::atomic<int32_t> pids[kMaxRanks];
  std::atomic<int64_t> values[32];  // Scenario-defined.
};

struct RankContext {
  int rank = 0;
  int num_ranks = 0;
  std::string backend;
  TransportOptions options;  // This rank's, as its transport was created.
  std::unique_ptr<Transport> transport;
  FaultInjectingTransport* faults = nullptr;  // Set when the spec asks for fault injection.
  std::unique_ptr<BackendMemory> memory;
  std::unique_ptr<BackendMemory> device_memory;  // Registered buffers' (see make_device_memory).
  SharedState* shared = nullptr;
  int64_t deadline_ns = 0;  // When the parent gives up on this run.

  Transport& t() { return *transport; }
  // All ranks of the run, or the given ones.
  Group group(uint64_t epoch) const;
  static Group group(uint64_t epoch, std::vector<int> ranks);
  Buffer buffer(const std::vector<uint8_t>& bytes) { return Buffer(memory.get(), bytes); }
  std::vector<uint8_t> download(ByteSpan span);
  // Fails unless `got` holds exactly pattern(seed, num_bytes).
  Status expect_bytes(ByteSpan got, uint64_t seed, size_t num_bytes, const std::string& what);

  // Address exchange, generation `gen` (the harness does gen 1 before the scenario runs).
  void publish_address(int gen);
  Result<std::string> await_address(int peer, int gen);
  Status connect_all(int gen);
  // Waits (with the run deadline) until shared->values[idx] >= value.
  Status await_value(int idx, int64_t value);
};

using Scenario = std::function<Status(RankContext&)>;

// What the parent sees while the ranks run.
struct ParentView {
  SharedState* shared;
  std::vector<pid_t> pids;
  std::vector<bool> exited;
};

struct ClusterSpec {
  int num_ranks = 2;
  TransportOptions options;    // rank is set per child; an empty session gets a fresh one.
  int deadline_ms = 30000;     // For the whole run: then every rank is SIGKILLed.
  bool inject_faults = false;  // Wrap each rank's transport in a FaultInjectingTransport.
  std::function<void(ParentView&)> parent_step;  // Called about every 0.5 ms in the parent.
};

struct RunResult {
  std::string session;
  std::vector<int> wait_status;  // As waitpid() reported each rank.
  bool timed_out = false;
  double seconds = 0;
};

// A session name unique to this process and call: parallel test runs never collide.
std::string new_session();
RunResult run_cluster(const std::string& backend, const ClusterSpec& spec,
                      const Scenario& scenario);
bool exited_ok(int wait_status);
std::string describe_wait_status(int wait_status);
// Shared-memory names the run left behind (/dev/shm/flexpert-<session>-*).
std::vector<std::string> leftover_segments(const std::string& session);
// Removes what dead ranks of `session` left behind (a supervisor's job).
void cleanup_session(const std::string& backend, const std::string& session);

// Parameterized over (backend, number of ranks). Each test runs its scenario once.
class ConformanceTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  // Skips when the backend cannot run here (see backend_unavailable_reason).
  void SetUp() override;
  const std::string& backend() const { return std::get<0>(GetParam()); }
  int num_ranks() const { return std::get<1>(GetParam()); }
  // max_ranks is num_ranks + 1: one rank slot that never joins (spans for it stay empty).
  ClusterSpec spec(int timeout_ms) const;
  // Runs the scenario; expects every rank to exit 0 and no /dev/shm names left behind.
  RunResult run_ok(const ClusterSpec& spec, const Scenario& scenario);
};

std::string param_name(const ::testing::TestParamInfo<std::tuple<std::string, int>>& info);

#define CT_INSTANTIATE(suite)                                                                  \
  INSTANTIATE_TEST_SUITE_P(                                                                    \
      Backends, suite,                                                                         \
      ::testing::Combine(::testing::ValuesIn(::flexpert::conformance::conformance_backends()), \
                         ::testing::Values(2, 3, 4)),                                          \
      ::flexpert::conformance::param_name)

// ms elapsed since `start_ns` (CLOCK_MONOTONIC, comparable across the ranks' processes).
double ms_since(int64_t start_ns);
int64_t mono_now_ns();

}  // namespace flexpert::conformance
