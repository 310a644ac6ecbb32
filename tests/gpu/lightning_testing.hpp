// The GPU lightning indexer's contract (docs/design.md §5.7) checked against the CPU oracle: exact float64
// scores of the CPU-quantised inputs (sink keys +inf, invisible keys -inf; blocks: the maximum over their
// visible keys), and per row the kernel's bound ε (cuda_backend::lightning_epsilon).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/selector_contract.hpp"
#include "common/testing.hpp"
#include "cuda/selectors/backend.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::testing {

/// The CPU's dequantised values of an index tensor (load_quantized): float copies rounded through the
/// precision with the per-tensor scale (fp8: amax / 448; a zero scale keeps the raw values). `scale` returns it.
inline std::vector<float> lightning_values(const HostTensor& t, IndexPrecision p, float& scale) {
  const std::int64_t n = t.numel(), D = t.shape().back();
  std::vector<float> v(static_cast<std::size_t>(n));
  float amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    v[static_cast<std::size_t>(i)] = static_cast<float>(element(t, i));
    amax = std::fmax(amax, std::fabs(v[static_cast<std::size_t>(i)]));
  }
  scale = p == IndexPrecision::fp8_e4m3 ? amax / 448.0f : 1.0f;
  if (p == IndexPrecision::fp8_e4m3 && scale == 0.0f) return v;
  for (std::int64_t r = 0; r < n / D; ++r) quantize_dequantize(v.data() + r * D, D, p, scale);
  return v;
}

/// Exact scores and the per-row bound of one lightning problem (rows b * Lq + t).
struct LightningOracle {
  ExactScores exact;
  std::vector<double> eps;
};

inline LightningOracle lightning_oracle(const HostTensor& qI, const HostTensor& w, const HostTensor& kI,
                                        const LightningOptions& o, bool blocks) {
  const std::int64_t B = qI.shape()[0], Lq = qI.shape()[1], HI = qI.shape()[2], Di = qI.shape()[3];
  const std::int64_t Lk = kI.shape()[1], Tk = (Lk + kBlockK - 1) / kBlockK;
  float sq = 0.0f, sk = 0.0f;
  const std::vector<float> qv = lightning_values(qI, o.precision, sq), kv = lightning_values(kI, o.precision, sk);
  const bool zero_scale = o.precision == IndexPrecision::fp8_e4m3 && (sq == 0.0f || sk == 0.0f);
  std::vector<float> wv(static_cast<std::size_t>(w.numel()));
  for (std::int64_t i = 0; i < w.numel(); ++i) wv[static_cast<std::size_t>(i)] = static_cast<float>(element(w, i));
  LightningOracle r;
  r.exact.rows = B * Lq;
  r.exact.candidates = blocks ? Tk : Lk;
  r.exact.score.assign(static_cast<std::size_t>(r.exact.rows * r.exact.candidates),
                       -std::numeric_limits<double>::infinity());
  r.eps.resize(static_cast<std::size_t>(B * Lq));
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t b = 0; b < B; ++b) {
    double key_inf = 0.0, key_norm = 0.0;
    for (std::int64_t s = 0; s < Lk; ++s) {
      double n2 = 0.0;
      for (std::int64_t d = 0; d < Di; ++d) {
        const double x = kv[static_cast<std::size_t>((b * Lk + s) * Di + d)];
        key_inf = std::max(key_inf, std::fabs(x)), n2 += x * x;
      }
      key_norm = std::max(key_norm, std::sqrt(n2) * (1.0 + 0x1p-40));
    }
    for (std::int64_t t = 0; t < Lq; ++t) {
      const std::int64_t row = b * Lq + t;
      const float* q = qv.data() + row * HI * Di;
      const float* wr = wv.data() + row * HI;
      r.eps[static_cast<std::size_t>(row)] =
          cuda_backend::lightning_epsilon(o.precision, HI, Di, wr, q, key_inf, key_norm, zero_scale);
      const std::int64_t end = o.causal ? std::clamp<std::int64_t>(t + (Lk - Lq) + 1, 0, Lk) : Lk;
      for (std::int64_t s = 0; s < end; ++s) {
        double x = inf;
        if (s >= o.sink_keys) {
          const float* k = kv.data() + (b * Lk + s) * Di;
          x = 0.0;
          for (std::int64_t j = 0; j < HI; ++j) {
            double dot = 0.0;
            for (std::int64_t d = 0; d < Di; ++d)
              dot += static_cast<double>(q[j * Di + d]) * static_cast<double>(k[d]);
            x = std::fma(static_cast<double>(wr[j]), std::max(0.0, dot), x);
          }
        }
        double& cell = r.exact.at(row, blocks ? s / kBlockK : s);
        cell = blocks ? std::max(cell, x) : x;
      }
    }
  }
  return r;
}

/// Checks every group of a GPU output idx [B, G, Lq, Kt] against the oracle; returns group 0's report.
inline ContractReport expect_lightning_contract(const LightningOracle& oracle, const HostTensor& idx, int top_k,
                                                const std::string& what) {
  const std::int64_t B = idx.shape()[0], G = idx.shape()[1], Lq = idx.shape()[2], Kt = idx.shape()[3];
  ContractReport first;
  for (std::int64_t g = 0; g < G; ++g) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(B * Lq * Kt));
    for (std::int64_t b = 0; b < B; ++b)
      std::copy_n(idx.data<std::int32_t>() + (b * G + g) * Lq * Kt, Lq * Kt, ids.data() + b * Lq * Kt);
    const ContractReport rep = expect_top_k_within(
        oracle.exact, ids.data(), Kt, Kt, nullptr, top_k,
        [&](std::int64_t r) { return oracle.eps[static_cast<std::size_t>(r)]; }, what + " group " + std::to_string(g));
    if (g == 0) first = rep;
  }
  return first;
}

}  // namespace sparse_attn::testing
