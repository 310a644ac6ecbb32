#include "common/testing.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/cpu.hpp"
#include <gtest/gtest.h>

namespace sparse_attn::testing {

HostTensor random_tensor(DType dtype, std::vector<std::int64_t> shape, std::uint64_t seed, float stddev) {
  HostTensor t(dtype, std::move(shape));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  const TensorView& v = t.view();
  const std::size_t es = dtype_size(dtype);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    float x = dist(rng);
    if (x == 0.0f) x = 1e-3f;
    detail::store_float(v, static_cast<char*>(v.data) + i * static_cast<std::int64_t>(es), x);
  }
  return t;
}

void poison(HostTensor& t) {
  const TensorView& v = t.view();
  const std::size_t es = dtype_size(v.dtype);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    char* p = static_cast<char*>(v.data) + i * static_cast<std::int64_t>(es);
    switch (v.dtype) {
      case DType::i32: *reinterpret_cast<std::int32_t*>(p) = 0x7fffffff; break;
      case DType::u32: *reinterpret_cast<std::uint32_t*>(p) = 0xffffffffu; break;
      case DType::u8: *reinterpret_cast<std::uint8_t*>(p) = 0xff; break;
      default: detail::store_float(v, p, std::numeric_limits<float>::quiet_NaN()); break;
    }
  }
}

double element(const HostTensor& t, std::int64_t i) {
  const TensorView& v = t.view();
  const char* p = static_cast<const char*>(v.data) + i * static_cast<std::int64_t>(dtype_size(v.dtype));
  if (v.dtype == DType::f64) return *reinterpret_cast<const double*>(p);
  return detail::load_float(v, p);
}

bool all_finite(const HostTensor& t, bool allow_neg_inf) {
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double x = element(t, i);
    if (std::isnan(x)) return false;
    if (std::isinf(x) && !(allow_neg_inf && x < 0)) return false;
  }
  return true;
}

Reference reference_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                              const Selection& selection, const ProblemShape& p, double scale) {
  Reference r;
  r.out.assign(static_cast<std::size_t>(p.B * p.Lq * p.Hq * p.D), 0.0);
  r.lse.assign(static_cast<std::size_t>(p.B * p.Hq * p.Lq), -std::numeric_limits<double>::infinity());
  const std::int64_t group = p.Hq / p.Hkv;
  detail::parallel_for(p.B * p.Hq, [&](std::int64_t bh) {
    const std::int64_t b = bh / p.Hq, h = bh % p.Hq, hk = h / group;
    std::vector<std::uint8_t> row(static_cast<std::size_t>(p.Lk));
    std::vector<float> qf(static_cast<std::size_t>(p.D)), kf(static_cast<std::size_t>(p.D));
    std::vector<double> s(static_cast<std::size_t>(p.Lk)), acc(static_cast<std::size_t>(p.D));
    for (std::int64_t i = 0; i < p.Lq; ++i) {
      selection_row(selection, p, b, h, i, row.data());
      detail::load_bhld(q, b, i, h, qf.data());
      double m = -std::numeric_limits<double>::infinity();
      bool poisoned = false;  // a NaN or +inf score among the visible keys: the row is NaN (docs/design.md §2)
      for (std::int64_t j = 0; j < p.Lk; ++j) {
        if (!row[static_cast<std::size_t>(j)]) continue;
        detail::load_bhld(k, b, j, hk, kf.data());
        double dot = 0;
        for (std::int64_t d = 0; d < p.D; ++d) dot += double(qf[static_cast<std::size_t>(d)]) * kf[static_cast<std::size_t>(d)];
        s[static_cast<std::size_t>(j)] = dot * scale;
        poisoned = poisoned || std::isnan(s[static_cast<std::size_t>(j)]) || s[static_cast<std::size_t>(j)] == std::numeric_limits<double>::infinity();
        m = std::max(m, s[static_cast<std::size_t>(j)]);
      }
      if (poisoned) {
        const std::size_t o = static_cast<std::size_t>(((b * p.Lq + i) * p.Hq + h) * p.D);
        std::fill(r.out.begin() + static_cast<std::ptrdiff_t>(o), r.out.begin() + static_cast<std::ptrdiff_t>(o + p.D),
                  std::numeric_limits<double>::quiet_NaN());
        r.lse[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      if (m == -std::numeric_limits<double>::infinity()) continue;  // sees no key: out 0, lse -inf
      double denom = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t j = 0; j < p.Lk; ++j) {
        if (!row[static_cast<std::size_t>(j)]) continue;
        const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
        denom += w;
        detail::load_bhld(v, b, j, hk, kf.data());
        for (std::int64_t d = 0; d < p.D; ++d) acc[static_cast<std::size_t>(d)] += w * kf[static_cast<std::size_t>(d)];
      }
      const std::size_t o = static_cast<std::size_t>(((b * p.Lq + i) * p.Hq + h) * p.D);
      for (std::int64_t d = 0; d < p.D; ++d) r.out[o + static_cast<std::size_t>(d)] = acc[static_cast<std::size_t>(d)] / denom;
      r.lse[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)] = m + std::log(denom);
    }
  });
  return r;
}

