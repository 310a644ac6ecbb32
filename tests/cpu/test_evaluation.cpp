// Selection quality against a brute-force evaluation written here: the selection's meaning is
// re-derived from the format (not through selection_row), dense softmax in float64 per query.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
using sa::DType;
using sa::HostTensor;
using sa::kBlockK;
using sa::kTileQ;

namespace {

using I64 = std::int64_t;
using Picked = std::function<bool(I64 b, I64 h, I64 i, I64 j)>;  // selected, before causal visibility

struct Problem {
  I64 B, Lq, Lk, Hq, Hkv, D;
  bool causal;
  DType dtype = DType::f32;
};

struct Inputs {
  HostTensor q, k, v;
};

Inputs make_inputs(const Problem& p, std::uint64_t seed) {
  return {sa::testing::random_tensor(p.dtype, {p.B, p.Lq, p.Hq, p.D}, seed),
          sa::testing::random_tensor(p.dtype, {p.B, p.Lk, p.Hkv, p.D}, seed + 1),
          sa::testing::random_tensor(p.dtype, {p.B, p.Lk, p.Hkv, p.D}, seed + 2)};
}

double val(const HostTensor& t, I64 b, I64 l, I64 h, I64 d) {
  const auto& s = t.shape();
  return sa::testing::element(t, ((b * s[1] + l) * s[2] + h) * s[3] + d);
}

sa::QualityReport brute_force(const Problem& p, const Inputs& in, const Picked& picked, float softmax_scale = 0.0f) {
  // The scale in effect is the float the operators use (1/sqrt(D) rounded to float32).
  const double scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.D));
  const I64 group = p.Hq / p.Hkv, off = p.Lk - p.Lq;
  sa::QualityReport r;
  double kept_sum = 0, err = 0, ref = 0, kept_min = 2;
  I64 kept_n = 0, sel_tiles = 0, vis_tiles = 0;
  for (I64 h = 0; h < p.Hq; ++h) {
    double h_sum = 0, h_min = 2, h_err = 0, h_ref = 0;
    I64 h_n = 0;
    for (I64 b = 0; b < p.B; ++b) {
      std::set<std::pair<I64, I64>> sel_t, vis_t;  // (q tile, kv block)
      for (I64 i = 0; i < p.Lq; ++i) {
        std::vector<double> s(static_cast<std::size_t>(p.Lk));
        std::vector<bool> vis(static_cast<std::size_t>(p.Lk)), sel(static_cast<std::size_t>(p.Lk));
        double m = -INFINITY;
        for (I64 j = 0; j < p.Lk; ++j) {
          vis[static_cast<std::size_t>(j)] = !p.causal || j <= i + off;
          if (!vis[static_cast<std::size_t>(j)]) continue;
          sel[static_cast<std::size_t>(j)] = picked(b, h, i, j);
          vis_t.insert({i / kTileQ, j / kBlockK});
          if (sel[static_cast<std::size_t>(j)]) sel_t.insert({i / kTileQ, j / kBlockK});
          r.visible_pairs += 1;
          r.selected_pairs += sel[static_cast<std::size_t>(j)] ? 1 : 0;
          double d = 0;
          for (I64 x = 0; x < p.D; ++x) d += val(in.q, b, i, h, x) * val(in.k, b, j, h / group, x);
          s[static_cast<std::size_t>(j)] = d * scale;
          m = std::max(m, s[static_cast<std::size_t>(j)]);
        }
        if (m == -INFINITY) continue;  // sees nothing: both outputs 0, no mass statistics
        double z = 0, kept = 0;
        for (I64 j = 0; j < p.Lk; ++j)
          if (vis[static_cast<std::size_t>(j)]) {
            z += std::exp(s[static_cast<std::size_t>(j)] - m);
            if (sel[static_cast<std::size_t>(j)]) kept += std::exp(s[static_cast<std::size_t>(j)] - m);
          }
        for (I64 x = 0; x < p.D; ++x) {
          double dense = 0, sparse = 0;
          for (I64 j = 0; j < p.Lk; ++j) {
            if (!vis[static_cast<std::size_t>(j)]) continue;
            const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
            dense += w / z * val(in.v, b, j, h / group, x);
            if (sel[static_cast<std::size_t>(j)]) sparse += w / kept * val(in.v, b, j, h / group, x);
          }
          h_err += (sparse - dense) * (sparse - dense);
          h_ref += dense * dense;
        }
        h_sum += kept / z;
        h_min = std::min(h_min, kept / z);
        ++h_n;
      }
      sel_tiles += static_cast<I64>(sel_t.size());
      vis_tiles += static_cast<I64>(vis_t.size());
    }
    r.kept_mass_mean_per_head.push_back(h_n ? h_sum / double(h_n) : 1.0);
    r.kept_mass_min_per_head.push_back(h_n ? h_min : 1.0);
    r.out_rel_err_per_head.push_back(std::sqrt(h_err / h_ref));
    kept_sum += h_sum;
    kept_n += h_n;
    kept_min = std::min(kept_min, h_min);
    err += h_err;
    ref += h_ref;
  }
  r.kept_mass_mean = kept_n ? kept_sum / double(kept_n) : 1.0;
  r.kept_mass_min = kept_n ? kept_min : 1.0;
  r.out_rel_err = std::sqrt(err / ref);
  r.token_sparsity = 1.0 - double(r.selected_pairs) / double(r.visible_pairs);
  r.block_sparsity = 1.0 - double(sel_tiles) / double(vis_tiles);
  return r;
}

