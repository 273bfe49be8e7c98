// SPDX-License-Identifier: Apache-2.0
#include "conformance_harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <thread>

#include "transport/shm/shm_transport.h"

namespace flexpert::conformance {

namespace {

int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

class HostMemory final : public BackendMemory {
 public:
  void* allocate(size_t num_bytes) override { return std::malloc(num_bytes == 0 ? 1 : num_bytes); }
  void release(void* data) override { std::free(data); }
  void copy_in(void* dst, const void* src, size_t n) override {
    if (n > 0) std::memcpy(dst, src, n);
  }
  void copy_out(void* dst, const void* src, size_t n) override {
    if (n > 0) std::memcpy(dst, src, n);
  }
};

// FLEXPERT_CONFORMANCE_NETNS=A,B,...: moves this (forked) process into network namespace
// /var/run/netns/<name of rank % count> (scripts/netns_conformance.sh sets them up).
bool join_netns(int rank) {
  const char* list = std::getenv("FLEXPERT_CONFORMANCE_NETNS");
  if (list == nullptr || *list == '\0') return true;
  std::vector<std::string> names;
  std::string cur;
  for (const char* c = list;; ++c) {
    if (*c == ',' || *c == '\0') {
      if (!cur.empty()) names.push_back(cur);
      cur.clear();
      if (*c == '\0') break;
    } else {
      cur.push_back(*c);
    }
  }
  if (names.empty()) return true;
  const std::string path = "/var/run/netns/" + names[static_cast<size_t>(rank) % names.size()];
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
    std::fprintf(stderr, "[rank %d] cannot join network namespace %s: %s\n", rank, path.c_str(),
                 std::strerror(errno));
    if (fd >= 0) ::close(fd);
    return false;
  }
  ::close(fd);
  // /sys still shows the old namespace's devices (UCX lists interfaces there): mount this
  // namespace's sysfs in a private mount namespace, as `ip netns exec` does.
  if (::unshare(CLONE_NEWNS) != 0 || ::mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0 ||
      ::umount2("/sys", MNT_DETACH) != 0 ||
      ::mount(names[0].c_str(), "/sys", "sysfs", 0, nullptr) != 0) {
    std::fprintf(stderr, "[rank %d] cannot remount /sys in network namespace %s: %s\n", rank,
                 path.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

// A suite name as create_transport's backend name and options: "cuda_ipc_host" is cuda_ipc
// with TransportOptions::host_collectives (what GPU workers run), "hier_gpu" hier so (what GPU
// workers run with --transport hier: cuda_ipc within the host).
void resolve_backend(const std::string& name, std::string* backend, TransportOptions* options) {
  *backend = name;
  if (name == "cuda_ipc_host") {
    *backend = "cuda_ipc";
    options->host_collectives = true;
  } else if (name == "hier_gpu") {
    *backend = "hier";
    options->host_collectives = true;
  }
}

// Runs in the forked child; the return value is its exit code.
int run_rank(const std::string& backend, const ClusterSpec& spec, const Scenario& scenario,
             SharedState* shared, int rank, const std::string& session, int64_t deadline_ns) {
  RankContext ctx;
  ctx.rank = rank;
  ctx.num_ranks = spec.num_ranks;
  ctx.options = spec.options;
  resolve_backend(backend, &ctx.backend, &ctx.options);
  ctx.options.rank = rank;
  ctx.options.session = session;
  if (const char* devices = std::getenv("FLEXPERT_CONFORMANCE_DEVICES")) {
    const int n = std::atoi(devices);
    if (n > 0) ctx.options.device = rank % n;
  }
  ctx.shared = shared;
  ctx.deadline_ns = deadline_ns;
  if (!join_netns(rank)) return 2;
  auto created = create_transport(ctx.backend, ctx.options);
  if (!created.ok()) {
    std::fprintf(stderr, "[rank %d] create_transport: %s\n", rank,
                 created.status().to_string().c_str());
    return 2;
  }
  ctx.transport = std::move(created).value();
  if (spec.inject_faults) {
    auto wrapped = std::make_unique<FaultInjectingTransport>(std::move(ctx.transport));
    ctx.faults = wrapped.get();
    ctx.transport = std::move(wrapped);
  }
  ctx.memory = make_backend_memory(ctx.transport->capabilities(), ctx.options.device);
  if (ctx.memory == nullptr) {
    std::fprintf(stderr, "[rank %d] the suite has no BackendMemory for '%s' (device memory)\n",
                 rank, backend.c_str());
    return 2;
  }
  ctx.device_memory = make_device_memory(ctx.transport->capabilities(), ctx.options.device);
  ctx.publish_address(1);
  if (Status s = ctx.connect_all(1); !s.ok()) {
    std::fprintf(stderr, "[rank %d] connect: %s\n", rank, s.to_string().c_str());
    return 2;
  }
  const Status result = scenario(ctx);
  const Status down = ctx.transport != nullptr ? ctx.transport->shutdown() : Status();
  ctx.transport.reset();
  if (!result.ok()) {
    std::fprintf(stderr, "[rank %d] FAILED %s\n", rank, result.to_string().c_str());
    return 1;
  }
  if (!down.ok()) {
    std::fprintf(stderr, "[rank %d] shutdown: %s\n", rank, down.to_string().c_str());
    return 3;
  }
  return 0;
}

}  // namespace

std::vector<std::string> conformance_backends() {
  // A new backend adds its create_transport() name here.
  // "ucx" and "hier" skip themselves (with the reason) in builds without UCX.
#ifdef FLEXPERT_CONFORMANCE_CUDA
  return {"shm", "cuda_ipc", "cuda_ipc_host", "ucx", "hier", "hier_gpu"};
#else
  return {"shm", "ucx", "hier"};
#endif
}

std::string backend_unavailable_reason(const std::string& backend) {
  static std::map<std::string, std::string> cache;  // Test bodies run on one thread.
  if (auto it = cache.find(backend); it != cache.end()) return it->second;
  int fds[2];
  if (::pipe(fds) != 0) std::abort();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) std::abort();
  if (pid == 0) {
    ::close(fds[0]);
    TransportOptions options;
    options.session = new_session() + "probe";
    int code = 0;
    if (!join_netns(0)) ::_exit(1);
    std::string name;
    resolve_backend(backend, &name, &options);
    auto created = create_transport(name, options);
    std::string message;
    if (created.ok()) {
      (void)created.value()->shutdown();
    } else {
      const StatusCode c = created.status().code();
      code = (c == StatusCode::kUnavailable || c == StatusCode::kUnimplemented) ? 77 : 1;
      message = created.status().to_string();
    }
    if (!message.empty() && ::write(fds[1], message.data(), message.size()) < 0) code = 1;
    ::_exit(code);
  }
  ::close(fds[1]);
  std::string message;
  char chunk[512];
  for (ssize_t n; (n = ::read(fds[0], chunk, sizeof(chunk))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    message.append(chunk, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::string reason;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    reason = message;
  } else if (!exited_ok(status)) {
    // Not "unavailable": let the tests run and fail with the real error.
    std::fprintf(stderr, "probing backend %s: %s (%s)\n", backend.c_str(), message.c_str(),
                 describe_wait_status(status).c_str());
  }
  cache[backend] = reason;
  return reason;
}

Status failure(const char* file, int line, const char* what, const std::string& detail) {
  const char* base = std::strrchr(file, '/');
  return internal_error(cat(base != nullptr ? base + 1 : file, ":", line, ": ", what,
                            detail.empty() ? "" : " -- ", detail));
}

std::unique_ptr<BackendMemory> make_backend_memory(const TransportCapabilities& caps, int device) {
  if (!caps.device_memory) return std::make_unique<HostMemory>();
#ifdef FLEXPERT_CONFORMANCE_CUDA
  return make_cuda_memory(device);
#else
  return nullptr;
#endif
}

std::unique_ptr<BackendMemory> make_device_memory(const TransportCapabilities& caps, int device) {
  if (!caps.mapped_peer_buffers) return nullptr;
#ifdef FLEXPERT_CONFORMANCE_CUDA
  return make_cuda_memory(device);
#else
  return nullptr;
#endif
}

Buffer::Buffer(BackendMemory* memory, const std::vector<uint8_t>& bytes)
    : memory_(memory), data_(memory->allocate(bytes.size())), num_bytes_(bytes.size()) {
  memory_->copy_in(data_, bytes.data(), bytes.size());
}

Buffer::~Buffer() {
  if (data_ != nullptr) memory_->release(data_);
}

Buffer::Buffer(Buffer&& other) noexcept
    : memory_(other.memory_), data_(other.data_), num_bytes_(other.num_bytes_) {
  other.data_ = nullptr;
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::vector<uint8_t> pattern(uint64_t seed, size_t num_bytes) {
  std::vector<uint8_t> out(num_bytes);
  for (size_t i = 0; i < num_bytes; i += 8) {
    const uint64_t word = mix64(seed ^ (i * 0x100000001b3ULL));
    std::memcpy(out.data() + i, &word, std::min<size_t>(8, num_bytes - i));
  }
  return out;
}

Group RankContext::group(uint64_t epoch) const {
  Group g;
  g.epoch = epoch;
  for (int r = 0; r < num_ranks; ++r) g.ranks.push_back(r);
  return g;
}

Group RankContext::group(uint64_t epoch, std::vector<int> ranks) {
  Group g;
  g.epoch = epoch;
  g.ranks = std::move(ranks);
  return g;
}

std::vector<uint8_t> RankContext::download(ByteSpan span) {
  std::vector<uint8_t> out(span.num_bytes);
  memory->copy_out(out.data(), span.data, span.num_bytes);
  return out;
}

Status RankContext::expect_bytes(ByteSpan got, uint64_t seed, size_t num_bytes,
                                 const std::string& what) {
  if (got.num_bytes != num_bytes) {
    return internal_error(cat(what, ": got ", got.num_bytes, " bytes, expected ", num_bytes));
  }
  const std::vector<uint8_t> want = pattern(seed, num_bytes);
  const std::vector<uint8_t> have = download(got);
  for (size_t i = 0; i < num_bytes; ++i) {
    if (have[i] != want[i]) {
      return internal_error(cat(what, ": byte ", i, " of ", num_bytes, " is ", int{have[i]},
                                ", expected ", int{want[i]}));
    }
  }
  return Status();
}

void RankContext::publish_address(int gen) {
  const std::string address = transport->address();
  std::snprintf(shared->addresses[rank], sizeof(shared->addresses[rank]), "%s", address.c_str());
  shared->address_gen[rank].store(gen, std::memory_order_release);
}

Result<std::string> RankContext::await_address(int peer, int gen) {
  while (shared->address_gen[peer].load(std::memory_order_acquire) < gen) {
    if (mono_ns() > deadline_ns) {
      return deadline_exceeded(cat("rank ", peer, " never published address generation ", gen));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return std::string(shared->addresses[peer]);
}

Status RankContext::connect_all(int gen) {
  for (int peer = 0; peer < num_ranks; ++peer) {
    if (peer == rank) continue;
    FLEX_ASSIGN_OR_RETURN(std::string address, await_address(peer, gen));
    FLEX_RETURN_IF_ERROR(transport->connect(peer, address));
  }
  return Status();
}

Status RankContext::await_value(int idx, int64_t value) {
  while (shared->values[idx].load(std::memory_order_acquire) < value) {
    if (mono_ns() > deadline_ns) {
      return deadline_exceeded(cat("shared value ", idx, " never reached ", value));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return Status();
}

std::string new_session() {
  static std::atomic<int> counter{0};
  return cat("ct", ::getpid(), "x", counter.fetch_add(1));
}

RunResult run_cluster(const std::string& backend, const ClusterSpec& spec,
                      const Scenario& scenario) {
  RunResult result;
  result.session = spec.options.session.empty() ? new_session() : spec.options.session;
  const int n = spec.num_ranks;
  if (n < 1 || n > SharedState::kMaxRanks) {
    std::fprintf(stderr, "run_cluster: bad num_ranks %d\n", n);
    std::abort();
  }
  void* mem = ::mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) std::abort();
  auto* shared = new (mem) SharedState();
  const int64_t start_ns = mono_ns();
  const int64_t deadline_ns = start_ns + int64_t{spec.deadline_ms} * 1'000'000;

  std::fflush(nullptr);
  ParentView view{shared, {}, {}};
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) std::abort();
    if (pid == 0) {
      const int code = run_rank(backend, spec, scenario, shared, r, result.session, deadline_ns);
      std::fflush(nullptr);
      ::_exit(code);
    }
    view.pids.push_back(pid);
    shared->pids[r].store(pid);
  }
  view.exited.assign(n, false);
  result.wait_status.assign(n, -1);
  int remaining = n;
  while (remaining > 0) {
    for (int r = 0; r < n; ++r) {
      if (view.exited[r]) continue;
      int status = 0;
      if (::waitpid(view.pids[r], &status, WNOHANG) == view.pids[r]) {
        view.exited[r] = true;
        result.wait_status[r] = status;
        --remaining;
      }
    }
    if (remaining == 0) break;
    if (mono_ns() > deadline_ns) {
      result.timed_out = true;
      for (int r = 0; r < n; ++r) {
        if (view.exited[r]) continue;
        ::kill(view.pids[r], SIGKILL);
        ::waitpid(view.pids[r], &result.wait_status[r], 0);
      }
      break;
    }
    if (spec.parent_step) spec.parent_step(view);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  result.seconds = static_cast<double>(mono_ns() - start_ns) / 1e9;
  ::munmap(mem, sizeof(SharedState));
  return result;
}

bool exited_ok(int wait_status) {
  return wait_status != -1 && WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

std::string describe_wait_status(int wait_status) {
  if (wait_status == -1) return "not reaped";
  if (WIFEXITED(wait_status)) return cat("exit code ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return cat("killed by signal ", WTERMSIG(wait_status));
  return cat("wait status ", wait_status);
}

std::vector<std::string> leftover_segments(const std::string& session) {
  std::vector<std::string> out;
  const std::string prefix = "flexpert-" + session + "-";
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return out;
  while (const dirent* entry = ::readdir(dir)) {
    if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0) {
      out.emplace_back(entry->d_name);
    }
  }
  ::closedir(dir);
  return out;
}

void cleanup_session(const std::string& backend, const std::string& session) {
  // Both host backends name their control segments alike (cuda_ipc's device memory dies with
  // its process).
  (void)remove_shm_session(session);
}

void ConformanceTest::SetUp() {
  const std::string why = backend_unavailable_reason(backend());
  if (!why.empty()) {
    GTEST_SKIP() << "transport backend '" << backend() << "' cannot run on this machine: " << why;
  }
}

ClusterSpec ConformanceTest::spec(int timeout_ms) const {
  ClusterSpec s;
  s.num_ranks = num_ranks();
  s.options.max_ranks = num_ranks() + 1;
  s.options.timeout_ms = timeout_ms;
  return s;
}

RunResult ConformanceTest::run_ok(const ClusterSpec& spec, const Scenario& scenario) {
  RunResult result = run_cluster(backend(), spec, scenario);
  EXPECT_FALSE(result.timed_out) << "the ranks did not finish within " << spec.deadline_ms
                                 << " ms (hang?)";
  for (size_t r = 0; r < result.wait_status.size(); ++r) {
    EXPECT_TRUE(exited_ok(result.wait_status[r]))
        << "rank " << r << ": " << describe_wait_status(result.wait_status[r]);
  }
  const std::vector<std::string> left = leftover_segments(result.session);
  EXPECT_TRUE(left.empty()) << "left in /dev/shm after shutdown: " << left.size()
                            << " names, first " << (left.empty() ? "" : left[0]);
  cleanup_session(backend(), result.session);
  return result;
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<std::string, int>>& info) {
  return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks";
}

int64_t mono_now_ns() { return mono_ns(); }
double ms_since(int64_t start_ns) { return static_cast<double>(mono_ns() - start_ns) / 1e6; }

}  // namespace flexpert::conformance
