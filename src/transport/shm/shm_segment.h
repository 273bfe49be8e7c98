// SPDX-License-Identifier: Apache-2.0
// OS plumbing of the shm transport: one RAII wrapper per foreign handle (an fd, a mapped
// POSIX shm segment, a pidfd watching another process) and the cross-process futex calls.
//
// Nothing here knows the transport's layout. All classes are thread-compatible (callers
// synchronize); the free functions are thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "core/clock.h"
#include "flexpert/status.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace flexpert::shm {

class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ~ScopedFd() { reset(); }
  ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_;
};

// A named POSIX shm segment mapped into this process. The creator owns the name: unlink()
// removes it, and the destructor does so at the latest (a crashing test leaks nothing).
// Openers only unmap. The mapping stays at one address for the object's life.
class ShmMapping {
 public:
  // Creates `name` exclusively, reserves `num_bytes` of /dev/shm up front (so a full /dev/shm
  // is ResourceExhausted now rather than a SIGBUS on first touch), zeroed, mapped read-write.
  // An existing name is FailedPrecondition (the caller decides whether it is stale).
  static Result<std::unique_ptr<ShmMapping>> create(const std::string& name, size_t num_bytes,
                                                    bool populate);
  // Maps all of an existing segment. NotFound when it does not exist or is still empty.
  static Result<std::unique_ptr<ShmMapping>> open(const std::string& name, bool writable,
                                                  bool populate);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  std::byte* data() const { return data_; }
  size_t num_bytes() const { return num_bytes_; }
  const std::string& name() const { return name_; }
  // Removes the name (owner only; idempotent). The mapping itself stays valid.
  Status unlink();

 private:
  ShmMapping(std::string name, std::byte* data, size_t num_bytes, bool owner)
      : name_(std::move(name)), data_(data), num_bytes_(num_bytes), owner_(owner) {}

  std::string name_;
  std::byte* data_;
  size_t num_bytes_;
  bool owner_;  // Created here and not yet unlinked.
};

// errno of a failed call -> Status, naming the call: "shm_open /flexpert-x: No such file".
Status errno_status(int err, const std::string& what);

// Cross-process futex on a word in shared memory (never FUTEX_PRIVATE_FLAG).
// Returns when woken, when *word != expected, or after timeout_ns; spurious returns happen.
void futex_wait_shared(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
void futex_wake_shared(std::atomic<uint32_t>* word);

// Start time of a process (/proc/<pid>/stat field 22, clock ticks since boot), 0 if unknown.
// Together with the pid it names one process: a reused pid has another start time.
uint64_t process_start_time(int pid);

// The fields of a /proc/<pid>/stat line this file reads (the command name, field 2, may
// hold spaces and ')'). parse_proc_stat: false if the line is not one.
struct ProcStat {
  char state = '?';         // Field 3: R, S, D, Z (zombie), X (dead), ...
  uint64_t flags = 0;       // Field 9: the kernel's PF_* flags of the task.
  uint64_t start_time = 0;  // Field 22: clock ticks since boot.
};
bool parse_proc_stat(std::string_view line, ProcStat* stat);
// PF_EXITING (include/linux/sched.h): set as the task enters do_exit, long before the
// process has torn its memory (and a GPU context) down and its pidfd turns readable.
inline constexpr uint64_t kProcFlagExiting = 0x4;
// The task is in the exit path: PF_EXITING, a zombie or dead.
bool proc_stat_exiting(const ProcStat& stat);

// Watches another process. exited(): it has ended (a pidfd where the kernel has them,
// else kill(pid, 0) plus /proc, where a zombie leader counts). ended(): exited, or on its
// way out: every thread in the kernel's exit path (PF_EXITING), which for a process with
// gigabytes mapped or a CUDA context lasts tens to hundreds of milliseconds (a SIGKILLed
// rank is dead from its start); the leader's /proc/<pid>/stat through a descriptor held
// since watch(), ~3 us, and the other threads' only once the leader is exiting (a leader
// may leave alone), so for liveness checks, not per message. Watches nothing (never
// reports an end) when the pid is not that process: another PID namespace, or a pid
// already reused.
class ProcessWatch {
 public:
  ProcessWatch() = default;
  static ProcessWatch watch(int pid, uint64_t start_time);

  bool watching() const { return pid_ > 0; }
  bool has_pidfd() const { return pidfd_.valid(); }
  bool exited() const;
  bool ended() const;

 private:
  int pid_ = -1;
  uint64_t start_time_ = 0;
  ScopedFd pidfd_;
  ScopedFd stat_fd_;  // /proc/<pid>/stat of this very process (reads fail once reaped).
};

// The collectives' waits (both host backends) check their peers' liveness (ended(), a
// few us a peer) first kFirstLivenessNs into a wait, then every kLivenessSliceNs, which
// is also their longest futex sleep: a peer's death is seen within ~1 ms.
inline constexpr int64_t kFirstLivenessNs = 200'000;
inline constexpr int64_t kLivenessSliceNs = 1'000'000;

struct SegmentHeader;
// Transport::peer_status of the backends built on these segments: Unavailable "rank R (pid
// P) shut down" once the peer's segment is closed, "... died" once its process ended.
Status peer_liveness(int rank, int32_t pid, const SegmentHeader& header, const ProcessWatch& watch);

// CLOCK_MONOTONIC in ns (core/clock.h): comparable across processes of one host.
using flexpert::now_ns;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace flexpert::shm