void expect_report(const sa::QualityReport& got, const sa::QualityReport& want) {
  EXPECT_NEAR(got.kept_mass_mean, want.kept_mass_mean, 1e-12);
  EXPECT_NEAR(got.kept_mass_min, want.kept_mass_min, 1e-12);
  EXPECT_NEAR(got.out_rel_err, want.out_rel_err, 1e-9 * std::max(1.0, want.out_rel_err));
  EXPECT_EQ(got.selected_pairs, want.selected_pairs);
  EXPECT_EQ(got.visible_pairs, want.visible_pairs);
  EXPECT_NEAR(got.token_sparsity, want.token_sparsity, 1e-15);
  EXPECT_NEAR(got.block_sparsity, want.block_sparsity, 1e-15);
  ASSERT_EQ(got.kept_mass_mean_per_head.size(), want.kept_mass_mean_per_head.size());
  ASSERT_EQ(got.kept_mass_min_per_head.size(), want.kept_mass_min_per_head.size());
  ASSERT_EQ(got.out_rel_err_per_head.size(), want.out_rel_err_per_head.size());
  for (std::size_t h = 0; h < want.kept_mass_mean_per_head.size(); ++h) {
    EXPECT_NEAR(got.kept_mass_mean_per_head[h], want.kept_mass_mean_per_head[h], 1e-12) << "head " << h;
    EXPECT_NEAR(got.kept_mass_min_per_head[h], want.kept_mass_min_per_head[h], 1e-12) << "head " << h;
    EXPECT_NEAR(got.out_rel_err_per_head[h], want.out_rel_err_per_head[h], 1e-9 * std::max(1.0, want.out_rel_err_per_head[h]))
        << "head " << h;
  }
}

sa::QualityOptions opts(bool causal) {
  sa::QualityOptions o;
  o.causal = causal;
  return o;
}

sa::ProblemShape shape_of(const Problem& p) {
  sa::ProblemShape s;
  s.B = p.B, s.Lq = p.Lq, s.Lk = p.Lk, s.Hq = p.Hq, s.Hkv = p.Hkv, s.D = p.D, s.causal = p.causal;
  return s;
}

void expect_full(const sa::QualityReport& r, const Problem& p) {
  EXPECT_EQ(r.kept_mass_mean, 1.0);  // sparse and dense sums run over the same keys in the same order
  EXPECT_NEAR(r.kept_mass_min, 1.0, 1e-15);
  EXPECT_EQ(r.out_rel_err, 0.0);
  EXPECT_EQ(r.token_sparsity, 0.0);
  EXPECT_EQ(r.block_sparsity, 0.0);
  EXPECT_EQ(r.visible_pairs, shape_of(p).visible_pairs() * p.B * p.Hq);
  EXPECT_EQ(r.selected_pairs, r.visible_pairs);
  ASSERT_EQ(r.kept_mass_min_per_head.size(), static_cast<std::size_t>(p.Hq));
  for (I64 h = 0; h < p.Hq; ++h) {
    EXPECT_NEAR(r.kept_mass_min_per_head[static_cast<std::size_t>(h)], 1.0, 1e-15);
    EXPECT_EQ(r.out_rel_err_per_head[static_cast<std::size_t>(h)], 0.0);
  }
}

