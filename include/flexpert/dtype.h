// SPDX-License-Identifier: Apache-2.0
// Element types and the bf16/f16/fp8 <-> f32 conversions.
//
// bf16 and f16 are stored as raw uint16_t, fp8 E4M3 (the "fn" variant of
// DeepSeek checkpoints: no infinities, 0x7f/0xff NaN, max 448) as uint8_t.
// Conversions to f32 are exact; conversions from f32 round to nearest even (NaN
// stays NaN; fp8 saturates at +-448, as quantizers clamp before casting). Pure
// functions, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace flexpert {

// kF8E4M3 is a storage type: checkpoints hold it with block scales, and the loader
// dequantizes it (Checkpoint::get_weight); kernels never see it.
enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "F32", "BF16", "F16", "F8_E4M3" as in safetensors.
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
float f8e4m3_to_f32(uint8_t h);
uint8_t f32_to_f8e4m3(float f);

// Converts n elements of `src` (of type `dtype`) to f32.
void convert_to_f32(DType dtype, const void* src, float* dst, size_t n);
// Converts n f32 elements to `dtype`.
void convert_from_f32(DType dtype, const float* src, void* dst, size_t n);

}  // namespace flexpert
