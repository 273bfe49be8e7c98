// SPDX-License-Identifier: Apache-2.0
// Writing side of the safetensors format; see safetensors.cc for the layout.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "file_util.h"
#include "flexpert/checkpoint.h"

namespace flexpert {
namespace {

Status write_all(int fd, const void* data, size_t num_bytes, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (num_bytes > 0) {
    ssize_t n = ::write(fd, p, num_bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, "write " + path);
    }
    p += n;
    num_bytes -= static_cast<size_t>(n);
  }
  return Status();
}

uint64_t tensor_bytes(DType dtype, const Shape& shape) {
  return static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype);
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Streams the data section through one bounded buffer. Small tensors are packed
// together so that a norm weight does not cost a write() call of its own.
class DataStreamer {
 public:
  DataStreamer(int fd, const std::string& path, size_t capacity,
               const std::function<void(uint64_t, uint64_t)>& progress, uint64_t total)
      : fd_(fd), path_(path), capacity_(capacity), progress_(progress), total_(total) {}

  Status init() {
    // 64-byte alignment keeps every element-aligned position aligned for its type.
    buffer_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (capacity_ + 63) / 64 * 64)));
    if (buffer_ == nullptr) {
      return resource_exhausted("writing " + path_ + ": cannot allocate a " +
                                std::to_string(capacity_) + "-byte buffer");
    }
    if (progress_) progress_(0, total_);
    return Status();
  }

  Status add(uint64_t num_bytes, size_t element_bytes, const SafetensorsWriter::Fill& fill) {
    uint64_t offset = 0;
    while (offset < num_bytes) {
      // Keep dst aligned and chunks made of whole elements (the Fill contract).
      if (used_ % element_bytes != 0 || capacity_ - used_ < element_bytes) {
        FLEX_RETURN_IF_ERROR(flush());
      }
      uint64_t n = std::min<uint64_t>(num_bytes - offset, capacity_ - used_);
      n -= n % element_bytes;
      fill(offset, buffer_.get() + used_, n);
      used_ += n;
      offset += n;
      if (used_ == capacity_) FLEX_RETURN_IF_ERROR(flush());
    }
    return Status();
  }

  Status flush() {
    if (used_ == 0) return Status();
    FLEX_RETURN_IF_ERROR(write_all(fd_, buffer_.get(), used_, path_));
    done_ += used_;
    used_ = 0;
    if (progress_) progress_(done_, total_);
    return Status();
  }

 private:
  int fd_;
  const std::string& path_;
  size_t capacity_;
  const std::function<void(uint64_t, uint64_t)>& progress_;
  uint64_t total_;
  std::unique_ptr<uint8_t, FreeDeleter> buffer_;
  size_t used_ = 0;
  uint64_t done_ = 0;
};

}  // namespace

void SafetensorsWriter::add(std::string name, DType dtype, Shape shape, Fill fill) {
  tensors_.push_back({std::move(name), dtype, std::move(shape), std::move(fill)});
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

uint64_t SafetensorsWriter::total_bytes() const {
  uint64_t total = 0;
  for (const Pending& t : tensors_) total += tensor_bytes(t.dtype, t.shape);
  return total;
}

Status SafetensorsWriter::write(const std::string& path,
                                const std::function<void(uint64_t, uint64_t)>& progress) const {
  // ordered_json keeps the header in the order tensors were added: easier to read.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  for (const Pending& t : tensors_) {
    if (t.name == "__metadata__") return invalid_argument(path + ": '__metadata__' is reserved");
    if (!seen.insert(t.name).second) {
      return invalid_argument(path + ": tensor '" + t.name + "' added twice");
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return invalid_argument(path + ": tensor '" + t.name + "' has shape " +
                                shape_to_string(t.shape));
      }
    }
    if (!t.fill && shape_numel(t.shape) != 0) {
      return invalid_argument(path + ": tensor '" + t.name + "' has no fill callback");
    }
    const uint64_t end = offset + tensor_bytes(t.dtype, t.shape);
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  // Padding the header to 8 bytes aligns the data section for every dtype.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));

  const std::string tmp_path = path + ".tmp";
  ScopedFd fd(::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return errno_status(errno, "create " + tmp_path);
  auto write_body = [&]() -> Status {
    FLEX_RETURN_IF_ERROR(write_all(fd.get(), length, sizeof(length), tmp_path));
    FLEX_RETURN_IF_ERROR(write_all(fd.get(), text.data(), text.size(), tmp_path));
    DataStreamer streamer(fd.get(), tmp_path, std::max<size_t>(buffer_bytes_, 64), progress,
                          offset);
    FLEX_RETURN_IF_ERROR(streamer.init());
    for (const Pending& t : tensors_) {
      FLEX_RETURN_IF_ERROR(streamer.add(tensor_bytes(t.dtype, t.shape), dtype_size(t.dtype), t.fill)
                               .annotate("tensor '" + t.name + "'"));
    }
    FLEX_RETURN_IF_ERROR(streamer.flush());
    // NOTE: no fsync: the rename protects readers from a partial file after a crash of
    // this process, which is the failure that matters here; power loss is out of scope.
    if (fd.close() != 0) return errno_status(errno, "close " + tmp_path);
    if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
      return errno_status(errno, "rename " + tmp_path + " to " + path);
    }
    return Status();
  };
  Status status = write_body();
  if (!status.ok()) ::unlink(tmp_path.c_str());
  return status;
}

}  // namespace flexpert
