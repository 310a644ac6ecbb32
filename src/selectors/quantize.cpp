// Low-precision formats of the index paths: e4m3 ("fn"), e2m1 and their scaled (fp8 per-tensor,
// NVFP4 block) round trips. Every conversion is exact arithmetic on powers of two, so the results
// are bit-exact with the hardware formats and independent of the host's floating-point mode
// (std::nearbyint under the default round-to-nearest-even mode).
#include <cmath>
#include <limits>

#include "core/check.hpp"
#include "selectors/select_common.hpp"
#include "sparse_attn/dtype.hpp"
#include "sparse_attn/selectors.hpp"

namespace sparse_attn {

namespace {

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
constexpr int kFp4Block = 16;  // NVFP4: one e4m3 scale per 16 consecutive elements

// Rounds |a| (finite, >= 0, <= the format's max) to a code of a format with `mant_bits` mantissa
// bits, exponent bias `bias` and subnormals. Returns the magnitude code (exponent << mant | mantissa).
std::uint8_t round_magnitude(float a, int mant_bits, int bias) {
  const int min_exp = 1 - bias;  // exponent of the smallest normal
  int e;
  std::frexp(a, &e);  // a = f * 2^e with f in [0.5, 1)
  int E = e - 1;      // a in [2^E, 2^(E+1))
  const bool subnormal = a == 0.0f || E < min_exp;
  if (subnormal) E = min_exp;  // subnormals share the quantum of the first normal binade
  // a / quantum is exact (a power of two); nearbyint rounds half to even.
  const int m = static_cast<int>(std::nearbyint(a / std::ldexp(1.0f, E - mant_bits)));
  // Subnormal: m in [0, 2^mant], and m = 2^mant is exactly the first normal code. Normal: m in
  // [2^mant, 2^(mant+1)], and m = 2^(mant+1) carries into the next exponent.
  const int code = subnormal ? m : (((E + bias) << mant_bits) + (m - (1 << mant_bits)));
  return static_cast<std::uint8_t>(code);
}

}  // namespace

std::uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  // Everything above 448 saturates: RNE would send (448, 464] to 448 anyway, and larger values
  // (infinity included) have no finite code.
  if (a >= kE4m3Max) return static_cast<std::uint8_t>(sign | 0x7e);
  return static_cast<std::uint8_t>(sign | round_magnitude(a, 3, 7));
}

float e4m3_to_float(std::uint8_t b) {
  const bool neg = (b & 0x80) != 0;
  const int e = (b >> 3) & 0xf;
  const int m = b & 0x7;
  float v;
  if (e == 0xf && m == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) v = std::ldexp(static_cast<float>(m), -9);
  else v = std::ldexp(static_cast<float>(8 + m), e - 10);
  return neg ? -v : v;
}

std::uint8_t float_to_e2m1(float f) {
  // e2m1 has no NaN code; the library saturates NaN to +6 like an overflow.
  if (std::isnan(f)) return 0x7;
  const std::uint8_t sign = std::signbit(f) ? 0x8 : 0x0;
  const float a = std::fabs(f);
  if (a >= kE2m1Max) return static_cast<std::uint8_t>(sign | 0x7);
  return static_cast<std::uint8_t>(sign | round_magnitude(a, 1, 1));
}

float e2m1_to_float(std::uint8_t b) {
  const bool neg = (b & 0x8) != 0;
  const int e = (b >> 1) & 0x3;
  const int m = b & 0x1;
  const float v = e == 0 ? 0.5f * static_cast<float>(m) : std::ldexp(static_cast<float>(2 + m), e - 2);
  return neg ? -v : v;
}

const char* precision_name(IndexPrecision p) {
  switch (p) {
    case IndexPrecision::bf16: return "bf16";
    case IndexPrecision::fp8_e4m3: return "fp8_e4m3";
    case IndexPrecision::fp4_e2m1: return "fp4_e2m1";
  }
  return "?";
}

