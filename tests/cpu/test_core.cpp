// Core pieces: 16-bit float conversions, tensor views, HostTensor ownership, attention argument
// checks and safetensors I/O.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "core/safetensors.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn {
namespace {

using ::testing::HasSubstr;

// ---- 16-bit floats -----------------------------------------------------------------------------

/// Bits (without the sign) of the nearest value, ties to even, of a binary format with `mbits`
/// stored mantissa bits and minimum normal exponent `emin`, computed in double from first
/// principles (frexp and nearbyint under the default round-to-nearest-even mode).
std::uint32_t reference_round(double a, int mbits, int emin, int emax) {
  const std::uint32_t inf = std::uint32_t((emax - emin + 2)) << mbits;
  if (std::isinf(a)) return inf;
  if (a == 0.0) return 0;
  int e2 = 0;
  std::frexp(a, &e2);
  int E = std::max(e2 - 1, emin);
  const double ulp = std::ldexp(1.0, E - mbits);
  double r = std::nearbyint(a / ulp);
  if (r == std::ldexp(1.0, mbits + 1)) {
    ++E;
    r = std::ldexp(1.0, mbits);
  }
  if (r < std::ldexp(1.0, mbits)) return static_cast<std::uint32_t>(r);  // subnormal (or zero)
  if (E > emax) return inf;
  return (std::uint32_t(E - emin + 1) << mbits) | (static_cast<std::uint32_t>(r) - (1u << mbits));
}

std::uint16_t reference_f16(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  return static_cast<std::uint16_t>(sign | reference_round(std::fabs(double(x)), 10, -14, 15));
}

std::uint16_t reference_bf16(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  return static_cast<std::uint16_t>(sign | reference_round(std::fabs(double(x)), 7, -126, 127));
}

double f16_value(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

TEST(F16, DecodesEveryPatternExactly) {
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const auto h = static_cast<std::uint16_t>(u);
    const float f = f16_to_float(h);
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f && m != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << u;
    } else if (e == 0x1f) {
      ASSERT_TRUE(std::isinf(f) && std::signbit(f) == bool(h & 0x8000)) << std::hex << u;
    } else {
      ASSERT_EQ(double(f), f16_value(h)) << std::hex << u;
      ASSERT_EQ(std::signbit(f), bool(h & 0x8000)) << std::hex << u;
    }
  }
  EXPECT_EQ(f16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(f16_to_float(0xc000), -2.0f);
}

TEST(F16, RoundTripOfEveryFinitePatternIsExact) {
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const auto h = static_cast<std::uint16_t>(u);
    if (((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff)) continue;  // NaN: checked separately
    ASSERT_EQ(float_to_f16(f16_to_float(h)), h) << std::hex << u;
  }
}

TEST(F16, TiesRoundToEvenAndNeighboursToNearest) {
  // Between every pair of adjacent finite magnitudes (and from the largest to the overflow
  // boundary 65536), the midpoint goes to the even pattern and its float neighbours to the near side.
  for (std::uint16_t lo = 0; lo < 0x7c00; ++lo) {
    const double a = f16_value(lo), b = lo + 1 < 0x7c00 ? f16_value(lo + 1) : 65536.0;
    const auto hi = static_cast<std::uint16_t>(lo + 1);  // 0x7c00 (inf) past the largest
    const float mid = static_cast<float>((a + b) / 2);    // exact: 11 significant bits + 1
    ASSERT_EQ(double(mid), (a + b) / 2);
    const std::uint16_t even = (lo & 1) ? hi : lo;
    for (float sign : {1.0f, -1.0f}) {
      const std::uint16_t s = sign < 0 ? 0x8000 : 0;
      ASSERT_EQ(float_to_f16(sign * mid), s | even) << std::hex << lo;
      ASSERT_EQ(float_to_f16(sign * std::nextafter(mid, 0.0f)), s | lo) << std::hex << lo;
      ASSERT_EQ(float_to_f16(sign * std::nextafter(mid, INFINITY)), s | hi) << std::hex << lo;
    }
  }
}

TEST(F16, OverflowNaNAndKnownValues) {
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65519.996f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // tie with 65536 rounds to even: overflow
  EXPECT_EQ(float_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(float_to_f16(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(float_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(float_to_f16(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);  // tie between 0 and the smallest subnormal
  EXPECT_EQ(float_to_f16(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(float_to_f16(0x1.8p-24f), 0x0002);  // tie between 1 and 2 ulps: even
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(float_to_f16(0.1f), 0x2e66);
  EXPECT_EQ(float_to_f16(1.0f / 3.0f), 0x3555);
  for (std::uint32_t u = 0x7c01; u < 0x8000; ++u) {
    ASSERT_TRUE(std::isnan(f16_to_float(static_cast<std::uint16_t>(u))));
    ASSERT_TRUE(std::isnan(f16_to_float(static_cast<std::uint16_t>(u | 0x8000))));
  }
  for (float nan : {std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7f800001u),
                    std::bit_cast<float>(0xffc00000u), std::bit_cast<float>(0x7fffffffu)}) {
    const std::uint16_t h = float_to_f16(nan);
    EXPECT_TRUE(std::isnan(f16_to_float(h))) << std::hex << h;
  }
}

TEST(F16, MatchesTheReferenceOnSampledFloats) {
  // Every float pattern in steps of 251 (about 17 million, all exponents and both signs) plus a
  // random low-bit offset so the rounding bits vary.
  std::mt19937 rng(7);
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    const auto bits = static_cast<std::uint32_t>(u ^ (rng() & 0x1fffu));
    const float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_f16(x), reference_f16(x)) << std::hexfloat << x;
  }
}

TEST(BF16, DecodeRoundTripAndNaN) {
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const auto h = static_cast<std::uint16_t>(u);
    const float f = bf16_to_float(h);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f), u << 16);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f)))) << std::hex << u;
    } else {
      ASSERT_EQ(float_to_bf16(f), h) << std::hex << u;
    }
  }
  // Signalling NaNs whose payload sits in the low 16 bits must not truncate to infinity.
  for (std::uint32_t payload : {1u, 0x8000u, 0xffffu}) {
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7f800000u | payload)))));
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0xff800000u | payload)))));
  }
}

