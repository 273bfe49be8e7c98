// SPDX-License-Identifier: Apache-2.0
#include "flexpert/dtype.h"

#include <array>
#include <cmath>

namespace flexpert {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* dtype) {
  if (name == "F32")
    *dtype = DType::kF32;
  else if (name == "BF16")
    *dtype = DType::kBF16;
  else if (name == "F16")
    *dtype = DType::kF16;
  else if (name == "F8_E4M3")
    *dtype = DType::kF8E4M3;
  else
    return false;
  return true;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // Subnormal: value = mant * 2^-24.
      float f = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // Overflow (incl. inf) -> inf.
  if (abs < 0x38800000u) {                        // Below the smallest normal.
    // Subnormal or zero: round(|f| * 2^24) with ties to even.
    float a;
    std::memcpy(&a, &abs, 4);
    float scaled = a * 16777216.0f;
    float r = std::nearbyint(scaled);  // Default rounding mode is to nearest even.
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);  // Round mantissa to 10 bits, ties to even.
  return sign | static_cast<uint16_t>((m - 0x38000000u) >> 13);
}

float f8e4m3_to_f32(uint8_t h) {
  const bool negative = (h & 0x80u) != 0;
  const int exp = (h >> 3) & 0xf;
  const int mant = h & 0x7;
  float value;
  if (exp == 0xf && mant == 0x7) {
    value = NAN;
  } else if (exp == 0) {
    value = std::ldexp(static_cast<float>(mant), -9);  // Subnormal: mant/8 * 2^-6.
  } else {
    value = std::ldexp(static_cast<float>(8 + mant), exp - 10);  // (1 + mant/8) * 2^(exp-7).
  }
  return negative ? -value : value;
}

uint8_t f32_to_f8e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7f;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;  // Saturate at the largest finite value.
  if (a < std::ldexp(1.0f, -6)) {
    // Subnormal or zero: a multiple of 2^-9, rounded to nearest even.
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  }
  int exp = 0;
  const float frac = std::frexp(a, &exp);  // a = frac * 2^exp, frac in [0.5, 1).
  // 4 significant bits: m in [8, 16] after rounding to nearest even.
  int m = static_cast<int>(std::nearbyint(std::ldexp(frac, 4)));
  int e = exp - 1 + 7;  // Biased exponent of 2^(exp-1).
  if (m == 16) {
    m = 8;
    ++e;
  }
  if (e > 15 || (e == 15 && m - 8 == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((e << 3) | (m - 8));
}

void convert_to_f32(DType dtype, const void* src, float* dst, size_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::kF8E4M3: {
      static const auto table = [] {
        std::array<float, 256> t{};
        for (int i = 0; i < 256; ++i) t[i] = f8e4m3_to_f32(static_cast<uint8_t>(i));
        return t;
      }();
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = table[s[i]];
      return;
    }
  }
}

void convert_from_f32(DType dtype, const float* src, void* dst, size_t n) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::kF8E4M3: {
      auto* d = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f8e4m3(src[i]);
      return;
    }
  }
}

}  // namespace flexpert
