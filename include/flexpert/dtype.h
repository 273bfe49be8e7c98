// SPDX-License-Identifier: Apache-2.0
// Element types and the bf16/f16 <-> f32 conversions.
//
// bf16 and f16 are stored as raw uint16_t. Conversions to f32 are exact;
// conversions from f32 round to nearest even (NaN stays NaN). Pure functions,
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace flexpert {

enum class DType : uint8_t { kF32, kBF16, kF16 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "F32", "BF16", "F16" as in safetensors.
// Parses a safetensors dtype name; returns false for names flexpert does not compute in.
bool parse_dtype(std::string_view name, DType* dtype);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // Round to nearest even.
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements of `src` (of type `dtype`) to f32.
void convert_to_f32(DType dtype, const void* src, float* dst, size_t n);
// Converts n f32 elements to `dtype`.
void convert_from_f32(DType dtype, const float* src, void* dst, size_t n);

}  // namespace flexpert
