// SPDX-License-Identifier: Apache-2.0
// Hostile files (docs/ARCHITECTURE.md, "Trust boundaries"): nesting deep enough to
// overflow a recursive walker, absurd sizes, FIFOs, and files changed on disk while
// open. Each must be a clear Status, never a crash, hang or signal.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "core/json_limits.h"
#include "flexpert/checkpoint.h"
#include "flexpert/model_config.h"
#include "test_util.h"

namespace flexpert {
namespace {

using testing::safetensors_bytes;
using testing::TempDir;
using testing::write_file;

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

const std::string kTiny = std::string(FLEXPERT_TESTDATA_DIR) + "/qwen3moe-tiny";

TEST(JsonNesting, CountsBracketsOutsideStringsOnly) {
  EXPECT_TRUE(check_json_nesting(nested(3), "x", 3).ok());
  EXPECT_EQ(check_json_nesting(nested(4), "x", 3).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(check_json_nesting(R"({"a": [[1], {"b": 2}], "c": [3]})", "x", 3).ok());
  // Brackets in strings, also after an escaped quote, are text.
  EXPECT_TRUE(check_json_nesting(R"(["[[[[", "\"[[[[", "\\"])", "x", 1).ok());
  EXPECT_EQ(check_json_nesting(R"(["\\", [[]]])", "x", 2).code(), StatusCode::kInvalidArgument);
  const Status s = check_json_nesting(nested(100000), "the body", 64);
  EXPECT_NE(s.message().find("the body nests"), std::string::npos) << s.message();
}

TEST(HostileSafetensors, DeepMetadataIsDataLoss) {
  TempDir tmp;
  const std::string header = R"({"__metadata__":{"x":)" + nested(100000) +
                             R"(},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const std::string path = tmp.file("deep.safetensors");
  write_file(path, safetensors_bytes(header, std::string(4, '\0')));
  auto file = SafetensorsFile::open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kDataLoss) << file.status().to_string();
  EXPECT_NE(file.status().message().find("deeper than 64"), std::string::npos);
  // Nesting within the limit is still metadata.
  const std::string ok_header = R"({"__metadata__":{"x":)" + nested(10) +
                                R"(},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  write_file(path, safetensors_bytes(ok_header, std::string(4, '\0')));
  auto ok = SafetensorsFile::open(path);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ((*ok)->metadata().at("x"), nested(10));
}

TEST(HostileSafetensors, FifoIsRefusedWithoutBlocking) {
  TempDir tmp;
  const std::string path = tmp.file("model.safetensors");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  auto file = SafetensorsFile::open(path);  // Would block forever on open(O_RDONLY).
  EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument) << file.status().to_string();
  EXPECT_NE(file.status().message().find("not a regular file"), std::string::npos);
}

// The file is read, never mapped: truncating it under an open SafetensorsFile gives
// DataLoss on the next read instead of SIGBUS, and tensors read before stay valid.
TEST(HostileSafetensors, TruncatedWhileOpenIsDataLossNotSigbus) {
  TempDir tmp;
  const std::string path = tmp.file("m.safetensors");
  std::string data(4096 * 4, '\0');
  for (size_t i = 0; i < 4096; ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(&data[i * 4], &v, 4);
  }
  write_file(path, safetensors_bytes(
                       R"({"a":{"dtype":"F32","shape":[4096],"data_offsets":[0,16384]}})", data));
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto before = (*file)->get("a");
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  auto after = (*file)->get("a");
  EXPECT_EQ(after.status().code(), StatusCode::kDataLoss) << after.status().to_string();
  EXPECT_NE(after.status().message().find("changed on disk"), std::string::npos);
  EXPECT_EQ(before->data<float>()[4095], 4095.0f);  // Still readable: a private copy.
  std::vector<float> into(4096, -1.0f);
  const Status s = (*file)->read_into("a", {{0, 16384, into.data()}});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  EXPECT_NE(s.message().find("changed on disk"), std::string::npos);
  EXPECT_EQ(into[0], -1.0f);  // Checked before the read.
}

TEST(HostileSafetensors, RewrittenInPlaceIsDetected) {
  TempDir tmp;
  const std::string path = tmp.file("m.safetensors");
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  write_file(path, safetensors_bytes(header, std::string(8, '\0')));
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->check_unchanged().ok());
  // Same size, new contents: the modification time tells.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  write_file(path, safetensors_bytes(header, std::string(8, '\x7f')));
  EXPECT_EQ((*file)->get("a").status().code(), StatusCode::kDataLoss);
}

class HostileConfig : public ::testing::Test {
 protected:
  nlohmann::json tiny() {
    return nlohmann::json::parse(testing::read_file(kTiny + "/config.json"));
  }
  void expect_refused(const nlohmann::json& j, const std::string& mention) {
    const auto t0 = std::chrono::steady_clock::now();
    auto c = ModelConfig::from_json(j.dump());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(c.ok()) << j.dump();
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
    EXPECT_NE(c.status().message().find(mention), std::string::npos) << c.status().message();
    EXPECT_LT(s, 1.0);  // Refused before anything is sized from it.
  }
};

TEST_F(HostileConfig, AbsurdSizesAreRefusedBeforeAllocating) {
  ASSERT_TRUE(ModelConfig::from_json(tiny().dump()).ok());
  for (const char* field : {"num_experts", "num_hidden_layers", "vocab_size", "hidden_size",
                            "moe_intermediate_size", "num_attention_heads"}) {
    nlohmann::json j = tiny();
    if (std::string(field) == "num_experts") j.erase("num_local_experts");
    j[field] = 2147483647;
    expect_refused(j, field);
  }
  nlohmann::json layers = tiny();
  layers["num_hidden_layers"] = 100000000;
  expect_refused(layers, "num_hidden_layers");
  nlohmann::json experts = tiny();
  experts["num_local_experts"] = 10000000;  // The fixture's spelling.
  expect_refused(experts, "num_experts");
  nlohmann::json product = tiny();  // Each within its bound, the product is not.
  product["num_local_experts"] = 16384;
  product["num_hidden_layers"] = 1024;
  expect_refused(product, "num_hidden_layers x num_experts");
}

TEST_F(HostileConfig, DeepNestingIsInvalidArgument) {
  nlohmann::json j = tiny();
  std::string text = j.dump();
  text.insert(text.size() - 1, R"(,"junk":)" + nested(100000));
  auto c = ModelConfig::from_json(text);
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
}

TEST_F(HostileConfig, FifoConfigIsRefusedWithoutBlocking) {
  TempDir tmp;
  ASSERT_EQ(::mkfifo(tmp.file("config.json").c_str(), 0600), 0);
  auto c = ModelConfig::load(tmp.path());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
}

}  // namespace
}  // namespace flexpert
