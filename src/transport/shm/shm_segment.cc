// SPDX-License-Identifier: Apache-2.0
#include "transport/shm/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>

#include "transport/shm/shm_layout.h"

namespace flexpert::shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "futex words must be plain 32-bit words");

void ScopedFd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status errno_status(int err, const std::string& what) {
  std::string message = what + ": " + std::strerror(err);
  switch (err) {
    case ENOENT:
      return not_found(std::move(message));
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EDQUOT:
      return resource_exhausted(std::move(message));
    case EEXIST:
      return failed_precondition(std::move(message));
    case EINVAL:
    case ENAMETOOLONG:
      return invalid_argument(std::move(message));
    default:
      return unavailable(std::move(message));
  }
}

Result<std::unique_ptr<ShmMapping>> ShmMapping::create(const std::string& name, size_t num_bytes,
                                                       bool populate) {
  if (num_bytes == 0) return invalid_argument("shm segment " + name + ": size 0");
  ScopedFd fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd.valid()) return errno_status(errno, "shm_open(create) " + name);
  // From here on the name exists: any failure must remove it again.
  auto fail = [&](Status status) {
    ::shm_unlink(name.c_str());
    return status;
  };
  // posix_fallocate also sets the size; on tmpfs it allocates the pages now.
  if (int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(num_bytes)); err != 0) {
    return fail(errno_status(
        err, "posix_fallocate " + name + " (" + std::to_string(num_bytes) + " bytes of /dev/shm)"));
  }
  void* data = ::mmap(nullptr, num_bytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED | (populate ? MAP_POPULATE : 0), fd.get(), 0);
  if (data == MAP_FAILED) return fail(errno_status(errno, "mmap " + name));
  return std::unique_ptr<ShmMapping>(
      new ShmMapping(name, static_cast<std::byte*>(data), num_bytes, /*owner=*/true));
}

Result<std::unique_ptr<ShmMapping>> ShmMapping::open(const std::string& name, bool writable,
                                                     bool populate) {
  ScopedFd fd(::shm_open(name.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0));
  if (!fd.valid()) return errno_status(errno, "shm_open " + name);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, "fstat " + name);
  if (st.st_size <= 0) return not_found("shm segment " + name + " is empty (still being created?)");
  const auto num_bytes = static_cast<size_t>(st.st_size);
  void* data = ::mmap(nullptr, num_bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                      MAP_SHARED | (populate ? MAP_POPULATE : 0), fd.get(), 0);
  if (data == MAP_FAILED) return errno_status(errno, "mmap " + name);
  return std::unique_ptr<ShmMapping>(
      new ShmMapping(name, static_cast<std::byte*>(data), num_bytes, /*owner=*/false));
}

ShmMapping::~ShmMapping() {
  if (owner_) (void)unlink();
  ::munmap(data_, num_bytes_);
}

Status ShmMapping::unlink() {
  if (!owner_) return Status();
  owner_ = false;
  // ENOENT: someone (a supervisor cleaning up the session) removed it already; fine.
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    return errno_status(errno, "shm_unlink " + name_);
  }
  return Status();
}

