// Non-finite scores on the CPU (docs/design.md §2): a NaN or +inf score among a row's visible, selected keys
// (NaN in q or k, +inf in k, finite inputs whose score or scaled score overflows float32) makes that
// row's out and lse NaN in every executor (dense, tile_sparse, bits_sparse, query_sparse,
// token_sparse, gated); a -inf score weighs 0; every other row is as the float64 reference has it.
// gated keeps a block whose scores hold a NaN whatever its threshold. NaN in v reaches out, not lse.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/cpu_kernel.hpp"
#include "common/nonfinite_testing.hpp"
#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;
namespace nf = sparse_attn::testing::nonfinite;

namespace {

sa::ProblemShape shape() {
  sa::ProblemShape p;
  p.B = 1, p.Lq = 256, p.Lk = 256, p.Hq = 4, p.Hkv = 2, p.D = 32, p.causal = true;
  return p;
}

struct Outputs {
  sa::HostTensor out, lse;
};

Outputs run(const nf::Case& c, const std::string& executor, const nf::FullSelections& sel) {
  const sa::ProblemShape& p = c.p;
  Outputs r{sa::HostTensor(c.q.dtype(), {p.B, p.Lq, p.Hq, p.D}), sa::HostTensor(sa::DType::f32, {p.B, p.Hq, p.Lq})};
  st::poison(r.out);
  st::poison(r.lse);
  sa::AttentionOptions o;
  o.causal = p.causal;
  o.softmax_scale = c.scale;
  const auto q = c.q.view(), k = c.k.view(), v = c.v.view(), out = r.out.view(), lse = r.lse.view();
  if (executor == "dense") sa::dense(q, k, v, out, lse, o);
  if (executor == "tile_sparse") sa::tile_sparse(q, k, v, {sel.tile_idx.view(), sel.tile_cnt.view()}, out, lse, o);
  if (executor == "bits_sparse") sa::bits_sparse(q, k, v, {sel.bits.view()}, out, lse, o);
  if (executor == "query_sparse") {
    sa::QuerySparseOptions qo;
    static_cast<sa::AttentionOptions&>(qo) = o;
    sa::query_sparse(q, k, v, {sel.query_idx.view()}, out, lse, qo);
  }
  if (executor == "token_sparse") sa::token_sparse(q, k, v, {sel.token_idx.view()}, out, lse, o);
  if (executor == "gated") {  // causal only; a threshold of -inf keeps every block
    EXPECT_TRUE(p.causal);
    sa::HostTensor t(sa::DType::f32, {p.Hq, p.Tq()});
    std::fill(t.data<float>(), t.data<float>() + t.numel(), -std::numeric_limits<float>::infinity());
    sa::GatedOptions g;
    g.softmax_scale = c.scale;
    sa::gated(q, k, v, t.view(), out, lse, g);
  }
  return r;
}

TEST(NonFinite, ExpF32PassesNaN) {
  EXPECT_TRUE(std::isnan(sa::detail::attn::exp_f32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(sa::detail::attn::exp_f32(-std::numeric_limits<float>::infinity()), 0.0f);
}

TEST(NonFinite, EveryExecutorGivesNaNRowsAndLeavesTheOthers) {
  for (const sa::DType dtype : {sa::DType::f32, sa::DType::bf16})
    for (const bool causal : {true, false}) {
      sa::ProblemShape p = shape();
      p.causal = causal;
      for (const nf::Case& c : nf::make_cases(p, dtype, 11)) {
        const nf::FullSelections sel(c.p);
        const double scale = c.scale ? double(*c.scale) : 1.0 / std::sqrt(double(c.p.D));
        const st::Reference ref = st::reference_attention(c.q.view(), c.k.view(), c.v.view(), sa::AllBlocks{}, c.p, scale);
        std::vector<std::string> executors = {"dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse"};
        if (c.p.causal) executors.push_back("gated");
        for (const std::string& ex : executors) {
          const Outputs r = run(c, ex, sel);
          nf::expect_rows(c, r.out, r.lse, ref.out, ref.lse, dtype == sa::DType::f32 ? 1e-5 : 1e-2, 1e-5,
                          ex + " " + sa::dtype_name(dtype) + (causal ? " causal" : ""));
        }
      }
    }
}

TEST(NonFinite, RowsThatSeeNoKeyStayZeroAndMinusInf) {
  // Lq > Lk under the causal mask: the first 100 queries see no key, also next to NaN rows.
  sa::ProblemShape p = shape();
  p.Lq = 300;
  p.Lk = 200;
  sa::HostTensor q = st::random_tensor(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}, 21);
  const sa::HostTensor k = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 22);
  const sa::HostTensor v = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 23);
  for (std::int64_t i = 0; i < p.Lq; ++i) q.data<float>()[nf::at4(p, p.Lq, p.Hq, 0, i, 0, 0)] = std::numeric_limits<float>::quiet_NaN();
  nf::Case c{"no_key_next_to_nan", q, k, v, p, std::nullopt, std::vector<char>(static_cast<std::size_t>(p.Hq * p.Lq), 0)};
  for (std::int64_t i = 100; i < p.Lq; ++i) c.nan_row[static_cast<std::size_t>(i)] = 1;  // head 0
  const nf::FullSelections sel(p);
  const st::Reference ref = st::reference_attention(q.view(), k.view(), v.view(), sa::AllBlocks{}, p, 1.0 / std::sqrt(32.0));
  for (const std::string ex : {"dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse"}) {
    const Outputs r = run(c, ex, sel);
    nf::expect_rows(c, r.out, r.lse, ref.out, ref.lse, 1e-5, 1e-5, ex);
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < 100; ++i) {
        EXPECT_EQ(r.lse.data<float>()[h * p.Lq + i], -std::numeric_limits<float>::infinity()) << ex;
        EXPECT_EQ(r.out.data<float>()[nf::at4(p, p.Lq, p.Hq, 0, i, h, 0)], 0.0f) << ex;
      }
  }
}

