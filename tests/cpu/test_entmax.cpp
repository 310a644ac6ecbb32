// alpha-entmax: outputs against a long double entmax written here (sort-based closed forms for
// alpha = 1.5 and 2, bisection anchored at the support's smallest score for other alphas), two-key
// closed forms for alpha from 1.01 to 1000, weights summing to one, the block mask against the
// reference support, exact statistics, NaN and +inf scores, and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <initializer_list>
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

// The executor's default scale, rounded as resolve_scale rounds it.
float default_scale(std::int64_t D) { return 1.0f / std::sqrt(static_cast<float>(D)); }

std::int64_t key_end(const ProblemShape& p, std::int64_t i) {
  if (!p.causal) return p.Lk;
  return std::clamp<std::int64_t>(i + p.Lk - p.Lq + 1, 0, p.Lk);
}

/// Entmax weights of the scores z in long double: p_i = [(alpha - 1) z_i - tau]_+^(1/(alpha-1)),
/// sum p = 1. For alpha = 2 and 1.5 tau comes from the sort-based closed form per support size s
/// (the s whose tau lies in [a_(s+1), a_(s))), which needs no precision beyond long double's. For
/// other alphas the weight of the support's smallest score is far more sensitive to tau than any
/// float type resolves (about 1e-35 of a ~30 score at alpha = 30), so the support is taken where the
/// mass at tau = a_(s) is < 1 and at a_(s+1) is >= 1, and eps = a_(s) - tau is bisected on log eps,
/// with every weight written as ((alpha - 1)(z_i - z_(s)) + eps)^r: nothing cancels.
std::vector<double> entmax_weights(const std::vector<double>& z, double alpha) {
  using LD = long double;
  const std::size_t n = z.size();
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return z[x] > z[y]; });
  const LD am1 = LD(alpha) - 1, r = 1 / am1;
  auto zs = [&](std::size_t i) { return LD(z[order[i]]); };  // i-th largest score
  std::vector<double> w(n, 0.0);
  if (alpha == 2.0 || alpha == 1.5) {
    LD sum = 0, sq = 0;
    for (std::size_t s = 1; s <= n; ++s) {
      const LD a = am1 * zs(s - 1);
      sum += a;
      sq += a * a;
      LD tau;
      if (alpha == 2.0) {
        tau = (sum - 1) / LD(s);
      } else {  // s tau^2 - 2 sum tau + sq - 1 = 0, smaller root
        const LD mean = sum / LD(s), disc = mean * mean - (sq - 1) / LD(s);
        if (disc < 0) continue;
        tau = mean - std::sqrt(disc);
      }
      if (tau < a && (s == n || tau >= am1 * zs(s))) {
        for (std::size_t i = 0; i < n; ++i) {
          const LD x = am1 * LD(z[i]);
          if (x > tau) w[i] = double(std::pow(x - tau, r));
        }
        return w;
      }
    }
    ADD_FAILURE() << "no consistent support size";
    return w;
  }
  // mass with support [0, s) at eps (tau = a_(s-1) - eps).
  auto mass = [&](std::size_t s, LD eps) {
    LD m = 0;
    for (std::size_t i = 0; i < s; ++i) m += std::pow(am1 * (zs(i) - zs(s - 1)) + eps, r);
    return m;
  };
  std::size_t s = 1, s_hi = n;  // the largest s with mass(s, 0) < 1 (nondecreasing in s)
  while (s < s_hi) {
    const std::size_t mid = (s + s_hi + 1) / 2;
    if (mass(mid, 0) < 1) s = mid;
    else s_hi = mid - 1;
  }
  LD hi = 0;  // eps <= 1
  if (s < n) hi = std::min(hi, std::log(am1 * (zs(s - 1) - zs(s))));
  LD lo = std::log(std::numeric_limits<LD>::min());
  for (int it = 0; it < 120; ++it) {
    const LD mid = (lo + hi) / 2;
    (mass(s, std::exp(mid)) >= 1 ? hi : lo) = mid;
  }
  const LD eps = std::exp(hi);
  for (std::size_t i = 0; i < s; ++i) w[order[i]] = double(std::pow(am1 * (zs(i) - zs(s - 1)) + eps, r));
  return w;
}

struct Reference {
  std::vector<double> out;                 // [B, Lq, Hq, D]
  std::vector<std::vector<double>> weight;  // per (b, h, i): weights over keys [0, key_end)
  std::vector<double> weight_sum;
};

