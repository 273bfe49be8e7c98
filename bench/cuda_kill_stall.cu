// SPDX-License-Identifier: Apache-2.0
// cuda_kill_stall: how long a GPU process is held when another process on the same GPU is
// SIGKILLed, by what the dead process shared with it (docs/benchmarks.md, "Losing a rank").
//
// For each mode and size: a victim process allocates G GiB on device 0 (touched, in --chunks
// allocations) and runs a loop of tiny kernels; a survivor process runs a loop of {tiny
// kernel, 4 KiB device copy from the victim's memory, stream sync}, stamping each iteration.
// Modes: `none` (the victim shares nothing), `legacy` (cudaIpcGetMemHandle /
// cudaIpcOpenMemHandle), `vmm` (cuMemCreate with POSIX file descriptors, the fd taken with
// pidfd_getfd, then cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess). The parent
// SIGKILLs the victim after --pre-ms and prints the survivor's longest gap within --post-ms of
// the kill against its longest gap before it, and when the victim was reaped. The survivor
// stops reading the victim's memory at the kill (as flexpert's survivors do once they see the
// death) unless --read-after-kill. Variants: --mutual (the victim also maps a buffer of the
// survivor's), --victim-spin (the victim dies inside a kernel that never ends, as a rank in a
// spinning wait; with --release-ms N the parent ends that spin N ms after the kill through
// host memory the kernel polls, as a group-wide fence word would), --victim-wait (the victim
// dies with its stream held by cuStreamWaitValue32, no kernel running), --survivor-rm (the survivor
// also calls cuMemAlloc/cuMemFree each iteration: calls into the kernel driver),
// --victim-pinned-gib (pinned host memory in the victim). MPS is the caller's choice (start the
// control daemon first).
//
//   cuda_kill_stall --modes none,legacy,vmm --gib 0.5,4,16 [--pre-ms 800] [--post-ms 3000]
#include <cuda.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kMaxStamps = 4u << 20;
constexpr size_t kCopyBytes = 4096;
constexpr int kMaxChunks = 256;

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Shared {
  std::atomic<int> victim_ready;
  std::atomic<int> survivor_ready;
  std::atomic<int> survivor_done;
  std::atomic<int64_t> kill_ns;
  std::atomic<int> survivor_exported;
  int victim_pid;
  int survivor_pid;
  int num_chunks;
  uint64_t chunk_bytes;       // Of each victim allocation.
  int victim_fd[kMaxChunks];  // vmm: the exported fds in the victim's table.
  unsigned char ipc_handle[kMaxChunks][CU_IPC_HANDLE_SIZE];
  // --mutual: one buffer of the survivor's that the victim maps.
  uint64_t survivor_bytes;
  int survivor_fd;
  unsigned char survivor_handle[CU_IPC_HANDLE_SIZE];
  std::atomic<int> release;  // --release-ms: the parent lets the victim's spin end.
  double map_ms;
  double unmap_ms;
  char error[256];  // First failure in a child.
  int64_t num_stamps;
  int64_t stamps[kMaxStamps];
};

Shared* g = nullptr;

__global__ void tick(int* counter) {
  if (threadIdx.x == 0) atomicAdd(counter, 1);
}

