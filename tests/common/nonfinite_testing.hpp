// Non-finite scores (docs/design.md §2), shared by the CPU and GPU suites: problems whose q or k hold NaN, +inf
// or -inf, or whose scores overflow float32, each with the rows whose out and lse must be NaN; the
// selections that give every executor every key; and the row-by-row check.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "core/cpu.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::testing::nonfinite {

struct Case {
  std::string name;
  HostTensor q, k, v;
  ProblemShape p;
  std::optional<float> scale;
  std::vector<char> nan_row;  // per (b, h, i), [B, Hq, Lq]: out and lse must be NaN
};

inline void set(HostTensor& t, std::int64_t flat, float x) {
  const TensorView& v = t.view();
  detail::store_float(v, static_cast<char*>(v.data) + flat * static_cast<std::int64_t>(dtype_size(v.dtype)), x);
}
inline std::int64_t at4(const ProblemShape& p, std::int64_t L, std::int64_t H, std::int64_t b, std::int64_t l,
                        std::int64_t h, std::int64_t d) {
  return ((b * L + l) * H + h) * p.D + d;
}

/// The cases on one problem shape (Lq = Lk, causal, Hq = 2 Hkv >= 4, Lk > 200) and dtype. Heads 0 and
/// 1 read KV head 0, heads 2 and 3 KV head 1.
inline std::vector<Case> make_cases(const ProblemShape& shape, DType dtype, std::uint64_t seed) {
  const ProblemShape p = shape;
  const auto fresh = [&](const std::string& name, float qk_stddev = 1.0f) {
    Case c{name, random_tensor(dtype, {p.B, p.Lq, p.Hq, p.D}, seed, qk_stddev),
           random_tensor(dtype, {p.B, p.Lk, p.Hkv, p.D}, seed + 1, qk_stddev),
           random_tensor(dtype, {p.B, p.Lk, p.Hkv, p.D}, seed + 2), p, std::nullopt,
           std::vector<char>(static_cast<std::size_t>(p.B * p.Hq * p.Lq), 0)};
    return c;
  };
  const auto mark = [&](Case& c, std::int64_t b, std::int64_t h, std::int64_t i) {
    c.nan_row[static_cast<std::size_t>((b * p.Hq + h) * p.Lq + i)] = 1;
  };
  // Element d0 of q made positive for the heads of KV head 0, so that +-inf in k's element d0 gives a
  // score of the same sign.
  const auto positive_q = [&](Case& c) {
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t i = 0; i < p.Lq; ++i)
        for (std::int64_t h = 0; h < p.group_size(); ++h) {
          const std::int64_t e = at4(p, p.Lq, p.Hq, b, i, h, 0);
          set(c.q, e, std::fabs(float(element(c.q, e))) + 0.25f);
        }
  };
  std::vector<Case> cases;
  {
    Case c = fresh("nan_in_query");  // one element of one row: every score of that row is NaN
    set(c.q, at4(p, p.Lq, p.Hq, 0, 10, 1, 3), std::numeric_limits<float>::quiet_NaN());
    mark(c, 0, 1, 10);
    cases.push_back(std::move(c));
  }
  {
    Case c = fresh("inf_in_key");  // key 150 scores +inf for heads 0 and 1: the rows that see it
    positive_q(c);
    set(c.k, at4(p, p.Lk, p.Hkv, 0, 150, 0, 0), std::numeric_limits<float>::infinity());
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t i = 0; i < p.Lq; ++i)
        if (p.visible(i, 150))
          for (std::int64_t h = 0; h < p.group_size(); ++h) mark(c, b, h, i);
    cases.push_back(std::move(c));
  }
  {
    Case c = fresh("nan_in_key");  // one key of KV head 1 in batch 0
    const std::int64_t hk = 1 % p.Hkv, j = 200;
    set(c.k, at4(p, p.Lk, p.Hkv, 0, j, hk, 5), std::numeric_limits<float>::quiet_NaN());
    for (std::int64_t i = 0; i < p.Lq; ++i)
      if (p.visible(i, j))
        for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) mark(c, 0, h, i);
    cases.push_back(std::move(c));
  }
  {
    // 1e19 * 1e20 > FLT_MAX in one (row, key). The other rows of KV head 0 get 0 in that element:
    // scores of 1e19 that stay finite are not what this case is about.
    Case c = fresh("finite_inputs_overflowing_score");
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t i = 0; i < p.Lq; ++i)
        for (std::int64_t h = 0; h < p.group_size(); ++h) set(c.q, at4(p, p.Lq, p.Hq, b, i, h, 0), 0.0f);
    set(c.q, at4(p, p.Lq, p.Hq, 0, 20, 0, 0), 1e19f);
    set(c.k, at4(p, p.Lk, p.Hkv, 0, 5, 0, 0), 1e20f);
    mark(c, 0, 0, 20);
    cases.push_back(std::move(c));
  }
  {
    // Scores of about 100 scaled by 1e37: every row's max overflows (the first rows see few keys, so
    // the problem is taken without the causal mask).
    Case c = fresh("softmax_scale_overflow", 3.0f);
    c.p.causal = false;
    c.scale = 1e37f;
    std::fill(c.nan_row.begin(), c.nan_row.end(), 1);
    cases.push_back(std::move(c));
  }
  {
    Case c = fresh("minus_inf_score_weighs_zero");  // key 77 scores -inf for heads 0 and 1: no NaN
    positive_q(c);
    set(c.k, at4(p, p.Lk, p.Hkv, 0, 77, 0, 0), -std::numeric_limits<float>::infinity());
    cases.push_back(std::move(c));
  }
  return cases;
}

