// gated (BSFA): -inf thresholds against dense causal attention; finite thresholds against the
// float64 reference over the explicit mask of the blocks a float64 gate keeps (thresholds chosen
// away from every block maximum, so rounding cannot flip a decision); exact density counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  std::int64_t B, Lq, Lk, Hq, Hkv, D;
};

ProblemShape shape_of(const Case& c) {
  ProblemShape p;
  p.B = c.B;
  p.Lq = c.Lq;
  p.Lk = c.Lk;
  p.Hq = c.Hq;
  p.Hkv = c.Hkv;
  p.D = c.D;
  p.causal = true;
  return p;
}

// Geometry written out directly from the causal rule j <= i + (Lk - Lq), independent of the library.
bool block_visible(const ProblemShape& p, std::int64_t t, std::int64_t j) {
  const std::int64_t last_row = std::min(p.Lq, (t + 1) * 128) - 1;
  return j * 128 < p.Lk && j * 128 <= last_row + (p.Lk - p.Lq);
}
bool block_on_diagonal(const ProblemShape& p, std::int64_t t, std::int64_t j) {
  const std::int64_t last_key = std::min(p.Lk, (j + 1) * 128) - 1;
  return last_key > t * 128 + (p.Lk - p.Lq);
}

struct Inputs {
  HostTensor q, k, v;
};

Inputs make_inputs(const Case& c, std::uint64_t seed, DType dtype = DType::f32) {
  return {testing::random_tensor(dtype, {c.B, c.Lq, c.Hq, c.D}, seed),
          testing::random_tensor(dtype, {c.B, c.Lk, c.Hkv, c.D}, seed + 1),
          testing::random_tensor(dtype, {c.B, c.Lk, c.Hkv, c.D}, seed + 2)};
}

/// Float64 maximum of the scaled scores of an off-diagonal (fully visible) block.
double block_max64(const Inputs& in, const ProblemShape& p, double scale, std::int64_t b, std::int64_t h,
                   std::int64_t t, std::int64_t j) {
  const std::int64_t hk = h / (p.Hq / p.Hkv);
  double m = -kInf;
  for (std::int64_t i = t * 128; i < std::min(p.Lq, (t + 1) * 128); ++i)
    for (std::int64_t c = j * 128; c < std::min(p.Lk, (j + 1) * 128); ++c) {
      double dot = 0;
      for (std::int64_t d = 0; d < p.D; ++d)
        dot += testing::element(in.q, ((b * p.Lq + i) * p.Hq + h) * p.D + d) *
               testing::element(in.k, ((b * p.Lk + c) * p.Hkv + hk) * p.D + d);
      m = std::max(m, dot * scale);
    }
  return m;
}

struct Expected {
  HostTensor bits;  // BlockBits [B, Hq, Tq, W] of the kept blocks
  std::vector<std::int32_t> kept_per_tile;
  GatedStats stats;
};

/// Applies the gate in float64. `thr(h, col)` gives the thresholds.
template <class Thr>
Expected expected_gate(const Inputs& in, const ProblemShape& p, double scale, std::int64_t T, const Thr& thr) {
  const std::int64_t Tq = p.Tq(), Tk = p.Tk(), W = (Tk + 31) / 32;
  Expected e{HostTensor(DType::u32, {p.B, p.Hq, Tq, W}), {}, {}};
  auto* bits = e.bits.data<std::uint32_t>();
  std::fill(bits, bits + e.bits.numel(), 0u);
  e.kept_per_tile.assign(static_cast<std::size_t>(p.B * p.Hq * Tq), 0);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t t = 0; t < Tq; ++t)
        for (std::int64_t j = 0; j < Tk; ++j) {
          if (!block_visible(p, t, j)) continue;
          ++e.stats.visible_blocks;
          bool keep = true;
          if (!block_on_diagonal(p, t, j)) {
            ++e.stats.gated_candidates;
            keep = block_max64(in, p, scale, b, h, t, j) >= thr(h, std::min(t, T - 1));
            e.stats.gated_kept += keep;
          }
          if (!keep) continue;
          ++e.stats.kept_blocks;
          ++e.kept_per_tile[static_cast<std::size_t>((b * p.Hq + h) * Tq + t)];
          bits[((b * p.Hq + h) * Tq + t) * W + j / 32] |= 1u << (j % 32);
        }
  return e;
}

/// Thresholds [Hq, T] stored transposed ([T, Hq] memory) to exercise arbitrary strides. Each is
/// the midpoint of a gap of at least 1e-3 between float64 block maxima of its (head, column), so
/// float32 rounding cannot move any block across it. Head `closed_head` gets +inf (only the
/// diagonal survives).
struct Thresholds {
  HostTensor storage;
  TensorView view;
  double operator()(std::int64_t h, std::int64_t col) const {
    return *(view.ptr<const float>() + h * view.stride[0] + col * view.stride[1]);
  }
};