void quantize_dequantize(float* row, std::int64_t n, IndexPrecision p, float tensor_scale) {
  const std::string op = "quantize_dequantize";
  detail::check_precision(op, p);
  detail::require(n >= 0, op, "n", [&] { return "must be >= 0, got " + std::to_string(n); });
  detail::require(n == 0 || row != nullptr, op, "row", "is null");
  if (p == IndexPrecision::bf16) {
    for (std::int64_t i = 0; i < n; ++i) row[i] = round_bf16(row[i]);
    return;
  }
  detail::require(std::isfinite(tensor_scale) && tensor_scale >= 0.0f, op, "tensor_scale",
                  [&] { return "must be finite and >= 0, got " + std::to_string(tensor_scale); });
  if (tensor_scale == 0.0f) {
    // Only an all-zero tensor has scale 0; anything else in the row has no representation.
    for (std::int64_t i = 0; i < n; ++i)
      detail::require(row[i] == 0.0f, op, "tensor_scale",
                      [&] { return "is 0 but element " + std::to_string(i) + " is " + std::to_string(row[i]); });
    return;
  }
  if (p == IndexPrecision::fp8_e4m3) {
    for (std::int64_t i = 0; i < n; ++i) row[i] = e4m3_to_float(float_to_e4m3(row[i] / tensor_scale)) * tensor_scale;
    return;
  }
  // fp4 (NVFP4): per block of 16, scale = e4m3(amax_block / 6 / scale_of_scales) * scale_of_scales.
  // A final block shorter than 16 (n not a multiple of 16) is scaled over the elements it holds.
  for (std::int64_t b0 = 0; b0 < n; b0 += kFp4Block) {
    const std::int64_t b1 = std::min<std::int64_t>(n, b0 + kFp4Block);
    float amax = 0.0f;
    for (std::int64_t i = b0; i < b1; ++i) amax = std::fmax(amax, std::fabs(row[i]));
    const float block_scale = e4m3_to_float(float_to_e4m3(amax / kE2m1Max / tensor_scale)) * tensor_scale;
    for (std::int64_t i = b0; i < b1; ++i)
      row[i] = block_scale == 0.0f ? 0.0f : e2m1_to_float(float_to_e2m1(row[i] / block_scale)) * block_scale;
  }
}

namespace detail {

void check_precision(const std::string& op, IndexPrecision p) {
  require(p == IndexPrecision::bf16 || p == IndexPrecision::fp8_e4m3 || p == IndexPrecision::fp4_e2m1, op,
          "options.precision", [&] { return "unknown precision value " + std::to_string(static_cast<int>(p)); });
}

float precision_tensor_scale(IndexPrecision p, float amax) {
  switch (p) {
    case IndexPrecision::fp8_e4m3: return amax / kE4m3Max;
    case IndexPrecision::fp4_e2m1: return amax / (kE4m3Max * kE2m1Max);
    case IndexPrecision::bf16: return 1.0f;
  }
  return 1.0f;
}

QuantizedTensor load_quantized(const std::string& op, const std::string& name, const TensorView& t,
                               IndexPrecision p) {
  QuantizedTensor q;
  const bool three = t.ndim == 3;
  q.B = t.shape[0];
  q.L = t.shape[1];
  q.H = three ? 1 : t.shape[2];
  q.D = three ? t.shape[2] : t.shape[3];
  q.data.resize(static_cast<std::size_t>(q.B * q.L * q.H * q.D));
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(t.dtype));
  parallel_for(q.B * q.L, [&](std::int64_t bl) {
    const std::int64_t b = bl / q.L, l = bl % q.L;
    for (std::int64_t h = 0; h < q.H; ++h) {
      const std::int64_t off = b * t.stride[0] + l * t.stride[1] + (three ? 0 : h * t.stride[2]);
      float* dst = q.data.data() + (bl * q.H + h) * q.D;
      load_row(t, static_cast<const char*>(t.data) + off * es, q.D, dst);
      // A non-finite value would poison the per-tensor scale (fp8, fp4) or every score it touches.
      for (std::int64_t d = 0; d < q.D; ++d)
        require(std::isfinite(dst[d]), op, name,
                [&] { return "holds the non-finite value " + std::to_string(dst[d]) + " at " +
                    (three ? coord_string({b, l, d}) : coord_string({b, l, h, d})); });
    }
  });
  float amax = 0.0f;
  for (float x : q.data) amax = std::fmax(amax, std::fabs(x));
  q.tensor_scale = precision_tensor_scale(p, amax);
  const std::int64_t rows = q.B * q.L * q.H;
  parallel_for(rows, [&](std::int64_t r) { quantize_dequantize(q.data.data() + r * q.D, q.D, p, q.tensor_scale); });
  return q;
}

}  // namespace detail
}  // namespace sparse_attn
