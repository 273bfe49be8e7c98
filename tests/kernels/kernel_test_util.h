// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the CPU kernel tests: a seeded RNG that prints its seed,
// NaN poisoning of outputs, float64 decoders for stored weight bits, and
// comparisons against float64 references.
//
// The decoders below are written from the IEEE-754 / bfloat16 bit layouts and
// deliberately do not use flexpert's own conversions, so a wrong conversion in
// the library cannot hide behind the same mistake in the reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace flexpert::kernels::testing_util {

// A fresh seed per test, or FLEXPERT_TEST_SEED to reproduce a failure.
class SeededRng {
 public:
  SeededRng() : seed_(pick_seed()), gen_(seed_) {}

  uint32_t seed() const { return seed_; }
  std::string trace() const {
    return "seed=" + std::to_string(seed_) +
           " (rerun with FLEXPERT_TEST_SEED=" + std::to_string(seed_) + ")";
  }
  std::mt19937& gen() { return gen_; }

  float normal(float stddev = 1.0f) { return std::normal_distribution<float>(0.f, stddev)(gen_); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int64_t uniform_int(int64_t lo, int64_t hi) {  // Inclusive.
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  std::vector<float> normal_vector(size_t n, float stddev = 1.0f) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(stddev);
    return v;
  }

  // Finite bf16 bits with magnitudes in [2^-5, 2^3): sign, exponent and mantissa drawn directly.
  uint16_t bf16_bits() {
    const uint32_t sign = static_cast<uint32_t>(uniform_int(0, 1)) << 15;
    const uint32_t exp = static_cast<uint32_t>(uniform_int(127 - 5, 127 + 2)) << 7;
    const uint32_t mant = static_cast<uint32_t>(uniform_int(0, 0x7f));
    return static_cast<uint16_t>(sign | exp | mant);
  }
  // Finite f16 bits, mostly with magnitudes in [2^-5, 2^3), sometimes subnormal.
  uint16_t f16_bits() {
    const uint32_t sign = static_cast<uint32_t>(uniform_int(0, 1)) << 15;
    const int64_t e = uniform_int(0, 8);
    const uint32_t exp = e == 0 ? 0u : static_cast<uint32_t>(15 - 6 + e) << 10;
    const uint32_t mant = static_cast<uint32_t>(uniform_int(0, 0x3ff));
    return static_cast<uint16_t>(sign | exp | mant);
  }

 private:
  static uint32_t pick_seed() {
    if (const char* s = std::getenv("FLEXPERT_TEST_SEED")) {
      return static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
    }
    return std::random_device{}();
  }

  uint32_t seed_;
  std::mt19937 gen_;
};

// bfloat16: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
inline double ref_bf16_to_double(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int exp = (h >> 7) & 0xff;
  const int mant = h & 0x7f;
  if (exp == 0xff) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -126 - 7);
  return sign * std::ldexp(static_cast<double>(128 + mant), exp - 127 - 7);
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
inline double ref_f16_to_double(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -14 - 10);
  return sign * std::ldexp(static_cast<double>(1024 + mant), exp - 15 - 10);
}

inline void poison(std::vector<float>& v) {
  std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
}

inline ::testing::AssertionResult all_finite(const std::vector<float>& got) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      return ::testing::AssertionFailure()
             << "output[" << i << "] = " << got[i] << " (not written, or overflowed)";
    }
  }
  return ::testing::AssertionSuccess();
}

// ||got - ref||_2 / ||ref||_2 <= tol, for vectors whose elements may cancel to ~0.
inline ::testing::AssertionResult close_rel_l2(const std::vector<float>& got,
                                               const std::vector<double>& ref, double tol) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size mismatch";
  ::testing::AssertionResult finite = all_finite(got);
  if (!finite) return finite;
  double diff2 = 0.0, ref2 = 0.0;
  size_t worst = 0;
  double worst_abs = -1.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
    if (std::fabs(d) > worst_abs) {
      worst_abs = std::fabs(d);
      worst = i;
    }
  }
  const double err = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-300);
  if (err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "relative L2 error " << err << " > " << tol << "; worst at [" << worst << "]: got "
         << got[worst] << ", want " << ref[worst];
}

// max_i |got_i - ref_i| / max(1, |ref_i|) <= tol.
inline ::testing::AssertionResult close_elementwise(const std::vector<float>& got,
                                                    const std::vector<double>& ref, double tol) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size mismatch";
  for (size_t i = 0; i < got.size(); ++i) {
    const double err =
        std::fabs(static_cast<double>(got[i]) - ref[i]) / std::max(1.0, std::fabs(ref[i]));
    if (!(err <= tol)) {  // Also catches NaN.
      return ::testing::AssertionFailure() << "at [" << i << "]: got " << got[i] << ", want "
                                           << ref[i] << " (error " << err << " > " << tol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace flexpert::kernels::testing_util
