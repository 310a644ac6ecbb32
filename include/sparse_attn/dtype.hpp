// Exact conversions between float and the 16-bit storage formats (round to nearest even, NaN kept).
#pragma once

#include <bit>
#include <cstdint>

namespace sparse_attn {

inline float bf16_to_float(std::uint16_t h) { return std::bit_cast<float>(std::uint32_t(h) << 16); }

inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

float f16_to_float(std::uint16_t h);
std::uint16_t float_to_f16(float f);

/// Rounds through the storage format: the value a tensor of that dtype would hold.
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }
inline float round_f16(float f) { return f16_to_float(float_to_f16(f)); }

}  // namespace sparse_attn
