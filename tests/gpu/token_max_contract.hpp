// The token_max contract of the GPU tests (docs/design.md §5.7): every list is a top-k of the exact block
// scores within eps. Exact scores are float64 dots of the CPU's quantised values (detail::load_quantized,
// the values the CPU selector scores), the block max over visible keys (and over the tile's queries for
// TileLists); forced blocks (reserved local block, block 0 with force_block0) score +inf, blocks a list does
// not see -inf. eps of a list = 2 x the kernel's stated bound (cuda_backend::token_max_score_error) at the
// largest query-row norm of the list and the largest key-row norm of each candidate block.
#pragma once

#include <cuda_runtime.h>
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
#include "gpu/device_testing.hpp"
#include "selectors/select_common.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::testing {

struct TokenMaxCase {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 128, Hkv = 1, Hk = 1, Di = 64;
  int top_k = 4, kmax = 4;
  bool causal = true, reserve_local = true, force_block0 = false;
};

inline TokenMaxOptions token_max_options(const TokenMaxCase& c, IndexPrecision p, void* stream = nullptr) {
  TokenMaxOptions o;
  o.top_k = c.top_k, o.precision = p, o.causal = c.causal, o.reserve_local = c.reserve_local;
  o.force_block0 = c.force_block0, o.stream = stream;
  return o;
}

struct TokenMaxExact {
  ExactScores exact;
  std::vector<double> eps;  // per list
};

/// Exact scores and eps of every list (QueryLists rows (b, g, i), TileLists rows (b, g, t)).
inline TokenMaxExact token_max_exact(const TokenMaxCase& c, IndexPrecision p, bool tiles, const HostTensor& q,
                                     const HostTensor& k) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const detail::QuantizedTensor qv = detail::load_quantized("test", "qidx", q.view(), p);
  const detail::QuantizedTensor kv = detail::load_quantized("test", "kidx", k.view(), p);
  // The per-tensor scales from above: the CPU's for fp8 and fp4; bf16 codes are scaled by 2^e <= 2 amax.
  auto scale = [&](const detail::QuantizedTensor& t) {
    if (p != IndexPrecision::bf16) return static_cast<double>(t.tensor_scale);
    double amax = 0.0;
    for (float x : t.data) amax = std::max(amax, std::fabs(static_cast<double>(x)));
    return std::max(2.0 * amax * (1.0 + 0x1p-7), 0x1p-99);
  };
  const double sq = scale(qv), sk = scale(kv);
  auto norm = [](const float* r, std::int64_t n) {
    double s = 0.0;
    for (std::int64_t d = 0; d < n; ++d) s += static_cast<double>(r[d]) * r[d];
    return std::sqrt(s) * (1.0 + 0x1p-40);
  };
  const std::int64_t Tq = ceil_div(c.Lq, kTileQ), Tk = ceil_div(c.Lk, kBlockK), off = c.Lk - c.Lq;
  auto key_end = [&](std::int64_t i) { return c.causal ? std::clamp<std::int64_t>(i + off + 1, 0, c.Lk) : c.Lk; };
  auto local = [&](std::int64_t i) -> std::int64_t {
    if (!c.reserve_local) return -1;
    if (c.causal) return i + off >= 0 ? (i + off) / kBlockK : -1;
    return std::clamp<std::int64_t>(i + off, 0, c.Lk - 1) / kBlockK;
  };
  std::vector<double> nk(static_cast<std::size_t>(c.B * c.Hk * Tk), 0.0);  // block maxima of key norms
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hk; ++h)
      for (std::int64_t s = 0; s < c.Lk; ++s) {
        double& m = nk[static_cast<std::size_t>((b * c.Hk + h) * Tk + s / kBlockK)];
        m = std::max(m, norm(kv.row(b, s, h), c.Di));
      }
  const std::int64_t per = tiles ? Tq : c.Lq;
  TokenMaxExact out;
  out.exact.rows = c.B * c.Hkv * per;
  out.exact.candidates = Tk;
  out.exact.score.assign(static_cast<std::size_t>(out.exact.rows * Tk), -kInf);
  out.eps.assign(static_cast<std::size_t>(out.exact.rows), 0.0);
  std::vector<double> nq(static_cast<std::size_t>(out.exact.rows), 0.0);
  std::vector<std::int64_t> seen(static_cast<std::size_t>(out.exact.rows), 0);  // candidate blocks of the list
  detail::parallel_for(c.B * c.Hkv * Tq, [&](std::int64_t job) {
    const std::int64_t t = job % Tq, g = (job / Tq) % c.Hkv, b = job / (Tq * c.Hkv), hk = c.Hk == 1 ? 0 : g;
    for (std::int64_t i = t * kTileQ; i < std::min(c.Lq, (t + 1) * kTileQ); ++i) {
      const std::int64_t r = (b * c.Hkv + g) * per + (tiles ? t : i), e = key_end(i);
      const float* qr = qv.row(b, i, g);
      nq[static_cast<std::size_t>(r)] = std::max(nq[static_cast<std::size_t>(r)], norm(qr, c.Di));
      for (std::int64_t s = 0; s < e; ++s) {
        double& m = out.exact.at(r, s / kBlockK);
        m = std::max(m, detail::dot_f64(qr, kv.row(b, s, hk), c.Di));
      }
      const std::int64_t j = local(i);
      if (j >= 0) out.exact.at(r, j) = kInf;
      if (c.force_block0 && e > 0) out.exact.at(r, 0) = kInf;
      seen[static_cast<std::size_t>(r)] = std::max(seen[static_cast<std::size_t>(r)], ceil_div(e, kBlockK));
    }
  });
  for (std::int64_t r = 0; r < out.exact.rows; ++r) {
    const std::int64_t b = r / (c.Hkv * per), g = (r / per) % c.Hkv, hk = c.Hk == 1 ? 0 : g;
    double e = 0.0;
    for (std::int64_t j = 0; j < seen[static_cast<std::size_t>(r)]; ++j)
      e = std::max(e, cuda_backend::token_max_score_error(p, c.Di, nq[static_cast<std::size_t>(r)],
                                                          nk[static_cast<std::size_t>((b * c.Hk + hk) * Tk + j)], sq, sk));
    out.eps[static_cast<std::size_t>(r)] = 2.0 * e;
  }
  return out;
}

