// SPDX-License-Identifier: Apache-2.0
// Corrupt, truncated and inconsistent files and directories: each must give the
// right StatusCode and a message naming the file, never a crash.
#include <gtest/gtest.h>

#include "flexpert/checkpoint.h"
#include "test_util.h"

namespace flexpert {
namespace {

using testing::safetensors_bytes;
using testing::TempDir;
using testing::write_file;

const std::string kTwoTensors = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";

void expect_status(const Status& s, StatusCode code, const std::string& mention) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(mention), std::string::npos)
      << "message should mention '" << mention << "': " << s.message();
}

// Opens a file holding `bytes`; returns the status of the open.
Status open_bytes(const TempDir& tmp, const std::string& bytes, std::string* path) {
  *path = tmp.file("broken.safetensors");
  write_file(*path, bytes);
  return SafetensorsFile::open(*path).status();
}

struct BrokenCase {
  const char* what;
  std::string bytes;
  const char* mention;  // Besides the path, e.g. the tensor name.
};

TEST(BrokenFile, EachCaseIsDataLossNamingTheFile) {
  const std::string data(12, '\0');
  const BrokenCase cases[] = {
      {"empty file", "", "8-byte"},
      {"length only, 4 bytes", std::string(4, '\x01'), "8-byte"},
      {"truncated header", testing::le64(200) + "{\"a\":", "exceeds"},
      {"header length absurd", testing::le64(1ull << 40) + std::string(64, ' '), "absurd"},
      {"header length max", testing::le64(~0ull) + std::string(64, ' '), "absurd"},
      {"truncated data", safetensors_bytes(kTwoTensors, std::string(10, '\0')), "'b'"},
      {"invalid JSON", safetensors_bytes("{\"a\": [1, 2", data), "JSON"},
      {"JSON not an object", safetensors_bytes("[1, 2]", data), "object"},
      {"entry not an object", safetensors_bytes(R"({"a": 3})", data), "'a'"},
      {"missing dtype", safetensors_bytes(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", data),
       "dtype"},
      {"missing shape", safetensors_bytes(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", data),
       "shape"},
      {"missing offsets", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", data),
       "data_offsets"},
      {"one offset",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", data),
       "data_offsets"},
      {"negative dim",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data),
       "dimension"},
      {"float dim",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", data),
       "dimension"},
      {"huge shape",
       safetensors_bytes(
           R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", data),
       "too large"},
      {"offsets reversed",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data),
       "out of order"},
      {"offsets past the end",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data),
       "past the end"},
      {"byte count vs shape",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data),
       "needs 12"},
      {"overlapping",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         data),
       "overlap"},
      {"foreign dtype byte count",
       safetensors_bytes(R"({"a":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})", data),
       "needs 16"},
      {"foreign dtype overlapping",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})",
                         data),
       "overlap"},
      {"metadata not an object", safetensors_bytes(R"({"__metadata__": 1})", data), "__metadata__"},
  };
  TempDir tmp;
  for (const BrokenCase& c : cases) {
    SCOPED_TRACE(c.what);
    std::string path;
    Status s = open_bytes(tmp, c.bytes, &path);
    expect_status(s, StatusCode::kDataLoss, path);
    expect_status(s, StatusCode::kDataLoss, c.mention);
  }
}

// Every proper prefix of a valid file is rejected cleanly.
TEST(BrokenFile, EveryTruncationIsDataLoss) {
  const std::string full = safetensors_bytes(kTwoTensors, std::string(12, '\x7f'));
  TempDir tmp;
  std::string path;
  ASSERT_TRUE(open_bytes(tmp, full, &path).ok());
  for (size_t cut = 0; cut < full.size(); ++cut) {
    Status s = open_bytes(tmp, full.substr(0, cut), &path);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << "cut at " << cut << ": " << s.to_string();
  }
}

TEST(BrokenFile, MissingFileIsNotFound) {
  TempDir tmp;
  expect_status(SafetensorsFile::open(tmp.file("nope.safetensors")).status(), StatusCode::kNotFound,
                tmp.file("nope.safetensors"));
}

