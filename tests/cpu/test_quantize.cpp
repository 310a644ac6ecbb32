// e4m3 / e2m1 conversions and the scaled round trips of the index precisions, checked against
// tables derived here from the format definitions and against brute-force nearest-value rounding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;

namespace {

// e4m3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6);
// S.1111.111 is NaN; there is no infinity.
double e4m3_table(int code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (e == 0xf && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * (m / 8.0) * std::pow(2.0, -6);
  return sign * (1.0 + m / 8.0) * std::pow(2.0, e - 7);
}

// e2m1 magnitudes, codes 0..7, written out.
constexpr double kE2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

// Nearest magnitude code in [0, n) of a monotone table; ties go to the even code; above the last
// value everything saturates to it.
int nearest_code(double a, const std::vector<double>& mags) {
  if (a >= mags.back()) return static_cast<int>(mags.size()) - 1;
  int best = 0;
  for (int c = 1; c < static_cast<int>(mags.size()); ++c) {
    const double dc = std::fabs(mags[static_cast<std::size_t>(c)] - a), db = std::fabs(mags[static_cast<std::size_t>(best)] - a);
    if (dc < db || (dc == db && (c % 2 == 0) && (best % 2 == 1))) best = c;
  }
  return best;
}

std::vector<double> e4m3_magnitudes() {
  std::vector<double> m;
  for (int c = 0; c <= 0x7e; ++c) m.push_back(e4m3_table(c));
  return m;
}

}  // namespace

TEST(E4m3, AnchorValues) {
  EXPECT_EQ(sa::e4m3_to_float(0x00), 0.0f);
  EXPECT_EQ(sa::e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(sa::e4m3_to_float(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(sa::e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(sa::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(sa::e4m3_to_float(0x40), 2.0f);
  EXPECT_EQ(sa::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(sa::e4m3_to_float(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(sa::e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(sa::e4m3_to_float(0xff)));
  EXPECT_TRUE(std::signbit(sa::e4m3_to_float(0x80)));
}

TEST(E4m3, AllCodesDecodeAndReencode) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const double want = e4m3_table(c);
    const float got = sa::e4m3_to_float(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_EQ(sa::float_to_e4m3(got), 0x7f) << "NaN encodes to 0x7f";
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(sa::float_to_e4m3(got), code) << "code " << c << " value " << got;
  }
}

TEST(E4m3, MidpointsRoundToEven) {
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = sa::e4m3_to_float(static_cast<std::uint8_t>(c)), hi = sa::e4m3_to_float(static_cast<std::uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: both have at most 4 significant bits
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(sa::float_to_e4m3(mid), even) << "midpoint " << mid;
    EXPECT_EQ(sa::float_to_e4m3(-mid), 0x80 | even) << "midpoint " << -mid;
    EXPECT_EQ(sa::float_to_e4m3(std::nextafter(mid, 0.0f)), c) << "below " << mid;
    EXPECT_EQ(sa::float_to_e4m3(std::nextafter(mid, 1e9f)), c + 1) << "above " << mid;
  }
}

TEST(E4m3, SaturatesAndHandlesSpecials) {
  for (float x : {448.0f, 448.5f, 464.0f, 464.5f, 480.0f, 1e6f, 3.0e38f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(sa::float_to_e4m3(x), 0x7e) << x;
    EXPECT_EQ(sa::float_to_e4m3(-x), 0xfe) << -x;
  }
  EXPECT_EQ(sa::float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(sa::float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(sa::float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(sa::float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(sa::float_to_e4m3(-1e-30f), 0x80);
  EXPECT_EQ(sa::float_to_e4m3(-0.0f), 0x80);
}

// Every bf16 value (all 65536 bit patterns) against brute-force nearest-even rounding.
TEST(E4m3, EveryBf16ValueMatchesBruteForce) {
  const std::vector<double> mags = e4m3_magnitudes();
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const float x = sa::bf16_to_float(static_cast<std::uint16_t>(bits));
    if (std::isnan(x)) continue;
    const int want = (std::signbit(x) ? 0x80 : 0) | nearest_code(std::fabs(static_cast<double>(x)), mags);
    ASSERT_EQ(sa::float_to_e4m3(x), want) << "x = " << x;
  }
}

TEST(E2m1, AllCodesDecodeAndReencode) {
  for (int c = 0; c < 16; ++c) {
    const double want = (c & 8 ? -1.0 : 1.0) * kE2m1[c & 7];
    const float got = sa::e2m1_to_float(static_cast<std::uint8_t>(c));
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 8) != 0) << "code " << c;
    EXPECT_EQ(sa::float_to_e2m1(got), c) << "code " << c;
  }
}

TEST(E2m1, MidpointsSaturationAndBruteForce) {
  // (value, code): the midpoints between neighbours go to the even code.
  const std::pair<float, int> cases[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4},
                                         {3.5f, 6},  {5.0f, 6},  {5.01f, 7}, {6.0f, 7},  {7.0f, 7},
                                         {100.0f, 7}, {0.2f, 0}, {0.3f, 1}, {2.6f, 5}};
  for (const auto& [x, code] : cases) {
    EXPECT_EQ(sa::float_to_e2m1(x), code) << x;
    EXPECT_EQ(sa::float_to_e2m1(-x), 8 | code) << -x;
  }
  EXPECT_EQ(sa::float_to_e2m1(std::numeric_limits<float>::infinity()), 0x7);
  EXPECT_EQ(sa::float_to_e2m1(-std::numeric_limits<float>::infinity()), 0xf);
  const std::vector<double> mags(std::begin(kE2m1), std::end(kE2m1));
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const float x = sa::bf16_to_float(static_cast<std::uint16_t>(bits));
    if (std::isnan(x)) continue;
    const int want = (std::signbit(x) ? 8 : 0) | nearest_code(std::fabs(static_cast<double>(x)), mags);
    ASSERT_EQ(sa::float_to_e2m1(x), want) << "x = " << x;
  }
}

TEST(Quantize, PrecisionNames) {
  EXPECT_STREQ(sa::precision_name(sa::IndexPrecision::bf16), "bf16");
  EXPECT_STREQ(sa::precision_name(sa::IndexPrecision::fp8_e4m3), "fp8_e4m3");
  EXPECT_STREQ(sa::precision_name(sa::IndexPrecision::fp4_e2m1), "fp4_e2m1");
}

TEST(Quantize, Bf16RoundsEachValue) {
  std::vector<float> row = {1.00390625f, 3.14159265f, -2.7182818f, 1e-3f, 65504.0f};
  std::vector<float> want;
  for (float x : row) want.push_back(sa::round_bf16(x));
  sa::quantize_dequantize(row.data(), static_cast<std::int64_t>(row.size()), sa::IndexPrecision::bf16, 123.0f);
  EXPECT_EQ(row, want);
  EXPECT_EQ(row[0], 1.0f);  // 1 + 2^-8 is the midpoint to 1 + 2^-7: ties to even
}

TEST(Quantize, Fp8HandWorked) {
  // scale 0.5: x / scale rounded to e4m3, times scale.
  std::vector<float> row = {1.3f, -300.0f, 224.0f, 0.0f, 1e-4f, 0.01f};
  // 2.6 -> 2.5 (quantum 0.25); -600 -> -448 (saturated); 448 exact; 0; 2e-4 -> 0; 0.02 -> 10 * 2^-9
  const std::vector<float> want = {1.25f, -224.0f, 224.0f, 0.0f, 0.0f, 10.0f * std::ldexp(1.0f, -9) * 0.5f};
  sa::quantize_dequantize(row.data(), 6, sa::IndexPrecision::fp8_e4m3, 0.5f);
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(row[i], want[i]) << "element " << i;
}

TEST(Quantize, Fp4BlockScalesHandWorked) {
  const float ts = 1.0f / 256.0f;  // scale-of-scales, i.e. a tensor amax of 10.5 = 6 * 448 / 256
  // Block 0: amax 3 -> scale 0.5 / ts = 128, an e4m3 value -> block scale 0.5.
  // Block 1: amax 1 -> (1/6) / ts = 42.67 -> e4m3 44 (quantum 4 in [32, 64)) -> block scale 44/256.
  std::vector<float> row = {3.0f, -1.0f, 0.2f, 0.7f, 0.0f,   1.25f, -2.2f, 0.1f,   // block 0
                            0.5f, 0.6f,  2.6f, -0.3f, 0.375f, 1.75f, -0.125f, 2.9f,
                            1.0f, -0.5f, 0.25f, 0.1f, 0.6f,  -0.8f, 0.9f,  0.03f,  // block 1
                            -1.0f, 0.5f, -0.25f, -0.1f, -0.6f, 0.8f, -0.9f, -0.03f};
  const float s1 = 44.0f / 256.0f;
  const std::vector<float> want = {
      // x / 0.5 = 6, -2, 0.4->0.5, 1.4->1.5, 0, 2.5->2 (tie, even), -4.4->-4, 0.2->0,
      3.0f, -1.0f, 0.25f, 0.75f, 0.0f, 1.0f, -2.0f, 0.0f,
      // 1, 1.2->1, 5.2->6, -0.6->-0.5, 0.75->1 (tie, even), 3.5->4 (tie, even), -0.25->-0 (tie), 5.8->6
      0.5f, 0.5f, 3.0f, -0.25f, 0.5f, 2.0f, -0.0f, 3.0f,
      // x / s1 = 5.82->6, -2.91->-3, 1.45->1.5, 0.58->0.5, 3.49->3, -4.65->-4, 5.24->6, 0.17->0
      6 * s1, -3 * s1, 1.5f * s1, 0.5f * s1, 3 * s1, -4 * s1, 6 * s1, 0.0f,
      -6 * s1, 3 * s1, -1.5f * s1, -0.5f * s1, -3 * s1, 4 * s1, -6 * s1, -0.0f};
  sa::quantize_dequantize(row.data(), 32, sa::IndexPrecision::fp4_e2m1, ts);
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(row[i], want[i]) << "element " << i;
  EXPECT_EQ(s1, 0.171875f);
}

TEST(Quantize, Fp4ZeroBlockAndPartialBlock) {
  // A zero block stays zero; a final block of 3 elements is scaled over what it holds.
  std::vector<float> row(19, 0.0f);
  row[16] = 6.0f;
  row[17] = 1.0f;
  row[18] = -2.9f;
  // amax 6 -> 1 / ts(=1/256) = 256, an e4m3 value -> block scale 1: values round straight to e2m1.
  sa::quantize_dequantize(row.data(), 19, sa::IndexPrecision::fp4_e2m1, 1.0f / 256.0f);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(row[static_cast<std::size_t>(i)], 0.0f);
  EXPECT_EQ(row[16], 6.0f);
  EXPECT_EQ(row[17], 1.0f);
  EXPECT_EQ(row[18], -3.0f);
}

TEST(Quantize, RejectsBadScale) {
  std::vector<float> row = {1.0f, 2.0f};
  try {
    sa::quantize_dequantize(row.data(), 2, sa::IndexPrecision::fp8_e4m3, -1.0f);
    FAIL() << "negative scale accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "tensor_scale");
  }
  try {
    sa::quantize_dequantize(row.data(), 2, sa::IndexPrecision::fp4_e2m1, 0.0f);
    FAIL() << "zero scale with nonzero data accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "tensor_scale");
  }
  EXPECT_THROW(sa::quantize_dequantize(row.data(), 2, sa::IndexPrecision::fp8_e4m3,
                                       std::numeric_limits<float>::quiet_NaN()),
               sa::Error);
  EXPECT_THROW(sa::quantize_dequantize(row.data(), 2, static_cast<sa::IndexPrecision>(7), 1.0f), sa::Error);
}
