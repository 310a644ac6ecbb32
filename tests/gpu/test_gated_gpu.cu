// GPU tests of gated (BSFA) on the Hopper kernel (the gate policy of the Q-centric mainloop,
// docs/design.md §5.5) against the CPU reference on the same inputs: -inf thresholds give the GPU's
// dense causal output; the blocks kept per gate tile equal the CPU's, apart from blocks whose maximum
// lies within a rounding bound of the threshold (counted, reported, and the only ones allowed to
// differ); the counters, on the host and on the device, are exact; sink blocks and NaN scores keep
// their blocks; D 64 and 128, bf16 and fp16, GQA, B > 1, Lq < Lk, Lq > Lk, lengths off the tiles.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr std::int64_t kRows = sa::kGateRows;

struct Case {
  std::string name;
  sa::DType dtype;
  std::int64_t B, Lq, Lk, Hq, Hkv, D;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

sa::ProblemShape shape_of(const Case& c) {
  sa::ProblemShape p;
  p.B = c.B, p.Lq = c.Lq, p.Lk = c.Lk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.D = c.D, p.causal = true;
  return p;
}
std::int64_t gate_tiles(const sa::ProblemShape& p) { return (p.Lq + kRows - 1) / kRows; }

struct Inputs {
  sa::HostTensor q, k, v;
};
Inputs make_inputs(const Case& c, std::uint64_t seed) {
  return {st::random_tensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}, seed),
          st::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed + 1),
          st::random_tensor(c.dtype, {c.B, c.Lk, c.Hkv, c.D}, seed + 2)};
}

// Geometry from the causal rule j <= i + (Lk - Lq), independent of the library.
bool visible(const sa::ProblemShape& p, std::int64_t t, std::int64_t j) {
  const std::int64_t last_row = std::min(p.Lq, (t + 1) * kRows) - 1;
  return j * 128 < p.Lk && j * 128 <= last_row + (p.Lk - p.Lq);
}
bool forced(const sa::ProblemShape& p, std::int64_t t, std::int64_t j, std::int64_t sinks) {
  return j < sinks || std::min(p.Lk, (j + 1) * 128) - 1 > t * kRows + (p.Lk - p.Lq);
}

/// Float64 maximum of the scaled scores of gate tile t and block j (inputs as stored: bf16/fp16 values).
double block_max(const Inputs& in, const sa::ProblemShape& p, double scale, std::int64_t b, std::int64_t h,
                 std::int64_t t, std::int64_t j) {
  const std::int64_t hk = h / (p.Hq / p.Hkv);
  double m = -kInf;
  for (std::int64_t i = t * kRows; i < std::min(p.Lq, (t + 1) * kRows); ++i)
    for (std::int64_t c = j * 128; c < std::min(p.Lk, (j + 1) * 128) && c <= i + (p.Lk - p.Lq); ++c) {
      double dot = 0;
      for (std::int64_t d = 0; d < p.D; ++d)
        dot += st::element(in.q, ((b * p.Lq + i) * p.Hq + h) * p.D + d) *
               st::element(in.k, ((b * p.Lk + c) * p.Hkv + hk) * p.D + d);
      m = std::max(m, dot * scale);
    }
  return m;
}

std::vector<double> values(const sa::HostTensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = st::element(t, i);
  return v;
}

struct GatedRun {
  sa::HostTensor out, lse, kept;
  sa::GatedStats stats;
};

/// gated on the CPU (host tensors) or the GPU (device copies), outputs poisoned first.
GatedRun run_gated(const Inputs& in, const sa::ProblemShape& p, const sa::HostTensor& thr, bool gpu, std::int64_t sinks,
              sa::HostTensor* device_counts = nullptr) {
  GatedRun r{sa::HostTensor(in.q.dtype(), {p.B, p.Lq, p.Hq, p.D}), sa::HostTensor(sa::DType::f32, {p.B, p.Hq, p.Lq}),
        st::poisoned_i32({p.B, p.Hq, gate_tiles(p)}), {}};
  st::poison(r.out);
  st::poison(r.lse);
  sa::GatedOptions o;
  o.sink_blocks = sinks;
  if (!gpu) {
    o.kept_per_tile = r.kept.view();
    r.stats = sa::gated(in.q.view(), in.k.view(), in.v.view(), thr.view(), r.out.view(), r.lse.view(), o);
    return r;
  }
  st::Dev q(in.q), k(in.k), v(in.v), t(thr), out(r.out), lse(r.lse), kept(r.kept);
  std::optional<st::Dev> counts;
  o.kept_per_tile = kept.view;
  if (device_counts != nullptr) {
    counts.emplace(*device_counts);
    o.counts = counts->view;
  }
  r.stats = sa::gated(q.view, k.view, v.view, t.view, out.view, lse.view, o);
  st::cuda_ok(cudaDeviceSynchronize(), "gated");
  r.out = out.download(r.out);
  r.lse = lse.download(r.lse);
  r.kept = kept.download(r.kept);
  if (device_counts != nullptr) *device_counts = counts->download(*device_counts);
  return r;
}

