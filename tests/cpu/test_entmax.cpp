// alpha-entmax: outputs against a float64 entmax written here (sort-based closed forms for
// alpha = 1.5 and 2, bisection on the full row for other alphas), weights summing to one, the block
// mask against the float64 support, exact statistics, and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn {
namespace {

struct Case {
  std::int64_t B, Lq, Lk, Hq, Hkv, D;
  bool causal;
};

ProblemShape shape_of(const Case& c) {
  ProblemShape p;
  p.B = c.B;
  p.Lq = c.Lq;
  p.Lk = c.Lk;
  p.Hq = c.Hq;
  p.Hkv = c.Hkv;
  p.D = c.D;
  p.causal = c.causal;
  return p;
}

std::int64_t key_end(const ProblemShape& p, std::int64_t i) {
  if (!p.causal) return p.Lk;
  return std::clamp<std::int64_t>(i + p.Lk - p.Lq + 1, 0, p.Lk);
}

/// tau of sum_i [a_i - tau]_+^(1/(alpha-1)) = 1 in float64. For alpha = 2 and 1.5 the sort-based
/// closed form per support size s, taking the s whose tau lies in [a_(s+1), a_(s)); otherwise
/// bisection on the whole row.
double entmax_tau(std::vector<double> a, double alpha) {
  std::sort(a.begin(), a.end(), std::greater<double>());
  const std::size_t n = a.size();
  if (alpha == 2.0 || alpha == 1.5) {
    double sum = 0, sq = 0;
    for (std::size_t s = 1; s <= n; ++s) {
      sum += a[s - 1];
      sq += a[s - 1] * a[s - 1];
      double tau;
      if (alpha == 2.0) {
        tau = (sum - 1.0) / double(s);
      } else {  // s tau^2 - 2 sum tau + sq - 1 = 0, smaller root
        const double mean = sum / double(s), disc = mean * mean - (sq - 1.0) / double(s);
        if (disc < 0) continue;
        tau = mean - std::sqrt(disc);
      }
      if (tau < a[s - 1] && (s == n || tau >= a[s])) return tau;
    }
    ADD_FAILURE() << "no consistent support size";
    return 0;
  }
  const double r = 1.0 / (alpha - 1.0);
  double lo = a[0] - 1.0, hi = a[0];
  for (int it = 0; it < 200; ++it) {
    const double mid = 0.5 * (lo + hi);
    double mass = 0;
    for (double x : a)
      if (x > mid) mass += std::pow(x - mid, r);
    (mass >= 1.0 ? lo : hi) = mid;
  }
  return lo;
}

struct Reference {
  std::vector<double> out;                 // [B, Lq, Hq, D]
  std::vector<std::vector<double>> weight;  // per (b, h, i): weights over keys [0, key_end)
  std::vector<double> weight_sum;
};

Reference reference_entmax(const HostTensor& q, const HostTensor& k, const HostTensor& v, const ProblemShape& p,
                           double scale, double alpha) {
  Reference ref;
  ref.out.assign(static_cast<std::size_t>(p.B * p.Lq * p.Hq * p.D), 0.0);
  ref.weight.resize(static_cast<std::size_t>(p.B * p.Hq * p.Lq));
  ref.weight_sum.assign(ref.weight.size(), 0.0);
  const double r = 1.0 / (alpha - 1.0);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h) {
      const std::int64_t hk = h / (p.Hq / p.Hkv);
      for (std::int64_t i = 0; i < p.Lq; ++i) {
        const std::int64_t n = key_end(p, i);
        auto& w = ref.weight[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)];
        if (n == 0) continue;
        std::vector<double> a(static_cast<std::size_t>(n));
        for (std::int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < p.D; ++d)
            dot += testing::element(q, ((b * p.Lq + i) * p.Hq + h) * p.D + d) *
                   testing::element(k, ((b * p.Lk + j) * p.Hkv + hk) * p.D + d);
          a[static_cast<std::size_t>(j)] = (alpha - 1.0) * scale * dot;
        }
        const double tau = entmax_tau(a, alpha);
        w.assign(static_cast<std::size_t>(n), 0.0);
        double* o = ref.out.data() + ((b * p.Lq + i) * p.Hq + h) * p.D;
        for (std::int64_t j = 0; j < n; ++j) {
          const double x = a[static_cast<std::size_t>(j)];
          if (x <= tau) continue;
          const double pj = std::pow(x - tau, r);
          w[static_cast<std::size_t>(j)] = pj;
          ref.weight_sum[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)] += pj;
          for (std::int64_t d = 0; d < p.D; ++d) o[d] += pj * testing::element(v, ((b * p.Lk + j) * p.Hkv + hk) * p.D + d);
        }
      }
    }
  return ref;
}

