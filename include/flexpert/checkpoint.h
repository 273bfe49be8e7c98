// SPDX-License-Identifier: Apache-2.0
// Checkpoint: the tensors of a Hugging Face safetensors checkpoint.
//
// A checkpoint directory holds either `model.safetensors` or shards listed by
// `model.safetensors.index.json`. Every file is validated when opened (header
// JSON, dtypes, offsets inside the file, no overlaps), so a truncated or
// corrupt file gives a DataLoss status, never a crash. Tensors are read (pread)
// into memory of their own, never memory-mapped: a file truncated or rewritten
// while a process serves from it cannot raise SIGBUS. Each read first checks that
// the file still has the size, inode and modification time it had when opened
// (DataLoss otherwise: "changed on disk"), and a short read is DataLoss too.
// read_into() reads a tensor's bytes, or pieces of them, straight into the caller's memory
// (an expert slot) under the same checks, without a copy of its own or a conversion.
// Read-only after open: thread-safe (pread on a shared descriptor).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "flexpert/status.h"
#include "flexpert/tensor.h"

namespace flexpert {

// One open .safetensors file.
class SafetensorsFile {
 public:
  struct Entry {
    DType dtype;
    Shape shape;
    uint64_t begin = 0;  // Byte offsets relative to the data section.
    uint64_t end = 0;
  };

  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Tensors in a dtype flexpert does not compute in (I64, U8, F8_E5M2, ...): name ->
  // dtype as written. They are validated like the others but are not in entries().
  const std::map<std::string, std::string>& unsupported() const { return unsupported_; }
  // An owned copy of the named tensor read from the file, or NotFound (Unimplemented
  // for an unsupported dtype; DataLoss when the file changed since open()).
  Result<Tensor> get(const std::string& name) const;
  // One piece of a read_into(): bytes [offset, offset + num_bytes) of a tensor's data (in its
  // own dtype, as the file stores it) to `dst`.
  struct ReadPiece {
    uint64_t offset = 0;
    uint64_t num_bytes = 0;
    void* dst = nullptr;
  };
  // Reads `pieces` of the named tensor (pread; one check_unchanged() before them all). A piece
  // outside the tensor is InvalidArgument; errors otherwise as get().
  Status read_into(const std::string& name, const std::vector<ReadPiece>& pieces) const;
  // DataLoss when the file's size, inode or modification time differ from open().
  Status check_unchanged() const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  int fd_ = -1;
  uint64_t data_offset_ = 0;  // Of the data section: 8 + header length.
  // What open() saw, compared before every read.
  uint64_t file_bytes_ = 0;
  uint64_t inode_ = 0;
  int64_t mtime_ns_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, std::string> unsupported_;
};

class Checkpoint {
 public:
  // Opens DIR/model.safetensors, or DIR/model.safetensors.index.json and its shards.
  static Result<std::unique_ptr<Checkpoint>> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;
  // An owned copy of the tensor (NotFound names the tensor and directory).
  Result<Tensor> get(const std::string& name) const;
  // As get(), and InvalidArgument when the shape differs from `expected`.
  Result<Tensor> get(const std::string& name, const Shape& expected) const;
  // The dtype, shape and offsets of a tensor, without reading it (NotFound; Unimplemented for
  // an unsupported dtype).
  Result<SafetensorsFile::Entry> entry(const std::string& name) const;
  // As entry(), and InvalidArgument when the shape differs from `expected` (as get()).
  Result<SafetensorsFile::Entry> entry(const std::string& name, const Shape& expected) const;
  // SafetensorsFile::read_into() of the file that holds `name`.
  Status read_into(const std::string& name,
                   const std::vector<SafetensorsFile::ReadPiece>& pieces) const;
  // A 2-D weight ready for the kernels: as get(name, expected), except that an F8_E4M3
  // tensor is dequantized with its sibling `<name>_scale_inv` (F32 or BF16 block scales
  // [ceil(rows / block_rows), ceil(cols / block_cols)], as DeepSeek-V3 stores them) into
  // an owned BF16 tensor: w[i, j] = fp8[i, j] * scale_inv[i / block_rows, j / block_cols].
  // An F8_E4M3 tensor without (or with misshapen) scales is InvalidArgument.
  Result<Tensor> get_weight(const std::string& name, const Shape& expected, int block_rows = 128,
                            int block_cols = 128) const;
  // As above with a config's ModelConfig::weight_block_size ([rows, cols]; empty: 128 x 128).
  Result<Tensor> get_weight(const std::string& name, const Shape& expected,
                            const std::vector<int>& weight_block_size) const;

 private:
  Status wrong_shape(const std::string& name, const Shape& shape, const Shape& expected) const;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> index_;  // Tensor name -> its file.
};

// Writes a .safetensors file tensor by tensor, streaming: the data of each
// tensor is produced by a callback into a bounded buffer, so files far larger
// than memory can be written. Not thread-safe.
class SafetensorsWriter {
 public:
  // Fills `dst` with `num_bytes` bytes of the tensor starting at byte `offset`.
  // `offset` and `num_bytes` are multiples of the element size and `dst` is aligned
  // to it, so a callback can write whole elements.
  using Fill = std::function<void(uint64_t offset, void* dst, uint64_t num_bytes)>;

  void add(std::string name, DType dtype, Shape shape, Fill fill);
  void set_metadata(std::string key, std::string value);
  // The size of the staging buffer (default 16 MiB); tests make it small.
  void set_buffer_bytes(size_t num_bytes) { buffer_bytes_ = num_bytes; }
  uint64_t total_bytes() const;  // Of the data section.
  // Writes the file (as PATH.tmp, renamed to PATH when complete, so a reader never
  // sees a partial file); `progress(bytes_done, bytes_total)` is called now and then.
  // Duplicate or reserved names are an InvalidArgument.
  Status write(const std::string& path,
               const std::function<void(uint64_t, uint64_t)>& progress = nullptr) const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    Shape shape;
    Fill fill;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
  size_t buffer_bytes_ = size_t{16} << 20;
};

}  // namespace flexpert