/// Dense causal attention on the GPU.
void gpu_dense_causal(const Inputs& in, const sa::ProblemShape& p, sa::HostTensor& out, sa::HostTensor& lse) {
  st::Dev q(in.q), k(in.k), v(in.v), o(out), l(lse);
  sa::AttentionOptions opt;
  opt.causal = true;
  sa::dense(q.view, k.view, v.view, o.view, l.view, opt);
  st::cuda_ok(cudaDeviceSynchronize(), "dense");
  out = o.download(out);
  lse = l.download(lse);
}

class GatedGpu : public ::testing::TestWithParam<Case> {};

TEST_P(GatedGpu, NegInfThresholdsGiveDenseCausal) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const sa::ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 10 + c.Lq);
  sa::HostTensor thr(sa::DType::f32, {c.Hq, 2});
  std::fill(thr.data<float>(), thr.data<float>() + thr.numel(), -std::numeric_limits<float>::infinity());
  for (const std::int64_t sinks : {0, 1}) {
    const GatedRun g = run_gated(in, p, thr, true, sinks);
    sa::HostTensor out(in.q.dtype(), {p.B, p.Lq, p.Hq, p.D}), lse(sa::DType::f32, {p.B, p.Hq, p.Lq});
    gpu_dense_causal(in, p, out, lse);
    // The same kernel with every block kept: the same sums in the same order.
    for (std::int64_t i = 0; i < out.numel(); ++i)
      ASSERT_EQ(st::element(g.out, i), st::element(out, i)) << "out element " << i;
    for (std::int64_t i = 0; i < lse.numel(); ++i)
      ASSERT_EQ(g.lse.data<float>()[i], lse.data<float>()[i]) << "lse element " << i;
    const GatedRun cpu = run_gated(in, p, thr, false, sinks);
    st::expect_gated_stats_eq(g.stats, cpu.stats);
    EXPECT_EQ(g.stats.kept_blocks, g.stats.visible_blocks);
    st::expect_equal_i32(g.kept, cpu.kept, "kept_per_tile");
  }
}