TEST(NonFinite, GatedKeepsABlockWithANaNScoreWhateverItsThreshold) {
  // Thresholds of FLT_MAX gate off every off-diagonal block (no sink block); a NaN in key 10 (block
  // 0) must still reach every row of heads 2 and 3 that sees it, in gate tiles 2 and 3 (block 0 off
  // the diagonal) as well as in gate tiles 0 and 1 (block 0 on it).
  const sa::ProblemShape p = shape();
  const sa::HostTensor q = st::random_tensor(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}, 31);
  sa::HostTensor k = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 32);
  const sa::HostTensor v = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 33);
  sa::HostTensor t(sa::DType::f32, {p.Hq, p.Tq()});
  std::fill(t.data<float>(), t.data<float>() + t.numel(), std::numeric_limits<float>::max());
  sa::HostTensor out(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}), lse(sa::DType::f32, {p.B, p.Hq, p.Lq});
  sa::GatedOptions g;
  g.sink_blocks = 0;
  const sa::GatedStats clean = sa::gated(q.view(), k.view(), v.view(), t.view(), out.view(), lse.view(), g);
  EXPECT_EQ(clean.gated_kept, 0);
  k.data<float>()[nf::at4(p, p.Lk, p.Hkv, 0, 10, 1, 4)] = std::numeric_limits<float>::quiet_NaN();
  const sa::GatedStats stats = sa::gated(q.view(), k.view(), v.view(), t.view(), out.view(), lse.view(), g);
  EXPECT_EQ(stats.gated_kept, 4);  // block 0 for gate tiles 2 and 3 of heads 2 and 3
  for (std::int64_t h = 0; h < p.Hq; ++h)
    for (std::int64_t i = 0; i < p.Lq; ++i) {
      const bool nan = h >= 2 && i >= 10;
      EXPECT_EQ(std::isnan(lse.data<float>()[h * p.Lq + i]), nan) << "head " << h << " query " << i;
      EXPECT_EQ(std::isnan(out.data<float>()[nf::at4(p, p.Lq, p.Hq, 0, i, h, 0)]), nan) << "head " << h << " query " << i;
    }
}

