// SPDX-License-Identifier: Apache-2.0
// The monotonic clock as the runtime reads it: nanoseconds for deadlines and liveness
// slices, milliseconds since a point for logs. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>

namespace flexpert {

// steady_clock (CLOCK_MONOTONIC on Linux: comparable across processes of one host), in ns.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace flexpert