TEST_P(GatedGpu, KeptBlocksMatchTheCpuUpToNearThresholdBlocks) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const sa::ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 500 + c.Lk);
  const double scale = 1.0 / std::sqrt(double(c.D));
  const std::int64_t Tg = gate_tiles(p), T = std::max<std::int64_t>(1, Tg - 2);
  const std::int64_t sinks = 1;
  // Float64 block maxima of every candidate, by (b, h, gate tile).
  std::vector<std::vector<double>> maxima(static_cast<std::size_t>(p.B * p.Hq * Tg));
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t t = 0; t < Tg; ++t)
        for (std::int64_t j = 0; j < p.Tk(); ++j)
          if (visible(p, t, j) && !forced(p, t, j, sinks))
            maxima[static_cast<std::size_t>((b * p.Hq + h) * Tg + t)].push_back(block_max(in, p, scale, b, h, t, j));
  // Thresholds per (head, column): the median of the candidates' maxima of that column, so about
  // half the candidates go; head 0 takes it exactly (a block sits on its threshold), the others
  // nudged up by 1e-3 of its magnitude.
  sa::HostTensor thr(sa::DType::f32, {c.Hq, T});
  for (std::int64_t h = 0; h < p.Hq; ++h)
    for (std::int64_t col = 0; col < T; ++col) {
      std::vector<double> m;
      for (std::int64_t b = 0; b < p.B; ++b)
        for (std::int64_t t = 0; t < Tg; ++t)
          if (std::min(t, T - 1) == col) {
            const auto& v = maxima[static_cast<std::size_t>((b * p.Hq + h) * Tg + t)];
            m.insert(m.end(), v.begin(), v.end());
          }
      double value = 0.0;
      if (!m.empty()) {
        std::nth_element(m.begin(), m.begin() + static_cast<std::ptrdiff_t>(m.size() / 2), m.end());
        value = m[m.size() / 2];
        if (h != 0) value += 1e-3 * (1.0 + std::abs(value));
      }
      thr.data<float>()[h * T + col] = static_cast<float>(value);
    }
  const GatedRun cpu = run_gated(in, p, thr, false, sinks);
  sa::HostTensor counts(sa::DType::i32, {4});
  const GatedRun gpu = run_gated(in, p, thr, true, sinks, &counts);
  EXPECT_TRUE(gpu.stats.deferred);

  // Near the threshold: within a bound on the difference between the two float32 scores of one
  // block maximum (inputs exact in both; fp32 sums of D products in two orders, scaled).
  std::int64_t near = 0, differ = 0;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t t = 0; t < Tg; ++t) {
        const std::size_t at = static_cast<std::size_t>((b * p.Hq + h) * Tg + t);
        const double th = thr.data<float>()[h * T + std::min(t, T - 1)];
        std::int64_t n = 0;
        for (const double m : maxima[at]) n += std::abs(m - th) <= 1e-4 * (1.0 + std::abs(th));
        near += n;
        const std::int64_t d = std::abs(gpu.kept.data<std::int32_t>()[at] - cpu.kept.data<std::int32_t>()[at]);
        differ += d;
        EXPECT_LE(d, n) << "b " << b << " head " << h << " gate tile " << t << ": kept " << gpu.kept.data<std::int32_t>()[at]
                        << " on the GPU, " << cpu.kept.data<std::int32_t>()[at] << " on the CPU";
      }
  std::cout << "[ gated ] " << c.name << ": " << near << " of " << cpu.stats.gated_candidates
            << " candidate blocks within 1e-4 (1 + |t|) of their threshold, " << differ << " kept differently\n";
  RecordProperty("near_threshold_blocks", static_cast<int>(near));
  RecordProperty("kept_differently", static_cast<int>(differ));
  if (cpu.stats.gated_candidates > 0) {  // head 0 keeps its median block, the others drop theirs
    EXPECT_LT(cpu.stats.gated_kept, cpu.stats.gated_candidates);
    EXPECT_GT(cpu.stats.gated_kept, 0);
  }
  // Device counters: the GPU's own kept_per_tile summed, and the CPU's where no decision differs.
  std::int64_t kept_sum = 0;
  for (std::int64_t i = 0; i < gpu.kept.numel(); ++i) kept_sum += gpu.kept.data<std::int32_t>()[i];
  EXPECT_EQ(counts.data<std::int32_t>()[0], kept_sum);
  EXPECT_EQ(counts.data<std::int32_t>()[1], cpu.stats.visible_blocks);
  EXPECT_EQ(counts.data<std::int32_t>()[2], cpu.stats.gated_candidates);
  EXPECT_EQ(counts.data<std::int32_t>()[3] - cpu.stats.gated_kept, kept_sum - cpu.stats.kept_blocks);
  if (differ == 0) {
    // The same blocks: the CPU's float32 result within the 16-bit output's rounding.
    EXPECT_LE(st::rel_err(gpu.out, values(cpu.out)), c.dtype == sa::DType::bf16 ? 1e-2 : 2e-3);
    EXPECT_LE(st::lse_max_err(gpu.lse, values(cpu.lse)), 2e-3);
  }
}

TEST_P(GatedGpu, SinksAndDiagonalSurviveInfiniteThresholds) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const sa::ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 900);
  sa::HostTensor thr(sa::DType::f32, {c.Hq, 1});
  std::fill(thr.data<float>(), thr.data<float>() + thr.numel(), std::numeric_limits<float>::infinity());
  for (const std::int64_t sinks : {0, 1, 3}) {
    const GatedRun cpu = run_gated(in, p, thr, false, sinks);
    const GatedRun gpu = run_gated(in, p, thr, true, sinks);
    st::expect_gated_stats_eq(gpu.stats, cpu.stats);
    EXPECT_EQ(gpu.stats.gated_kept, 0);
    st::expect_equal_i32(gpu.kept, cpu.kept, "kept_per_tile, sinks " + std::to_string(sinks));
    std::int64_t want = 0;
    for (std::int64_t t = 0; t < gate_tiles(p); ++t)
      for (std::int64_t j = 0; j < p.Tk(); ++j) want += visible(p, t, j) && forced(p, t, j, sinks);
    EXPECT_EQ(gpu.stats.kept_blocks, want * p.B * p.Hq);
    EXPECT_LE(st::rel_err(gpu.out, values(cpu.out)), c.dtype == sa::DType::bf16 ? 1e-2 : 2e-3);
    EXPECT_LE(st::lse_max_err(gpu.lse, values(cpu.lse)), 2e-3);
  }
}