TEST(BF16, TiesRoundToEvenAndOverflow) {
  for (std::uint32_t lo = 0; lo < 0x7f80; ++lo) {
    const std::uint32_t mid_bits = (lo << 16) | 0x8000u;  // exact midpoint to the next pattern
    const std::uint16_t even = (lo & 1) ? static_cast<std::uint16_t>(lo + 1) : static_cast<std::uint16_t>(lo);
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid_bits)), even) << std::hex << lo;
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid_bits - 1)), lo) << std::hex << lo;
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid_bits + 1)), lo + 1) << std::hex << lo;
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid_bits | 0x80000000u)), even | 0x8000u) << std::hex << lo;
  }
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.5f), 0xc020);
  EXPECT_EQ(round_bf16(1.0f + 0x1p-8f), 1.0f);           // tie: down to even
  EXPECT_EQ(round_bf16(1.0f + 3 * 0x1p-8f), 1.015625f);  // tie: up to even
}

TEST(BF16, MatchesTheReferenceOnSampledFloats) {
  std::mt19937 rng(11);
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    const auto bits = static_cast<std::uint32_t>(u ^ (rng() & 0x1ffffu));
    const float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16(x), reference_bf16(x)) << std::hexfloat << x;
  }
}

// ---- tensor views ------------------------------------------------------------------------------

TEST(TensorView, ContiguousStridesAndAddressing) {
  std::vector<float> buf(2 * 3 * 4);
  const TensorView v = TensorView::contiguous(buf.data(), DType::f32, {2, 3, 4});
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.stride[0], 12);
  EXPECT_EQ(v.stride[1], 4);
  EXPECT_EQ(v.stride[2], 1);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.at({1, 2, 3}), static_cast<void*>(buf.data() + 23));
  EXPECT_EQ(v.describe(), "[2, 3, 4] f32 cpu");

  TensorView t = v;  // a transposed view of the last two dims
  std::swap(t.shape[1], t.shape[2]);
  std::swap(t.stride[1], t.stride[2]);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.at({1, 3, 2}), static_cast<void*>(buf.data() + 23));

  // Extents of 1 do not constrain their stride.
  TensorView s = TensorView::contiguous(buf.data(), DType::bf16, {4, 1, 6});
  s.stride[1] = 999;
  EXPECT_TRUE(s.is_contiguous());

  std::vector<std::int64_t> shape{5, 0, 2};
  const TensorView e = TensorView::contiguous(nullptr, DType::i32, shape, Device::cuda, 3);
  EXPECT_EQ(e.numel(), 0);
  EXPECT_FALSE(e.defined());
  EXPECT_EQ(e.describe(), "[5, 0, 2] i32 cuda:3");
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::f32, {1, 2, 3, 4, 5, 6, 7}), Error);
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::f32, {2, -1}), Error);
}

