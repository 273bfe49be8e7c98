// SPDX-License-Identifier: Apache-2.0
// Reading side of the safetensors format: 8-byte little-endian header length N,
// N bytes of JSON, then the data section that the JSON's data_offsets index.
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string_view>
#include <tuple>

#include "core/json_limits.h"
#include "file_util.h"
#include "flexpert/checkpoint.h"

namespace flexpert {
namespace {

using json = nlohmann::json;

// Real headers are a few MB at most (a 100k-tensor model); anything larger is corrupt,
// and parsing it would only waste memory.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Keeps numel * element size far from uint64 overflow.
constexpr uint64_t kMaxDim = 1ull << 48;

// Element sizes of the safetensors dtypes flexpert stores but does not compute in,
// so their byte counts can still be checked. An unknown name gets 0: not checked.
uint64_t foreign_dtype_size(std::string_view name) {
  if (name == "F64" || name == "I64" || name == "U64") return 8;
  if (name == "I32" || name == "U32") return 4;
  if (name == "I16" || name == "U16") return 2;
  if (name == "I8" || name == "U8" || name == "BOOL" || name.starts_with("F8_")) return 1;
  return 0;
}

struct Range {
  uint64_t begin;
  uint64_t end;
  const std::string* name;
};

class HeaderParser {
 public:
  HeaderParser(const std::string& path, uint64_t data_bytes)
      : path_(path), data_bytes_(data_bytes) {}

  Status parse_entry(const std::string& name, const json& value, SafetensorsFile::Entry* entry,
                     std::string* foreign_dtype) {
    if (!value.is_object()) return error(name, "entry is not an object");
    auto dtype_it = value.find("dtype");
    auto shape_it = value.find("shape");
    auto offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || !dtype_it->is_string()) {
      return error(name, "missing or non-string 'dtype'");
    }
    if (shape_it == value.end() || !shape_it->is_array()) {
      return error(name, "missing or non-array 'shape'");
    }
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      return error(name, "'data_offsets' must be an array [begin, end]");
    }

    uint64_t numel = 1;
    entry->shape.clear();
    for (const json& d : *shape_it) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > kMaxDim) {
        return error(name, "bad dimension " + d.dump() + " in shape " + shape_it->dump());
      }
      uint64_t dim = d.get<uint64_t>();
      if (__builtin_mul_overflow(numel, dim, &numel) || numel > kMaxDim) {
        return error(name, "shape " + shape_it->dump() + " is too large");
      }
      entry->shape.push_back(static_cast<int64_t>(dim));
    }

    const json& b = (*offsets_it)[0];
    const json& e = (*offsets_it)[1];
    if (!b.is_number_unsigned() || !e.is_number_unsigned()) {
      return error(name, "data_offsets " + offsets_it->dump() + " are not non-negative integers");
    }
    entry->begin = b.get<uint64_t>();
    entry->end = e.get<uint64_t>();
    if (entry->begin > entry->end) {
      return error(name, "data_offsets " + offsets_it->dump() + " are out of order");
    }
    if (entry->end > data_bytes_) {
      return error(name, "data_offsets " + offsets_it->dump() + " run past the end of the " +
                             std::to_string(data_bytes_) + "-byte data section (truncated file?)");
    }

    const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
    uint64_t element_bytes = 0;
    if (parse_dtype(dtype_name, &entry->dtype)) {
      element_bytes = dtype_size(entry->dtype);
      foreign_dtype->clear();
    } else {
      element_bytes = foreign_dtype_size(dtype_name);
      *foreign_dtype = dtype_name.empty() ? "<empty>" : dtype_name;
    }
    if (element_bytes != 0 && entry->end - entry->begin != numel * element_bytes) {
      return error(name, "holds " + std::to_string(entry->end - entry->begin) +
                             " bytes but shape " + shape_it->dump() + " of " + dtype_name +
                             " needs " + std::to_string(numel * element_bytes));
    }
    return Status();
  }

  Status error(const std::string& name, const std::string& what) const {
    return data_loss(path_ + ": tensor '" + name + "': " + what);
  }

 private:
  const std::string& path_;
  uint64_t data_bytes_;
};