TEST_P(GatedGpu, OpenAndClosedGatesInOneCall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const sa::ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 1300);
  // One threshold per (head, gate tile), -inf and +inf alternating: the two warpgroups of a Q tile and
  // neighbouring heads take the open gate's loop and the gated one in the same launch.
  const std::int64_t Tg = gate_tiles(p);
  sa::HostTensor thr(sa::DType::f32, {c.Hq, Tg});
  for (std::int64_t h = 0; h < c.Hq; ++h)
    for (std::int64_t t = 0; t < Tg; ++t)
      thr.data<float>()[h * Tg + t] = (h + t) % 2 == 0 ? -std::numeric_limits<float>::infinity()
                                                       : std::numeric_limits<float>::infinity();
  for (const std::int64_t sinks : {0, 1}) {
    const GatedRun cpu = run_gated(in, p, thr, false, sinks);
    const GatedRun gpu = run_gated(in, p, thr, true, sinks);
    st::expect_gated_stats_eq(gpu.stats, cpu.stats);
    st::expect_equal_i32(gpu.kept, cpu.kept, "kept_per_tile, sinks " + std::to_string(sinks));
    EXPECT_LE(st::rel_err(gpu.out, values(cpu.out)), c.dtype == sa::DType::bf16 ? 1e-2 : 2e-3);
    EXPECT_LE(st::lse_max_err(gpu.lse, values(cpu.lse)), 2e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GatedGpu,
    ::testing::Values(Case{"bf16_D128_gqa4_L1013", sa::DType::bf16, 1, 1013, 1013, 8, 2, 128},
                      Case{"f16_D128_B2_L700", sa::DType::f16, 2, 700, 700, 2, 1, 128},
                      Case{"bf16_D64_chunked_Lq300_Lk1000", sa::DType::bf16, 1, 300, 1000, 4, 1, 64},
                      Case{"f16_D64_L17", sa::DType::f16, 1, 17, 17, 2, 2, 64},
                      Case{"bf16_D128_Lq1_Lk777", sa::DType::bf16, 1, 1, 777, 4, 4, 128},
                      Case{"bf16_D64_Lq520_Lk400", sa::DType::bf16, 1, 520, 400, 2, 1, 64},  // early rows see no key
                      Case{"bf16_D128_gqa8_L2100", sa::DType::bf16, 1, 2100, 2100, 8, 1, 128}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(GatedGpu, HostStatsAndDeviceCountersAgree) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"", sa::DType::bf16, 2, 900, 900, 4, 2, 128};
  const sa::ProblemShape p = shape_of(c);
  const Inputs in = make_inputs(c, 77);
  sa::HostTensor thr(sa::DType::f32, {c.Hq, 3});
  // Around the typical maximum of 64 x 128 standard normal scores (about 3.7): some blocks go.
  for (std::int64_t i = 0; i < thr.numel(); ++i) thr.data<float>()[i] = 3.25f + 0.25f * static_cast<float>(i % 4);
  const GatedRun host = run_gated(in, p, thr, true, 1);
  EXPECT_FALSE(host.stats.deferred);
  sa::HostTensor counts = st::poisoned_i32({4});
  const GatedRun dev = run_gated(in, p, thr, true, 1, &counts);
  EXPECT_TRUE(dev.stats.deferred);
  EXPECT_EQ(dev.stats.kept_blocks, 0);
  EXPECT_EQ(counts.data<std::int32_t>()[0], host.stats.kept_blocks);
  EXPECT_EQ(counts.data<std::int32_t>()[1], host.stats.visible_blocks);
  EXPECT_EQ(counts.data<std::int32_t>()[2], host.stats.gated_candidates);
  EXPECT_EQ(counts.data<std::int32_t>()[3], host.stats.gated_kept);
  EXPECT_GT(host.stats.gated_kept, 0);
  EXPECT_LT(host.stats.gated_kept, host.stats.gated_candidates);
  st::expect_equal_i32(dev.kept, host.kept, "kept_per_tile");
  for (std::int64_t i = 0; i < host.out.numel(); ++i) ASSERT_EQ(st::element(dev.out, i), st::element(host.out, i));
}

TEST(GatedGpu, ABlockWithANaNScoreIsKept) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // FLT_MAX thresholds skip every candidate; a NaN in key 10 (block 0, no sink) is still seen by
  // every row of the heads of KV head 1 past query 10, as on the CPU.
  const Case c{"", sa::DType::bf16, 1, 384, 384, 4, 2, 64};
  const sa::ProblemShape p = shape_of(c);
  Inputs in = make_inputs(c, 5);
  sa::HostTensor thr(sa::DType::f32, {c.Hq, 1});
  std::fill(thr.data<float>(), thr.data<float>() + thr.numel(), std::numeric_limits<float>::max());
  const GatedRun clean = run_gated(in, p, thr, true, 0);
  EXPECT_EQ(clean.stats.gated_kept, 0);
  // k [1, L, 2, 64]: key 10 of KV head 1, element 3 (bf16 NaN 0x7fc0).
  in.k.data<std::uint16_t>()[(10 * 2 + 1) * 64 + 3] = 0x7fc0;
  const GatedRun cpu = run_gated(in, p, thr, false, 0);
  const GatedRun gpu = run_gated(in, p, thr, true, 0);
  st::expect_gated_stats_eq(gpu.stats, cpu.stats);
  EXPECT_GT(gpu.stats.gated_kept, 0);
  for (std::int64_t h = 0; h < p.Hq; ++h)
    for (std::int64_t i = 0; i < p.Lq; ++i) {
      const bool nan = h >= 2 && i >= 10;
      EXPECT_EQ(std::isnan(gpu.lse.data<float>()[h * p.Lq + i]), nan) << "head " << h << " query " << i;
      EXPECT_EQ(std::isnan(st::element(gpu.out, (i * p.Hq + h) * p.D)), nan) << "head " << h << " query " << i;
    }
}

}  // namespace