Thresholds pick_thresholds(const Inputs& in, const ProblemShape& p, double scale, std::int64_t T,
                           std::int64_t closed_head) {
  Thresholds th{HostTensor(DType::f32, {T, p.Hq}), {}};
  th.view = th.storage.view();
  std::swap(th.view.shape[0], th.view.shape[1]);
  std::swap(th.view.stride[0], th.view.stride[1]);
  float* base = th.storage.data<float>();
  for (std::int64_t h = 0; h < p.Hq; ++h)
    for (std::int64_t col = 0; col < T; ++col) {
      std::vector<double> m;
      for (std::int64_t b = 0; b < p.B; ++b)
        for (std::int64_t t = 0; t < p.Tq(); ++t)
          if (std::min(t, T - 1) == col)
            for (std::int64_t j = 0; j < p.Tk(); ++j)
              if (block_visible(p, t, j) && !block_on_diagonal(p, t, j)) m.push_back(block_max64(in, p, scale, b, h, t, j));
      std::sort(m.begin(), m.end());
      double value = 0.37;  // no candidate: any finite value
      if (h == closed_head) {
        value = kInf;
      } else if (!m.empty()) {
        value = m.front() - 1.0;  // keep everything when no gap is wide enough
        const std::size_t n = m.size();
        for (std::size_t off = 0; off < n; ++off) {  // search outwards from the median
          const std::size_t i = n / 2 + ((off % 2) ? (off + 1) / 2 : n - off / 2) % n;
          if (i >= 1 && i < n && m[i] - m[i - 1] > 1e-3) {
            value = 0.5 * (m[i] + m[i - 1]);
            break;
          }
        }
      }
      base[col * p.Hq + h] = static_cast<float>(value);
    }
  return th;
}

struct Outputs {
  HostTensor out, lse, kept;
  GatedStats stats;
};

Outputs run_gated(const Inputs& in, const ProblemShape& p, const TensorView& thresholds, DType dtype = DType::f32) {
  Outputs o{HostTensor(dtype, {p.B, p.Lq, p.Hq, p.D}), HostTensor(DType::f32, {p.B, p.Hq, p.Lq}),
            HostTensor(DType::i32, {p.B, p.Hq, p.Tq()}), {}};
  testing::poison(o.out);
  testing::poison(o.lse);
  testing::poison(o.kept);
  GatedOptions opt;
  opt.kept_per_tile = o.kept.view();
  o.stats = gated(in.q.view(), in.k.view(), in.v.view(), thresholds, o.out.view(), o.lse.view(), opt);
  return o;
}

void expect_stats_eq(const GatedStats& got, const GatedStats& want) {
  EXPECT_EQ(got.kept_blocks, want.kept_blocks);
  EXPECT_EQ(got.visible_blocks, want.visible_blocks);
  EXPECT_EQ(got.gated_candidates, want.gated_candidates);
  EXPECT_EQ(got.gated_kept, want.gated_kept);
}

class GatedShapes : public ::testing::TestWithParam<Case> {};

TEST_P(GatedShapes, NegInfThresholdsEqualDenseCausal) {
  const Case c = GetParam();
  const ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 100 + c.Lq * 7 + c.Hq);
  const std::int64_t T = 3;
  HostTensor thr(DType::f32, {c.Hq, T});
  std::fill(thr.data<float>(), thr.data<float>() + thr.numel(), -std::numeric_limits<float>::infinity());
  const Outputs o = run_gated(in, p, thr.view());

  const double scale = 1.0 / std::sqrt(double(c.D));
  const testing::Reference ref = testing::reference_attention(in.q.view(), in.k.view(), in.v.view(), AllBlocks{}, p, scale);
  ASSERT_TRUE(testing::all_finite(o.out));
  ASSERT_TRUE(testing::all_finite(o.lse, /*allow_neg_inf=*/true));
  EXPECT_LE(testing::rel_err(o.out, ref.out), 1e-5);
  EXPECT_LE(testing::lse_max_err(o.lse, ref.lse), 1e-5);

  const Expected e = expected_gate(in, p, scale, T, [](std::int64_t, std::int64_t) { return -kInf; });
  expect_stats_eq(o.stats, e.stats);
  EXPECT_EQ(o.stats.kept_blocks, o.stats.visible_blocks);
  EXPECT_DOUBLE_EQ(o.stats.density(), 1.0);
  for (std::int64_t i = 0; i < o.kept.numel(); ++i)
    ASSERT_EQ(o.kept.data<std::int32_t>()[i], e.kept_per_tile[static_cast<std::size_t>(i)]) << "tile entry " << i;
}

