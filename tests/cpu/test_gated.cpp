// gated (BSFA): -inf thresholds against dense causal attention; finite thresholds against the
// float64 reference over the explicit mask of the blocks a float64 gate keeps (thresholds chosen
// away from every block maximum, so rounding cannot flip a decision); exact density counters; the
// gate tile of kGateRows queries and the sink blocks (docs/design.md §5.5).
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

// Geometry written out directly from the causal rule j <= i + (Lk - Lq), independent of the library:
// gate tile t holds queries [64 t, 64 t + 64), block j keys [128 j, 128 j + 128).
constexpr std::int64_t kRows = 64;
std::int64_t gate_tiles(const ProblemShape& p) { return (p.Lq + kRows - 1) / kRows; }
bool block_visible(const ProblemShape& p, std::int64_t t, std::int64_t j) {
  const std::int64_t last_row = std::min(p.Lq, (t + 1) * kRows) - 1;
  return j * 128 < p.Lk && j * 128 <= last_row + (p.Lk - p.Lq);
}
bool block_on_diagonal(const ProblemShape& p, std::int64_t t, std::int64_t j) {
  const std::int64_t last_key = std::min(p.Lk, (j + 1) * 128) - 1;
  return last_key > t * kRows + (p.Lk - p.Lq);
}
/// Kept whatever its maximum: on the diagonal or one of the first `sinks` blocks.
bool block_forced(const ProblemShape& p, std::int64_t t, std::int64_t j, std::int64_t sinks) {
  return j < sinks || block_on_diagonal(p, t, j);
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
  for (std::int64_t i = t * kRows; i < std::min(p.Lq, (t + 1) * kRows); ++i)
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
  HostTensor bits;  // bit sets [B, Hq, Tg, W] of the blocks each gate tile keeps
  std::vector<std::int32_t> kept_per_tile;
  GatedStats stats;
};

/// Applies the gate in float64. `thr(h, col)` gives the thresholds.
template <class Thr>
Expected expected_gate(const Inputs& in, const ProblemShape& p, double scale, std::int64_t T, const Thr& thr,
                       std::int64_t sinks = 1) {
  const std::int64_t Tg = gate_tiles(p), Tk = p.Tk(), W = (Tk + 31) / 32;
  Expected e{HostTensor(DType::u32, {p.B, p.Hq, Tg, W}), {}, {}};
  auto* bits = e.bits.data<std::uint32_t>();
  std::fill(bits, bits + e.bits.numel(), 0u);
  e.kept_per_tile.assign(static_cast<std::size_t>(p.B * p.Hq * Tg), 0);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t t = 0; t < Tg; ++t)
        for (std::int64_t j = 0; j < Tk; ++j) {
          if (!block_visible(p, t, j)) continue;
          ++e.stats.visible_blocks;
          bool keep = true;
          if (!block_forced(p, t, j, sinks)) {
            ++e.stats.gated_candidates;
            keep = block_max64(in, p, scale, b, h, t, j) >= thr(h, std::min(t, T - 1));
            e.stats.gated_kept += keep;
          }
          if (!keep) continue;
          ++e.stats.kept_blocks;
          ++e.kept_per_tile[static_cast<std::size_t>((b * p.Hq + h) * Tg + t)];
          bits[((b * p.Hq + h) * Tg + t) * W + j / 32] |= 1u << (j % 32);
        }
  return e;
}

/// Dense causal attention over the blocks kept per gate tile (`bits` [B, Hq, Tg, W]), float64 out
/// [B, Lq, Hq, D] and lse [B, Hq, Lq]: written directly, independent of the library.
struct GateReference {
  std::vector<double> out, lse;
};
GateReference gate_reference(const Inputs& in, const ProblemShape& p, double scale, const HostTensor& bits) {
  const std::int64_t Tg = gate_tiles(p), W = bits.shape()[3], G = p.Hq / p.Hkv;
  GateReference r{std::vector<double>(static_cast<std::size_t>(p.B * p.Lq * p.Hq * p.D), 0.0),
                  std::vector<double>(static_cast<std::size_t>(p.B * p.Hq * p.Lq), -kInf)};
  std::vector<double> s(static_cast<std::size_t>(p.Lk));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Lq; ++i) {
        const std::int64_t t = i / kRows, hk = h / G;
        const std::uint32_t* row_bits = bits.data<std::uint32_t>() + ((b * p.Hq + h) * Tg + t) * W;
        double m = -kInf;
        for (std::int64_t c = 0; c < p.Lk; ++c) {
          const std::int64_t j = c / 128;
          const bool on = c <= i + (p.Lk - p.Lq) && ((row_bits[j / 32] >> (j % 32)) & 1u);
          double dot = -kInf;
          if (on) {
            dot = 0;
            for (std::int64_t d = 0; d < p.D; ++d)
              dot += testing::element(in.q, ((b * p.Lq + i) * p.Hq + h) * p.D + d) *
                     testing::element(in.k, ((b * p.Lk + c) * p.Hkv + hk) * p.D + d);
            dot *= scale;
          }
          s[static_cast<std::size_t>(c)] = dot;
          m = std::max(m, dot);
        }
        if (m == -kInf) continue;  // no key: out 0, lse -inf
        double l = 0;
        double* o = r.out.data() + ((b * p.Lq + i) * p.Hq + h) * p.D;
        for (std::int64_t c = 0; c < p.Lk; ++c) {
          const double w = std::exp(s[static_cast<std::size_t>(c)] - m);
          if (w == 0) continue;
          l += w;
          for (std::int64_t d = 0; d < p.D; ++d) o[d] += w * testing::element(in.v, ((b * p.Lk + c) * p.Hkv + hk) * p.D + d);
        }
        for (std::int64_t d = 0; d < p.D; ++d) o[d] /= l;
        r.lse[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)] = m + std::log(l);
      }
  return r;
}