namespace {

TEST(GatedGpu, CalibrationMatchesTheCpuCalibrator) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // Samples of several lengths (off the tiles), GQA, both dtypes and head dims: the same -inf
  // pattern (it depends on candidate counts only) and thresholds equal up to the float32 rounding of
  // the scores (the sums' order is the CPU's; fused or not).
  for (const sa::DType dtype : {sa::DType::bf16, sa::DType::f16})
    for (const std::int64_t D : {64, 128})
      for (const std::int64_t sinks : {0, 1}) {
        const std::vector<std::int64_t> budgets{1, 2, 5};
        sa::Calibrator cpu(budgets, 2, "m", sinks), gpu(budgets, 2, "m", sinks);
        std::uint64_t seed = 300 + static_cast<std::uint64_t>(D);
        for (const std::int64_t L : {1013, 129, 700})
          for (std::int64_t layer = 0; layer < 2; ++layer) {
            const sa::HostTensor q = st::random_tensor(dtype, {1, L, 8, D}, seed++);
            const sa::HostTensor k = st::random_tensor(dtype, {1, L, 2, D}, seed++);
            cpu.add(layer, q.view(), k.view());
            const st::Dev dq(q), dk(k);
            gpu.add(layer, dq.view, dk.view);
          }
        const sa::ThresholdTable a = cpu.finish(), b = gpu.finish();
        ASSERT_EQ(a.values.size(), b.values.size());
        EXPECT_EQ(b.sink_blocks, sinks);
        std::int64_t finite = 0;
        for (std::size_t i = 0; i < a.values.size(); ++i) {
          const float x = a.values[i], y = b.values[i];
          ASSERT_EQ(std::isinf(x), std::isinf(y)) << "value " << i << ": cpu " << x << ", gpu " << y;
          if (std::isinf(x)) continue;
          ++finite;
          EXPECT_NEAR(y, x, 1e-5 * (1.0 + std::abs(x))) << "value " << i;
        }
        EXPECT_GT(finite, 0);
      }
}

TEST(GatedGpu, CalibrationRefusesWhatTheGpuCannotRun) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::HostTensor q = st::random_tensor(sa::DType::f32, {1, 256, 2, 64}, 1);
  const sa::HostTensor k = st::random_tensor(sa::DType::f32, {1, 256, 2, 64}, 2);
  const st::Dev dq(q), dk(k);
  sa::Calibrator cal({1}, 1);
  try {
    cal.add(0, dq.view, dk.view);
    ADD_FAILURE() << "float32 on the GPU was accepted";
  } catch (const sa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 or f16"), std::string::npos) << e.what();
  }
}

}  // namespace
