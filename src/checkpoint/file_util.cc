// SPDX-License-Identifier: Apache-2.0
#include "file_util.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cstdio>

namespace flexpert {

Result<ScopedFd> open_regular_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  // It changes nothing for the regular files this accepts.
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) return errno_status(errno, "open " + path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, "stat " + path);
  if (!S_ISREG(st.st_mode)) {
    return invalid_argument(path + ": not a regular file (a FIFO, device or directory)");
  }
  return fd;
}

Result<std::string> read_text_file(const std::string& path, size_t max_bytes) {
  FLEX_ASSIGN_OR_RETURN(ScopedFd fd, open_regular_file(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, "stat " + path);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return data_loss(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                     std::to_string(max_bytes) + " expected of this file");
  }
  std::string text;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, "read " + path);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > max_bytes) return data_loss(path + ": grew while being read");
  }
  return text;
}

Status write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp_path = path + ".tmp";
  ScopedFd fd(::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return errno_status(errno, "create " + tmp_path);
  Status status;
  size_t done = 0;
  while (status.ok() && done < text.size()) {
    ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno != EINTR) status = errno_status(errno, "write " + tmp_path);
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (status.ok() && fd.close() != 0) status = errno_status(errno, "close " + tmp_path);
  if (status.ok() && std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    status = errno_status(errno, "rename " + tmp_path + " to " + path);
  }
  if (!status.ok()) ::unlink(tmp_path.c_str());
  return status;
}

}  // namespace flexpert