struct EntmaxRun {
  HostTensor out, bits;
  EntmaxStats stats;
};

EntmaxRun run_entmax(const HostTensor& q, const HostTensor& k, const HostTensor& v, const ProblemShape& p, double alpha,
               int bins = 64) {
  EntmaxRun r{HostTensor(q.dtype(), {p.B, p.Lq, p.Hq, p.D}), HostTensor(DType::u32, {p.B, p.Hq, p.Tq(), (p.Tk() + 31) / 32}), {}};
  testing::poison(r.out);
  testing::poison(r.bits);
  EntmaxOptions opt;
  opt.alpha = static_cast<float>(alpha);
  opt.causal = p.causal;
  opt.histogram_bins = bins;
  opt.block_bits = r.bits.view();
  r.stats = entmax(q.view(), k.view(), v.view(), r.out.view(), opt);
  return r;
}

bool bit_set(const EntmaxRun& r, const ProblemShape& p, std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t j) {
  const std::int64_t W = (p.Tk() + 31) / 32;
  return (r.bits.data<std::uint32_t>()[((b * p.Hq + h) * p.Tq() + t) * W + j / 32] >> (j % 32)) & 1u;
}

/// Checks the block mask and statistics against the float64 support. Weights below `tiny` may
/// legitimately flip with float32 rounding of the scores; above it they must be in a set tile.
void check_mask_and_stats(const EntmaxRun& r, const Reference& ref, const ProblemShape& p) {
  const double tiny = 1e-6;
  const std::int64_t Tq = p.Tq(), Tk = p.Tk(), W = (Tk + 31) / 32;
  std::int64_t visible = 0, active = 0, support = 0, support_lo = 0;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t t = 0; t < Tq; ++t) {
        const std::int64_t last_row = std::min(p.Lq, (t + 1) * 128) - 1;
        std::vector<bool> needed(static_cast<std::size_t>(Tk), false), possible(static_cast<std::size_t>(Tk), false);
        for (std::int64_t i = t * 128; i <= last_row; ++i) {
          const auto& w = ref.weight[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)];
          for (std::size_t j = 0; j < w.size(); ++j) {
            if (w[j] > 0) {
              ++support;
              possible[j / 128] = true;
            }
            if (w[j] > tiny) {
              needed[j / 128] = true;
              ++support_lo;
            }
          }
        }
        for (std::int64_t j = 0; j < Tk; ++j) {
          const bool vis = key_end(p, last_row) > j * 128;
          visible += vis;
          const bool set = bit_set(r, p, b, h, t, j);
          active += set;
          if (needed[static_cast<std::size_t>(j)])
            EXPECT_TRUE(set) << "tile with weight dropped at " << b << "," << h << "," << t << "," << j;
          if (set) EXPECT_TRUE(vis) << "invisible tile marked at " << b << "," << h << "," << t << "," << j;
        }
        for (std::int64_t j = Tk; j < 32 * W; ++j) EXPECT_FALSE(bit_set(r, p, b, h, t, j)) << "stray high bit";
      }
  EXPECT_EQ(r.stats.visible_tiles, visible);
  EXPECT_EQ(r.stats.active_tiles, active);
  // The support can differ from float64 only by entries within rounding of the threshold.
  EXPECT_GE(r.stats.support, support_lo);
  EXPECT_LE(r.stats.support, support + (support - support_lo));
}