double rel_err(const HostTensor& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    const double x = element(out, i);
    if (std::isnan(x)) return std::numeric_limits<double>::infinity();
    const double d = x - ref[static_cast<std::size_t>(i)];
    num += d * d;
    den += ref[static_cast<std::size_t>(i)] * ref[static_cast<std::size_t>(i)];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

double max_abs_err(const HostTensor& out, const std::vector<double>& ref) {
  double m = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    const double x = element(out, i);
    if (std::isnan(x)) return std::numeric_limits<double>::infinity();
    m = std::max(m, std::abs(x - ref[static_cast<std::size_t>(i)]));
  }
  return m;
}

double lse_max_err(const HostTensor& lse, const std::vector<double>& ref) {
  double m = 0;
  for (std::int64_t i = 0; i < lse.numel(); ++i) {
    const double x = element(lse, i), r = ref[static_cast<std::size_t>(i)];
    if (std::isnan(x)) return std::numeric_limits<double>::infinity();
    if (std::isinf(r) || std::isinf(x)) {
      if (x != r) return std::numeric_limits<double>::infinity();
      continue;
    }
    m = std::max(m, std::abs(x - r));
  }
  return m;
}

std::int64_t expect_empty_rows(const HostTensor& out, const HostTensor& lse, const Reference& ref, const std::string& what) {
  const auto& os = out.shape();
  const std::int64_t B = os[0], Lq = os[1], Hq = os[2], D = os[3];
  std::int64_t empty = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Lq; ++i) {
        const std::int64_t li = (b * Hq + h) * Lq + i;
        if (!std::isinf(ref.lse[static_cast<std::size_t>(li)])) continue;
        ++empty;
        const double l = element(lse, li);
        if (!(std::isinf(l) && l < 0)) {
          ADD_FAILURE() << what << ": lse of (b " << b << ", head " << h << ", query " << i << ") sees no key but is " << l;
          return empty;
        }
        for (std::int64_t e = 0; e < D; ++e)
          if (element(out, ((b * Lq + i) * Hq + h) * D + e) != 0.0) {
            ADD_FAILURE() << what << ": out of (b " << b << ", head " << h << ", query " << i
                          << ") sees no key but element " << e << " is " << element(out, ((b * Lq + i) * Hq + h) * D + e);
            return empty;
          }
      }
  return empty;
}

void expect_gated_stats_eq(const GatedStats& got, const GatedStats& want) {
  EXPECT_EQ(got.kept_blocks, want.kept_blocks);
  EXPECT_EQ(got.visible_blocks, want.visible_blocks);
  EXPECT_EQ(got.gated_candidates, want.gated_candidates);
  EXPECT_EQ(got.gated_kept, want.gated_kept);
}

}  // namespace sparse_attn::testing