void fail(const char* what, int code) {
  if (g->error[0] == 0) snprintf(g->error, sizeof(g->error), "%s failed (%d)", what, code);
  _exit(1);
}
#define RT(call)                                 \
  do {                                           \
    cudaError_t e_ = (call);                     \
    if (e_ != cudaSuccess) fail(#call, int(e_)); \
  } while (0)
#define DRV(call)                                 \
  do {                                            \
    CUresult r_ = (call);                         \
    if (r_ != CUDA_SUCCESS) fail(#call, int(r_)); \
  } while (0)

// One exported allocation.
struct Exported {
  void* data = nullptr;
  int fd = -1;                  // vmm
  cudaIpcMemHandle_t handle{};  // legacy
};

size_t vmm_granularity() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  DRV(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return gran;
}

// `num_bytes` is a multiple of vmm_granularity() for vmm. Touched (memset 1).
Exported export_memory(const std::string& mode, size_t num_bytes) {
  Exported out;
  if (mode == "vmm") {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h;
    DRV(cuMemCreate(&h, num_bytes, &prop, 0));
    CUdeviceptr p = 0;
    DRV(cuMemAddressReserve(&p, num_bytes, vmm_granularity(), 0, 0));
    DRV(cuMemMap(p, num_bytes, 0, h, 0));
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    DRV(cuMemSetAccess(p, num_bytes, &access, 1));
    DRV(cuMemExportToShareableHandle(&out.fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    out.data = reinterpret_cast<void*>(p);
  } else {
    RT(cudaMalloc(&out.data, num_bytes));
    if (mode == "legacy") RT(cudaIpcGetMemHandle(&out.handle, out.data));
  }
  RT(cudaMemset(out.data, 1, num_bytes));
  return out;
}

// Another process's allocation mapped here.
struct Imported {
  const char* data = nullptr;
  size_t num_bytes = 0;
  CUmemGenericAllocationHandle vmm{};
};

Imported import_memory(const std::string& mode, size_t num_bytes, const unsigned char* handle,
                       int owner_pid, int owner_fd) {
  Imported out;
  out.num_bytes = num_bytes;
  if (mode == "legacy") {
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    void* p = nullptr;
    RT(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    out.data = static_cast<const char*>(p);
  } else if (mode == "vmm") {
    const int pidfd = int(syscall(SYS_pidfd_open, owner_pid, 0));
    if (pidfd < 0) fail("pidfd_open", errno);
    const int fd = int(syscall(SYS_pidfd_getfd, pidfd, owner_fd, 0));
    if (fd < 0) fail("pidfd_getfd", errno);
    close(pidfd);
    DRV(cuMemImportFromShareableHandle(&out.vmm, reinterpret_cast<void*>(intptr_t(fd)),
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);  // The handle holds the memory now.
    CUdeviceptr p = 0;
    DRV(cuMemAddressReserve(&p, num_bytes, vmm_granularity(), 0, 0));
    DRV(cuMemMap(p, num_bytes, 0, out.vmm, 0));
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    DRV(cuMemSetAccess(p, num_bytes, &access, 1));
    out.data = reinterpret_cast<const char*>(p);
  }
  return out;
}

void unmap(const std::string& mode, Imported& m) {
  if (mode == "legacy") RT(cudaIpcCloseMemHandle(const_cast<char*>(m.data)));
  if (mode == "vmm") {
    const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(m.data);
    DRV(cuMemUnmap(p, m.num_bytes));
    DRV(cuMemAddressFree(p, m.num_bytes));
    DRV(cuMemRelease(m.vmm));
  }
}

__global__ void spin(const volatile int* flag) {
  while (*flag == 0) {
  }
}

// Spins until *release (host memory the parent writes) is set, as a rank's wait that a
// group-wide fence word ends.
__global__ void spin_until(const volatile int* flag, const volatile int* release) {
  while (*flag == 0 && *release == 0) {
    __nanosleep(100);
  }
}

struct Options {
  int pre_ms = 800, post_ms = 3000, chunks = 1;
  int release_ms = -1;  // --victim-spin: the spin ends this long after the kill (-1: never).
  bool read_after_kill = false, mutual = false, victim_spin = false, survivor_rm = false;
  bool victim_wait = false;
  double victim_pinned_gib = 0;
};

void victim(const std::string& mode, size_t num_bytes, const Options& o) {
  RT(cudaSetDevice(0));
  RT(cudaFree(nullptr));
  int* counter = nullptr;
  RT(cudaMalloc(&counter, sizeof(int)));
  RT(cudaMemset(counter, 0, sizeof(int)));
  size_t chunk = num_bytes / size_t(o.chunks);
  if (mode == "vmm") {
    const size_t gran = vmm_granularity();
    chunk = (chunk + gran - 1) / gran * gran;
  }
  for (int c = 0; c < o.chunks; ++c) {
    Exported e = export_memory(mode, chunk);
    g->victim_fd[c] = e.fd;
    memcpy(g->ipc_handle[c], &e.handle, sizeof(e.handle));
  }
  if (o.victim_pinned_gib > 0) {
    void* h = nullptr;
    const size_t n = size_t(o.victim_pinned_gib * double(1ull << 30));
    RT(cudaMallocHost(&h, n));
    memset(h, 1, n);
  }
  if (o.mutual) {
    while (g->survivor_exported.load() == 0) usleep(500);
    Imported m =
        import_memory(mode, g->survivor_bytes, g->survivor_handle, g->survivor_pid, g->survivor_fd);
    (void)m;
  }
  RT(cudaDeviceSynchronize());
  g->num_chunks = o.chunks;
  g->chunk_bytes = chunk;
  g->victim_ready.store(1);
  cudaStream_t s;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (o.victim_spin && o.release_ms >= 0) {  // Dies inside a kernel that a fence ends.
    const uintptr_t page = reinterpret_cast<uintptr_t>(g) & ~uintptr_t(4095);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(&g->release + 1) + 4095) & ~uintptr_t(4095);
    RT(cudaHostRegister(reinterpret_cast<void*>(page), end - page, cudaHostRegisterMapped));
    int* release = nullptr;
    RT(cudaHostGetDevicePointer(reinterpret_cast<void**>(&release), &g->release, 0));
    spin_until<<<1, 32, 0, s>>>(counter, release);
    pause();
  }
  if (o.victim_spin) {  // Dies inside a kernel that never ends (a rank's spinning wait).
    spin<<<1, 32, 0, s>>>(counter);
    pause();
  }
  if (o.victim_wait) {  // Dies with its stream held by a wait on memory (no kernel running).
    DRV(cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(counter),
                            1, CU_STREAM_WAIT_VALUE_GEQ));
    tick<<<1, 32, 0, s>>>(counter);
    pause();
  }
  for (;;) {  // Busy until killed, as a serving rank is.
    tick<<<1, 32, 0, s>>>(counter);
    RT(cudaStreamSynchronize(s));
  }
}

void survivor(const std::string& mode, const Options& o) {
  RT(cudaSetDevice(0));
  RT(cudaFree(nullptr));
  int* counter = nullptr;
  char* local = nullptr;
  RT(cudaMalloc(&counter, sizeof(int)));
  RT(cudaMalloc(&local, kCopyBytes));
  cudaStream_t s;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (o.mutual && mode != "none") {
    const size_t n = mode == "vmm" ? vmm_granularity() * 64 : size_t(128) << 20;
    Exported e = export_memory(mode, n);
    g->survivor_bytes = n;
    g->survivor_fd = e.fd;
    memcpy(g->survivor_handle, &e.handle, sizeof(e.handle));
    RT(cudaDeviceSynchronize());
  }
  g->survivor_exported.store(1);
  while (g->victim_ready.load() == 0) usleep(1000);
  std::vector<Imported> maps;
  const int64_t t0 = now_ns();
  if (mode != "none") {
    for (int c = 0; c < g->num_chunks; ++c) {
      maps.push_back(
          import_memory(mode, g->chunk_bytes, g->ipc_handle[c], g->victim_pid, g->victim_fd[c]));
    }
  }
  g->map_ms = (now_ns() - t0) / 1e6;
  const char* peer = maps.empty() ? nullptr : maps[0].data;
  const size_t peer_bytes = g->chunk_bytes;
  // Warm up, then run until post_ms after the kill.
  for (int i = 0; i < 100; ++i) {
    tick<<<1, 32, 0, s>>>(counter);
    if (peer) RT(cudaMemcpyAsync(local, peer, kCopyBytes, cudaMemcpyDeviceToDevice, s));
    RT(cudaStreamSynchronize(s));
  }
  g->survivor_ready.store(1);
  int64_t n = 0;
  for (;;) {
    const int64_t kill_ns = g->kill_ns.load(std::memory_order_relaxed);
    tick<<<1, 32, 0, s>>>(counter);
    if (peer && (kill_ns == 0 || o.read_after_kill)) {
      const size_t off = (size_t(n) * 65536) % (peer_bytes - kCopyBytes);
      RT(cudaMemcpyAsync(local, peer + off, kCopyBytes, cudaMemcpyDeviceToDevice, s));
    }
    if (o.survivor_rm) {  // A call into the kernel driver each iteration.
      CUdeviceptr p = 0;
      DRV(cuMemAlloc(&p, 2 << 20));
      DRV(cuMemFree(p));
    }
    const cudaError_t e = cudaStreamSynchronize(s);
    const int64_t t = now_ns();
    if (e != cudaSuccess) fail("cudaStreamSynchronize in the loop", int(e));
    if (n < int64_t(kMaxStamps)) g->stamps[n++] = t;
    if (kill_ns != 0 && t > kill_ns + int64_t(o.post_ms) * 1000000) break;
  }
  g->num_stamps = n;
  const int64_t t1 = now_ns();
  for (Imported& m : maps) unmap(mode, m);
  g->unmap_ms = (now_ns() - t1) / 1e6;
  g->survivor_done.store(1);
  _exit(0);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

bool wait_flag(std::atomic<int>& flag, pid_t a, pid_t b, int timeout_ms) {
  const int64_t deadline = now_ns() + int64_t(timeout_ms) * 1000000;
  while (flag.load() == 0) {
    if (now_ns() > deadline) return false;
    int status;
    if (waitpid(a, &status, WNOHANG) == a || waitpid(b, &status, WNOHANG) == b) return false;
    usleep(500);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string modes = "none,legacy,vmm", sizes = "0.5,4,16";
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--modes")
      modes = next();
    else if (a == "--gib")
      sizes = next();
    else if (a == "--pre-ms")
      o.pre_ms = std::atoi(next().c_str());
    else if (a == "--post-ms")
      o.post_ms = std::atoi(next().c_str());
    else if (a == "--chunks")
      o.chunks = std::clamp(std::atoi(next().c_str()), 1, kMaxChunks);
    else if (a == "--victim-pinned-gib")
      o.victim_pinned_gib = std::atof(next().c_str());
    else if (a == "--read-after-kill")
      o.read_after_kill = true;
    else if (a == "--mutual")
      o.mutual = true;
    else if (a == "--victim-spin")
      o.victim_spin = true;
    else if (a == "--survivor-rm")
      o.survivor_rm = true;
    else if (a == "--victim-wait")
      o.victim_wait = true;
    else if (a == "--release-ms")
      o.release_ms = std::atoi(next().c_str());
    else {
      fprintf(stderr,
              "usage: %s [--modes none,legacy,vmm] [--gib 0.5,4,16] [--pre-ms N] [--post-ms N]\n"
              "  [--chunks N] [--victim-pinned-gib G] [--read-after-kill] [--mutual]\n"
              "  [--victim-spin [--release-ms N]] [--victim-wait] [--survivor-rm]\n",
              argv[0]);
      return 2;
    }
  }
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 1;
  g = static_cast<Shared*>(mem);
  printf(
      "| mode | GiB | chunks | flags | map ms | steady max gap ms | kill stall ms | at ms after "
      "kill | "
      "reaped ms | unmap ms | error |\n");
  printf("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|\n");
  std::string flags;
  if (o.mutual) flags += "mutual ";
  if (o.victim_spin) flags += "victim-spin ";
  if (o.victim_spin && o.release_ms >= 0)
    flags += "released " + std::to_string(o.release_ms) + " ms after ";
  if (o.victim_wait) flags += "victim-wait ";
  if (o.survivor_rm) flags += "survivor-rm ";
  if (o.read_after_kill) flags += "read-after-kill ";
  if (o.victim_pinned_gib > 0) flags += "pinned " + std::to_string(o.victim_pinned_gib) + " ";
  if (flags.empty()) flags = "-";
  for (const std::string& mode : split(modes)) {
    for (const std::string& size : split(sizes)) {
      memset(static_cast<void*>(g), 0, offsetof(Shared, stamps));
      const size_t num_bytes = size_t(std::atof(size.c_str()) * double(1ull << 30));
      const pid_t s = fork();
      if (s == 0) survivor(mode, o);
      g->survivor_pid = s;
      const pid_t v = fork();
      if (v == 0) victim(mode, num_bytes, o);
      g->victim_pid = v;
      bool ok = wait_flag(g->survivor_ready, v, s, 60000);
      int64_t kill_ns = 0, reaped_ns = 0;
      if (ok) {
        usleep(o.pre_ms * 1000);
        kill_ns = now_ns();
        g->kill_ns.store(kill_ns);
        kill(v, SIGKILL);
        if (o.release_ms >= 0) {
          usleep(o.release_ms * 1000);
          g->release.store(1);
        }
        waitpid(v, nullptr, 0);
        reaped_ns = now_ns();
      } else {
        kill(v, SIGKILL);
        waitpid(v, nullptr, 0);
        kill(s, SIGKILL);
      }
      int status = 0;
      waitpid(s, &status, 0);
      double steady = 0, stall = 0, at = 0;
      for (int64_t i = 1; i < g->num_stamps; ++i) {
        const double gap = (g->stamps[i] - g->stamps[i - 1]) / 1e6;
        if (g->stamps[i] <= kill_ns) {
          if (g->stamps[i] > kill_ns - int64_t(o.pre_ms) * 500000) steady = std::max(steady, gap);
        } else if (gap > stall) {
          stall = gap;
          at = (std::max(g->stamps[i - 1], kill_ns) - kill_ns) / 1e6;
        }
      }
      printf("| %s | %s | %d | %s | %.1f | %.2f | %.2f | %.1f | %.1f | %.1f | %s |\n", mode.c_str(),
             size.c_str(), o.chunks, flags.c_str(), g->map_ms, steady, stall, at,
             ok ? (reaped_ns - kill_ns) / 1e6 : 0.0, g->unmap_ms, g->error[0] ? g->error : "-");
      fflush(stdout);
    }
  }
  return 0;
}