/// The scores are rounded as the executor rounds them (float32 products summed in order of d, then
/// scaled): at large alpha a weight moves by a visible amount with a score's last bit, so the
/// comparison is of the threshold and the weights, not of the score rounding.
Reference reference_entmax(const HostTensor& q, const HostTensor& k, const HostTensor& v, const ProblemShape& p,
                           float scale, double alpha) {
  Reference ref;
  ref.out.assign(static_cast<std::size_t>(p.B * p.Lq * p.Hq * p.D), 0.0);
  ref.weight.resize(static_cast<std::size_t>(p.B * p.Hq * p.Lq));
  ref.weight_sum.assign(ref.weight.size(), 0.0);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h) {
      const std::int64_t hk = h / (p.Hq / p.Hkv);
      for (std::int64_t i = 0; i < p.Lq; ++i) {
        const std::int64_t n = key_end(p, i);
        auto& w = ref.weight[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)];
        if (n == 0) continue;
        std::vector<double> z(static_cast<std::size_t>(n));
        for (std::int64_t j = 0; j < n; ++j) {
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.D; ++d)
            dot += float(testing::element(q, ((b * p.Lq + i) * p.Hq + h) * p.D + d)) *
                   float(testing::element(k, ((b * p.Lk + j) * p.Hkv + hk) * p.D + d));
          z[static_cast<std::size_t>(j)] = dot * scale;
        }
        w = entmax_weights(z, alpha);
        double* o = ref.out.data() + ((b * p.Lq + i) * p.Hq + h) * p.D;
        for (std::int64_t j = 0; j < n; ++j) {
          const double pj = w[static_cast<std::size_t>(j)];
          if (pj == 0.0) continue;
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
  const float scale = default_scale(c.D);
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
                      Param{{1, 300, 100, 2, 1, 16, true}, 2.0},  // Lq > Lk: early rows see no key
                      Param{{1, 17, 300, 2, 1, 16, false}, 1.01}, Param{{1, 200, 333, 2, 1, 16, true}, 4.0},
                      Param{{1, 200, 333, 2, 1, 16, true}, 10.0}, Param{{1, 17, 1013, 2, 2, 32, false}, 30.0},
                      Param{{1, 130, 300, 2, 1, 16, false}, 100.0}, Param{{1, 130, 300, 2, 1, 16, true}, 1000.0}));

/// With v = 1 every output element is the row's sum of weights: each must be within `tol` of 1.
void expect_weights_sum_to_one(const Case& c, std::uint64_t seed, float q_stddev, std::initializer_list<double> alphas,
                               float tol) {
  const ProblemShape p = shape_of(c);
  const HostTensor q = testing::random_tensor(DType::f32, {c.B, c.Lq, c.Hq, c.D}, seed, q_stddev);
  const HostTensor k = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, seed + 1);
  HostTensor v(DType::f32, {c.B, c.Lk, c.Hkv, c.D});
  std::fill(v.data<float>(), v.data<float>() + v.numel(), 1.0f);
  for (double alpha : alphas) {
    const EntmaxRun r = run_entmax(q, k, v, p, alpha);
    for (std::int64_t i = 0; i < r.out.numel(); ++i)
      ASSERT_NEAR(r.out.data<float>()[i], 1.0f, tol) << "alpha " << alpha << " element " << i;
  }
}

TEST(Entmax, WeightsSumToOne) {
  expect_weights_sum_to_one({2, 260, 700, 2, 1, 32, true}, 5, 2.0f, {1.5, 2.0, 1.1, 4.0, 1.01, 10.0, 30.0, 100.0, 1000.0},
                            2e-5f);
}

TEST(Entmax, ShortRowsSumToOneWithinFloatRounding) {
  // 16 keys per row: the float32 sum of the weights is within 16 roundings of the exact 1.
  expect_weights_sum_to_one({4, 16, 16, 8, 2, 16, false}, 41, 2.0f, {1.01, 1.5, 2.0, 4.0, 10.0, 30.0, 100.0, 1000.0},
                            1e-6f);
}

// Two keys with scores z1 >= z2: p1 + p2 = 1 and p1^(alpha-1) - p2^(alpha-1) = (alpha - 1)(z1 - z2)
// while that is below 1 (else p = (1, 0)). p1 is bisected on [1/2, 1] in long double, where the
// equation is well conditioned; alpha = 2 and 3 have it in closed form, p1 = (1 + (alpha - 1) dz) / 2.
double two_key_p1(double alpha, double dz) {
  using LD = long double;
  const LD am1 = LD(alpha) - 1, d = am1 * LD(dz);
  if (d >= 1) return 1.0;
  if (alpha == 2.0 || alpha == 3.0) return double((1 + d) / 2);
  LD lo = 0.5, hi = 1;
  for (int it = 0; it < 200; ++it) {
    const LD mid = (lo + hi) / 2;
    (std::pow(mid, am1) - std::pow(1 - mid, am1) < d ? lo : hi) = mid;
  }
  return double((lo + hi) / 2);
}

