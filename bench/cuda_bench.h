// SPDX-License-Identifier: Apache-2.0
// What the GPU benchmark programs (moe_layer_bench, gemv_bench) share: failing on an error,
// splitting a list flag, timing by events, the device copy bandwidth.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "flexpert/status.h"

namespace flexpert::cuda {

// Exits with the status's message where expr (a Status) is an error.
#define BENCH_CHECK(expr)                                                              \
  do {                                                                                 \
    const Status s_ = (expr);                                                          \
    if (!s_.ok()) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.to_string().c_str()); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

// The value of r, or exit with its status's message.
template <typename T>
inline T take(Result<T> r, const char* what) {
  if (!r.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, r.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(r).value();
}

// A comma-separated flag's items (empty ones left out).
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// Median milliseconds of `fn` enqueued `reps` times, each timed by events.
template <typename Fn>
inline double median_ms(cudaStream_t stream, int reps, Fn fn) {
  Event a = take(Event::create(), "event"), b = take(Event::create(), "event");
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(a.record(stream));
    fn();
    BENCH_CHECK(b.record(stream));
    BENCH_CHECK(b.synchronize());
    ms.push_back(take(Event::elapsed_ms(a, b), "elapsed"));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Bytes a second read and written by a device copy of 2 GB (median of 15).
inline double measure_bandwidth(cudaStream_t stream) {
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer src = take(DeviceBuffer::create(bytes), "alloc");
  DeviceBuffer dst = take(DeviceBuffer::create(bytes), "alloc");
  BENCH_CHECK(
      cuda_status(fill_uniform(DType::kBF16, src.data(), bytes / 2, 1, 1.f, stream), "fill"));
  for (int i = 0; i < 3; ++i) copy_bytes(src.data(), dst.data(), bytes, stream);
  const double ms =
      median_ms(stream, 15, [&] { copy_bytes(src.data(), dst.data(), bytes, stream); });
  BENCH_CHECK(cuda_status(cudaGetLastError(), "copy"));
  return 2.0 * bytes / (ms * 1e-3);  // Read + write.
}

}  // namespace flexpert::cuda
