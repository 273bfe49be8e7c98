// SPDX-License-Identifier: Apache-2.0
// The bf16/f16/fp8 conversions are checked against references built here from the bit layouts
// alone: an exact decoder per format and "nearest of the two neighbouring patterns, ties to the
// even pattern" for encoding. The 16- and 8-bit formats are small enough to check exhaustively.
#include "flexpert/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace flexpert {
namespace {

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// bfloat16: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
double ref_bf16(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int exp = (h >> 7) & 0xff;
  const int mant = h & 0x7f;
  if (exp == 0xff) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -133);
  return sign * std::ldexp(static_cast<double>(128 + mant), exp - 134);
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
double ref_f16(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  return sign * std::ldexp(static_cast<double>(1024 + mant), exp - 25);
}

bool is_bf16_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }
bool is_f16_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// A 16-bit float format as the reference encoder sees it: non-negative patterns
// 0..inf_pattern are increasing in value; inf stands for 2^(emax+1) when rounding.
struct Format {
  double (*decode)(uint16_t);
  uint16_t inf_pattern;
  double overflow_value;
};
constexpr Format kBF16{ref_bf16, 0x7f80, 0x1p128};
constexpr Format kF16{ref_f16, 0x7c00, 65536.0};

double value_for_rounding(const Format& fmt, uint16_t p) {
  return p == fmt.inf_pattern ? fmt.overflow_value : fmt.decode(p);
}

// Round-to-nearest-even encoding of a finite or infinite, non-NaN f, by search.
uint16_t ref_encode(const Format& fmt, float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= fmt.overflow_value) return sign | fmt.inf_pattern;
  // Largest pattern lo with value <= a (lo < inf_pattern since a < overflow_value).
  uint32_t lo = 0, hi = fmt.inf_pattern;  // Invariant: value(lo) <= a < value(hi).
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (value_for_rounding(fmt, static_cast<uint16_t>(mid)) <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const double below = a - fmt.decode(static_cast<uint16_t>(lo));
  const double above = value_for_rounding(fmt, static_cast<uint16_t>(hi)) - a;
  const uint32_t tie = (lo % 2 == 0) ? lo : hi;  // Ties go to the even pattern.
  const uint32_t pick = below < above ? lo : above < below ? hi : tie;
  return static_cast<uint16_t>(sign | pick);
}

uint32_t test_seed() {
  if (const char* s = std::getenv("FLEXPERT_TEST_SEED")) {
    return static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
  }
  return std::random_device{}();
}

TEST(DTypeTest, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}) {
    DType parsed = d == DType::kF32 ? DType::kF16 : DType::kF32;
    ASSERT_TRUE(parse_dtype(dtype_name(d), &parsed)) << dtype_name(d);
    EXPECT_EQ(parsed, d);
  }
  EXPECT_EQ(dtype_name(DType::kBF16), "BF16");
  DType untouched = DType::kBF16;
  EXPECT_EQ(dtype_name(DType::kF8E4M3), "F8_E4M3");
  for (const char* name : {"F64", "I32", "bf16", "", "F32 ", "F8_E5M2"}) {
    EXPECT_FALSE(parse_dtype(name, &untouched)) << '"' << name << '"';
  }
  EXPECT_EQ(untouched, DType::kBF16);
}

// ------------------------------------------------------------------------------------- bf16

TEST(BF16Test, DecodeAndRoundTripAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = bf16_to_f32(h);
    if (is_bf16_nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_TRUE(is_bf16_nan(f32_to_bf16(f))) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref_bf16(h)) << std::hex << i;
    ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << i;
    ASSERT_EQ(f32_to_bf16(f), h) << std::hex << i;
  }
}

// Every halfway point between neighbouring patterns is an f32: it must go to the even pattern,
// and the floats just beside it to the nearer neighbour.
TEST(BF16Test, AllMidpointsRoundToEven) {
  for (uint32_t p = 0; p < 0x7f80u; ++p) {
    const double next = value_for_rounding(kBF16, static_cast<uint16_t>(p + 1));
    const double mid_d = (ref_bf16(static_cast<uint16_t>(p)) + next) / 2;
    const auto mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d) << "midpoint not exact at " << std::hex << p;
    const uint16_t even = static_cast<uint16_t>(p % 2 == 0 ? p : p + 1);
    ASSERT_EQ(f32_to_bf16(mid), even) << std::hex << p;
    ASSERT_EQ(f32_to_bf16(-mid), even | 0x8000u) << std::hex << p;
    ASSERT_EQ(f32_to_bf16(std::nextafter(mid, 0.f)), p) << std::hex << p;
    ASSERT_EQ(f32_to_bf16(std::nextafter(mid, INFINITY)), p + 1) << std::hex << p;
  }
}

