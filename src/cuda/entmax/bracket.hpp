// The per-row arithmetic of the CUDA entmax's threshold passes (entmax/threshold.cu): where a score
// goes in a pass's bins, and what a row's bins say about its threshold. Host and device code: the CPU
// suite (EntmaxBracketTest) runs the same functions on scores whose threshold the float64 solver knows.
//
// Shifted units u = (alpha - 1)(z - z_max) + 1, in which tau* lies in [0, 1): the max alone has weight
// 1 at tau = 0, and a score with u <= 0 (z at least 1 / (alpha - 1) below the max) has no weight.
//
// First pass, r = 1 and 2 (alpha = 2, 1.5), while z_max is still being found: bins of width
// 1 / kSections in u (1 / (kSections (alpha - 1)) in z) on a grid fixed by the row's first visible
// max (its anchor), grid position pos(z) = (z - anchor) * c, c = kSections (alpha - 1) (16 or 32, so
// pos is exact in float64), bin index floor(pos) + kRingBase. A row keeps a ring of kRing = kSections
// + 1 bins, the bin of its running max (top) and the kSections below it: when the running max moves
// up, the bins that fall out are cleared for reuse, which loses nothing, since they lie at least
// kSections bins (u <= 0) below the max. Per bin the count and the sums of d and d^2, d = u - (the
// bin's left edge) in [0, 1 / kSections). Now and then the pass also raises the row's bottom bin to
// where f over the scores seen so far reaches 1 (ring_settled): the threshold can only be higher, so
// the scores below need no bin (on random rows this cuts the binned scores several-fold). At the end
// the ring is the layout below with lo = (floor(P) - P) / kSections in (-1 / kSections, 0],
// P = pos(z_max), and hi = lo + 1.
//
// A bracketing pass cuts the row's bracket [lo, hi] (f(lo) >= 1 > f(hi), f(tau) = sum [u - tau]_+^r)
// into kSections intervals with edges e_0 = lo .. e_kSections = hi.
//   r = 1 and 2: bin k < kSections holds the scores in [e_k, e_k+1), bin kSections those >= hi; per
//   bin the count and the sums of d and d^2, d = u - e_k >= 0. Then f at any edge is exact, summed
//   from the top bin down with every term >= 0 (no cancellation). The root's interval is the next
//   bracket; where no score lies inside it, f is a polynomial on it and tau has a closed form.
//   Other r: bin j (1 <= j < kSections) holds f(e_j) itself (their first pass finds z_max only).
// Collecting (r = 1, 2, once a pass has counted at most kCollect scores inside the bracket): the next
// pass keeps those scores themselves (d = u - lo) and the moments of the scores >= hi; f is then
// piecewise polynomial between the collected scores, and tau is solved exactly in that pass (on random
// rows the second pass finishes every row).
#pragma once

#include <cmath>

#include "cuda/common/host_device.hpp"
#include "cuda/attention/entmax_params.hpp"

namespace sparse_attn::cuda_kernels::entmax {

inline constexpr int kSections = 32;  // intervals of a bracketing pass
inline constexpr int kMaxPasses = 6;  // refining passes after the first (random rows need one)
// Bracket width where other alphas stop: 5 passes (32^-5 = 2.98e-8), about the float32 resolution of
// u near 1. A row still bracketed after the last pass (the closed-form paths whose root keeps landing
// in an interval holding scores) takes the bracket's midpoint.
inline constexpr double kGeneralTolerance = 3e-8;
inline constexpr int kCollect = 48;  // scores a row may collect inside its bracket
inline constexpr int kRing = kSections + 1;     // bins of the first pass's ring
inline constexpr int kRingBase = 2 * kRing;     // bin index of the anchor: a window's bins are >= kRing
inline constexpr double kRingLimit = 1 << 30;   // grid positions past this: the row leaves the ring

/// The K block the first pass visits at step i of its nblk (> i) visible blocks: block 0, then the last
/// visible one (the diagonal's, where causal), then 1, 2, ... A row's ring is anchored at its first
/// visible maximum and bins scores from there as the maximum rises, so the sooner the row's largest
/// scores come, the fewer scores are binned on the way; on language-model inputs they tend to sit at the
/// first keys (the attention sink) and next to the query (docs/notes/entmax.md, version 4).
SPARSE_ATTN_HD int first_pass_block(int i, int nblk) {
  if (i == 0) return 0;
  return i == 1 ? nblk - 1 : i - 1;
}

/// Whether the first pass settles its rows' bottoms after step i (1, 2, 4, 8, 16, then every 16th).
SPARSE_ATTN_HD bool settles_after(int i) { return i >= 1 && ((i & (i - 1)) == 0 || (i & 15) == 0); }

/// Whether a row's next pass collects the scores inside its bracket (power 1 or 2 only).
SPARSE_ATTN_HD bool collects(const EntmaxRow& st, int power) {
  return power != 0 && st.inside >= 0 && st.inside <= kCollect;
}

/// x rounded to a float32 that is <= x.
SPARSE_ATTN_HD float float_down(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) > x) f = nextafterf(f, -INFINITY);
  return f;
}