/// Selections that give every key to every query of `p`, in each format (G = Hkv).
struct FullSelections {
  HostTensor tile_idx, tile_cnt, bits, query_idx, token_idx;
  explicit FullSelections(const ProblemShape& p)
      : tile_idx(DType::i32, {p.B, p.Hkv, p.Tq(), p.Tk()}),
        tile_cnt(DType::i32, {p.B, p.Hkv, p.Tq()}),
        bits(DType::u32, {p.B, p.Hkv, p.Tq(), ceil_div(p.Tk(), 32)}),
        query_idx(DType::i32, {p.B, p.Hkv, p.Lq, p.Tk()}),
        token_idx(DType::i32, {p.B, p.Hkv, p.Lq, p.Lk}) {
    const std::int64_t W = ceil_div(p.Tk(), 32);
    for (std::int64_t row = 0; row < p.B * p.Hkv * p.Tq(); ++row) {
      tile_cnt.data<std::int32_t>()[row] = static_cast<std::int32_t>(p.Tk());
      for (std::int64_t j = 0; j < p.Tk(); ++j) tile_idx.data<std::int32_t>()[row * p.Tk() + j] = static_cast<std::int32_t>(j);
      for (std::int64_t w = 0; w < W; ++w) {
        const std::int64_t n = std::min<std::int64_t>(32, p.Tk() - 32 * w);
        bits.data<std::uint32_t>()[row * W + w] = n == 32 ? 0xffffffffu : (1u << n) - 1u;
      }
    }
    for (std::int64_t row = 0; row < p.B * p.Hkv * p.Lq; ++row) {
      for (std::int64_t j = 0; j < p.Tk(); ++j) query_idx.data<std::int32_t>()[row * p.Tk() + j] = static_cast<std::int32_t>(j);
      for (std::int64_t j = 0; j < p.Lk; ++j) token_idx.data<std::int32_t>()[row * p.Lk + j] = static_cast<std::int32_t>(j);
    }
  }
};

/// Rows marked in `c.nan_row` must be NaN in every element of out and in lse; every other row must be
/// finite and within `tol` (relative to the largest |ref| element, at least 1) of `ref_out`, with lse
/// within `lse_tol` (relative to max(1, |ref|)) of `ref_lse` (both densely packed, out [B, Lq, Hq, D],
/// lse [B, Hq, Lq]).
inline void expect_rows(const Case& c, const HostTensor& out, const HostTensor& lse, const std::vector<double>& ref_out,
                        const std::vector<double>& ref_lse, double tol, double lse_tol, const std::string& what) {
  const ProblemShape& p = c.p;
  double scale = 1.0;
  for (std::size_t e = 0; e < ref_out.size(); ++e)
    if (std::isfinite(ref_out[e])) scale = std::max(scale, std::abs(ref_out[e]));
  int failures = 0;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Lq && failures < 5; ++i) {
        const std::int64_t li = (b * p.Hq + h) * p.Lq + i;
        const bool nan = c.nan_row[static_cast<std::size_t>(li)] != 0;
        const std::string where = what + " " + c.name + ": (b " + std::to_string(b) + ", head " + std::to_string(h) +
                                  ", query " + std::to_string(i) + ")";
        const double l = element(lse, li), rl = ref_lse[static_cast<std::size_t>(li)];
        if (nan ? !std::isnan(l) : !(l == rl || std::abs(l - rl) <= lse_tol * std::max(1.0, std::abs(rl)))) {
          ADD_FAILURE() << where << ": lse " << l << ", expected " << (nan ? std::string("NaN") : std::to_string(rl));
          ++failures;
          continue;
        }
        for (std::int64_t d = 0; d < p.D; ++d) {
          const std::int64_t e = at4(p, p.Lq, p.Hq, b, i, h, d);
          const double o = element(out, e), r = ref_out[static_cast<std::size_t>(e)];
          if (nan ? !std::isnan(o) : !(std::abs(o - r) <= tol * scale)) {
            ADD_FAILURE() << where << ": out element " << d << " is " << o << ", expected " << (nan ? std::string("NaN") : std::to_string(r));
            ++failures;
            break;
          }
        }
      }
}

}  // namespace sparse_attn::testing::nonfinite