void futex_wait_shared(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  if (timeout_ns <= 0) return;
  timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000),
              static_cast<long>(timeout_ns % 1'000'000'000)};
  // EAGAIN (value changed), EINTR and ETIMEDOUT all mean "look again"; the caller loops.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_shared(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

namespace {

// Reads the stat line through a held descriptor; false once the process is reaped.
bool read_proc_stat_fd(int fd, ProcStat* stat) {
  char buf[2048];  // The whole line is < 1.2 KB; the fields read here come first.
  const ssize_t n = ::pread(fd, buf, sizeof(buf), 0);
  return n > 0 && parse_proc_stat(std::string_view(buf, static_cast<size_t>(n)), stat);
}

}  // namespace

bool parse_proc_stat(std::string_view line, ProcStat* stat) {
  const size_t paren = line.rfind(')');
  if (paren == std::string_view::npos) return false;
  // Fields 3, 4, ... after the name; rest[i] is field i + 3.
  std::string_view rest = line.substr(paren + 1);
  std::string_view field[20];
  int count = 0;
  while (count < 20) {
    const size_t start = rest.find_first_not_of(" \n");
    if (start == std::string_view::npos) break;
    const size_t end = std::min(rest.find_first_of(" \n", start), rest.size());
    field[count++] = rest.substr(start, end - start);
    rest = rest.substr(end);
  }
  if (count < 20) return false;
  auto number = [](std::string_view f, uint64_t* v) {
    return std::from_chars(f.data(), f.data() + f.size(), *v).ec == std::errc();
  };
  ProcStat out;
  out.state = field[0].empty() ? '?' : field[0][0];
  if (!number(field[6], &out.flags) || !number(field[19], &out.start_time)) return false;
  *stat = out;
  return true;
}

uint64_t process_start_time(int pid) {
  const ScopedFd fd(
      ::open(("/proc/" + std::to_string(pid) + "/stat").c_str(), O_RDONLY | O_CLOEXEC));
  ProcStat stat;
  return fd.valid() && read_proc_stat_fd(fd.get(), &stat) ? stat.start_time : 0;
}

ProcessWatch ProcessWatch::watch(int pid, uint64_t start_time) {
  ProcessWatch w;
  if (pid <= 0 || start_time == 0) return w;
#ifdef SYS_pidfd_open
  // Open first, then check the start time: if they match, the fds are that very process.
  w.pidfd_ = ScopedFd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
#endif
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  w.stat_fd_ = ScopedFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ProcStat stat;
  if (!w.stat_fd_.valid() || !read_proc_stat_fd(w.stat_fd_.get(), &stat) ||
      stat.start_time != start_time) {
    return ProcessWatch();
  }
  w.pid_ = pid;
  w.start_time_ = start_time;
  return w;
}

bool ProcessWatch::exited() const {
  if (pid_ <= 0) return false;
  if (pidfd_.valid()) {
    pollfd p{pidfd_.get(), POLLIN, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0;
  }
  if (::kill(pid_, 0) != 0 && errno == ESRCH) return true;
  ProcStat stat;
  if (!read_proc_stat_fd(stat_fd_.get(), &stat)) return true;
  return stat.state == 'Z' || stat.state == 'X' || stat.start_time != start_time_;
}

bool proc_stat_exiting(const ProcStat& stat) {
  return (stat.flags & kProcFlagExiting) != 0 || stat.state == 'Z' || stat.state == 'X';
}

namespace {

// Whether every thread of process `pid` is in the exit path (or gone): a SIGKILL takes
// them all; a leader that left by itself leaves the others running.
bool all_tasks_exiting(int pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return true;  // Reaped meanwhile.
  bool all = true;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    ScopedFd fd(::open((dir + "/" + e->d_name + "/stat").c_str(), O_RDONLY | O_CLOEXEC));
    ProcStat stat;
    if (!fd.valid() || !read_proc_stat_fd(fd.get(), &stat)) continue;  // That thread is gone.
    if (!proc_stat_exiting(stat)) {
      all = false;
      break;
    }
  }
  ::closedir(d);
  return all;
}

}  // namespace

bool ProcessWatch::ended() const {
  if (pid_ <= 0) return false;
  if (exited()) return true;
  ProcStat stat;
  if (!read_proc_stat_fd(stat_fd_.get(), &stat)) return true;  // Reaped meanwhile.
  // The leader's entry first (one read); the other threads only once it is exiting.
  return proc_stat_exiting(stat) && all_tasks_exiting(pid_);
}

Status peer_liveness(int rank, int32_t pid, const SegmentHeader& header,
                     const ProcessWatch& watch) {
  const std::string who = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ")";
  if (header.closed.load(std::memory_order_seq_cst) != 0) return unavailable(who + " shut down");
  if (watch.ended()) return unavailable(who + " died").with_dead_rank(rank);
  return Status();
}

}  // namespace flexpert::shm
