// SPDX-License-Identifier: Apache-2.0
// A whole .safetensors file (length, header JSON, data): open() gives a Status,
// and every tensor it accepts reads back with its shape's byte count.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flexpert/checkpoint.h"
#include "flexpert/logging.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An in-memory regular file, reached through its /proc path.
  const int fd = ::memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  FLEX_CHECK(fd >= 0);
  FLEX_CHECK(::write(fd, data, size) == static_cast<ssize_t>(size));
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto file = flexpert::SafetensorsFile::open(path);
  if (file.ok()) {
    for (const auto& [name, entry] : (*file)->entries()) {
      auto t = (*file)->get(name);
      if (t.ok()) FLEX_CHECK(t->num_bytes() == entry.end - entry.begin) << name;
    }
  }
  ::close(fd);
  return 0;
}