TEST(BrokenFile, UnsupportedDtypeFailsOnlyInGet) {
  const std::string header = R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                             R"("fp8":{"dtype":"F8_E5M2","shape":[4],"data_offsets":[8,12]},)"
                             R"("odd":{"dtype":"Q4_WEIRD","shape":[4],"data_offsets":[12,14]},)"
                             R"("w":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})";
  TempDir tmp;
  const std::string path = tmp.file("mixed.safetensors");
  write_file(path, safetensors_bytes(header, std::string(24, '\0')));
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_EQ((*file)->entries().size(), 1u);
  EXPECT_EQ((*file)->unsupported().at("fp8"), "F8_E5M2");
  EXPECT_TRUE((*file)->get("w").ok());
  for (const char* name : {"ids", "fp8", "odd"}) {
    Status s = (*file)->get(name).status();
    expect_status(s, StatusCode::kUnimplemented, "unsupported dtype");
    // (Not "'" + std::string(name): GCC 12 warns about that with -Wrestrict, a false alarm.)
    expect_status(s, StatusCode::kUnimplemented, std::string("'").append(name).append("'"));
    expect_status(s, StatusCode::kUnimplemented, path);
  }

  // Through a Checkpoint: listed and contained, but get() says why it cannot be used.
  write_file(tmp.file("model.safetensors"), testing::read_file(path));
  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_TRUE((*ckpt)->contains("ids"));
  EXPECT_EQ((*ckpt)->get("ids").status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ((*ckpt)->entry("ids").status().code(), StatusCode::kUnimplemented);
  char dst[8];
  EXPECT_EQ((*ckpt)->read_into("ids", {{0, 8, dst}}).code(), StatusCode::kUnimplemented);
}

TEST(BrokenCheckpoint, MissingTensorAndWrongShape) {
  TempDir tmp;
  write_file(tmp.file("model.safetensors"), safetensors_bytes(kTwoTensors, std::string(12, '\0')));
  auto ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  Status missing = (*ckpt)->get("c").status();
  expect_status(missing, StatusCode::kNotFound, "'c'");
  expect_status(missing, StatusCode::kNotFound, tmp.path());
  Status shape = (*ckpt)->get("a", {1, 2}).status();
  expect_status(shape, StatusCode::kInvalidArgument, "[2]");
  expect_status(shape, StatusCode::kInvalidArgument, "[1, 2]");
  expect_status(shape, StatusCode::kInvalidArgument, "'a'");
  EXPECT_TRUE((*ckpt)->get("a", {2}).ok());
}

TEST(BrokenCheckpoint, MissingDirectoryOrWeights) {
  TempDir tmp;
  expect_status(Checkpoint::open(tmp.file("absent")).status(), StatusCode::kNotFound,
                tmp.file("absent"));
  Status empty = Checkpoint::open(tmp.path()).status();
  expect_status(empty, StatusCode::kNotFound, "model.safetensors");
  expect_status(empty, StatusCode::kNotFound, tmp.path());
}

TEST(BrokenCheckpoint, CorruptSingleFileNamesIt) {
  TempDir tmp;
  write_file(tmp.file("model.safetensors"), "");
  expect_status(Checkpoint::open(tmp.path()).status(), StatusCode::kDataLoss,
                tmp.file("model.safetensors"));
}

class BrokenIndex : public ::testing::Test {
 protected:
  void SetUp() override {
    write_file(tmp_.file("shard-1.safetensors"),
               safetensors_bytes(kTwoTensors, std::string(12, '\0')));
  }
  Status open_with_index(const std::string& index) {
    write_file(tmp_.file("model.safetensors.index.json"), index);
    return Checkpoint::open(tmp_.path()).status();
  }
  TempDir tmp_;
};

TEST_F(BrokenIndex, ValidIndexOpens) {
  EXPECT_TRUE(open_with_index(R"({"weight_map": {"a": "shard-1.safetensors"}})").ok());
}

TEST_F(BrokenIndex, MissingShardIsNotFound) {
  Status s = open_with_index(
      R"({"weight_map": {"a": "shard-1.safetensors", "z": "shard-2.safetensors"}})");
  expect_status(s, StatusCode::kNotFound, "shard-2.safetensors");
  expect_status(s, StatusCode::kNotFound, "model.safetensors.index.json");
}

TEST_F(BrokenIndex, TensorAbsentFromItsShardIsDataLoss) {
  Status s = open_with_index(R"({"weight_map": {"a": "shard-1.safetensors",
                                                "ghost": "shard-1.safetensors"}})");
  expect_status(s, StatusCode::kDataLoss, "'ghost'");
  expect_status(s, StatusCode::kDataLoss, "shard-1.safetensors");
}

TEST_F(BrokenIndex, MalformedIndexIsDataLoss) {
  for (const char* index :
       {"{", "[]", R"({"metadata": {}})", R"({"weight_map": []})", R"({"weight_map": {"a": 3}})",
        R"({"weight_map": {"a": "../shard-1.safetensors"}})",
        R"({"weight_map": {"a": "/etc/passwd"}})"}) {
    SCOPED_TRACE(index);
    expect_status(open_with_index(index), StatusCode::kDataLoss, "model.safetensors.index.json");
  }
}

TEST_F(BrokenIndex, CorruptShardNamesShardAndIndex) {
  write_file(tmp_.file("bad.safetensors"), "xx");
  Status s = open_with_index(R"({"weight_map": {"a": "bad.safetensors"}})");
  expect_status(s, StatusCode::kDataLoss, tmp_.file("bad.safetensors"));
  expect_status(s, StatusCode::kDataLoss, "model.safetensors.index.json");
}

}  // namespace
}  // namespace flexpert
