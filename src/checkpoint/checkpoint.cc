// SPDX-License-Identifier: Apache-2.0
#include "flexpert/checkpoint.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/json_limits.h"
#include "file_util.h"

namespace flexpert {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

// Shard names come from a file we did not write: keep them inside the directory.
bool is_safe_shard_name(const std::string& shard) {
  if (shard.empty() || shard.front() == '/') return false;
  for (const auto& part : fs::path(shard)) {
    if (part == "..") return false;
  }
  return true;
}

}  // namespace

Result<std::unique_ptr<Checkpoint>> Checkpoint::open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return not_found("checkpoint directory " + dir + " does not exist or is not a directory");
  }
  auto ckpt = std::make_unique<Checkpoint>();
  ckpt->dir_ = dir;
  const std::string single_path = dir + "/" + kSingleFile;
  const std::string index_path = dir + "/" + kIndexFile;

  // The single file wins when both exist, as in Hugging Face transformers.
  if (is_regular_file(single_path)) {
    FLEX_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(single_path));
    for (const auto& [name, entry] : file->entries()) ckpt->index_[name] = file.get();
    for (const auto& [name, dtype] : file->unsupported()) ckpt->index_[name] = file.get();
    ckpt->files_.push_back(std::move(file));
    return ckpt;
  }
  if (!is_regular_file(index_path)) {
    return not_found("no " + std::string(kSingleFile) + " or " + kIndexFile + " in " + dir);
  }

  FLEX_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path));
  if (Status s = check_json_nesting(text, "index"); !s.ok()) {
    return data_loss(index_path + ": " + s.message());
  }
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {
    return data_loss(index_path + ": not valid JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return data_loss(index_path + ": no \"weight_map\" object");
  }
  std::map<std::string, const SafetensorsFile*> shards;
  for (const auto& [name, value] : index["weight_map"].items()) {
    if (!value.is_string() || !is_safe_shard_name(value.get<std::string>())) {
      return data_loss(index_path + ": tensor '" + name + "' maps to a bad shard name " +
                       value.dump());
    }
    const std::string shard = value.get<std::string>();
    auto it = shards.find(shard);
    if (it == shards.end()) {
      const std::string shard_path = dir + "/" + shard;
      auto file = SafetensorsFile::open(shard_path);
      if (!file.ok()) {
        return file.status().annotate("shard " + shard + " listed in " + index_path);
      }
      it = shards.emplace(shard, file->get()).first;
      ckpt->files_.push_back(std::move(file).value());
    }
    const SafetensorsFile* file = it->second;
    if (!file->entries().contains(name) && !file->unsupported().contains(name)) {
      return data_loss(index_path + " maps tensor '" + name + "' to " + file->path() +
                       ", which does not contain it");
    }
    ckpt->index_[name] = file;
  }
  return ckpt;
}

bool Checkpoint::contains(const std::string& name) const { return index_.contains(name); }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, file] : index_) names.push_back(name);
  return names;
}

Result<Tensor> Checkpoint::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return not_found("no tensor '" + name + "' in checkpoint " + dir_);
  return it->second->get(name);
}

Status Checkpoint::wrong_shape(const std::string& name, const Shape& shape,
                               const Shape& expected) const {
  return invalid_argument("tensor '" + name + "' in checkpoint " + dir_ + " has shape " +
                          shape_to_string(shape) + ", expected " + shape_to_string(expected));
}

Result<SafetensorsFile::Entry> Checkpoint::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return not_found("no tensor '" + name + "' in checkpoint " + dir_);
  auto e = it->second->entries().find(name);
  if (e == it->second->entries().end()) return it->second->get(name).status();  // Unsupported.
  return e->second;
}

Result<SafetensorsFile::Entry> Checkpoint::entry(const std::string& name,
                                                 const Shape& expected) const {
  FLEX_ASSIGN_OR_RETURN(SafetensorsFile::Entry e, entry(name));
  if (e.shape != expected) return wrong_shape(name, e.shape, expected);
  return e;
}

Status Checkpoint::read_into(const std::string& name,
                             const std::vector<SafetensorsFile::ReadPiece>& pieces) const {
  auto it = index_.find(name);
  if (it == index_.end()) return not_found("no tensor '" + name + "' in checkpoint " + dir_);
  return it->second->read_into(name, pieces);
}

Result<Tensor> Checkpoint::get(const std::string& name, const Shape& expected) const {
  FLEX_ASSIGN_OR_RETURN(Tensor tensor, get(name));
  if (tensor.shape() != expected) return wrong_shape(name, tensor.shape(), expected);
  return tensor;
}

Result<Tensor> Checkpoint::get_weight(const std::string& name, const Shape& expected,
                                      const std::vector<int>& weight_block_size) const {
  if (weight_block_size.empty()) return get_weight(name, expected);
  if (weight_block_size.size() != 2) {
    return invalid_argument("weight_block_size must be [rows, cols], got " +
                            std::to_string(weight_block_size.size()) + " values");
  }
  return get_weight(name, expected, weight_block_size[0], weight_block_size[1]);
}

Result<Tensor> Checkpoint::get_weight(const std::string& name, const Shape& expected,
                                      int block_rows, int block_cols) const {
  FLEX_ASSIGN_OR_RETURN(Tensor w, get(name, expected));
  if (w.dtype() != DType::kF8E4M3) return w;
  if (w.dim() != 2 || block_rows <= 0 || block_cols <= 0) {
    return invalid_argument("tensor '" + name +
                            "' is F8_E4M3 but not a 2-D block-quantized weight");
  }
  const int64_t rows = w.size(0), cols = w.size(1);
  const int64_t scale_rows = (rows + block_rows - 1) / block_rows;
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  const std::string scale_name = name + "_scale_inv";
  if (!contains(scale_name)) {
    return invalid_argument("tensor '" + name + "' is F8_E4M3 but checkpoint " + dir_ +
                            " has no '" + scale_name + "' to dequantize it");
  }
  FLEX_ASSIGN_OR_RETURN(Tensor scale_raw, get(scale_name, {scale_rows, scale_cols}));
  if (scale_raw.dtype() == DType::kF8E4M3) {
    return invalid_argument("tensor '" + scale_name + "' must be F32 or BF16, not F8_E4M3");
  }
  const Tensor scale = scale_raw.to(DType::kF32);
  Tensor out = Tensor::empty(DType::kBF16, {rows, cols});
  std::vector<float> row(static_cast<size_t>(cols));
  const auto* src = static_cast<const uint8_t*>(w.raw());
  auto* dst = out.data<uint16_t>();
  for (int64_t i = 0; i < rows; ++i) {
    convert_to_f32(DType::kF8E4M3, src + i * cols, row.data(), static_cast<size_t>(cols));
    const float* s = scale.data<float>() + (i / block_rows) * scale_cols;
    for (int64_t j = 0; j < cols; ++j) dst[i * cols + j] = f32_to_bf16(row[j] * s[j / block_cols]);
  }
  return out;
}

}  // namespace flexpert