struct Param {
  Case c;
  double alpha;
};

class EntmaxShapes : public ::testing::TestWithParam<Param> {};

TEST_P(EntmaxShapes, MatchesFloat64Entmax) {
  const auto [c, alpha] = GetParam();
  const ProblemShape p = shape_of(c);
  const std::uint64_t seed = static_cast<std::uint64_t>(c.Lq * 31 + c.Lk * 7 + c.Hq + (c.causal ? 1000 : 0) + alpha * 100);
  // Spread scores (std of z about 2) so that the support is a small part of each row.
  const HostTensor q = testing::random_tensor(DType::f32, {c.B, c.Lq, c.Hq, c.D}, seed, 1.5f);
  const HostTensor k = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, seed + 1, 1.5f);
  const HostTensor v = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, seed + 2);
  const double scale = 1.0 / std::sqrt(double(c.D));
  const EntmaxRun r = run_entmax(q, k, v, p, alpha);
  const Reference ref = reference_entmax(q, k, v, p, scale, alpha);
  ASSERT_TRUE(testing::all_finite(r.out));
  EXPECT_LE(testing::rel_err(r.out, ref.out), 1e-5);
  check_mask_and_stats(r, ref, p);
  for (std::size_t i = 0; i < ref.weight.size(); ++i)
    if (!ref.weight[i].empty()) ASSERT_NEAR(ref.weight_sum[i], 1.0, 1e-9) << "reference row " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, EntmaxShapes,
    ::testing::Values(Param{{2, 300, 300, 2, 1, 32, true}, 1.5}, Param{{2, 300, 300, 2, 1, 32, true}, 2.0},
                      Param{{1, 17, 1013, 2, 2, 32, false}, 1.5}, Param{{1, 17, 1013, 2, 2, 32, false}, 2.0},
                      Param{{1, 1, 200, 2, 1, 16, true}, 1.5}, Param{{1, 1013, 1013, 1, 1, 16, true}, 2.0},
                      Param{{1, 1013, 1013, 1, 1, 16, true}, 1.5}, Param{{1, 150, 260, 16, 1, 16, true}, 1.5},
                      Param{{1, 200, 333, 2, 1, 16, false}, 1.25}, Param{{1, 200, 333, 2, 1, 16, true}, 3.0},
                      Param{{1, 300, 100, 2, 1, 16, true}, 2.0}));  // Lq > Lk: early rows see no key

TEST(Entmax, WeightsSumToOne) {
  // With v = 1 every output element is the row's sum of weights.
  const Case c{2, 260, 700, 2, 1, 32, true};
  const ProblemShape p = shape_of(c);
  const HostTensor q = testing::random_tensor(DType::f32, {c.B, c.Lq, c.Hq, c.D}, 5, 2.0f);
  const HostTensor k = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, 6);
  HostTensor v(DType::f32, {c.B, c.Lk, c.Hkv, c.D});
  std::fill(v.data<float>(), v.data<float>() + v.numel(), 1.0f);
  for (double alpha : {1.5, 2.0, 1.1, 4.0}) {
    const EntmaxRun r = run_entmax(q, k, v, p, alpha);
    for (std::int64_t i = 0; i < r.out.numel(); ++i)
      ASSERT_NEAR(r.out.data<float>()[i], 1.0f, 2e-5f) << "alpha " << alpha << " element " << i;
  }
}