TEST(Evaluation, FullSelectionKeepsEverything) {
  const Problem problems[] = {{2, 200, 300, 4, 2, 16, false, DType::f32},
                              {2, 200, 300, 4, 2, 16, true, DType::bf16},
                              {1, 300, 129, 2, 1, 8, true, DType::f16},  // the first queries see nothing
                              {1, 1, 300, 16, 1, 8, true, DType::f32}};
  std::uint64_t seed = 10;
  for (const auto& p : problems) {
    SCOPED_TRACE("Lq=" + std::to_string(p.Lq) + " Lk=" + std::to_string(p.Lk) + " causal=" + std::to_string(p.causal));
    const Inputs in = make_inputs(p, seed += 3);
    expect_full(sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::AllBlocks{}, opts(p.causal)), p);
    // The same through explicit per-group lists naming every block.
    const I64 Tq = sa::ceil_div(p.Lq, kTileQ), Tk = sa::ceil_div(p.Lk, kBlockK);
    HostTensor idx(DType::i32, {p.B, p.Hkv, Tq, Tk}), cnt(DType::i32, {p.B, p.Hkv, Tq});
    for (I64 r = 0; r < p.B * p.Hkv * Tq; ++r) {
      cnt.data<std::int32_t>()[r] = static_cast<std::int32_t>(Tk);
      for (I64 j = 0; j < Tk; ++j) idx.data<std::int32_t>()[r * Tk + j] = static_cast<std::int32_t>(j);
    }
    expect_full(sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::TileLists{idx.view(), cnt.view()},
                                       opts(p.causal)),
                p);
  }
}

// Tile 0 keeps block 1, tile 1 keeps blocks 0 and 3: the sparsities are known in closed form.
TEST(Evaluation, HandMadeTileListsMatchBruteForce) {
  const Problem p{1, 256, 512, 1, 1, 16, false};
  const Inputs in = make_inputs(p, 50);
  HostTensor idx(DType::i32, {1, 1, 2, 2}), cnt(DType::i32, {1, 1, 2});
  std::int32_t* ix = idx.data<std::int32_t>();
  ix[0] = 1, ix[1] = -1, ix[2] = 0, ix[3] = 3;
  cnt.data<std::int32_t>()[0] = 1, cnt.data<std::int32_t>()[1] = 2;
  const auto r = sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::TileLists{idx.view(), cnt.view()}, opts(false));
  EXPECT_EQ(r.selected_pairs, 128 * 128 + 128 * 256);
  EXPECT_EQ(r.visible_pairs, 256 * 512);
  EXPECT_DOUBLE_EQ(r.token_sparsity, 0.625);
  EXPECT_DOUBLE_EQ(r.block_sparsity, 1.0 - 3.0 / 8.0);
  EXPECT_GT(r.out_rel_err, 0.0);
  EXPECT_LT(r.kept_mass_mean, 1.0);
  expect_report(r, brute_force(p, in, [](I64, I64, I64 i, I64 j) {
                  return i < 128 ? j / 128 == 1 : (j / 128 == 0 || j / 128 == 3);
                }));
}

// Random token lists (GQA, causal, B = 2 with different lists), some rows empty.
TEST(Evaluation, TokenListsMatchBruteForce) {
  const Problem p{2, 150, 260, 4, 2, 16, true, DType::bf16};
  const Inputs in = make_inputs(p, 70);
  const I64 Kt = 6;
  HostTensor idx(DType::i32, {p.B, p.Hkv, p.Lq, Kt});
  std::mt19937_64 rng(71);
  std::vector<std::set<I64>> lists(static_cast<std::size_t>(p.B * p.Hkv * p.Lq));
  for (I64 r = 0; r < p.B * p.Hkv * p.Lq; ++r) {
    auto& set = lists[static_cast<std::size_t>(r)];
    const I64 n = r % 9 == 4 ? 0 : static_cast<I64>(rng() % (Kt + 1));
    while (static_cast<I64>(set.size()) < n) set.insert(static_cast<I64>(rng() % p.Lk));  // some invisible
    I64 s = 0;
    for (I64 j : set) idx.data<std::int32_t>()[r * Kt + s++] = static_cast<std::int32_t>(j);
    for (; s < Kt; ++s) idx.data<std::int32_t>()[r * Kt + s] = -1;
  }
  const auto r = sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::TokenLists{idx.view()}, opts(true));
  EXPECT_EQ(r.kept_mass_min, 0.0);  // rows with no visible selected key keep nothing
  expect_report(r, brute_force(p, in, [&](I64 b, I64 h, I64 i, I64 j) {
                  return lists[static_cast<std::size_t>((b * p.Hkv + h / 2) * p.Lq + i)].count(j) > 0;
                }));
}

// Per-query block lists with Hq = 16 x Hkv and a causal offset.
TEST(Evaluation, QueryListsMatchBruteForce) {
  const Problem p{1, 130, 300, 16, 1, 8, true};
  const Inputs in = make_inputs(p, 90);
  const I64 Kq = 2;
  HostTensor idx(DType::i32, {1, 1, p.Lq, Kq});
  std::mt19937_64 rng(91);
  for (I64 i = 0; i < p.Lq; ++i) {
    const auto a = static_cast<std::int32_t>(rng() % 3);
    idx.data<std::int32_t>()[i * Kq] = a;
    idx.data<std::int32_t>()[i * Kq + 1] = i % 5 == 0 ? -1 : (a + 1 + static_cast<std::int32_t>(rng() % 2)) % 3;
  }
  const auto r = sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::QueryLists{idx.view()}, opts(true));
  expect_report(r, brute_force(p, in, [&](I64, I64, I64 i, I64 j) {
                  const std::int32_t* row = idx.data<std::int32_t>() + i * Kq;
                  return row[0] == j / 128 || row[1] == j / 128;
                }));
}