/// The z below which a row's pass ignores scores: the bracket's low end, rounded down.
SPARSE_ATTN_HD float z_of_lo(const EntmaxRow& st, double am1) {
  return float_down(static_cast<double>(st.z_max) + (st.lo - 1.0) / am1);
}

/// r = 1, 2: the bin of a score u > lo (up to rounding) and its d.
SPARSE_ATTN_HD int bin_of(double u, double lo, double hi, double& d) {
  if (u >= hi) {
    d = u - hi;
    return kSections;
  }
  const double w = (hi - lo) / kSections;
  int k = static_cast<int>((u - lo) / w);
  k = k < 0 ? 0 : (k > kSections - 1 ? kSections - 1 : k);
  d = fmax(u - (lo + k * w), 0.0);
  return k;
}

/// A row's threshold found: tau in shifted units -> z_tau in float32, kept below z_max (with n tied maxima
/// tau = 1 - n^(1 - alpha), 1 - 4^-15 at alpha = 16, can round z_tau up to z_max, which would leave the
/// row no weight at all; one float step below keeps the tied maxima in, with equal weights).
SPARSE_ATTN_HD void finish_row(EntmaxRow& st, double tau, double am1) {
  const float z = static_cast<float>(static_cast<double>(st.z_max) + (tau - 1.0) / am1);
  st.z_tau = z < st.z_max ? z : nextafterf(st.z_max, -INFINITY);
  st.status = EntmaxRow::kLive;
}

/// First pass: a score's grid position, (z - anchor) * c (exact: c is 16 or 32).
SPARSE_ATTN_HD double ring_pos(float z, float anchor, double c) {
  return (static_cast<double>(z) - static_cast<double>(anchor)) * c;
}

/// The bin index of grid position pos (pos <= kRingLimit).
SPARSE_ATTN_HD int ring_index(double pos) { return static_cast<int>(floor(pos)) + kRingBase; }

/// The ring slot of bin index idx (>= 0).
SPARSE_ATTN_HD int ring_slot(int idx) { return idx % kRing; }

/// The z of the left edge of bin index idx, rounded down (the bin test decides the scores at the edge).
SPARSE_ATTN_HD float ring_edge(float anchor, int idx, double c) {
  return float_down(static_cast<double>(anchor) + (idx - kRingBase) / c);
}

/// The lowest bin index a row still bins: the window's bottom (kSections below the top bin), or above
/// it the row's settled index (ring_settled).
SPARSE_ATTN_HD int ring_bottom(int top, int settled) {
  return top - kSections > settled ? top - kSections : settled;
}

/// While the first pass runs: the position k (0 .. kSections) in the ring, gathered in order by
/// `bin(k, n, s1, s2)`, of the lowest bin that can still matter. f over the scores seen so far only
/// grows as scores come (each term is >= 0 at a fixed absolute edge), so the threshold lies at or
/// above the highest edge where that f reaches 1; scores below it weigh nothing and need no bin. One
/// bin of slack under that edge absorbs the rounding of the float32 sums. The bins from the returned
/// position up must stay complete: close_row, searching from the top down, stops at or above it.
template <class Bin>
SPARSE_ATTN_HD int ring_settled(Bin bin, int power) {
  constexpr double w = 1.0 / kSections;
  double n = 0.0, a1 = 0.0, a2 = 0.0;  // moments of x = u - e_k over the bins >= k
  for (int k = kSections; k >= 1; --k) {
    int cnt;
    float s1, s2;
    bin(k, cnt, s1, s2);
    n += cnt;
    a1 += s1;
    a2 += s2;
    if ((power == 1 ? a1 : a2) >= 1.0) return k - 1;
    a2 += 2.0 * w * a1 + w * w * n;
    a1 += w * n;
  }
  return 0;
}

/// Where score z (<= the running max) goes: false below bin index `bottom` (ring_bottom), else its
/// slot and d = u - (the bin's left edge) in [0, 1 / kSections).
SPARSE_ATTN_HD bool ring_place(float z, float anchor, int bottom, double c, int& slot, float& d) {
  const double pos = ring_pos(z, anchor, c), fl = floor(pos);
  const int idx = static_cast<int>(fl) + kRingBase;
  if (idx < bottom) return false;
  slot = ring_slot(idx);
  d = static_cast<float>((pos - fl) * (1.0 / kSections));
  return true;
}

