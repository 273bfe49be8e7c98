// SPDX-License-Identifier: Apache-2.0
#include "flexpert/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "flexpert/logging.h"

namespace flexpert {
namespace {

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

}  // namespace

std::string shape_to_string(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

void ensure_f32_rows(Tensor* t, int64_t rows, int64_t cols) {
  if (!t->owned() || t->dtype() != DType::kF32 || t->size(0) < rows || t->size(1) != cols) {
    *t = Tensor::empty(DType::kF32, {std::max<int64_t>(rows, 1), cols});
  }
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    dtype_ = other.dtype_;
    shape_ = std::move(other.shape_);
    strides_ = std::move(other.strides_);
    data_ = other.data_;
    buffer_ = std::move(other.buffer_);
    other.shape_.clear();
    other.strides_.clear();
    other.data_ = nullptr;
  }
  return *this;
}

void Tensor::FreeDeleter::operator()(void* p) const { std::free(p); }

Tensor Tensor::empty(DType dtype, Shape shape) {
  for (int64_t d : shape) FLEX_CHECK(d >= 0) << shape_to_string(shape);
  Tensor t;
  t.dtype_ = dtype;
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  size_t bytes = (t.num_bytes() + 63) / 64 * 64;
  if (bytes == 0) bytes = 64;
  void* p = std::aligned_alloc(64, bytes);
  FLEX_CHECK(p != nullptr) << "out of memory allocating " << bytes << " bytes";
  t.buffer_.reset(p);
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(DType dtype, Shape shape) {
  Tensor t = empty(dtype, std::move(shape));
  std::memset(t.data_, 0, t.num_bytes());
  return t;
}

Tensor Tensor::borrow(void* data, DType dtype, Shape shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  t.data_ = data;
  return t;
}

Tensor Tensor::view() const {
  Tensor t;
  t.dtype_ = dtype_;
  t.shape_ = shape_;
  t.strides_ = strides_;
  t.data_ = data_;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  FLEX_CHECK(dim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0])
      << begin << ".." << end << " of " << shape_to_string(shape_);
  Tensor t = view();
  t.shape_[0] = end - begin;
  t.data_ = static_cast<char*>(data_) + begin * strides_[0] * dtype_size(dtype_);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  FLEX_CHECK(is_contiguous() && shape_numel(shape) == numel())
      << shape_to_string(shape_) << " -> " << shape_to_string(shape);
  return borrow(data_, dtype_, std::move(shape));
}

Tensor Tensor::to(DType dtype) const {
  FLEX_CHECK(is_contiguous());
  Tensor t = empty(dtype, shape_);
  if (dtype == dtype_) {
    std::memcpy(t.data_, data_, num_bytes());
  } else if (dtype == DType::kF32) {
    convert_to_f32(dtype_, data_, t.data<float>(), numel());
  } else if (dtype_ == DType::kF32) {
    convert_from_f32(dtype, data<float>(), t.data_, numel());
  } else {
    Tensor tmp = to(DType::kF32);
    convert_from_f32(dtype, tmp.data<float>(), t.data_, numel());
  }
  return t;
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

}  // namespace flexpert