TEST(BF16Test, RandomFloatsGoToNearestNeighbour) {
  const uint32_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " (rerun with FLEXPERT_TEST_SEED)");
  std::mt19937 gen(seed);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = gen();
    const float f = from_bits(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), ref_encode(kBF16, f)) << std::hex << "f32 bits " << bits;
  }
}

TEST(BF16Test, SpecialValues) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // Tie, 0x3f80 is even.
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // Tie, 0x3f82 is even.
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80) << "rounds up to inf";
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  // NaNs stay NaN, including ones whose payload sits only in the low 16 bits (truncation
  // would turn them into inf) and signalling ones; the sign is kept.
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fbfffffu, 0xffc00000u,
                        0xff800001u, 0x7fffffffu}) {
    const uint16_t h = f32_to_bf16(from_bits(bits));
    EXPECT_TRUE(is_bf16_nan(h)) << std::hex << bits << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (bits >> 16) & 0x8000u) << std::hex << bits;
  }
}

// -------------------------------------------------------------------------------------- f16

TEST(F16Test, DecodeAndRoundTripAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = f16_to_f32(h);
    if (is_f16_nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_TRUE(is_f16_nan(f32_to_f16(f))) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref_f16(h)) << std::hex << i;
    ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << i;
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << i;
  }
}

TEST(F16Test, AllMidpointsRoundToEven) {
  for (uint32_t p = 0; p < 0x7c00u; ++p) {
    const double next = value_for_rounding(kF16, static_cast<uint16_t>(p + 1));
    const double mid_d = (ref_f16(static_cast<uint16_t>(p)) + next) / 2;
    const auto mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d) << "midpoint not exact at " << std::hex << p;
    const uint16_t even = static_cast<uint16_t>(p % 2 == 0 ? p : p + 1);
    ASSERT_EQ(f32_to_f16(mid), even) << std::hex << p;
    ASSERT_EQ(f32_to_f16(-mid), even | 0x8000u) << std::hex << p;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 0.f)), p) << std::hex << p;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, INFINITY)), p + 1) << std::hex << p;
  }
}

// Magnitudes from far below the smallest subnormal to past the overflow threshold.
TEST(F16Test, RandomFloatsGoToNearestNeighbour) {
  const uint32_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " (rerun with FLEXPERT_TEST_SEED)");
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> exp_dist(127 - 30, 127 + 17);
  for (int i = 0; i < 400000; ++i) {
    const uint32_t sign = gen() & 0x80000000u;
    const uint32_t exp = static_cast<uint32_t>(exp_dist(gen)) << 23;
    const uint32_t mant = gen() & 0x7fffffu;
    const float f = from_bits(sign | exp | mant);
    ASSERT_EQ(f32_to_f16(f), ref_encode(kF16, f)) << std::hex << "f32 bits " << to_bits(f);
  }
}

TEST(F16Test, SpecialValues) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);      // Tie, to even.
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);  // Tie, to even.
  EXPECT_EQ(f32_to_f16(0.1f), 0x2e66);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  // Overflow: 65504 is the largest finite; 65520 is the tie with 2^16 and goes to inf.
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(std::nextafter(65520.0f, 0.f)), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xfc00);
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(f32_to_f16(-INFINITY), 0xfc00);
  // Subnormals: 2^-24 is the smallest; 2^-25 is the tie with 0 and goes to 0 (even).
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);
  EXPECT_EQ(f32_to_f16(std::nextafter(0x1p-25f, 1.f)), 0x0001);
  EXPECT_EQ(f32_to_f16(-0x1p-25f), 0x8000);
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);  // Tie between 1 and 2: even.
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);      // Smallest normal.
  EXPECT_EQ(f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400) << "tie at the subnormal/normal edge";
  EXPECT_EQ(f32_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0xfc00), -INFINITY);
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7f801fffu, 0xffc00000u, 0xff800001u}) {
    const uint16_t h = f32_to_f16(from_bits(bits));
    EXPECT_TRUE(is_f16_nan(h)) << std::hex << bits << " -> " << h;
  }
}

// ------------------------------------------------------------------------------------- fp8