/// max |got - want| / max |want| over out, and max |got - want| over the finite lse.
void expect_matches(const HostTensor& out, const HostTensor& lse, const GateReference& r, double out_tol, double lse_tol) {
  double err = 0, ref = 0, lse_err = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    err = std::max(err, std::abs(testing::element(out, i) - r.out[static_cast<std::size_t>(i)]));
    ref = std::max(ref, std::abs(r.out[static_cast<std::size_t>(i)]));
  }
  for (std::int64_t i = 0; i < lse.numel(); ++i) {
    const double want = r.lse[static_cast<std::size_t>(i)], got = lse.data<float>()[i];
    if (want == -kInf) {
      EXPECT_EQ(got, -kInf) << "lse " << i;
      continue;
    }
    lse_err = std::max(lse_err, std::abs(got - want));
  }
  EXPECT_LE(err / std::max(ref, 1e-30), out_tol);
  EXPECT_LE(lse_err, lse_tol);
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
        for (std::int64_t t = 0; t < gate_tiles(p); ++t)
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

Outputs run_gated(const Inputs& in, const ProblemShape& p, const TensorView& thresholds, DType dtype = DType::f32,
                  std::int64_t sinks = 1) {
  Outputs o{HostTensor(dtype, {p.B, p.Lq, p.Hq, p.D}), HostTensor(DType::f32, {p.B, p.Hq, p.Lq}),
            HostTensor(DType::i32, {p.B, p.Hq, gate_tiles(p)}), {}};
  testing::poison(o.out);
  testing::poison(o.lse);
  testing::poison(o.kept);
  GatedOptions opt;
  opt.kept_per_tile = o.kept.view();
  opt.sink_blocks = sinks;
  o.stats = gated(in.q.view(), in.k.view(), in.v.view(), thresholds, o.out.view(), o.lse.view(), opt);
  return o;
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
  testing::expect_gated_stats_eq(o.stats, e.stats);
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
  // Fewer threshold columns than gate tiles: later tiles reuse the last column.
  const std::int64_t T = std::max<std::int64_t>(1, gate_tiles(p) - 3);
  const Thresholds th = pick_thresholds(in, p, scale, T, /*closed_head=*/c.Hq - 1);
  for (const std::int64_t sinks : {0, 1, 2}) {
    SCOPED_TRACE("sink_blocks " + std::to_string(sinks));
    const Outputs o = run_gated(in, p, th.view, DType::f32, sinks);
    const Expected e = expected_gate(in, p, scale, T, th, sinks);

    testing::expect_gated_stats_eq(o.stats, e.stats);
    // The +inf head alone guarantees skipped blocks wherever the gate has candidates.
    if (e.stats.gated_candidates > 0) EXPECT_LT(e.stats.gated_kept, e.stats.gated_candidates);
    for (std::int64_t i = 0; i < o.kept.numel(); ++i)
      ASSERT_EQ(o.kept.data<std::int32_t>()[i], e.kept_per_tile[static_cast<std::size_t>(i)]) << "tile entry " << i;

    ASSERT_TRUE(testing::all_finite(o.out));
    ASSERT_TRUE(testing::all_finite(o.lse, /*allow_neg_inf=*/true));
    expect_matches(o.out, o.lse, gate_reference(in, p, scale, e.bits), 1e-5, 1e-5);
  }
}

TEST(Gated, SinkBlocksAreKeptAtAnyThreshold) {
  // +inf thresholds: only the diagonal and the sinks survive, whatever the scores.
  const Case c{1, 700, 900, 2, 1, 16};
  const ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 31);
  HostTensor thr(DType::f32, {c.Hq, 1});
  std::fill(thr.data<float>(), thr.data<float>() + thr.numel(), std::numeric_limits<float>::infinity());
  for (const std::int64_t sinks : {0, 1, 3, 100}) {
    const Outputs o = run_gated(in, p, thr.view(), DType::f32, sinks);
    EXPECT_EQ(o.stats.gated_kept, 0);
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t t = 0; t < gate_tiles(p); ++t) {
        std::int64_t want = 0;
        for (std::int64_t j = 0; j < p.Tk(); ++j) want += block_visible(p, t, j) && block_forced(p, t, j, sinks);
        EXPECT_EQ(o.kept.data<std::int32_t>()[h * gate_tiles(p) + t], want) << "sinks " << sinks << " tile " << t;
      }
    // Rows whose visible keys lie in the sinks see them: at 100 sinks every block is kept.
    if (sinks == 100) EXPECT_EQ(o.stats.kept_blocks, o.stats.visible_blocks);
    if (sinks == 100) EXPECT_EQ(o.stats.gated_candidates, 0);
  }
}

