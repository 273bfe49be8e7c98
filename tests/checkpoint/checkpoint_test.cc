// SPDX-License-Identifier: Apache-2.0
// Reading the real fixture, writer roundtrips and sharded checkpoints.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "flexpert/checkpoint.h"
#include "test_util.h"

namespace flexpert {
namespace {

using testing::read_file;
using testing::TempDir;

const std::string kFixtureDir = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

TEST(CheckpointFixture, OpensQwen3MoeTiny) {
  auto ckpt = Checkpoint::open(kFixtureDir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  // 4 layers x (8 attention/norm + router + 16 experts x 3) + embed, final norm, lm_head.
  EXPECT_EQ((*ckpt)->names().size(), 4u * (8 + 1 + 16 * 3) + 3);
  EXPECT_EQ((*ckpt)->dir(), kFixtureDir);
  EXPECT_TRUE((*ckpt)->contains("lm_head.weight"));
  EXPECT_FALSE((*ckpt)->contains("model.layers.4.input_layernorm.weight"));

  const std::pair<const char*, Shape> expected[] = {
      {"model.embed_tokens.weight", {512, 128}},
      {"lm_head.weight", {512, 128}},
      {"model.norm.weight", {128}},
      {"model.layers.0.self_attn.q_proj.weight", {128, 128}},
      {"model.layers.0.self_attn.k_proj.weight", {64, 128}},
      {"model.layers.3.self_attn.k_norm.weight", {32}},
      {"model.layers.2.mlp.gate.weight", {16, 128}},
      {"model.layers.1.mlp.experts.15.down_proj.weight", {128, 64}},
      {"model.layers.1.mlp.experts.7.up_proj.weight", {64, 128}},
  };
  for (const auto& [name, shape] : expected) {
    auto t = (*ckpt)->get(name, shape);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_EQ(t->dtype(), DType::kF32) << name;
    EXPECT_TRUE(t->owned()) << name;  // A private copy, never a view of the file.
    EXPECT_TRUE(t->is_contiguous()) << name;
  }
}

// The view must alias exactly the bytes the header points at, read here without
// the library: header length, JSON offsets, then the data section.
TEST(CheckpointFixture, ViewMatchesFileBytes) {
  const std::string path = kFixtureDir + "/model.safetensors";
  const std::string bytes = read_file(path);
  ASSERT_GT(bytes.size(), 8u);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_TRUE((*file)->unsupported().empty());

  for (const char* name : {"model.layers.0.mlp.gate.weight", "model.norm.weight",
                           "model.layers.3.mlp.experts.9.gate_proj.weight", "lm_head.weight"}) {
    const auto& offsets = header[name]["data_offsets"];
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    auto t = (*file)->get(name);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_EQ(t->num_bytes(), end - begin) << name;
    EXPECT_EQ(std::memcmp(t->raw(), bytes.data() + 8 + n + begin, end - begin), 0) << name;
    const SafetensorsFile::Entry& entry = (*file)->entries().at(name);
    EXPECT_EQ(entry.begin, begin);
    EXPECT_EQ(entry.end, end);
  }
  auto norm = (*file)->get("model.norm.weight");
  ASSERT_TRUE(norm.ok());
  EXPECT_FLOAT_EQ(norm->data<float>()[0], 1.0f);  // transformers initialises norms to ones.
}

// read_into() puts exactly the header's bytes where each piece says, in any order, and
// nothing outside the pieces; pieces outside the tensor are refused before any read.
TEST(CheckpointFixture, ReadIntoMatchesFileBytes) {
  const std::string path = kFixtureDir + "/model.safetensors";
  const std::string bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  auto ckpt = Checkpoint::open(kFixtureDir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  const std::string name = "model.layers.3.mlp.experts.9.gate_proj.weight";
  const uint64_t begin = header[name]["data_offsets"][0].get<uint64_t>();
  const uint64_t size = header[name]["data_offsets"][1].get<uint64_t>() - begin;
  const char* file_bytes = bytes.data() + 8 + n + begin;
  auto entry = (*ckpt)->entry(name);
  ASSERT_TRUE(entry.ok()) << entry.status().to_string();
  EXPECT_EQ(entry->dtype, DType::kF32);
  EXPECT_EQ(entry->shape, (Shape{header[name]["shape"][0].get<int64_t>(),
                                 header[name]["shape"][1].get<int64_t>()}));
  ASSERT_GE(size, 64u);
  EXPECT_TRUE((*ckpt)->entry(name, entry->shape).ok());
  const Status misshapen = (*ckpt)->entry(name, {1, 2}).status();
  EXPECT_EQ(misshapen.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(misshapen.message().find(name), std::string::npos) << misshapen.message();

  std::string whole(size, '\x5a');
  ASSERT_TRUE((*ckpt)->read_into(name, {{0, size, whole.data()}}).ok());
  EXPECT_EQ(std::memcmp(whole.data(), file_bytes, size), 0);

  // Two pieces swapped into a buffer with a guard band between them.
  const uint64_t half = size / 2;
  std::string swapped(size + 16, '\x5a');
  Status s = (*ckpt)->read_into(
      name, {{half, size - half, swapped.data()}, {0, half, swapped.data() + size - half + 16}});
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(swapped.data(), file_bytes + half, size - half), 0);
  EXPECT_EQ(swapped.substr(size - half, 16), std::string(16, '\x5a'));
  EXPECT_EQ(std::memcmp(swapped.data() + size - half + 16, file_bytes, half), 0);

  std::string untouched(size, '\x5a');
  EXPECT_EQ(
      (*ckpt)->read_into(name, {{0, 8, untouched.data()}, {size - 4, 8, untouched.data()}}).code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(untouched, std::string(size, '\x5a'));  // Refused before the first read.
  EXPECT_EQ((*ckpt)->read_into(name, {{size + 1, 0, untouched.data()}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*ckpt)->read_into("no.such.tensor", {}).code(), StatusCode::kNotFound);
  EXPECT_EQ((*ckpt)->entry("no.such.tensor").status().code(), StatusCode::kNotFound);
}

// Element i of a test tensor is a function of (tensor, i), so any chunk can be
// produced by the Fill callback and checked after reading.
float test_value(int tensor, int64_t i) { return static_cast<float>(tensor * 1000 + i) * 0.25f; }

SafetensorsWriter::Fill test_fill(int tensor, DType dtype) {
  return [tensor, dtype](uint64_t offset, void* dst, uint64_t num_bytes) {
    const size_t es = dtype_size(dtype);
    ASSERT_EQ(offset % es, 0u);
    ASSERT_EQ(num_bytes % es, 0u);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(dst) % es, 0u);
    std::vector<float> values(num_bytes / es);
    for (size_t k = 0; k < values.size(); ++k) values[k] = test_value(tensor, offset / es + k);
    convert_from_f32(dtype, values.data(), dst, values.size());
  };
}

class WriterRoundtrip : public ::testing::TestWithParam<std::tuple<DType, size_t>> {};

TEST_P(WriterRoundtrip, ReadsBackWhatWasWritten) {
  const auto [dtype, buffer_bytes] = GetParam();
  const std::vector<std::pair<std::string, Shape>> tensors = {
      {"b.first", {3, 5}}, {"a.second", {7}}, {"scalar", {}}, {"empty", {0, 4}}, {"big", {33, 17}}};
  SafetensorsWriter writer;
  for (size_t t = 0; t < tensors.size(); ++t) {
    writer.add(tensors[t].first, dtype, tensors[t].second, test_fill(static_cast<int>(t), dtype));
  }
  writer.set_metadata("format", "pt");
  writer.set_buffer_bytes(buffer_bytes);
  EXPECT_EQ(writer.total_bytes(), (15 + 7 + 1 + 0 + 33 * 17) * dtype_size(dtype));

  TempDir tmp;
  const std::string path = tmp.file("model.safetensors");
  uint64_t last_done = 0, last_total = 0;
  int calls = 0;
  Status status = writer.write(path, [&](uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
    ++calls;
  });
  ASSERT_TRUE(status.ok()) << status.to_string();
  EXPECT_GE(calls, 2);
  EXPECT_EQ(last_done, writer.total_bytes());
  EXPECT_EQ(last_total, writer.total_bytes());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  const std::string bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "header must be padded to 8 bytes";
  EXPECT_EQ(bytes.size(), 8 + n + writer.total_bytes());
  // Stored in the order added, not sorted by name.
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["b.first"]["data_offsets"][0], 0);
  EXPECT_EQ(header["a.second"]["data_offsets"][0], 15 * dtype_size(dtype));

  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->entries().size(), tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    auto view = (*file)->get(tensors[t].first);
    ASSERT_TRUE(view.ok()) << view.status().to_string();
    EXPECT_EQ(view->dtype(), dtype);
    EXPECT_EQ(view->shape(), tensors[t].second);
    std::vector<float> got(view->numel());
    if (!got.empty()) convert_to_f32(dtype, view->raw(), got.data(), got.size());
    for (int64_t i = 0; i < view->numel(); ++i) {
      float want = test_value(static_cast<int>(t), i);
      if (dtype == DType::kBF16) want = bf16_to_f32(f32_to_bf16(want));
      if (dtype == DType::kF16) want = f16_to_f32(f32_to_f16(want));
      ASSERT_EQ(got[i], want) << tensors[t].first << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DTypesAndBuffers, WriterRoundtrip,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(size_t{64}, size_t{100}, size_t{16} << 20)));

TEST(Writer, RejectsDuplicateAndReservedNames) {
  TempDir tmp;
  SafetensorsWriter dup;
  dup.add("w", DType::kF32, {2}, test_fill(0, DType::kF32));
  dup.add("w", DType::kF32, {2}, test_fill(1, DType::kF32));
  Status s = dup.write(tmp.file("dup.safetensors"));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.message();

  SafetensorsWriter reserved;
  reserved.add("__metadata__", DType::kF32, {1}, test_fill(0, DType::kF32));
  EXPECT_EQ(reserved.write(tmp.file("r.safetensors")).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(tmp.file("dup.safetensors.tmp")));
}

TEST(Writer, MissingDirectoryIsNotFound) {
  SafetensorsWriter writer;
  writer.add("w", DType::kF32, {2}, test_fill(0, DType::kF32));
  Status s = writer.write("/nonexistent-flexpert-dir/model.safetensors");
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_NE(s.message().find("/nonexistent-flexpert-dir/"), std::string::npos) << s.message();
}

// Hugging Face writers order tensors so that each is aligned; this one is not.
// get() copies into aligned memory of its own, so it reads correctly.
TEST(Writer, MisalignedTensorIsCopiedAligned) {
  TempDir tmp;
  SafetensorsWriter writer;
  writer.add("odd", DType::kBF16, {3}, test_fill(0, DType::kBF16));
  writer.add("f32", DType::kF32, {2}, test_fill(1, DType::kF32));
  ASSERT_TRUE(writer.write(tmp.file("m.safetensors")).ok());
  auto file = SafetensorsFile::open(tmp.file("m.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_TRUE((*file)->get("odd").ok());
  auto f32 = (*file)->get("f32");
  ASSERT_TRUE(f32.ok()) << f32.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f32->raw()) % alignof(float), 0u);
  EXPECT_EQ(f32->data<float>()[0], test_value(1, 0));
  EXPECT_EQ(f32->data<float>()[1], test_value(1, 1));
}

TEST(Checkpoint, OpensShardsThroughIndex) {
  TempDir tmp;
  SafetensorsWriter a, b;
  a.add("model.x", DType::kF32, {4, 2}, test_fill(0, DType::kF32));
  a.add("model.y", DType::kBF16, {6}, test_fill(1, DType::kBF16));
  b.add("model.z", DType::kF16, {2, 2}, test_fill(2, DType::kF16));
  ASSERT_TRUE(a.write(tmp.file("model-00001-of-00002.safetensors")).ok());
  ASSERT_TRUE(b.write(tmp.file("model-00002-of-00002.safetensors")).ok());
  testing::write_file(tmp.file("model.safetensors.index.json"), R"({
    "metadata": {"total_size": 52},
    "weight_map": {"model.x": "model-00001-of-00002.safetensors",
                   "model.y": "model-00001-of-00002.safetensors",
                   "model.z": "model-00002-of-00002.safetensors"}})");
  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_EQ((*ckpt)->names(), (std::vector<std::string>{"model.x", "model.y", "model.z"}));
  auto z = (*ckpt)->get("model.z", {2, 2});
  ASSERT_TRUE(z.ok()) << z.status().to_string();
  EXPECT_EQ(z->dtype(), DType::kF16);
  EXPECT_EQ(f16_to_f32(z->data<uint16_t>()[3]), test_value(2, 3));
  auto x = (*ckpt)->get("model.x");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(x->data<float>()[7], test_value(0, 7));
}

TEST(Checkpoint, SingleFileWinsOverIndex) {
  TempDir tmp;
  SafetensorsWriter w;
  w.add("only", DType::kF32, {1}, test_fill(0, DType::kF32));
  ASSERT_TRUE(w.write(tmp.file("model.safetensors")).ok());
  testing::write_file(tmp.file("model.safetensors.index.json"), "not even json");
  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_TRUE((*ckpt)->contains("only"));
}

}  // namespace
}  // namespace flexpert