/// GPU lists of one call on device views (gq, gk) holding the host inputs (q, k), output poisoned first.
struct TokenMaxGpuLists {
  HostTensor idx, cnt;  // cnt: TileLists only
};

inline TokenMaxGpuLists token_max_gpu(const TokenMaxCase& c, IndexPrecision p, bool tiles, const TensorView& gq,
                                      const TensorView& gk, void* stream = nullptr) {
  const std::int64_t Tq = ceil_div(c.Lq, kTileQ);
  TokenMaxGpuLists out{HostTensor(DType::i32, {c.B, c.Hkv, tiles ? Tq : c.Lq, c.kmax}),
                       HostTensor(DType::i32, {c.B, c.Hkv, Tq})};
  Dev didx(poisoned_i32(out.idx.shape())), dcnt(poisoned_i32(out.cnt.shape()));
  const TokenMaxOptions o = token_max_options(c, p, stream);
  if (tiles) token_max_select(gq, gk, TileLists{didx.view, dcnt.view}, o);
  else token_max_select(gq, gk, QueryLists{didx.view}, o);
  cuda_ok(stream != nullptr ? cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) : cudaDeviceSynchronize(),
          "token_max_select");
  out.idx = didx.download(out.idx);
  if (tiles) out.cnt = dcnt.download(out.cnt);
  return out;
}

/// Checks the GPU lists of (c, p, tiles) on device views of (q, k) against the contract; returns the report.
inline ContractReport check_token_max_gpu(const TokenMaxCase& c, IndexPrecision p, bool tiles, const HostTensor& q,
                                          const HostTensor& k, const TensorView& gq, const TensorView& gk,
                                          void* stream = nullptr) {
  const std::string what = c.name + " " + precision_name(p) + (tiles ? " TileLists" : " QueryLists");
  SCOPED_TRACE(what);
  const TokenMaxExact ex = token_max_exact(c, p, tiles, q, k);
  const TokenMaxGpuLists got = token_max_gpu(c, p, tiles, gq, gk, stream);
  return expect_top_k_within(ex.exact, got.idx.data<std::int32_t>(), c.kmax, c.kmax,
                             tiles ? got.cnt.data<std::int32_t>() : nullptr, c.top_k,
                             [&](std::int64_t r) { return ex.eps[static_cast<std::size_t>(r)]; }, what);
}

/// The same with the inputs uploaded from (q, k).
inline ContractReport check_token_max_gpu(const TokenMaxCase& c, IndexPrecision p, bool tiles, const HostTensor& q,
                                          const HostTensor& k) {
  Dev dq(q), dk(k);
  return check_token_max_gpu(c, p, tiles, q, k, dq.view, dk.view);
}

}  // namespace sparse_attn::testing