/// A row at the end of a pass, from its bins (cnt, s1, s2: kSections + 1 entries each): the next
/// bracket, or its threshold (status kLive, z_tau = z_max + (tau - 1) / (alpha - 1) in float32).
/// power: 1 (r = 1), 2 (r = 2) or 0 (other r: s1[j] = f(e_j)).
SPARSE_ATTN_HD void close_row(EntmaxRow& st, const int* cnt, const float* s1, const float* s2, int power, double am1,
                              bool last_pass) {
  const double lo = st.lo, hi = st.hi, w = (hi - lo) / kSections;
  const auto edge = [&](int k) { return k == kSections ? hi : lo + k * w; };
  const auto finish = [&](double tau) { finish_row(st, tau, am1); };
  int j = 0;  // the largest edge with f >= 1 (f(lo) >= 1 is known)
  if (power != 0) {
    // Moments (count, sum x, sum x^2) of x = u - e_k over the bins > k, from the top down: moving the
    // edge down by w adds w to every x, then bin k joins with its own d. Every term is >= 0.
    double n = cnt[kSections], a1 = s1[kSections], a2 = s2[kSections];
    double up_n = n, up1 = a1, up2 = a2;  // the moments over the bins > j, relative to e_j
    for (int k = kSections - 1; k >= 0; --k) {
      a2 += 2.0 * w * a1 + w * w * n;
      a1 += w * n;
      up_n = n, up1 = a1, up2 = a2;
      n += cnt[k];
      a1 += s1[k];
      a2 += s2[k];
      if ((power == 1 ? a1 : a2) >= 1.0 || k == 0) {
        j = k;
        break;
      }
    }
    const double e0 = edge(j), e1 = edge(j + 1);
    st.inside = cnt[j];
    if (cnt[j] == 0 || s1[j] == 0.0f) {  // no score strictly inside [e0, e1)
      // f(e0 + t) = sum over the bins > j of (x - t)^r for t in [0, e1 - e0].
      double t = 0.0;
      if (up_n > 0.0)
        t = power == 1 ? (up1 - 1.0) / up_n : (up1 - sqrt(fmax(up1 * up1 - up_n * (up2 - 1.0), 0.0))) / up_n;
      finish(e0 + fmin(fmax(t, 0.0), e1 - e0));
      return;
    }
  } else {
    for (int jj = kSections - 1; jj >= 1 && j == 0; --jj)
      if (s1[jj] >= 1.0f) j = jj;
  }
  st.lo = edge(j);
  st.hi = edge(j + 1);
  if (st.hi - st.lo < kGeneralTolerance || last_pass) {
    finish(0.5 * (st.lo + st.hi));
    return;
  }
  st.z_lo = z_of_lo(st, am1);
}

/// The first pass's verdict on a row (power 1 or 2) from its ring, gathered in order (bin k holds
/// index top - kSections + k, so bin kSections is the max's) and pos_max = ring_pos(z_max): the
/// closed form, or the bracket for the next pass. Where the max's own bin already holds f(hi) >= 1
/// (many scores tied within a bin of the max), the root lies in [hi, 1]: that is the next bracket.
SPARSE_ATTN_HD void ring_close(EntmaxRow& st, const int* cnt, const float* s1, const float* s2, double pos_max,
                               int power, double am1) {
  st.lo = (floor(pos_max) - pos_max) / kSections;
  st.hi = st.lo + 1.0;
  if ((power == 1 ? s1[kSections] : s2[kSections]) >= 1.0f) {
    st.lo = st.hi;
    st.hi = 1.0;
    st.inside = cnt[kSections];
    st.z_lo = z_of_lo(st, am1);
    return;
  }
  close_row(st, cnt, s1, s2, power, am1, false);
}

/// A collecting pass's verdict (power 1 or 2): `n`, `a1`, `a2` the count and the sums of d and d^2 of the
/// scores >= hi (d = u - hi), `d` the c collected scores inside the bracket as u - lo (sorted here,
/// descending; c <= kCollect). On [lo, hi) f(lo + t) = sum over the scores above t of (x - t)^r, with
/// x = d + (hi - lo) for those >= hi and x = d for the collected: a polynomial between consecutive
/// collected scores, solved in the segment where f crosses 1. Returns tau.
SPARSE_ATTN_HD double close_collected(EntmaxRow& st, double n, double a1, double a2, float* d, int c, int power,
                                    double am1) {
  for (int i = 1; i < c; ++i)  // insertion sort, descending
    for (int k = i; k > 0 && d[k] > d[k - 1]; --k) {
      const float x = d[k];
      d[k] = d[k - 1];
      d[k - 1] = x;
    }
  const double w = st.hi - st.lo;
  // Sums over the included scores of x and x^2 (x as above).
  double p1 = a1 + n * w, p2 = a2 + 2.0 * w * a1 + w * w * n;
  double t = 0.0, right = w;
  for (int k = 0; k <= c; ++k) {
    const double left = k < c ? fmin(static_cast<double>(d[k]), right) : 0.0;  // segment [left, right]
    const double f_left = power == 1 ? p1 - n * left : p2 - 2.0 * left * p1 + left * left * n;
    if (f_left >= 1.0 || k == c) {
      if (n > 0.0) t = power == 1 ? (p1 - 1.0) / n : (p1 - sqrt(fmax(p1 * p1 - n * (p2 - 1.0), 0.0))) / n;
      t = fmin(fmax(t, left), right);
      break;
    }
    const double x = d[k];
    n += 1.0;
    p1 += x;
    p2 += x * x;
    right = left;
  }
  finish_row(st, st.lo + t, am1);
  return st.lo + t;
}

}  // namespace sparse_attn::cuda_kernels::entmax
