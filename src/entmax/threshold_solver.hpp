// The entmax normalising threshold: given values x_1 >= x_2 >= ... with multiplicities w_i, the tau
// with sum_i w_i [x_i - tau]_+^r = 1 (r = 1 / (alpha - 1)). Used on histogram bins (weights =
// counts) for the conservative bound and on the real candidate scores (weights = 1) for the exact
// threshold.
#pragma once

#include <cmath>
#include <cstdint>

namespace sparse_attn::detail {

struct EntmaxRoot {
  double tau = 0.0;
  std::int64_t support = 0;  // number of leading values strictly above tau
};

/// sum over the first n values of w_i [x_i - tau]_+^r.
inline double entmax_mass(const double* x, const double* w, std::int64_t n, double r, double tau) {
  double s = 0.0;
  for (std::int64_t i = 0; i < n; ++i)
    if (x[i] > tau) s += (w ? w[i] : 1.0) * std::pow(x[i] - tau, r);
  return s;
}

/// x sorted descending, n >= 1, x[0] - 1 <= tau* (which holds when w[0] >= 1). w == nullptr means
/// all ones. The support is found exactly on the data (mass(x_s) < 1 <= mass(x_{s+1})), then tau is
/// solved on that support by safeguarded Newton to machine precision.
inline EntmaxRoot solve_entmax_threshold(const double* x, const double* w, std::int64_t n, double r) {
  // mass(x_i) is nondecreasing in i, so the support size is found by binary search.
  std::int64_t lo_i = 1, hi_i = n;  // mass(x_{lo_i}) < 1 always (mass(x_1) = 0)
  while (lo_i < hi_i) {
    const std::int64_t mid = (lo_i + hi_i + 1) / 2;
    if (entmax_mass(x, w, mid, r, x[mid - 1]) < 1.0) lo_i = mid;
    else hi_i = mid - 1;
  }
  const std::int64_t s = lo_i;
  // Bracket: mass(lo) >= 1 > mass(hi) on the support, with tau in [lo, hi).
  double lo = x[0] - 1.0;
  if (s < n) lo = std::fmax(lo, x[s]);
  double hi = x[s - 1];
  double tau = lo;
  for (int it = 0; it < 200; ++it) {
    double f = -1.0, df = 0.0;
    for (std::int64_t i = 0; i < s; ++i) {
      const double wi = w ? w[i] : 1.0, d = x[i] - tau;
      const double pr = std::pow(d, r);
      f += wi * pr;
      df -= wi * r * pr / d;
    }
    if (f >= 0.0) lo = tau;
    else hi = tau;
    if (f == 0.0) break;
    double next = tau - f / df;
    if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
    if (next == tau || next == lo || next == hi) break;
    tau = next;
  }
  // lo always satisfies mass(lo) >= 1, the side on which tau <= tau* holds in exact arithmetic.
  return {lo, s};
}

}  // namespace sparse_attn::detail
