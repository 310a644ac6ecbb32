// The entmax normalising threshold: given values x_1 >= x_2 >= ... with multiplicities w_i and a scale
// c > 0, the tau with sum_i w_i [c x_i - tau]_+^r = 1 (r = 1 / (alpha - 1)). Used on histogram bins
// (weights = counts, c = 1) for the conservative bound and on the real candidate scores (weights = 1,
// c = alpha - 1) for the exact threshold.
//
// tau itself is not a usable unknown. For large alpha (small r) the weight of the support's smallest
// value x_s is (c x_s - tau)^r with c x_s - tau far below the rounding of c x_s: two scores 1.0 and
// 0.995 at alpha = 30 give c x_s - tau = 3e-35 next to c x_s = 28.9, and weights 0.936 and 0.064 that
// no tau in float64 reproduces (at alpha = 10 one ulp of tau moves a weight by 0.02). So the root is
// held relative to its anchor x_s: eps = c x_s - tau > 0, solved as lambda = log eps, and every weight
// is (c (x_i - x_s) + eps)^r = exp(r logaddexp(log(c (x_i - x_s)), lambda)): the differences
// x_i - x_s are exact (or within one rounding) for float scores, nothing cancels, and nothing
// overflows or underflows (eps = 1e-3000 at alpha = 1000 is lambda = -6900). The support search and
// the root are computed in log space for the same reason (at alpha = 1.01, r = 100).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace sparse_attn::detail {

struct EntmaxRoot {
  std::int64_t support = 0;  // number of leading values in the support: exactly those >= anchor
  double anchor = 0.0;       // x_s, the support's smallest value
  double log_eps = 0.0;      // lambda = log(c x_s - tau)
  double c = 1.0, r = 1.0;

  /// The threshold tau in scaled units (c x), rounded: for bounds, not for weights.
  double tau() const { return c * anchor - std::exp(log_eps); }
  /// log of the weight of a value x >= anchor: r log(c (x - anchor) + eps).
  double log_weight(double x) const {
    const double d = c * (x - anchor);
    if (!(d > 0.0)) return r * log_eps;
    const double ld = std::log(d);
    return r * (std::max(ld, log_eps) + std::log1p(std::exp(-std::abs(ld - log_eps))));
  }
  /// The weight of value x: 0 below the anchor.
  double weight(double x) const { return x >= anchor ? std::exp(log_weight(x)) : 0.0; }
};

namespace entmax_detail {

/// Running log-sum-exp (with a second sum weighted by `s`, for derivatives).
struct LogSum {
  double m = -std::numeric_limits<double>::infinity(), sum = 0.0, wsum = 0.0;
  void add(double t, double s = 0.0) {
    if (t == -std::numeric_limits<double>::infinity()) return;
    if (t > m) {
      const double f = std::exp(m - t);
      sum *= f;
      wsum *= f;
      m = t;
    }
    const double e = std::exp(t - m);
    sum += e;
    wsum += e * s;
  }
  double log() const { return m + std::log(sum); }  // -inf when nothing was added
};

inline double log_w(const double* w, std::int64_t i) { return w ? std::log(w[i]) : 0.0; }

}  // namespace entmax_detail

/// x sorted descending, n >= 1, w[0] >= 1 when given (w == nullptr means all ones), c > 0, r > 0.
/// The support is found exactly on the data (the largest s with mass(tau = c x_s) < 1: ties with
/// x_s are in), then lambda is solved on that support by safeguarded Newton on the log-mass to
/// float64 precision, from the side where the mass is >= 1 (tau <= tau*, for the bound's sake).
inline EntmaxRoot solve_entmax_threshold(const double* x, const double* w, std::int64_t n, double r, double c) {
  using entmax_detail::LogSum;
  using entmax_detail::log_w;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // log of the mass at tau = c x_k: sum over i < k of w_i (c (x_i - x_k))^r; nondecreasing in k.
  const auto log_mass_at = [&](std::int64_t k) {
    LogSum s;
    for (std::int64_t i = 0; i < k && x[i] > x[k]; ++i) s.add(log_w(w, i) + r * std::log(c * (x[i] - x[k])));
    return s.log();
  };
  std::int64_t lo_i = 0, hi_i = n - 1;  // log_mass_at(0) = -inf < 0
  while (lo_i < hi_i) {
    const std::int64_t mid = (lo_i + hi_i + 1) / 2;
    if (log_mass_at(mid) < 0.0) lo_i = mid;
    else hi_i = mid - 1;
  }
  EntmaxRoot root;
  root.support = lo_i + 1;
  root.anchor = x[lo_i];
  root.c = c;
  root.r = r;
  const std::int64_t s = root.support;

  std::vector<double> ld(static_cast<std::size_t>(s));  // log(c (x_i - anchor)), -inf for ties
  for (std::int64_t i = 0; i < s; ++i) ld[static_cast<std::size_t>(i)] = std::log(c * (x[i] - root.anchor));
  // G(lambda) = log of the mass, and its derivative r * sum(p_i sigma_i) / sum(p_i) with
  // sigma_i = eps / (d_i + eps) (1 for the anchor, so G' > 0).
  const auto eval = [&](double lam, double& g, double& dg) {
    LogSum sum;
    for (std::int64_t i = 0; i < s; ++i) {
      const double li = ld[static_cast<std::size_t>(i)];
      const double L = li == -kInf ? lam : std::max(li, lam) + std::log1p(std::exp(-std::abs(li - lam)));
      sum.add(log_w(w, i) + r * L, std::exp(lam - L));
    }
    g = sum.log();
    dg = r * sum.wsum / sum.sum;
  };

  // eps <= 1 (the largest value alone: w_1 (d_1 + eps)^r <= 1) and eps <= c (x_s - x_{s+1}) (tau
  // stays at or above the next value), so G(hi) >= 0. G(-inf) = log_mass_at(s - 1) < 0: step down
  // from hi by doubling distances until G < 0, which brackets lambda within a factor of two.
  double hi = 0.0;
  if (s < n) hi = std::min(hi, std::log(c * (root.anchor - x[s])));
  double g = 0.0, dg = 0.0;
  double lo = hi - 1.0;
  for (double step = 1.0;; step *= 2.0) {
    lo = hi - step;
    eval(lo, g, dg);
    if (g < 0.0 || !std::isfinite(lo)) break;
    hi = lo;
  }
  double lam = hi;
  for (int it = 0; it < 200; ++it) {
    eval(lam, g, dg);
    if (g >= 0.0) hi = lam;
    else lo = lam;
    if (g == 0.0) break;
    double next = lam - g / dg;
    if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
    if (next == lam || next == lo || next == hi) break;
    lam = next;
  }
  root.log_eps = hi;
  return root;
}

}  // namespace sparse_attn::detail