// Tensors must not share bytes: a writer bug or a crafted file could otherwise
// make two weights alias. Gaps are tolerated although writers never leave any.
Status check_no_overlap(const std::string& path, std::vector<Range>& ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& x, const Range& y) {
    return std::tie(x.begin, x.end) < std::tie(y.begin, y.end);
  });
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;  // Empty tensors occupy no bytes.
    if (prev != nullptr && r.begin < prev->end) {
      return data_loss(path + ": tensors '" + *prev->name + "' [" + std::to_string(prev->begin) +
                       ", " + std::to_string(prev->end) + ") and '" + *r.name + "' [" +
                       std::to_string(r.begin) + ", " + std::to_string(r.end) + ") overlap");
    }
    prev = &r;
  }
  return Status();
}

}  // namespace

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// Reads exactly `num_bytes` at `offset`; DataLoss on a short read (a file cut meanwhile).
Status pread_exact(int fd, const std::string& path, uint64_t offset, void* dst,
                   uint64_t num_bytes) {
  auto* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < num_bytes) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(num_bytes - done, 1ull << 30));
    const ssize_t n = ::pread(fd, out + done, chunk, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, "read " + path);
    }
    if (n == 0) {
      return data_loss(path + ": ends at byte " + std::to_string(offset + done) + ", expected " +
                       std::to_string(offset + num_bytes) + " (truncated while open?)");
    }
    done += static_cast<uint64_t>(n);
  }
  return Status();
}

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  FLEX_ASSIGN_OR_RETURN(ScopedFd fd, open_regular_file(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, "stat " + path);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    return data_loss(path + ": file is " + std::to_string(file_bytes) +
                     " bytes, shorter than the 8-byte safetensors header length");
  }

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->file_bytes_ = file_bytes;
  file->inode_ = static_cast<uint64_t>(st.st_ino);
  file->mtime_ns_ = mtime_ns(st);

  uint8_t length_bytes[8];
  FLEX_RETURN_IF_ERROR(pread_exact(fd.get(), path, 0, length_bytes, 8));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    return data_loss(path + ": header length " + std::to_string(header_bytes) +
                     " is absurd (limit " + std::to_string(kMaxHeaderBytes) +
                     "); not safetensors?");
  }
  if (header_bytes > file_bytes - 8) {
    return data_loss(path + ": header length " + std::to_string(header_bytes) + " exceeds the " +
                     std::to_string(file_bytes) + "-byte file (truncated?)");
  }
  std::string header_text(header_bytes, '\0');
  FLEX_RETURN_IF_ERROR(pread_exact(fd.get(), path, 8, header_text.data(), header_bytes));
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;
  file->data_offset_ = 8 + header_bytes;
  file->fd_ = fd.release();  // Owned by `file` from here: its destructor closes it.

  if (Status s = check_json_nesting(header_text, "header"); !s.ok()) {
    return data_loss(path + ": " + s.message());
  }
  json header;
  try {
    header = json::parse(header_text);
  } catch (const json::exception& e) {
    return data_loss(path + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) return data_loss(path + ": header JSON is not an object");

  HeaderParser parser(path, data_bytes);
  std::vector<Range> ranges;
  ranges.reserve(header.size());
  std::string foreign_dtype;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return data_loss(path + ": __metadata__ is not an object");
      for (const auto& [key, v] : value.items()) {
        // dump() recurses, but check_json_nesting() bounded the depth above.
        file->metadata_[key] = v.is_string() ? v.get<std::string>() : v.dump();
      }
      continue;
    }
    Entry entry;
    FLEX_RETURN_IF_ERROR(parser.parse_entry(name, value, &entry, &foreign_dtype));
    if (foreign_dtype.empty()) {
      auto it = file->entries_.emplace(name, std::move(entry)).first;
      ranges.push_back({it->second.begin, it->second.end, &it->first});
    } else {
      auto it = file->unsupported_.emplace(name, foreign_dtype).first;
      ranges.push_back({entry.begin, entry.end, &it->first});
    }
  }
  FLEX_RETURN_IF_ERROR(check_no_overlap(path, ranges));
  return file;
}

Status SafetensorsFile::check_unchanged() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return errno_status(errno, "stat " + path_);
  struct stat by_path;
  const bool replaced = ::stat(path_.c_str(), &by_path) != 0 || by_path.st_ino != st.st_ino;
  if (static_cast<uint64_t>(st.st_size) != file_bytes_ ||
      static_cast<uint64_t>(st.st_ino) != inode_ || mtime_ns(st) != mtime_ns_ || replaced) {
    return data_loss(path_ + ": changed on disk since it was opened (size " +
                     std::to_string(file_bytes_) + " -> " + std::to_string(st.st_size) +
                     (replaced ? ", replaced or removed" : "") +
                     "); restart on the new checkpoint");
  }
  return Status();
}

Result<Tensor> SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    auto foreign = unsupported_.find(name);
    if (foreign != unsupported_.end()) {
      return unimplemented(path_ + ": tensor '" + name + "' has unsupported dtype " +
                           foreign->second + " (flexpert computes in F32, BF16, F16)");
    }
    return not_found(path_ + ": no tensor '" + name + "'");
  }
  FLEX_RETURN_IF_ERROR(check_unchanged());
  const Entry& entry = it->second;
  // NOTE: a copy, never a view of a mapping (checkpoint.h says why). The byte count
  // was checked against the shape at open.
  Tensor out = Tensor::empty(entry.dtype, entry.shape);
  FLEX_RETURN_IF_ERROR(
      pread_exact(fd_, path_, data_offset_ + entry.begin, out.raw(), entry.end - entry.begin));
  return out;
}

Status SafetensorsFile::read_into(const std::string& name,
                                  const std::vector<ReadPiece>& pieces) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return get(name).status();  // NotFound or Unimplemented.
  const Entry& entry = it->second;
  const uint64_t tensor_bytes = entry.end - entry.begin;
  for (const ReadPiece& piece : pieces) {
    if (piece.offset > tensor_bytes || piece.num_bytes > tensor_bytes - piece.offset ||
        (piece.dst == nullptr && piece.num_bytes > 0)) {
      return invalid_argument(path_ + ": bytes [" + std::to_string(piece.offset) + ", +" +
                              std::to_string(piece.num_bytes) + ") are outside tensor '" + name +
                              "' (" + std::to_string(tensor_bytes) + " bytes)");
    }
  }
  FLEX_RETURN_IF_ERROR(check_unchanged());
  for (const ReadPiece& piece : pieces) {
    FLEX_RETURN_IF_ERROR(pread_exact(fd_, path_, data_offset_ + entry.begin + piece.offset,
                                     piece.dst, piece.num_bytes));
  }
  return Status();
}

}  // namespace flexpert