TEST(Evaluation, HonoursSoftmaxScale) {
  const Problem p{1, 140, 260, 2, 2, 8, false};
  const Inputs in = make_inputs(p, 120);
  HostTensor idx(DType::i32, {1, 2, 2, 1}), cnt(DType::i32, {1, 2, 2});
  for (int r = 0; r < 4; ++r) idx.data<std::int32_t>()[r] = r % 3, cnt.data<std::int32_t>()[r] = 1;
  sa::QualityOptions o;
  o.softmax_scale = 0.9f;
  const auto r = sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::TileLists{idx.view(), cnt.view()}, o);
  expect_report(r, brute_force(p, in, [&](I64, I64 h, I64 i, I64 j) {
                  return idx.data<std::int32_t>()[h * 2 + i / 128] == j / 128;
                }, 0.9f));
}

// Selector output evaluated end to end: every block kept gives the dense result; two blocks per
// tile give the block sparsity 1 - 2 / Tk exactly (non-causal: every tile is visible).
TEST(Evaluation, PooledSelectionEndToEnd) {
  const Problem p{2, 256, 640, 4, 2, 16, false, DType::bf16};
  const Inputs in = make_inputs(p, 130);
  const I64 Tq = 2, Tk = 5;
  for (int top_k : {5, 2}) {
    HostTensor idx(DType::i32, {p.B, p.Hkv, Tq, top_k}), cnt(DType::i32, {p.B, p.Hkv, Tq});
    sa::PooledOptions po;
    po.top_k = top_k;
    po.representatives = 4;
    sa::pooled_select(in.q.view(), in.k.view(), {idx.view(), cnt.view()}, po);
    const auto r = sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::TileLists{idx.view(), cnt.view()});
    if (top_k == Tk) {
      expect_full(r, p);
    } else {
      EXPECT_DOUBLE_EQ(r.block_sparsity, 1.0 - 2.0 / 5.0);
      EXPECT_GT(r.kept_mass_mean, 0.0);
      EXPECT_LT(r.kept_mass_mean, 1.0);
      EXPECT_GT(r.out_rel_err, 0.0);
    }
  }
}

TEST(Evaluation, RejectsBadArguments) {
  const Problem p{1, 100, 200, 2, 1, 8, false};
  const Inputs in = make_inputs(p, 110);
  auto expect_arg = [](auto&& f, const std::string& arg) {
    try {
      f();
      ADD_FAILURE() << "no Error for '" << arg << "'";
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  const HostTensor v_bad = sa::testing::random_tensor(DType::f32, {1, 201, 1, 8}, 111);
  expect_arg([&] { sa::evaluate_selection(in.q.view(), in.k.view(), v_bad.view(), sa::AllBlocks{}); }, "v");
  const HostTensor k3 = sa::testing::random_tensor(DType::f32, {1, 200, 3, 8}, 112);
  expect_arg([&] { sa::evaluate_selection(in.q.view(), k3.view(), k3.view(), sa::AllBlocks{}); }, "k");
  HostTensor q64(DType::f64, {1, 100, 2, 8});
  expect_arg([&] { sa::evaluate_selection(q64.view(), in.k.view(), in.v.view(), sa::AllBlocks{}); }, "q");
  sa::QualityOptions bad_scale;
  bad_scale.softmax_scale = -1.0f;
  expect_arg([&] { sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::AllBlocks{}, bad_scale); }, "softmax_scale");
  HostTensor idx(DType::i32, {1, 1, 1, 2}), cnt(DType::i32, {1, 1, 1});
  idx.data<std::int32_t>()[0] = 0, idx.data<std::int32_t>()[1] = 7;  // Tk = 2: block 7 is out of range
  cnt.data<std::int32_t>()[0] = 2;
  EXPECT_THROW(sa::evaluate_selection(in.q.view(), in.k.view(), in.v.view(), sa::TileLists{idx.view(), cnt.view()}), sa::Error);
  sa::TensorView qd = in.q.view(), kd = in.k.view(), vd = in.v.view();
  qd.device = kd.device = vd.device = sa::Device::cuda;
  expect_arg([&] { sa::evaluate_selection(qd, kd, vd, sa::AllBlocks{}); }, "q");
}

}  // namespace