TEST(NonFinite, NaNInValuesReachesOutButNotLse) {
  const sa::ProblemShape p = shape();
  const sa::HostTensor q = st::random_tensor(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}, 41);
  const sa::HostTensor k = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 42);
  sa::HostTensor v = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 43);
  sa::HostTensor out(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}), lse(sa::DType::f32, {p.B, p.Hq, p.Lq});
  sa::AttentionOptions o;
  o.causal = true;
  sa::dense(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
  const sa::HostTensor clean_lse = lse;
  v.data<float>()[nf::at4(p, p.Lk, p.Hkv, 0, 130, 0, 7)] = std::numeric_limits<float>::quiet_NaN();
  sa::dense(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
  for (std::int64_t i = 0; i < p.Lq; ++i)
    for (std::int64_t h = 0; h < p.Hq; ++h) {
      EXPECT_EQ(lse.data<float>()[h * p.Lq + i], clean_lse.data<float>()[h * p.Lq + i]);
      const float o7 = out.data<float>()[nf::at4(p, p.Lq, p.Hq, 0, i, h, 7)];
      if (h < 2 && i >= 130) EXPECT_TRUE(std::isnan(o7)) << "query " << i << " head " << h;
      if (h >= 2 || i < 128) EXPECT_FALSE(std::isnan(o7)) << "query " << i << " head " << h;
    }
}

TEST(NonFinite, HugeFiniteScaleGivesTheArgmaxNotNaN) {
  // softmax_scale = 1e30 on scores of order 1: every scaled score is finite, and softmax is then the
  // one-hot of each row's largest score (random scores have no ties), so out is v of that key. The
  // weight of the max is computed as exp((s - m) * scale) = 1; exp(s * scale - m * scale) would be exp
  // of the rounding error of m * scale (about 1e23) and overflow. Scaled scores past float32 stay NaN.
  sa::ProblemShape p = shape();
  p.causal = false;
  const sa::HostTensor q = st::random_tensor(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}, 51);
  const sa::HostTensor k = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 52);
  const sa::HostTensor v = st::random_tensor(sa::DType::f32, {p.B, p.Lk, p.Hkv, p.D}, 53);
  sa::HostTensor out(sa::DType::f32, {p.B, p.Lq, p.Hq, p.D}), lse(sa::DType::f32, {p.B, p.Hq, p.Lq});
  sa::AttentionOptions o;
  o.softmax_scale = 1e30f;
  const nf::FullSelections sel(p);
  nf::Case c{"huge_scale", q, k, v, p, 1e30f, std::vector<char>(static_cast<std::size_t>(p.Hq * p.Lq), 0)};
  for (const std::string ex : {"dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse"}) {
    const Outputs r = run(c, ex, sel);
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Lq; ++i) {
        const std::int64_t kh = h / (p.Hq / p.Hkv);
        std::int64_t best = 0;
        double best_s = -1e300;
        for (std::int64_t j = 0; j < p.Lk; ++j) {
          double s = 0;
          for (std::int64_t d = 0; d < p.D; ++d)
            s += double(q.data<float>()[nf::at4(p, p.Lq, p.Hq, 0, i, h, d)]) *
                 double(k.data<float>()[nf::at4(p, p.Lk, p.Hkv, 0, j, kh, d)]);
          if (s > best_s) best_s = s, best = j;
        }
        const float l = r.lse.data<float>()[h * p.Lq + i];
        EXPECT_TRUE(std::isfinite(l)) << ex << " head " << h << " query " << i;
        EXPECT_NEAR(l, best_s * 1e30, std::abs(best_s) * 1e30 * 1e-5) << ex << " head " << h << " query " << i;
        for (std::int64_t d = 0; d < p.D; ++d)
          ASSERT_NEAR(r.out.data<float>()[nf::at4(p, p.Lq, p.Hq, 0, i, h, d)],
                      v.data<float>()[nf::at4(p, p.Lk, p.Hkv, 0, best, kh, d)], 1e-6)
              << ex << " head " << h << " query " << i;
      }
  }
}

}  // namespace
