// SPDX-License-Identifier: Apache-2.0
#include "flexpert/tensor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace flexpert {
namespace {

TEST(ShapeTest, ToStringAndNumel) {
  EXPECT_EQ(shape_to_string({}), "[]");
  EXPECT_EQ(shape_to_string({7}), "[7]");
  EXPECT_EQ(shape_to_string({2, 3, 4}), "[2, 3, 4]");
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({5, 0, 3}), 0);
}

TEST(TensorTest, DefaultIsUndefined) {
  const Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_FALSE(t.owned());
  EXPECT_EQ(t.raw(), nullptr);
}

TEST(TensorTest, EmptyHasContiguousLayoutAndAlignedBuffer) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Tensor t = Tensor::empty(dtype, {2, 3, 5});
    EXPECT_TRUE(t.defined());
    EXPECT_TRUE(t.owned());
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(t.shape(), (Shape{2, 3, 5}));
    EXPECT_EQ(t.strides(), (Shape{15, 5, 1}));
    EXPECT_EQ(t.dim(), 3);
    EXPECT_EQ(t.size(0), 2);
    EXPECT_EQ(t.size(2), 5);
    EXPECT_EQ(t.size(-1), 5);
    EXPECT_EQ(t.size(-3), 2);
    EXPECT_EQ(t.numel(), 30);
    EXPECT_EQ(t.num_bytes(), 30 * dtype_size(dtype));
    ASSERT_NE(t.raw(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
    // The whole buffer is writable (ASan builds would flag an undersized allocation).
    std::memset(t.raw(), 0xab, t.num_bytes());
  }
}

TEST(TensorTest, ZeroSizedAndScalarTensors) {
  Tensor z = Tensor::empty(DType::kF32, {0, 4});
  EXPECT_TRUE(z.defined());
  EXPECT_EQ(z.numel(), 0);
  EXPECT_EQ(z.num_bytes(), 0u);
  EXPECT_EQ(z.strides(), (Shape{4, 1}));
  Tensor zz = Tensor::zeros(DType::kBF16, {3, 0});
  EXPECT_EQ(zz.numel(), 0);
  Tensor converted = zz.to(DType::kF32);
  EXPECT_EQ(converted.shape(), (Shape{3, 0}));

  Tensor scalar = Tensor::zeros(DType::kF32, {});
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.data<float>()[0], 0.f);
}

TEST(TensorTest, ZerosAreZero) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    Tensor t = Tensor::zeros(dtype, {17, 9});
    const auto* bytes = t.data<unsigned char>();
    for (size_t i = 0; i < t.num_bytes(); ++i) ASSERT_EQ(bytes[i], 0) << dtype_name(dtype) << i;
  }
}

TEST(TensorTest, BorrowAliasesCallerMemory) {
  std::vector<float> buf(12);
  std::iota(buf.begin(), buf.end(), 0.f);
  Tensor t = Tensor::borrow(buf.data(), DType::kF32, {3, 4});
  EXPECT_FALSE(t.owned());
  EXPECT_TRUE(t.defined());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.raw(), buf.data());
  EXPECT_EQ(t.strides(), (Shape{4, 1}));
  t.data<float>()[5] = 100.f;
  EXPECT_EQ(buf[5], 100.f);

  const std::vector<uint16_t> cbuf(6, 0x3f80);
  const Tensor c = Tensor::borrow(static_cast<const void*>(cbuf.data()), DType::kBF16, {6});
  EXPECT_EQ(c.raw(), cbuf.data());
  EXPECT_EQ(c.to(DType::kF32).data<float>()[3], 1.0f);
}

TEST(TensorTest, ViewAliasesWithoutOwning) {
  Tensor t = Tensor::zeros(DType::kF32, {4, 2});
  Tensor v = t.view();
  EXPECT_FALSE(v.owned());
  EXPECT_EQ(v.raw(), t.raw());
  EXPECT_EQ(v.shape(), t.shape());
  EXPECT_EQ(v.strides(), t.strides());
  EXPECT_EQ(v.dtype(), t.dtype());
  v.data<float>()[3] = 2.5f;
  EXPECT_EQ(t.data<float>()[3], 2.5f);
}

TEST(TensorTest, SliceRowsOffsetsAndKeepsContiguity) {
  Tensor t = Tensor::empty(DType::kF16, {5, 3, 2});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<uint16_t>()[i] = static_cast<uint16_t>(i);
  Tensor s = t.slice_rows(1, 4);
  EXPECT_FALSE(s.owned());
  EXPECT_EQ(s.shape(), (Shape{3, 3, 2}));
  EXPECT_EQ(s.strides(), (Shape{6, 2, 1}));
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_EQ(s.data<uint16_t>(), t.data<uint16_t>() + 6);
  EXPECT_EQ(s.data<uint16_t>()[0], 6);
  EXPECT_EQ(s.data<uint16_t>()[s.numel() - 1], 23);

  Tensor ss = s.slice_rows(2, 3);  // Row 3 of t.
  EXPECT_EQ(ss.shape(), (Shape{1, 3, 2}));
  EXPECT_EQ(ss.data<uint16_t>()[0], 18);

  Tensor whole = t.slice_rows(0, 5);
  EXPECT_EQ(whole.raw(), t.raw());
  Tensor none = t.slice_rows(5, 5);
  EXPECT_EQ(none.numel(), 0);
  EXPECT_EQ(none.size(0), 0);
}