TEST(Gated, GateTilesOfOneQTileDecideApart) {
  // Rows 0..63 and 64..127 of every Q tile get different queries: block 0 of each gate tile has a
  // maximum of its own, and a threshold between them keeps it for one gate tile and not the other.
  const Case c{1, 512, 512, 1, 1, 8};
  const ProblemShape p = shape_of(c);
  Inputs in = make_inputs(c, 5);
  float* q = in.q.data<float>();
  for (std::int64_t i = 0; i < c.Lq; ++i)
    for (std::int64_t d = 0; d < c.D; ++d) q[i * c.D + d] = ((i / 64) % 2) ? 0.0f : 1.0f;
  float* k = in.k.data<float>();
  for (std::int64_t i = 0; i < c.Lk * c.D; ++i) k[i] = 0.5f;  // every score of a row: 4 or 0
  HostTensor thr(DType::f32, {1, 1});
  thr.data<float>()[0] = 1.0f;
  GatedOptions opt;
  opt.softmax_scale = 1.0f;
  opt.sink_blocks = 0;
  HostTensor out(DType::f32, {1, c.Lq, 1, c.D}), kept(DType::i32, {1, 1, gate_tiles(p)});
  opt.kept_per_tile = kept.view();
  const GatedStats s = gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), out.view(), std::nullopt, opt);
  for (std::int64_t t = 0; t < gate_tiles(p); ++t) {
    std::int64_t diag = 0, cand = 0;
    for (std::int64_t j = 0; j < p.Tk(); ++j)
      if (block_visible(p, t, j)) (block_on_diagonal(p, t, j) ? diag : cand) += 1;
    // Even gate tiles score 4 >= 1 (kept), odd ones 0 < 1 (skipped).
    EXPECT_EQ(kept.data<std::int32_t>()[t], diag + (t % 2 == 0 ? cand : 0)) << "gate tile " << t;
  }
  EXPECT_GT(s.gated_candidates, s.gated_kept);
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
  testing::expect_gated_stats_eq(o.stats, e.stats);
  // Output rounded to bf16 (8 bits of mantissa).
  expect_matches(o.out, o.lse, gate_reference(in, p, scale, e.bits), 4e-3, 1e-4);
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
  Inputs in = make_inputs(c, 7);
  std::fill(in.q.data<float>(), in.q.data<float>() + in.q.numel(), 1.0f);
  std::fill(in.k.data<float>(), in.k.data<float>() + in.k.numel(), 1.0f);
  HostTensor thr(DType::f32, {1, 1});
  GatedOptions opt;
  opt.softmax_scale = 1.0f;
  opt.sink_blocks = 0;
  HostTensor out(DType::f32, {1, c.Lq, 1, c.D});
  thr.data<float>()[0] = 4.0f;
  GatedStats s = gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), out.view(), std::nullopt, opt);
  EXPECT_EQ(s.gated_candidates, 6);  // gate tiles 2, 3: block 0; gate tiles 4, 5: blocks 0, 1
  EXPECT_EQ(s.gated_kept, 6);
  thr.data<float>()[0] = std::nextafter(4.0f, 5.0f);
  s = gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), out.view(), std::nullopt, opt);
  EXPECT_EQ(s.gated_kept, 0);
  EXPECT_EQ(s.kept_blocks, 6);  // one diagonal block per gate tile
  EXPECT_EQ(s.visible_blocks, 12);
  opt.sink_blocks = 1;  // block 0 is now kept outside the gate
  s = gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), out.view(), std::nullopt, opt);
  EXPECT_EQ(s.gated_candidates, 2);
  EXPECT_EQ(s.kept_blocks, 10);
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
  expect_error(good.view(), bad_kept, "options.kept_per_tile", "expected shape [1, 2, 4]");
  HostTensor counts(DType::i32, {3});
  GatedOptions bad_counts;
  bad_counts.counts = counts.view();
  expect_error(good.view(), bad_counts, "options.counts", "expected shape [4]");
  GatedOptions bad_sinks;
  bad_sinks.sink_blocks = -1;
  expect_error(good.view(), bad_sinks, "options.sink_blocks", "got -1");
  GatedOptions bad_scale;
  bad_scale.softmax_scale = -1.0f;
  expect_error(good.view(), bad_scale, "softmax_scale", "finite and > 0");
}

}  // namespace
}  // namespace sparse_attn