TEST(TensorView, DtypeSizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  EXPECT_STREQ(dtype_name(DType::u32), "u32");
  EXPECT_STREQ(dtype_name(DType::f16), "f16");
  EXPECT_STREQ(device_name(Device::cuda), "cuda");
}

TEST(HostTensor, CopyIsDeepAndMoveTransfersStorage) {
  HostTensor a = testing::random_tensor(DType::f32, {3, 5}, 1);
  ASSERT_TRUE(a.view().defined());
  EXPECT_EQ(a.view().describe(), "[3, 5] f32 cpu");
  const float first = a.data<float>()[0];

  HostTensor b = a;
  EXPECT_NE(b.data<float>(), a.data<float>());
  EXPECT_EQ(b.view().data, static_cast<void*>(b.data<float>()));
  EXPECT_EQ(std::memcmp(a.data<float>(), b.data<float>(), 15 * sizeof(float)), 0);
  b.data<float>()[0] = first + 1.0f;
  EXPECT_EQ(a.data<float>()[0], first);

  HostTensor c(DType::i32, {1});
  c = a;
  EXPECT_EQ(c.dtype(), DType::f32);
  EXPECT_EQ(c.shape(), (std::vector<std::int64_t>{3, 5}));
  EXPECT_EQ(c.view().data, static_cast<void*>(c.data<float>()));
  EXPECT_NE(c.data<float>(), a.data<float>());
  c = c;  // self-assignment keeps the contents
  EXPECT_EQ(c.data<float>()[0], first);

  const float* storage = a.data<float>();
  HostTensor d = std::move(a);
  EXPECT_EQ(d.data<float>(), storage);  // the buffer moved, not copied
  EXPECT_EQ(d.view().data, static_cast<const void*>(storage));
  EXPECT_EQ(d.data<float>()[0], first);
  EXPECT_FALSE(a.view().defined());  // NOLINT(bugprone-use-after-move): the moved-from state is specified

  HostTensor e;
  e = std::move(d);
  EXPECT_EQ(e.data<float>(), storage);
  EXPECT_EQ(e.numel(), 15);
  EXPECT_FALSE(d.view().defined());  // NOLINT(bugprone-use-after-move)
}

// ---- attention arguments -----------------------------------------------------------------------

struct Args {
  HostTensor q, k, v, out, lse;
  Args(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv, std::int64_t D,
       DType dt = DType::bf16)
      : q(testing::random_tensor(dt, {B, Lq, Hq, D}, 1)),
        k(testing::random_tensor(dt, {B, Lk, Hkv, D}, 2)),
        v(testing::random_tensor(dt, {B, Lk, Hkv, D}, 3)),
        out(dt, {B, Lq, Hq, D}),
        lse(DType::f32, {B, Hq, Lq}) {}
};

