// SPDX-License-Identifier: Apache-2.0
#include "core/fd_table.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

namespace flexpert {

int reserve_fd_table(int fds) {
  rlimit limit{};
  if (fds <= 0 || ::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  const rlim_t want = static_cast<rlim_t>(fds);
  if (limit.rlim_cur < want && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = std::min(limit.rlim_max, want);
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0 && ::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
      return 0;
    }
  }
  const int size = static_cast<int>(std::min(limit.rlim_cur, want));
  if (size < 4) return 0;
  // A descriptor at the top forces the table to its final size now; closing it keeps the
  // table (Linux never shrinks one).
  const int base = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (base < 0) return 0;
  const int top = ::fcntl(base, F_DUPFD_CLOEXEC, size - 1);
  ::close(base);
  if (top < 0) return 0;
  ::close(top);
  return size;
}

}  // namespace flexpert