TEST_P(GatedShapes, FiniteThresholdsEqualMaskedReference) {
  const Case c = GetParam();
  const ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 900 + c.Lk * 3 + c.Hkv);
  const double scale = 1.0 / std::sqrt(double(c.D));
  // Fewer threshold columns than Q tiles: later tiles reuse the last column.
  const std::int64_t T = std::max<std::int64_t>(1, p.Tq() - 2);
  const Thresholds th = pick_thresholds(in, p, scale, T, /*closed_head=*/c.Hq - 1);
  const Outputs o = run_gated(in, p, th.view);
  const Expected e = expected_gate(in, p, scale, T, th);

  expect_stats_eq(o.stats, e.stats);
  // The +inf head alone guarantees skipped blocks wherever the gate has candidates.
  if (e.stats.gated_candidates > 0) EXPECT_LT(e.stats.gated_kept, e.stats.gated_candidates);
  for (std::int64_t i = 0; i < o.kept.numel(); ++i)
    ASSERT_EQ(o.kept.data<std::int32_t>()[i], e.kept_per_tile[static_cast<std::size_t>(i)]) << "tile entry " << i;

  const testing::Reference ref =
      testing::reference_attention(in.q.view(), in.k.view(), in.v.view(), BlockBits{e.bits.view()}, p, scale);
  ASSERT_TRUE(testing::all_finite(o.out));
  ASSERT_TRUE(testing::all_finite(o.lse, /*allow_neg_inf=*/true));
  EXPECT_LE(testing::rel_err(o.out, ref.out), 1e-5);
  EXPECT_LE(testing::lse_max_err(o.lse, ref.lse), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GatedShapes,
                         ::testing::Values(Case{2, 1013, 1013, 2, 1, 16},   // partial last tile, B > 1
                                           Case{1, 17, 17, 1, 1, 16},       // one partial tile
                                           Case{1, 1, 300, 2, 2, 32},       // one query at the end of the keys
                                           Case{1, 300, 1000, 2, 1, 32},    // chunked prefill, Lq < Lk
                                           Case{1, 260, 450, 16, 1, 16},    // Hq = 16 x Hkv
                                           Case{1, 400, 400, 4, 4, 64},     // Hq = Hkv
                                           Case{1, 300, 200, 2, 1, 16}));   // Lq > Lk: early rows see no key

TEST(Gated, Bf16InputsMatchReference) {
  const Case c{1, 333, 333, 2, 1, 64};
  const ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 4242, DType::bf16);
  const double scale = 1.0 / std::sqrt(double(c.D));
  const Thresholds th = pick_thresholds(in, p, scale, 2, /*closed_head=*/-1);
  const Outputs o = run_gated(in, p, th.view, DType::bf16);
  const Expected e = expected_gate(in, p, scale, 2, th);
  expect_stats_eq(o.stats, e.stats);
  const testing::Reference ref =
      testing::reference_attention(in.q.view(), in.k.view(), in.v.view(), BlockBits{e.bits.view()}, p, scale);
  // Output rounded to bf16 (8 bits of mantissa).
  EXPECT_LE(testing::rel_err(o.out, ref.out), 4e-3);
  EXPECT_LE(testing::lse_max_err(o.lse, ref.lse), 1e-4);
}

/// The same values as `t` ([B, L, H, D] contiguous) stored head-major ([B, H, L, D] memory) and
/// viewed back as [B, L, H, D] with permuted strides.
struct HeadMajor {
  HostTensor storage;
  TensorView view;
};
HeadMajor head_major(const HostTensor& t) {
  const auto& s = t.shape();
  HeadMajor h{HostTensor(t.dtype(), {s[0], s[2], s[1], s[3]}), {}};
  const float* src = t.data<float>();
  float* dst = h.storage.data<float>();
  for (std::int64_t b = 0; b < s[0]; ++b)
    for (std::int64_t l = 0; l < s[1]; ++l)
      for (std::int64_t hh = 0; hh < s[2]; ++hh)
        for (std::int64_t d = 0; d < s[3]; ++d)
          dst[((b * s[2] + hh) * s[1] + l) * s[3] + d] = src[((b * s[1] + l) * s[2] + hh) * s[3] + d];
  h.view = h.storage.view();
  std::swap(h.view.shape[1], h.view.shape[2]);
  std::swap(h.view.stride[1], h.view.stride[2]);
  return h;
}

