// SPDX-License-Identifier: Apache-2.0
// Tensor: a typed, shaped view of host memory that it owns or borrows.
//
// An owned tensor holds a 64-byte aligned buffer and frees it when destroyed;
// a borrowed tensor points into memory someone else keeps alive (a mapped
// checkpoint file, a buffer of another tensor) and must not outlive it.
// Tensors are move-only; `view()` makes a borrowed alias. Strides are in
// elements. Not thread-safe for concurrent mutation of one tensor object;
// concurrent writes to disjoint elements of the data are fine.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "flexpert/dtype.h"

namespace flexpert {

using Shape = std::vector<int64_t>;

std::string shape_to_string(const Shape& shape);

class Tensor;
// Step scratch: makes *t an owned f32 [>= rows, cols] tensor, reallocating only
// when the one it holds is too small or of another width.
void ensure_f32_rows(Tensor* t, int64_t rows, int64_t cols);
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;
  // A moved-from tensor is empty (no data, shape []).
  Tensor(Tensor&& other) noexcept { *this = std::move(other); }
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  // A new contiguous tensor; contents are uninitialised.
  static Tensor empty(DType dtype, Shape shape);
  // A new contiguous tensor filled with zeros.
  static Tensor zeros(DType dtype, Shape shape);
  // A contiguous alias of `data`, which must outlive the tensor.
  static Tensor borrow(void* data, DType dtype, Shape shape);
  static Tensor borrow(const void* data, DType dtype, Shape shape) {
    return borrow(const_cast<void*>(data), dtype, std::move(shape));
  }

  // A borrowed alias of this tensor (same shape, strides and data).
  Tensor view() const;
  // A borrowed alias of rows [begin, end) along dimension 0.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // A borrowed alias with a new shape; requires a contiguous tensor.
  Tensor reshape(Shape shape) const;
  // An owned contiguous copy converted to `dtype`.
  Tensor to(DType dtype) const;

  bool defined() const { return data_ != nullptr || numel() == 0; }
  bool owned() const { return buffer_ != nullptr; }
  bool is_contiguous() const;
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const { return shape_[d < 0 ? d + dim() : d]; }
  int64_t numel() const { return shape_numel(shape_); }
  size_t num_bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }

 private:
  struct FreeDeleter {
    void operator()(void* p) const;
  };

  DType dtype_ = DType::kF32;
  Shape shape_;
  Shape strides_;
  void* data_ = nullptr;
  std::unique_ptr<void, FreeDeleter> buffer_;  // Set only when owned.
};

}  // namespace flexpert