TEST(Entmax, TwoKeysMatchTheClosedForm) {
  // D = 2, q = (1, 0), k_j = (z_j, 0), scale 1: the scores are exactly z1 and z2; one-hot values make
  // out = (p1, p2).
  const float z1 = 1.0f;
  for (const float z2 : {0.995f, 1.0f, 0.9f, 0.9999f, 0.3f})
    for (const double alpha_in : {1.01, 1.5, 2.0, 3.0, 4.0, 10.0, 30.0, 100.0, 1000.0}) {
      const double alpha = double(float(alpha_in));  // the executor takes alpha as float
      HostTensor q(DType::f32, {1, 1, 1, 2}), k(DType::f32, {1, 2, 1, 2}), v(DType::f32, {1, 2, 1, 2});
      const float qv[] = {1, 0}, kv[] = {z1, 0, z2, 0}, vv[] = {1, 0, 0, 1};
      std::copy(qv, qv + 2, q.data<float>());
      std::copy(kv, kv + 4, k.data<float>());
      std::copy(vv, vv + 4, v.data<float>());
      HostTensor out(DType::f32, {1, 1, 1, 2});
      testing::poison(out);
      EntmaxOptions opt;
      opt.alpha = static_cast<float>(alpha);
      opt.softmax_scale = 1.0f;
      entmax(q.view(), k.view(), v.view(), out.view(), opt);
      const double p1 = two_key_p1(alpha, double(z1) - double(z2));
      const float* o = out.data<float>();
      EXPECT_NEAR(o[0], p1, 1e-6) << "alpha " << alpha << " z2 " << z2;
      EXPECT_NEAR(o[1], 1.0 - p1, 1e-6) << "alpha " << alpha << " z2 " << z2;
      EXPECT_NEAR(double(o[0]) + double(o[1]), 1.0, 1e-6) << "alpha " << alpha << " z2 " << z2;
    }
}

TEST(Entmax, NonFiniteScoresGiveNaNRows) {
  // Nonnegative q and k, then a NaN in row 5 of head 1 and a +inf in key 40: row (5, 1) and every
  // row from 40 on (those that see key 40 under the causal mask, score +inf) are NaN; the other rows
  // are as before.
  const Case c{1, 64, 64, 2, 1, 16, true};
  const ProblemShape p = shape_of(c);
  HostTensor q = testing::random_tensor(DType::f32, {c.B, c.Lq, c.Hq, c.D}, 51);
  HostTensor k = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, 52);
  const HostTensor v = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, 53);
  for (HostTensor* t : {&q, &k})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = std::fabs(t->data<float>()[i]);
  const Reference ref = reference_entmax(q, k, v, p, default_scale(c.D), 1.5);
  q.data<float>()[(5 * c.Hq + 1) * c.D + 3] = std::numeric_limits<float>::quiet_NaN();
  k.data<float>()[40 * c.D + 2] = std::numeric_limits<float>::infinity();
  const EntmaxRun r = run_entmax(q, k, v, p, 1.5);
  for (std::int64_t i = 0; i < c.Lq; ++i)
    for (std::int64_t h = 0; h < c.Hq; ++h) {
      const bool nan_row = (h == 1 && i == 5) || i >= 40;
      for (std::int64_t d = 0; d < c.D; ++d) {
        const std::size_t e = static_cast<std::size_t>((i * c.Hq + h) * c.D + d);
        if (nan_row)
          ASSERT_TRUE(std::isnan(r.out.data<float>()[e])) << "row " << i << " head " << h;
        else
          ASSERT_NEAR(r.out.data<float>()[e], ref.out[e], 1e-5) << "row " << i << " head " << h;
      }
    }
}

TEST(Entmax, ScaleOverflowGivesNaN) {
  const Case c{1, 8, 8, 1, 1, 16, false};
  const ProblemShape p = shape_of(c);
  const HostTensor q = testing::random_tensor(DType::f32, {c.B, c.Lq, c.Hq, c.D}, 61, 4.0f);
  const HostTensor k = testing::random_tensor(DType::f32, {c.B, c.Lk, c.Hkv, c.D}, 62, 4.0f);
  HostTensor out(DType::f32, {c.B, c.Lq, c.Hq, c.D});
  EntmaxOptions opt;
  opt.softmax_scale = 1e38f;  // every score of magnitude > 3.4 overflows float32
  entmax(q.view(), k.view(), k.view(), out.view(), opt);
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isnan(out.data<float>()[i])) << i;
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
  const Reference ref = reference_entmax(q, k, v, p, default_scale(32), 2.0);
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
  const Reference ref = reference_entmax(q, k, v, p, default_scale(64), 1.5);
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