TEST(Gated, StridedViewsGiveTheSameBits) {
  const Case c{2, 300, 400, 4, 2, 32};
  const ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 5150);
  const Thresholds th = pick_thresholds(in, p, 1.0 / std::sqrt(double(c.D)), 2, /*closed_head=*/-1);
  const Outputs want = run_gated(in, p, th.view);
  const HeadMajor q = head_major(in.q), k = head_major(in.k), v = head_major(in.v);
  HostTensor out(DType::f32, {c.B, c.Hq, c.Lq, c.D});
  testing::poison(out);
  TensorView out_view = out.view();
  std::swap(out_view.shape[1], out_view.shape[2]);
  std::swap(out_view.stride[1], out_view.stride[2]);
  const GatedStats s = gated(q.view, k.view, v.view, th.view, out_view);
  EXPECT_EQ(s.kept_blocks, want.stats.kept_blocks);
  EXPECT_EQ(s.gated_kept, want.stats.gated_kept);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t l = 0; l < c.Lq; ++l)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t d = 0; d < c.D; ++d)
          ASSERT_EQ(out.data<float>()[((b * c.Hq + h) * c.Lq + l) * c.D + d],
                    want.out.data<float>()[((b * c.Lq + l) * c.Hq + h) * c.D + d]);
}

TEST(Gated, ThresholdEqualToBlockMaxKeepsTheBlock) {
  // q = k = all ones, D = 4, scale 1: every score is exactly 4, so a threshold of 4 sits on the
  // block maximum; ">=" keeps it, the next float above drops it.
  const Case c{1, 384, 384, 1, 1, 4};
  const ProblemShape p = shape_of(c);
  Inputs in = make_inputs(c, 7);
  std::fill(in.q.data<float>(), in.q.data<float>() + in.q.numel(), 1.0f);
  std::fill(in.k.data<float>(), in.k.data<float>() + in.k.numel(), 1.0f);
  HostTensor thr(DType::f32, {1, 1});
  GatedOptions opt;
  opt.softmax_scale = 1.0f;
  HostTensor out(DType::f32, {1, c.Lq, 1, c.D});
  thr.data<float>()[0] = 4.0f;
  GatedStats s = gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), out.view(), std::nullopt, opt);
  EXPECT_EQ(s.gated_candidates, 3);  // tile 1: block 0; tile 2: blocks 0, 1
  EXPECT_EQ(s.gated_kept, 3);
  thr.data<float>()[0] = std::nextafter(4.0f, 5.0f);
  s = gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), out.view(), std::nullopt, opt);
  EXPECT_EQ(s.gated_kept, 0);
  EXPECT_EQ(s.kept_blocks, 3);  // the three diagonal blocks
  EXPECT_EQ(s.visible_blocks, 6);
}

TEST(Gated, RejectsBadThresholdsAndCounters) {
  const Case c{1, 200, 200, 2, 1, 16};
  const Inputs in = make_inputs(c, 11);
  HostTensor out(DType::f32, {1, 200, 2, 16});
  const auto expect_error = [&](const TensorView& thr, const GatedOptions& opt, const std::string& arg,
                                const std::string& fragment) {
    try {
      gated(in.q.view(), in.k.view(), in.v.view(), thr, out.view(), std::nullopt, opt);
      ADD_FAILURE() << "no error for " << arg;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), arg);
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  const GatedOptions none;
  HostTensor wrong_heads(DType::f32, {3, 2});
  std::fill(wrong_heads.data<float>(), wrong_heads.data<float>() + 6, 0.0f);
  expect_error(wrong_heads.view(), none, "thresholds", "expected shape [2, *]");
  expect_error(TensorView::contiguous(wrong_heads.data<float>(), DType::f32, {2, 0}), none, "thresholds", "at least one");
  HostTensor wrong_dtype(DType::f64, {2, 2});
  expect_error(wrong_dtype.view(), none, "thresholds", "dtype f64");
  HostTensor with_nan(DType::f32, {2, 3});
  std::fill(with_nan.data<float>(), with_nan.data<float>() + 6, 0.5f);
  with_nan.data<float>()[1 * 3 + 2] = std::numeric_limits<float>::quiet_NaN();
  expect_error(with_nan.view(), none, "thresholds", "NaN at [1, 2]");
  HostTensor good(DType::f32, {2, 1});
  std::fill(good.data<float>(), good.data<float>() + 2, 0.0f);
  HostTensor kept(DType::i32, {1, 2, 1});
  GatedOptions bad_kept;
  bad_kept.kept_per_tile = kept.view();
  expect_error(good.view(), bad_kept, "options.kept_per_tile", "expected shape [1, 2, 2]");
  GatedOptions bad_scale;
  bad_scale.softmax_scale = -1.0f;
  expect_error(good.view(), bad_scale, "softmax_scale", "finite and > 0");
}

}  // namespace
}  // namespace sparse_attn