// float8 E4M3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf, S.1111.111 is NaN.
double ref_f8e4m3(uint8_t h) {
  const double sign = (h & 0x80u) ? -1.0 : 1.0;
  const int exp = (h >> 3) & 0xf;
  const int mant = h & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<double>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -9);
  return sign * std::ldexp(static_cast<double>(8 + mant), exp - 10);
}

// Nearest pattern by exhaustive search, ties to the even pattern, saturating at 448.
uint8_t ref_encode_f8e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(f));
  uint8_t best = 0;
  double best_err = INFINITY;
  for (int p = 0; p <= 0x7e; ++p) {
    const double err = std::fabs(ref_f8e4m3(static_cast<uint8_t>(p)) - a);
    if (err < best_err || (err == best_err && p % 2 == 0)) {
      best = static_cast<uint8_t>(p);
      best_err = err;
    }
  }
  return sign | best;
}

TEST(F8E4M3Test, DecodeAndRoundTripAllPatterns) {
  for (int i = 0; i < 256; ++i) {
    const auto h = static_cast<uint8_t>(i);
    const float f = f8e4m3_to_f32(h);
    if ((i & 0x7f) == 0x7f) {
      ASSERT_TRUE(std::isnan(f)) << i;
      ASSERT_EQ(f32_to_f8e4m3(f) & 0x7f, 0x7f) << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref_f8e4m3(h)) << i;
    ASSERT_EQ(f32_to_f8e4m3(f), h) << i;
  }
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
}

TEST(F8E4M3Test, RandomFloatsGoToNearestAndSaturate) {
  const uint32_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " (rerun with FLEXPERT_TEST_SEED)");
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> log2_mag(-12.f, 10.f);
  for (int i = 0; i < 20000; ++i) {
    float f = std::exp2(log2_mag(gen));
    if (gen() % 2) f = -f;
    ASSERT_EQ(f32_to_f8e4m3(f), ref_encode_f8e4m3(f)) << f;
  }
  // Midpoints between neighbours go to the even pattern.
  for (int p = 0; p < 0x7e; ++p) {
    const double mid =
        (ref_f8e4m3(static_cast<uint8_t>(p)) + ref_f8e4m3(static_cast<uint8_t>(p + 1))) / 2;
    ASSERT_EQ(f32_to_f8e4m3(static_cast<float>(mid)), p % 2 == 0 ? p : p + 1) << mid;
  }
  EXPECT_EQ(f32_to_f8e4m3(1e6f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_f8e4m3(-0.0f), 0x80);
}

// ---------------------------------------------------------------------------------- arrays

TEST(ConvertTest, ArraysMatchScalarConversions) {
  const uint32_t seed = test_seed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " (rerun with FLEXPERT_TEST_SEED)");
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 100.f);
  const size_t n = 1001;
  std::vector<float> src(n);
  for (float& v : src) v = dist(gen);
  src[0] = INFINITY;
  src[1] = -0.0f;
  src[2] = NAN;

  std::vector<uint16_t> half(n);
  std::vector<float> back(n, -1.f);
  convert_from_f32(DType::kBF16, src.data(), half.data(), n);
  convert_to_f32(DType::kBF16, half.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(half[i], f32_to_bf16(src[i])) << i;
    ASSERT_EQ(to_bits(back[i]), to_bits(bf16_to_f32(half[i]))) << i;
  }

  convert_from_f32(DType::kF16, src.data(), half.data(), n);
  convert_to_f32(DType::kF16, half.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(half[i], f32_to_f16(src[i])) << i;
    ASSERT_EQ(to_bits(back[i]), to_bits(f16_to_f32(half[i]))) << i;
  }

  std::vector<uint8_t> quarter(n);
  convert_from_f32(DType::kF8E4M3, src.data(), quarter.data(), n);
  convert_to_f32(DType::kF8E4M3, quarter.data(), back.data(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(quarter[i], f32_to_f8e4m3(src[i])) << i;
    ASSERT_EQ(to_bits(back[i]), to_bits(f8e4m3_to_f32(quarter[i]))) << i;
  }

  std::vector<float> copy(n, -1.f), copy2(n, -1.f);
  convert_from_f32(DType::kF32, src.data(), copy.data(), n);
  convert_to_f32(DType::kF32, copy.data(), copy2.data(), n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(to_bits(copy2[i]), to_bits(src[i])) << i;
}

}  // namespace
}  // namespace flexpert
