// Throughput of the CPU attention mainloop: dense, B = 1, H = 8 (Hkv = 8), Lq = Lk = 8192, D = 128,
// fp32, non-causal, on every thread the CPU backend uses. Prints the time and GFLOP/s and fails only
// past a generous bound, so it catches a lost vectorisation or a quadratic slip, not machine noise.
// A small float64 spot check first makes sure the timed kernel computes the right thing.

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <vector>

#include "common/testing.hpp"
#include "core/cpu.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

// out[0, i, h, :] and lse[0, h, i] in float64 for one (h, i) of a dense non-causal problem.
double spot_check(const sa::HostTensor& q, const sa::HostTensor& k, const sa::HostTensor& v, const sa::HostTensor& out,
                  const sa::HostTensor& lse, std::int64_t h, std::int64_t i, double scale) {
  const auto& qs = q.shape();
  const std::int64_t Lk = k.shape()[1], H = qs[2], D = qs[3], Lq = qs[1];
  const float* qp = q.data<float>() + (i * H + h) * D;
  std::vector<double> s(static_cast<std::size_t>(Lk));
  double m = -INFINITY;
  for (std::int64_t j = 0; j < Lk; ++j) {
    const float* kp = k.data<float>() + (j * H + h) * D;
    double dot = 0;
    for (std::int64_t d = 0; d < D; ++d) dot += double(qp[d]) * kp[d];
    s[static_cast<std::size_t>(j)] = dot * scale;
    m = std::max(m, s[static_cast<std::size_t>(j)]);
  }
  double den = 0;
  std::vector<double> acc(static_cast<std::size_t>(D), 0.0);
  for (std::int64_t j = 0; j < Lk; ++j) {
    const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
    den += w;
    const float* vp = v.data<float>() + (j * H + h) * D;
    for (std::int64_t d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += w * vp[d];
  }
  double num = 0, ref = 0;
  const float* op = out.data<float>() + (i * H + h) * D;
  for (std::int64_t d = 0; d < D; ++d) {
    const double r = acc[static_cast<std::size_t>(d)] / den;
    num += (op[d] - r) * (op[d] - r);
    ref += r * r;
  }
  const double lse_err = std::abs(lse.data<float>()[h * Lq + i] - (m + std::log(den)));
  return std::max(std::sqrt(num / ref), lse_err);
}

}  // namespace

TEST(AttentionPerf, DenseB1H8L8192D128Fp32NonCausal) {
  constexpr std::int64_t B = 1, H = 8, L = 8192, D = 128;
  const sa::HostTensor q = st::random_tensor(sa::DType::f32, {B, L, H, D}, 101);
  const sa::HostTensor k = st::random_tensor(sa::DType::f32, {B, L, H, D}, 102);
  const sa::HostTensor v = st::random_tensor(sa::DType::f32, {B, L, H, D}, 103);
  sa::HostTensor out(sa::DType::f32, {B, L, H, D});
  sa::HostTensor lse(sa::DType::f32, {B, H, L});
  st::poison(out);
  st::poison(lse);

  const auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  sa::dense(q.view(), k.view(), v.view(), out.view(), lse.view());
  const double cpu_seconds = double(std::clock() - c0) / CLOCKS_PER_SEC;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const double flops = 4.0 * B * H * double(L) * double(L) * D;
  // CPU time is printed too: on a shared machine it shows the kernel's own cost when wall time
  // includes waiting for cores.
  std::printf("[ perf     ] dense fp32 B=%lld H=%lld L=%lld D=%lld non-causal, %d threads: %.3f s wall "
              "(%.1f GFLOP/s), %.3f s CPU (%.1f GFLOP/s per busy core)\n",
              static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(L),
              static_cast<long long>(D), sa::detail::cpu_threads(), seconds, flops / seconds * 1e-9, cpu_seconds,
              flops / cpu_seconds * 1e-9);
  RecordProperty("seconds", std::to_string(seconds));

  EXPECT_TRUE(st::all_finite(out));
  EXPECT_TRUE(st::all_finite(lse));
  const double scale = 1.0 / std::sqrt(double(D));
  for (const auto& [h, i] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {3, 4097}, {7, L - 1}, {5, 1234}})
    EXPECT_LE(spot_check(q, k, v, out, lse, h, i, scale), 1e-5) << "head " << h << " query " << i;
  EXPECT_LT(seconds, 60.0) << "dense CPU attention far slower than expected";
}
