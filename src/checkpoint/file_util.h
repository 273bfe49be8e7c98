// SPDX-License-Identifier: Apache-2.0
// Private helpers of the checkpoint module: an owned file descriptor, errno to
// Status, whole-file reads and atomic writes. Thread-compatible.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "flexpert/status.h"

namespace flexpert {

class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = other.fd_;
      other.fd_ = -1;
    }
    return *this;
  }

  int get() const { return fd_; }
  // Gives up ownership: the caller closes the descriptor.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes now so that the error of close() (deferred write failures) is seen.
  int close() {
    int rc = fd_ >= 0 ? ::close(fd_) : 0;
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// `what` names the call and the path, e.g. "open /x/model.safetensors".
inline Status errno_status(int err, const std::string& what) {
  std::string message = what + ": " + std::strerror(err);
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return not_found(std::move(message));
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return resource_exhausted(std::move(message));
    case EACCES:
    case EPERM:
    case EROFS:
    case EISDIR:
      return failed_precondition(std::move(message));
    default:
      return internal_error(std::move(message));
  }
}

// Opens `path` read-only; InvalidArgument unless it is a regular file. Never blocks
// on a FIFO.
Result<ScopedFd> open_regular_file(const std::string& path);
// The whole of a small file (config.json, an index); DataLoss beyond `max_bytes`.
Result<std::string> read_text_file(const std::string& path, size_t max_bytes = size_t{64} << 20);
// Writes PATH.tmp and renames it to PATH, so that readers see all or nothing.
Status write_file_atomically(const std::string& path, const std::string& text);

}  // namespace flexpert