template <class F>
void expect_error(F&& f, const std::string& argument, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected sparse_attn::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    for (const std::string& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

TEST(AttentionArgs, AcceptsValidArgumentsAndReturnsTheShape) {
  Args a(2, 17, 300, 16, 1, 64);
  AttentionOptions o;
  o.causal = true;
  const ProblemShape p = check_attention_args("dense", a.q.view(), a.k.view(), a.v.view(), a.out.view(), a.lse.view(), o);
  EXPECT_EQ(p.B, 2);
  EXPECT_EQ(p.Lq, 17);
  EXPECT_EQ(p.Lk, 300);
  EXPECT_EQ(p.Hq, 16);
  EXPECT_EQ(p.Hkv, 1);
  EXPECT_EQ(p.D, 64);
  EXPECT_TRUE(p.causal);
  EXPECT_FLOAT_EQ(resolve_scale("dense", std::nullopt, 64), 0.125f);
  EXPECT_FLOAT_EQ(resolve_scale("dense", 0.5f, 64), 0.5f);
}

TEST(AttentionArgs, DtypeMix) {
  Args a(1, 4, 4, 2, 2, 8);
  const HostTensor k32 = testing::random_tensor(DType::f32, {1, 4, 2, 8}, 9);
  expect_error([&] { check_attention_args("dense", a.q.view(), k32.view(), a.v.view(), a.out.view(), {}, {}); }, "k",
               {"dense: argument 'k'", "dtype f32 differs from q's bf16"});
  const HostTensor out16(DType::f16, {1, 4, 2, 8});
  expect_error([&] { check_attention_args("dense", a.q.view(), a.k.view(), a.v.view(), out16.view(), {}, {}); },
               "out", {"dtype f16 differs from q's bf16"});
  const HostTensor qi(DType::i32, {1, 4, 2, 8});
  expect_error([&] { check_attention_args("dense", qi.view(), a.k.view(), a.v.view(), a.out.view(), {}, {}); }, "q",
               {"dtype i32 is not supported"});
}

TEST(AttentionArgs, HeadsNotAMultiple) {
  Args a(1, 4, 4, 6, 4, 8);
  expect_error([&] { check_attention_args("dense", a.q.view(), a.k.view(), a.v.view(), a.out.view(), {}, {}); }, "k",
               {"query heads (6) must be a multiple of KV heads (4)"});
}

TEST(AttentionArgs, ShapeMismatch) {
  Args a(2, 4, 5, 2, 1, 8);
  const HostTensor v_short = testing::random_tensor(DType::bf16, {2, 4, 1, 8}, 4);
  expect_error([&] { check_attention_args("dense", a.q.view(), a.k.view(), v_short.view(), a.out.view(), {}, {}); },
               "v", {"expected shape [2, 5, 1, 8], got [2, 4, 1, 8]"});
  const HostTensor k_d = testing::random_tensor(DType::bf16, {2, 5, 1, 16}, 5);
  expect_error([&] { check_attention_args("dense", a.q.view(), k_d.view(), a.v.view(), a.out.view(), {}, {}); }, "k",
               {"expected shape [2, *, *, 8]"});
  const HostTensor q3(DType::bf16, {2, 4, 2});
  expect_error([&] { check_attention_args("dense", q3.view(), a.k.view(), a.v.view(), a.out.view(), {}, {}); }, "q",
               {"expected 4 dimensions, got 3"});
}

TEST(AttentionArgs, LseShapeAndDtype) {
  Args a(2, 4, 5, 2, 1, 8);
  const HostTensor lse_t(DType::f32, {2, 4, 2});  // [B, Lq, Hq] instead of [B, Hq, Lq]
  expect_error([&] { check_attention_args("dense", a.q.view(), a.k.view(), a.v.view(), a.out.view(), lse_t.view(), {}); },
               "lse", {"expected shape [2, 2, 4], got [2, 4, 2]"});
  const HostTensor lse_bf(DType::bf16, {2, 2, 4});
  expect_error([&] { check_attention_args("dense", a.q.view(), a.k.view(), a.v.view(), a.out.view(), lse_bf.view(), {}); },
               "lse", {"dtype bf16 is not supported"});
}

TEST(AttentionArgs, BadSoftmaxScale) {
  Args a(1, 4, 4, 2, 2, 8);
  for (float s : {0.0f, -0.5f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    AttentionOptions o;
    o.softmax_scale = s;
    expect_error([&] { check_attention_args("dense", a.q.view(), a.k.view(), a.v.view(), a.out.view(), {}, o); },
                 "softmax_scale", {"must be finite and > 0"});
  }
}

TEST(AttentionArgs, NonContiguousHeadDim) {
  Args a(1, 4, 4, 2, 2, 8);
  TensorView q = a.q.view();
  q.shape[3] = 4;
  q.stride[3] = 2;
  const HostTensor out(DType::bf16, {1, 4, 2, 4});
  const HostTensor k = testing::random_tensor(DType::bf16, {1, 4, 2, 4}, 6);
  expect_error([&] { check_attention_args("dense", q, k.view(), k.view(), out.view(), {}, {}); }, "q", {"stride 2"});
}

// ---- safetensors -------------------------------------------------------------------------------

class Safetensors : public ::testing::Test {
 protected:
  std::string path;
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = (std::filesystem::temp_directory_path() /
            ("sparse_attn_" + std::to_string(::getpid()) + "_" + info->name() + ".safetensors"))
               .string();
  }
  void TearDown() override { std::filesystem::remove(path); }

  static detail::SafetensorsEntry entry(const std::string& name, const std::string& dtype,
                                        std::vector<std::int64_t> shape, std::uint32_t seed) {
    detail::SafetensorsEntry e{name, dtype, std::move(shape), {}};
    std::int64_t n = static_cast<std::int64_t>(detail::safetensors_dtype_size(dtype));
    for (std::int64_t s : e.shape) n *= s;
    std::mt19937 rng(seed);
    e.data.resize(static_cast<std::size_t>(n));
    for (auto& b : e.data) b = static_cast<std::byte>(rng());
    return e;
  }

  static detail::SafetensorsFile sample() {
    detail::SafetensorsFile f;
    f.metadata = {{"format", "sparse_attn.test"}, {"model", "tiny \"quoted\" name"}};
    f.tensors.push_back(entry("z_first", "F32", {3, 5}, 1));
    f.tensors.push_back(entry("a_second", "BF16", {7}, 2));
    f.tensors.push_back(entry("empty", "I32", {0, 4}, 3));
    f.tensors.push_back(entry("scalar", "F64", {}, 4));
    f.tensors.push_back(entry("budgets", "I64", {3}, 5));
    f.tensors.push_back(entry("bytes", "U8", {13}, 6));
    return f;
  }

  std::vector<char> bytes() const {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  void put(const std::vector<char>& b) const {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  }
  static std::uint64_t header_len(const std::vector<char>& b) {
    std::uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= std::uint64_t(static_cast<unsigned char>(b[static_cast<std::size_t>(i)])) << (8 * i);
    return n;
  }
  /// Writes a file with the given header text (padded) and `data_bytes` bytes of data.
  void put_raw(const std::string& header, std::size_t data_bytes) const {
    std::string b(8, '\0');
    const std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i));
    b += header;
    b.append(data_bytes, '\x5a');
    put(std::vector<char>(b.begin(), b.end()));
  }
  void expect_rejected(std::initializer_list<std::string> parts) const {
    expect_error([&] { detail::read_safetensors(path); }, path, parts);
  }
};

TEST_F(Safetensors, RoundTripKeepsOrderMetadataAndBytes) {
  const detail::SafetensorsFile f = sample();
  detail::write_safetensors(path, f);
  const detail::SafetensorsFile g = detail::read_safetensors(path);
  EXPECT_EQ(g.metadata, f.metadata);
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    EXPECT_EQ(g.tensors[i].name, f.tensors[i].name);
    EXPECT_EQ(g.tensors[i].dtype, f.tensors[i].dtype);
    EXPECT_EQ(g.tensors[i].shape, f.tensors[i].shape);
    EXPECT_EQ(g.tensors[i].data, f.tensors[i].data) << f.tensors[i].name;
  }
  EXPECT_TRUE(g.contains("a_second"));
  EXPECT_FALSE(g.contains("missing"));
  EXPECT_EQ(g.get("budgets").shape, (std::vector<std::int64_t>{3}));
  expect_error([&] { g.get("missing"); }, "missing", {"safetensors", "no tensor called 'missing'"});
}