TEST(Entmax, SparsemaxSkipsTilesAndBinsDoNotChangeTheResult) {
  // A tile is skippable only when none of its rows puts weight there: with spread scores each
  // sparsemax row keeps a handful of keys, so a short tile against a long context leaves most of
  // its 32 blocks empty.
  const Case c{2, 9, 4000, 2, 1, 32, true};
  const ProblemShape p = shape_of(c);
  const HostTensor q = testing::random_tensor(DType::f32, {c.B, c.Lq, c.Hq, c.D}, 77, 2.5f);
  const HostTensor k = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, 78, 2.5f);
  const HostTensor v = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, 79);
  const EntmaxRun coarse = run_entmax(q, k, v, p, 2.0, 2);
  const EntmaxRun fine = run_entmax(q, k, v, p, 2.0, 4096);
  EXPECT_LT(coarse.stats.active_tiles, coarse.stats.visible_tiles / 2);
  EXPECT_GT(coarse.stats.active_tiles, 0);
  // The histogram only narrows the candidate set; the exact threshold decides everything.
  EXPECT_EQ(coarse.stats.active_tiles, fine.stats.active_tiles);
  EXPECT_EQ(coarse.stats.support, fine.stats.support);
  for (std::int64_t i = 0; i < coarse.out.numel(); ++i) ASSERT_EQ(coarse.out.data<float>()[i], fine.out.data<float>()[i]);
  for (std::int64_t i = 0; i < coarse.bits.numel(); ++i)
    ASSERT_EQ(coarse.bits.data<std::uint32_t>()[i], fine.bits.data<std::uint32_t>()[i]);
  const Reference ref = reference_entmax(q, k, v, p, 1.0 / std::sqrt(32.0), 2.0);
  EXPECT_LE(testing::rel_err(coarse.out, ref.out), 1e-5);
  check_mask_and_stats(coarse, ref, p);
}

TEST(Entmax, Bf16Inputs) {
  const Case c{1, 200, 200, 2, 1, 64, true};
  const ProblemShape p = shape_of(c);
  const HostTensor q = testing::random_tensor(DType::bf16, {c.B, c.Lq, c.Hq, c.D}, 15);
  const HostTensor k = testing::random_tensor(DType::bf16, {c.B, c.Lk, c.Hkv, c.D}, 16);
  const HostTensor v = testing::random_tensor(DType::bf16, {c.B, c.Lk, c.Hkv, c.D}, 17);
  const EntmaxRun r = run_entmax(q, k, v, p, 1.5);
  const Reference ref = reference_entmax(q, k, v, p, 1.0 / 8.0, 1.5);
  EXPECT_LE(testing::rel_err(r.out, ref.out), 4e-3);  // output rounded to bf16
}

TEST(Entmax, RejectsBadOptions) {
  const HostTensor q = testing::random_tensor(DType::f32, {1, 40, 2, 16}, 1);
  const HostTensor k = testing::random_tensor(DType::f32, {1, 40, 1, 16}, 2);
  HostTensor out(DType::f32, {1, 40, 2, 16});
  const auto expect_error = [&](const EntmaxOptions& opt, const std::string& arg, const std::string& fragment) {
    try {
      entmax(q.view(), k.view(), k.view(), out.view(), opt);
      ADD_FAILURE() << "no error for " << arg;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  for (float alpha : {1.0f, 0.5f, -2.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    EntmaxOptions opt;
    opt.alpha = alpha;
    expect_error(opt, "options.alpha", "finite and > 1");
  }
  EntmaxOptions bins;
  bins.histogram_bins = 1;
  expect_error(bins, "options.histogram_bins", "got 1");
  HostTensor bits(DType::u32, {1, 2, 1, 2});
  EntmaxOptions bad_bits;
  bad_bits.block_bits = bits.view();
  expect_error(bad_bits, "options.block_bits", "expected shape [1, 2, 1, 1]");
  HostTensor bits_i32(DType::i32, {1, 2, 1, 1});
  bad_bits.block_bits = bits_i32.view();
  expect_error(bad_bits, "options.block_bits", "dtype i32");
}

}  // namespace
}  // namespace sparse_attn