TEST(TensorTest, ReshapeIsAnAlias) {
  Tensor t = Tensor::empty(DType::kF32, {2, 6});
  for (int i = 0; i < 12; ++i) t.data<float>()[i] = static_cast<float>(i);
  Tensor r = t.reshape({3, 2, 2});
  EXPECT_FALSE(r.owned());
  EXPECT_EQ(r.raw(), t.raw());
  EXPECT_EQ(r.shape(), (Shape{3, 2, 2}));
  EXPECT_EQ(r.strides(), (Shape{4, 2, 1}));
  EXPECT_TRUE(r.is_contiguous());
  Tensor flat = t.slice_rows(1, 2).reshape({6});
  EXPECT_EQ(flat.data<float>()[0], 6.f);
}

TEST(TensorTest, ToConvertsEveryPair) {
  const std::vector<float> values = {0.f,  -0.f,  1.f,    -2.5f, 3.14159f, 65504.f,
                                     1e5f, 1e-6f, -1e-8f, 0.1f,  300.7f,   -7.0e-5f};
  const int64_t n = static_cast<int64_t>(values.size());
  Tensor f32 = Tensor::empty(DType::kF32, {3, n / 3});
  std::copy(values.begin(), values.end(), f32.data<float>());

  Tensor bf16 = f32.to(DType::kBF16);
  Tensor f16 = f32.to(DType::kF16);
  for (const Tensor* t : {&bf16, &f16}) {
    EXPECT_TRUE(t->owned());
    EXPECT_NE(t->raw(), f32.raw());
    EXPECT_EQ(t->shape(), f32.shape());
    EXPECT_TRUE(t->is_contiguous());
  }
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(bf16.data<uint16_t>()[i], f32_to_bf16(values[i])) << i;
    EXPECT_EQ(f16.data<uint16_t>()[i], f32_to_f16(values[i])) << i;
  }

  Tensor bf16_back = bf16.to(DType::kF32);
  Tensor bf16_to_f16 = bf16.to(DType::kF16);
  Tensor f16_to_bf16 = f16.to(DType::kBF16);
  for (int64_t i = 0; i < n; ++i) {
    const float b = bf16_to_f32(bf16.data<uint16_t>()[i]);
    const float h = f16_to_f32(f16.data<uint16_t>()[i]);
    EXPECT_EQ(bf16_back.data<float>()[i], b) << i;
    EXPECT_EQ(bf16_to_f16.data<uint16_t>()[i], f32_to_f16(b)) << i;
    EXPECT_EQ(f16_to_bf16.data<uint16_t>()[i], f32_to_bf16(h)) << i;
  }
}

TEST(TensorTest, ToSameDTypeIsAnOwnedCopy) {
  Tensor t = Tensor::empty(DType::kBF16, {4, 3});
  for (int i = 0; i < 12; ++i) t.data<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);
  Tensor c = t.to(DType::kBF16);
  EXPECT_TRUE(c.owned());
  EXPECT_NE(c.raw(), t.raw());
  EXPECT_EQ(std::memcmp(c.raw(), t.raw(), t.num_bytes()), 0);
  t.data<uint16_t>()[0] = 0;
  EXPECT_EQ(c.data<uint16_t>()[0], 0x3f80) << "the copy must not alias";

  // A slice converts only its own rows.
  Tensor s = t.slice_rows(2, 4).to(DType::kF32);
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.data<float>()[0], bf16_to_f32(0x3f80 + 6));
  EXPECT_EQ(s.data<float>()[5], bf16_to_f32(0x3f80 + 11));
}

TEST(TensorTest, MoveTransfersOwnership) {
  Tensor a = Tensor::zeros(DType::kF32, {8});
  void* data = a.raw();
  Tensor b = std::move(a);
  EXPECT_TRUE(b.owned());
  EXPECT_EQ(b.raw(), data);
  Tensor c;
  c = std::move(b);
  EXPECT_TRUE(c.owned());
  EXPECT_EQ(c.raw(), data);
  EXPECT_EQ(c.shape(), (Shape{8}));
}

TEST(TensorDeathTest, InvalidSlicesAndReshapesAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Tensor t = Tensor::zeros(DType::kF32, {4, 2});
  EXPECT_DEATH((void)t.slice_rows(3, 5), "Check failed");
  EXPECT_DEATH((void)t.slice_rows(3, 2), "Check failed");
  EXPECT_DEATH((void)t.slice_rows(-1, 2), "Check failed");
  EXPECT_DEATH((void)t.reshape({3, 3}), "Check failed");
  EXPECT_DEATH((void)Tensor::empty(DType::kF32, {2, -1}), "Check failed");
}

}  // namespace
}  // namespace flexpert