TEST_F(Safetensors, LayoutFollowsTheFormat) {
  detail::write_safetensors(path, sample());
  const std::vector<char> b = bytes();
  const std::uint64_t n = header_len(b);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, b.size());
  const std::string header(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // padded with spaces only
  EXPECT_THAT(header, HasSubstr("\"__metadata__\""));
  // Offsets are contiguous in the order written: z_first 60 bytes, then a_second 14.
  EXPECT_THAT(header, HasSubstr("\"z_first\":{\"dtype\":\"F32\",\"shape\":[3,5],\"data_offsets\":[0,60]}"));
  EXPECT_THAT(header, HasSubstr("\"a_second\":{\"dtype\":\"BF16\",\"shape\":[7],\"data_offsets\":[60,74]}"));
  EXPECT_EQ(b.size(), 8 + n + 60 + 14 + 0 + 8 + 24 + 13);
  // Raw bytes of the first tensor sit right after the header.
  const auto f = sample();
  EXPECT_EQ(std::memcmp(b.data() + 8 + n, f.tensors[0].data.data(), 60), 0);
}

TEST_F(Safetensors, ReadsAHandWrittenFile) {
  // Hand-written header with extra whitespace, key order differing from offset order and no metadata.
  put_raw(R"({ "b": {"dtype": "U32", "shape": [2], "data_offsets": [4, 12]},
               "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]} }  )",
          12);
  const detail::SafetensorsFile g = detail::read_safetensors(path);
  ASSERT_EQ(g.tensors.size(), 2u);
  EXPECT_EQ(g.tensors[0].name, "a");  // file order
  EXPECT_EQ(g.tensors[1].name, "b");
  EXPECT_TRUE(g.metadata.empty());
}

