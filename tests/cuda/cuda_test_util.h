// SPDX-License-Identifier: Apache-2.0
// Helpers of the CUDA tests: skipping without a GPU, host <-> device copies,
// bf16 rounding of host data, relative L2 distance.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/device.h"
#include "flexpert/dtype.h"

// Skips the test, saying why, on machines without a CUDA device (CI).
#define FLEX_SKIP_WITHOUT_GPU()                                                        \
  do {                                                                                 \
    if (!::flexpert::cuda::device_available()) {                                       \
      GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs on a GPU host)"; \
    }                                                                                  \
  } while (0)

namespace flexpert::cuda_test {

inline std::vector<float> uniform(size_t n, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

// A device copy of f32 host data, stored as `dtype`.
inline cuda::DeviceBuffer to_device(const std::vector<float>& v, DType dtype) {
  auto b = cuda::DeviceBuffer::create(v.size() * dtype_size(dtype));
  EXPECT_TRUE(b.ok());
  if (dtype == DType::kBF16) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
    EXPECT_EQ(cudaMemcpy(b.value().data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  } else {
    EXPECT_EQ(cudaMemcpy(b.value().data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return std::move(b).value();
}

template <typename T>
inline cuda::DeviceBuffer to_device_raw(const std::vector<T>& v) {
  auto b = cuda::DeviceBuffer::create(v.size() * sizeof(T));
  EXPECT_TRUE(b.ok());
  EXPECT_EQ(cudaMemcpy(b.value().data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return std::move(b).value();
}

// n elements of `dtype` at a device address, as f32.
inline std::vector<float> to_host(const void* data, size_t n, DType dtype) {
  std::vector<float> out(n);
  if (dtype == DType::kBF16) {
    std::vector<uint16_t> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), data, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
  } else {
    EXPECT_EQ(cudaMemcpy(out.data(), data, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return std::sqrt(num / (den > 0 ? den : 1));
}

}  // namespace flexpert::cuda_test