TEST_F(Safetensors, RejectsTruncatedFiles) {
  put({'\x10', 0, 0});
  expect_rejected({"too short (3 bytes)"});
  detail::write_safetensors(path, sample());
  std::vector<char> b = bytes();
  const std::uint64_t n = header_len(b);
  b.resize(8 + n / 2);  // cut inside the header
  put(b);
  expect_rejected({"header length " + std::to_string(n), "runs past the end of the file"});
  detail::write_safetensors(path, sample());
  b = bytes();
  b.resize(b.size() - 5);  // cut inside the data
  put(b);
  expect_rejected({"tensor 'bytes'", "outside the data section"});
}

TEST_F(Safetensors, RejectsCorruptHeaders) {
  detail::write_safetensors(path, sample());
  std::vector<char> b = bytes();
  b[8] = '[';  // no longer a JSON object
  put(b);
  expect_rejected({"header does not start with '{'"});
  put_raw("[1, 2]  ", 0);
  expect_rejected({"header does not start with '{'"});
  put_raw("{\"x\": 1,}", 0);
  expect_rejected({"not valid JSON"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [2]}})", 8);
  expect_rejected({"tensor 'x' has no 'data_offsets' pair"});
  put_raw(R"({"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", 8);
  expect_rejected({"unknown dtype 'Q7'"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8);
  expect_rejected({"invalid shape entry -2"});
  put_raw(R"({"__metadata__": {"k": 3}})", 0);
  expect_rejected({"__metadata__ entry 'k' is not a string"});
}

TEST_F(Safetensors, RejectsBadOffsets) {
  put_raw(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}})", 8);
  expect_rejected({"tensor 'x'", "[0, 12) outside the data section of 8 bytes"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8);
  expect_rejected({"tensor 'x' of shape [3] and dtype F32 needs 12 bytes but its offsets span 8"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
          12);
  expect_rejected({"tensor 'y'", "overlaps the previous tensor"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8);
  expect_rejected({"data bytes [0, 4) belong to no tensor"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8);
  expect_rejected({"data bytes [4, 8) belong to no tensor"});
  put_raw(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8);
  expect_rejected({"outside the data section"});
  put_raw(R"({"x": {"dtype": "U8", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 0]}})", 0);
  expect_rejected({"overflowing"});
}

// Files from a hostile user: each used to crash, read uninitialised memory or load.
TEST_F(Safetensors, RejectsHostileHeaders) {
  // 70,000 levels of nesting (a 140 kB header) are refused by the pre-scan, in bounded stack.
  put_raw(R"({"x": {"dtype": "F32", "shape": [)" + std::string(70000, '[') + std::string(70000, ']') +
              R"(], "data_offsets": [0, 0]}})",
          0);
  expect_rejected({"header nests deeper than 8 levels"});
  // The JSON parser would stop at a NUL; the header must be one object padded with spaces only.
  const std::string valid = R"({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})";
  put_raw(valid + std::string(1, '\0') + "garbage", 1);
  expect_rejected({"control byte 0x00 at offset " + std::to_string(valid.size())});
  put_raw(valid + "  x", 1);
  expect_rejected({"bytes other than space padding after its JSON object (offset " + std::to_string(valid.size() + 2)});
  put_raw(valid + "\n", 1);
  expect_rejected({"bytes other than space padding"});
  put_raw(valid + "    ", 1);
  EXPECT_EQ(detail::read_safetensors(path).tensors.size(), 1u);
  // Bytes that are not UTF-8 are reported by offset, never copied into the message.
  put_raw("{\"__metadata__\": {\"model\": \"\xff\xfe\"}}", 0);
  expect_rejected({"header byte 0xff at offset 28 is not UTF-8"});
  put_raw("{\"__metadata__\": {\"model\": \"\xed\xa0\x80\"}}", 0);  // a UTF-16 surrogate
  expect_rejected({"byte 0xed at offset 28 is not UTF-8"});
  put_raw(R"({"": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})", 0);
  expect_rejected({"empty name"});
  // Escaped control characters in a name are legal JSON; messages show them escaped.
  put_raw(R"({"a\u0001": {"dtype": "Q7", "shape": [0], "data_offsets": [0, 0]}})", 0);
  expect_rejected({"tensor 'a\\x01' has unknown dtype 'Q7'"});
}

TEST_F(Safetensors, RejectsWhatIsNotARegularFileWithinTheLimits) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  expect_error([&] { detail::read_safetensors(dir, "reader"); }, dir, {"reader", "it is a directory"});
  expect_error([&] { detail::read_safetensors("/dev/null"); }, "/dev/null", {"not a regular file"});
  detail::write_safetensors(path, sample());
  const std::uint64_t size = std::filesystem::file_size(path), n = header_len(bytes());
  detail::SafetensorsLimits limits;
  limits.max_file_bytes = size - 1;
  expect_error([&] { detail::read_safetensors(path, "safetensors", limits); }, path,
               {"file of " + std::to_string(size) + " bytes is larger than the limit of " + std::to_string(size - 1)});
  limits = {};
  limits.max_header_bytes = n - 1;
  expect_error([&] { detail::read_safetensors(path, "safetensors", limits); }, path,
               {"header length " + std::to_string(n) + " is over the limit"});
  std::vector<char> b = bytes();
  for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = '\xff';  // 2^64 - 1
  put(b);
  expect_rejected({"header length 18446744073709551615 is over the limit of 100000000 bytes"});
}

TEST_F(Safetensors, WriterRefusesWhatTheReaderWouldRefuse) {
  detail::SafetensorsFile f = sample();
  f.metadata["model"] = "\xff";
  expect_error([&] { detail::write_safetensors(path, f); }, path, {"__metadata__ entry 'model' is not UTF-8 text"});
  f = sample();
  f.tensors[0].name = "bad\xc0\x80";  // an overlong encoding
  expect_error([&] { detail::write_safetensors(path, f); }, path, {"invalid tensor name 'bad\\xc0\\x80'"});
  f.tensors[0].name = "";
  expect_error([&] { detail::write_safetensors(path, f); }, path, {"invalid tensor name ''"});
  EXPECT_EQ(detail::printable(std::string("ok \xe2\x9c\x93 \x01\xff") + std::string(100, 'x'), 16), "ok \xe2\x9c\x93 \\x01\\xffx...");
}

TEST_F(Safetensors, RejectsMissingFileAndInconsistentWrites) {
  expect_error([&] { detail::read_safetensors(path + ".absent"); }, path + ".absent", {"cannot open"});
  detail::SafetensorsFile f;
  f.tensors.push_back(entry("x", "F32", {4}, 1));
  f.tensors.back().data.pop_back();
  expect_error([&] { detail::write_safetensors(path, f); }, path, {"tensor 'x'", "needs 16 bytes but holds 15"});
  f.tensors.back() = entry("x", "F32", {4}, 1);
  f.tensors.push_back(entry("x", "F32", {1}, 2));
  expect_error([&] { detail::write_safetensors(path, f); }, path, {"duplicate tensor 'x'"});
  f.tensors.pop_back();
  f.tensors.push_back(entry("y", "U8", {1}, 2));
  f.tensors.back().dtype = "F12";
  expect_error([&] { detail::write_safetensors(path, f); }, path, {"unknown dtype 'F12'"});
  EXPECT_THROW(detail::safetensors_dtype_size("F12"), Error);
  EXPECT_EQ(detail::safetensors_dtype_size("BF16"), 2u);
  EXPECT_EQ(detail::safetensors_dtype_size("I64"), 8u);
}

}  // namespace
}  // namespace sparse_attn
