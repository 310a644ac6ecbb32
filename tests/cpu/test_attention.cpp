// CPU executors dense, tile_sparse, bits_sparse, token_sparse and sparse_attention against the
// float64 reference that applies the selection as an explicit mask (docs/design.md §6), on awkward shapes,
// plus their agreement with each other and their error reporting. query_sparse has its own suite.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/cpu_backend.hpp"
#include "attention/cpu_kernel.hpp"
#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

// Test shapes are the library's own problem shape: {B, Lq, Lk, Hq, Hkv, D, causal}.
using Shape = sa::ProblemShape;

// Fresh random inputs, poisoned outputs, and the problem shape as the library sees it.
struct Problem {
  Shape s;
  sa::DType dtype;
  sa::HostTensor q, k, v, out, lse;
  sa::ProblemShape p;

  // `qk_stddev` scales q and k: 4 gives scores with a standard deviation of 16, so the running max
  // moves often and most weights underflow, which exercises the online rescaling.
  Problem(const Shape& shape, sa::DType dt, std::uint64_t seed, float qk_stddev = 1.0f) : s(shape), dtype(dt) {
    q = st::random_tensor(dt, {s.B, s.Lq, s.Hq, s.D}, seed * 7 + 1, qk_stddev);
    k = st::random_tensor(dt, {s.B, s.Lk, s.Hkv, s.D}, seed * 7 + 2, qk_stddev);
    v = st::random_tensor(dt, {s.B, s.Lk, s.Hkv, s.D}, seed * 7 + 3);
    out = sa::HostTensor(dt, {s.B, s.Lq, s.Hq, s.D});
    lse = sa::HostTensor(sa::DType::f32, {s.B, s.Hq, s.Lq});
    st::poison(out);
    st::poison(lse);
    p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.Hq = s.Hq, p.Hkv = s.Hkv, p.D = s.D, p.causal = s.causal;
  }

  sa::AttentionOptions options() const {
    sa::AttentionOptions o;
    o.causal = s.causal;
    return o;
  }
  double scale() const { return 1.0 / std::sqrt(double(s.D)); }
  st::Reference reference(const sa::Selection& sel) const {
    return st::reference_attention(q.view(), k.view(), v.view(), sel, p, scale());
  }
};

// Output bounds: fp32 is checked at the level of float32 arithmetic; 16-bit outputs at one rounding
// to the storage format (docs/design.md §6 expects about 3e-3 for bf16).
double out_bound(sa::DType dt) { return dt == sa::DType::f32 ? 1e-5 : dt == sa::DType::f16 ? 2e-3 : 8e-3; }

void expect_matches(const Problem& pr, const st::Reference& ref, const std::string& what, double lse_bound = 1e-5) {
  SCOPED_TRACE(what + " " + pr.s.describe() + " " + sa::dtype_name(pr.dtype));
  ASSERT_TRUE(st::all_finite(pr.out)) << "output has NaN (unwritten or invalid)";
  ASSERT_TRUE(st::all_finite(pr.lse, /*allow_neg_inf=*/true)) << "lse has NaN or +inf";
  EXPECT_LE(st::rel_err(pr.out, ref.out), out_bound(pr.dtype));
  // lse is float32 whatever the input dtype; its inputs are the stored values, so the bound is fp32's.
  EXPECT_LE(st::lse_max_err(pr.lse, ref.lse), lse_bound);
  const double max_ref = std::accumulate(ref.out.begin(), ref.out.end(), 0.0,
                                         [](double m, double x) { return std::max(m, std::abs(x)); });
  EXPECT_LE(st::max_abs_err(pr.out, ref.out), 16 * out_bound(pr.dtype) * std::max(1.0, max_ref));
}

bool bitwise_equal(const sa::HostTensor& a, const sa::HostTensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.view().data, b.view().data, static_cast<std::size_t>(a.numel()) * sa::dtype_size(a.dtype())) == 0;
}

struct TileSel {
  sa::HostTensor idx, cnt;
  sa::TileLists lists() const { return {idx.view(), cnt.view()}; }
};

// Random TileLists with G groups: each tile draws a random count in [0, kmax] of distinct ascending
// blocks (so some tiles are empty), and tile `empty_tile` (if >= 0) of every (b, g) is forced empty.
// Unused slots hold -1. Different (b, g) get different lists.
TileSel random_tiles(const sa::ProblemShape& p, std::int64_t G, std::int64_t kmax, std::uint64_t seed,
                     std::int64_t empty_tile = -1) {
  TileSel t{sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq(), kmax}), sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq()})};
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> all(static_cast<std::size_t>(p.Tk()));
  std::iota(all.begin(), all.end(), 0);
  auto* idx = t.idx.data<std::int32_t>();
  auto* cnt = t.cnt.data<std::int32_t>();
  for (std::int64_t row = 0; row < p.B * G * p.Tq(); ++row) {
    std::shuffle(all.begin(), all.end(), rng);
    std::int64_t c = std::uniform_int_distribution<std::int64_t>(0, std::min(kmax, p.Tk()))(rng);
    if (row % p.Tq() == empty_tile) c = 0;
    std::vector<std::int32_t> pick(all.begin(), all.begin() + c);
    std::sort(pick.begin(), pick.end());
    cnt[row] = static_cast<std::int32_t>(c);
    for (std::int64_t s = 0; s < kmax; ++s) idx[row * kmax + s] = s < c ? pick[static_cast<std::size_t>(s)] : -1;
  }
  return t;
}

// Every block of every tile, as TileLists.
TileSel full_tiles(const sa::ProblemShape& p, std::int64_t G) {
  TileSel t{sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq(), p.Tk()}), sa::HostTensor(sa::DType::i32, {p.B, G, p.Tq()})};
  for (std::int64_t row = 0; row < p.B * G * p.Tq(); ++row) {
    t.cnt.data<std::int32_t>()[row] = static_cast<std::int32_t>(p.Tk());
    for (std::int64_t j = 0; j < p.Tk(); ++j) t.idx.data<std::int32_t>()[row * p.Tk() + j] = static_cast<std::int32_t>(j);
  }
  return t;
}

// Random TokenLists: per (b, g, query) up to kt distinct positions in random order, -1 in random
// slots, and every 5th query with an all -1 row.
sa::HostTensor random_tokens(const sa::ProblemShape& p, std::int64_t kt, std::uint64_t seed) {
  sa::HostTensor idx(sa::DType::i32, {p.B, p.Hkv, p.Lq, kt});
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> all(static_cast<std::size_t>(p.Lk));
  std::iota(all.begin(), all.end(), 0);
  auto* d = idx.data<std::int32_t>();
  for (std::int64_t row = 0; row < p.B * p.Hkv * p.Lq; ++row) {
    std::shuffle(all.begin(), all.end(), rng);
    for (std::int64_t s = 0; s < kt; ++s) {
      const bool empty = row % 5 == 3 || s >= p.Lk || std::uniform_int_distribution<int>(0, 3)(rng) == 0;
      d[row * kt + s] = empty ? -1 : all[static_cast<std::size_t>(s)];
    }
  }
  return idx;
}

template <class F>
void expect_error(F&& f, const std::string& op, const std::string& argument, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected sparse_attn::Error from " << op << " naming '" << argument << "'";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// The awkward shapes of docs/design.md §6 (small head dims where the float64 reference would be slow).
const std::vector<Shape> kShapes = {
    {2, 300, 300, 4, 4, 64, false},     // B > 1, Hq = Hkv, partial last tile and block
    {2, 300, 300, 4, 4, 64, true},
    {1, 1, 1000, 16, 1, 128, false},    // Lq = 1, Hq = 16 x Hkv, Lk not a multiple of 128
    {1, 1, 1000, 16, 1, 128, true},
    {1, 17, 260, 8, 2, 48, true},       // Lq < Lk causal, D not a multiple of the vector chunk
    {1, 1013, 1013, 2, 1, 32, true},    // Lq = 1013
    {2, 300, 140, 4, 1, 16, true},      // Lq > Lk causal: the first 160 queries see no key
};

}  // namespace

// ---- the vectorised exp --------------------------------------------------------------------------

TEST(ExpF32, WithinTwoUlpOfExpAndZeroBelowRange) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.00731f) {
    const double ref = std::exp(double(x));
    const float y = sa::detail::attn::exp_f32(x);
    const double ulp = std::nextafter(float(ref), INFINITY) - float(ref);
    worst = std::max(worst, std::abs(y - ref) / ulp);
  }
  EXPECT_LE(worst, 2.0);
  EXPECT_EQ(sa::detail::attn::exp_f32(0.0f), 1.0f);
  EXPECT_EQ(sa::detail::attn::exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(sa::detail::attn::exp_f32(-1000.0f), 0.0f);
}

// ---- dense -------------------------------------------------------------------------------------

TEST(Dense, MatchesFloat64ReferenceOnAwkwardShapes) {
  std::uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    Problem pr(s, sa::DType::f32, seed++);
    sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), pr.lse.view(), pr.options());
    expect_matches(pr, pr.reference(sa::AllBlocks{}), "dense");
  }
}

TEST(Dense, QueriesThatSeeNoKeyGiveZeroAndMinusInf) {
  Problem pr({1, 200, 50, 2, 1, 16, true}, sa::DType::f32, 11);  // offset -150
  sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), pr.lse.view(), pr.options());
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 200; ++i) {
      const float l = pr.lse.data<float>()[h * 200 + i];
      if (i < 150) {
        EXPECT_EQ(l, -INFINITY) << "query " << i;
        for (std::int64_t d = 0; d < 16; ++d) EXPECT_EQ(pr.out.data<float>()[(i * 2 + h) * 16 + d], 0.0f);
      } else {
        EXPECT_TRUE(std::isfinite(l)) << "query " << i;
      }
    }
  expect_matches(pr, pr.reference(sa::AllBlocks{}), "dense");
}

TEST(Dense, SharpSoftmaxWithLargeScores) {
  for (const Shape& s : {Shape{1, 300, 1000, 4, 2, 64, true}, Shape{2, 17, 700, 4, 4, 32, false}}) {
    Problem pr(s, sa::DType::f32, 15, 4.0f);
    // Scores reach about 60 here, and a float32 score carries an absolute error of a few ulps of
    // that magnitude, so the LSE bound is relative to the largest LSE (1e-6 of it is about 8 ulps).
    auto lse_bound = [](const st::Reference& ref) {
      double m = 1.0;
      for (double x : ref.lse)
        if (std::isfinite(x)) m = std::max(m, std::abs(x));
      return 1e-6 * m;
    };
    sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), pr.lse.view(), pr.options());
    const st::Reference dense_ref = pr.reference(sa::AllBlocks{});
    expect_matches(pr, dense_ref, "dense, sharp softmax", lse_bound(dense_ref));
    const TileSel t = random_tiles(pr.p, s.Hkv, 4, 16);
    st::poison(pr.out);
    st::poison(pr.lse);
    sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view(), pr.lse.view(), pr.options());
    const st::Reference tile_ref = pr.reference(t.lists());
    expect_matches(pr, tile_ref, "tile_sparse, sharp softmax", lse_bound(tile_ref));
  }
}

TEST(Dense, Bf16AndF16InputsWithinOneRounding) {
  for (sa::DType dt : {sa::DType::bf16, sa::DType::f16}) {
    for (const Shape& s : {Shape{2, 130, 257, 8, 2, 64, true}, Shape{1, 17, 300, 16, 1, 128, false}}) {
      Problem pr(s, dt, 21);
      sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), pr.lse.view(), pr.options());
      expect_matches(pr, pr.reference(sa::AllBlocks{}), "dense");
    }
  }
}

TEST(Dense, StridedViewsAndExplicitScale) {
  // q, k, v and out are views into wider buffers (padding after each head and between tokens);
  // lse is a [B, Hq, Lq] view of a [B, Lq, Hq] buffer (transposed strides).
  const std::int64_t B = 2, Lq = 150, Lk = 200, Hq = 4, Hkv = 2, D = 32;
  auto wide = [](sa::DType dt, std::int64_t b, std::int64_t l, std::int64_t h, std::int64_t d, std::uint64_t seed) {
    return st::random_tensor(dt, {b, l, h, d + 8}, seed);
  };
  sa::HostTensor qb = wide(sa::DType::f32, B, Lq, Hq, D, 31), kb = wide(sa::DType::f32, B, Lk, Hkv, D, 32),
                 vb = wide(sa::DType::f32, B, Lk, Hkv, D, 33), ob(sa::DType::f32, {B, Lq, Hq, D + 8}),
                 lb(sa::DType::f32, {B, Lq, Hq});
  st::poison(ob);
  st::poison(lb);
  auto narrow = [&](const sa::HostTensor& t) {
    sa::TensorView v = t.view();
    v.shape[3] = D;
    return v;
  };
  sa::TensorView lse = lb.view();
  lse.shape = {B, Hq, Lq};
  lse.stride = {Lq * Hq, 1, Hq};

  sa::AttentionOptions o;
  o.causal = true;
  o.softmax_scale = 0.3f;
  sa::dense(narrow(qb), narrow(kb), narrow(vb), narrow(ob), lse, o);

  // Same problem on packed copies.
  Problem pr({B, Lq, Lk, Hq, Hkv, D, true}, sa::DType::f32, 0);
  auto pack = [&](const sa::HostTensor& src, sa::HostTensor& dst) {
    const std::int64_t rows = dst.numel() / D;
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(dst.data<float>() + r * D, src.data<float>() + r * (D + 8), D * sizeof(float));
  };
  pack(qb, pr.q);
  pack(kb, pr.k);
  pack(vb, pr.v);
  sa::HostTensor out(sa::DType::f32, {B, Lq, Hq, D});
  pack(ob, out);
  const st::Reference ref = st::reference_attention(pr.q.view(), pr.k.view(), pr.v.view(), sa::AllBlocks{}, pr.p, 0.3);
  EXPECT_LE(st::rel_err(out, ref.out), 1e-5);
  sa::HostTensor lse_packed(sa::DType::f32, {B, Hq, Lq});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Lq; ++i)
        lse_packed.data<float>()[(b * Hq + h) * Lq + i] = lb.data<float>()[(b * Lq + i) * Hq + h];
  EXPECT_LE(st::lse_max_err(lse_packed, ref.lse), 1e-5);
  // The padding of out was not written.
  for (std::int64_t r = 0; r < B * Lq * Hq; ++r)
    for (std::int64_t d = D; d < D + 8; ++d) EXPECT_TRUE(std::isnan(ob.data<float>()[r * (D + 8) + d]));
}

TEST(Dense, WithoutLse) {
  Problem pr({1, 129, 129, 2, 2, 32, true}, sa::DType::f32, 41);
  sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), std::nullopt, pr.options());
  EXPECT_LE(st::rel_err(pr.out, pr.reference(sa::AllBlocks{}).out), 1e-5);
}

// ---- tile_sparse / bits_sparse -------------------------------------------------------------------

TEST(TileSparse, MatchesFloat64ReferencePerGroupAndPerHead) {
  std::uint64_t seed = 100;
  for (const Shape& s : kShapes) {
    for (bool per_head : {false, true}) {
      Problem pr(s, sa::DType::f32, seed++);
      const std::int64_t G = per_head ? s.Hq : s.Hkv;
      const TileSel t = random_tiles(pr.p, G, 5, seed++, /*empty_tile=*/pr.p.Tq() > 1 ? 1 : -1);
      sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view(), pr.lse.view(), pr.options());
      expect_matches(pr, pr.reference(t.lists()), per_head ? "tile_sparse per head" : "tile_sparse per group");
    }
  }
}

TEST(TileSparse, EmptyTileGivesZeroAndMinusInf) {
  Problem pr({1, 256, 512, 4, 1, 32, false}, sa::DType::f32, 51);
  TileSel t = random_tiles(pr.p, 1, 3, 52);
  t.cnt.data<std::int32_t>()[1] = 0;  // tile 1 selects nothing
  sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view(), pr.lse.view(), pr.options());
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t i = 128; i < 256; ++i) {
      EXPECT_EQ(pr.lse.data<float>()[h * 256 + i], -INFINITY);
      for (std::int64_t d = 0; d < 32; ++d) ASSERT_EQ(pr.out.data<float>()[(i * 4 + h) * 32 + d], 0.0f);
    }
  expect_matches(pr, pr.reference(t.lists()), "tile_sparse");
}

TEST(TileSparse, Bf16AndF16Inputs) {
  for (sa::DType dt : {sa::DType::bf16, sa::DType::f16}) {
    Problem pr({2, 200, 700, 8, 2, 64, true}, dt, 61);
    const TileSel t = random_tiles(pr.p, 2, 4, 62, 0);
    sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view(), pr.lse.view(), pr.options());
    expect_matches(pr, pr.reference(t.lists()), "tile_sparse");
  }
}

TEST(TileSparse, EveryBlockSelectedEqualsDenseBitwise) {
  // Same mainloop, same block order: the results must be identical, causal skipping included.
  for (const Shape& s : {Shape{2, 300, 400, 8, 2, 32, true}, Shape{1, 17, 260, 4, 4, 64, false}}) {
    Problem pr(s, sa::DType::f32, 71);
    sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), pr.lse.view(), pr.options());
    sa::HostTensor out2(pr.dtype, {s.B, s.Lq, s.Hq, s.D}), lse2(sa::DType::f32, {s.B, s.Hq, s.Lq});
    st::poison(out2);
    st::poison(lse2);
    const TileSel t = full_tiles(pr.p, s.Hkv);
    sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), out2.view(), lse2.view(), pr.options());
    EXPECT_TRUE(bitwise_equal(pr.out, out2)) << s.describe();
    EXPECT_TRUE(bitwise_equal(pr.lse, lse2)) << s.describe();
  }
}

TEST(TileSparse, PassesOverKVHeadsGiveTheSameResult) {
  // A K/V store budget below one (batch, KV head) pair forces one pass per pair; nothing about a
  // query's computation depends on the passes, so the output is identical bit for bit.
  Problem pr({2, 200, 400, 8, 4, 32, true}, sa::DType::f32, 81);
  const TileSel t = random_tiles(pr.p, 8, 3, 82, 0);
  sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view(), pr.lse.view(), pr.options());
  sa::HostTensor out2(pr.dtype, {2, 200, 8, 32}), lse2(sa::DType::f32, {2, 8, 200});
  st::poison(out2);
  st::poison(lse2);
  const sa::detail::AttentionCall a =
      sa::detail::resolve_call("tile_sparse", pr.q.view(), pr.k.view(), pr.v.view(), out2.view(), lse2.view(),
                               pr.options());
  const sa::TileLists lists = t.lists();
  sa::detail::cpu::tile_sparse(a, {lists, lists.idx.shape[1], lists.idx.shape[3]}, 1);
  EXPECT_TRUE(bitwise_equal(pr.out, out2));
  EXPECT_TRUE(bitwise_equal(pr.lse, lse2));
  expect_matches(pr, pr.reference(t.lists()), "tile_sparse");
}

TEST(BitsSparse, EqualsTileSparseOnConvertedSelectionAndReference) {
  std::uint64_t seed = 200;
  for (const Shape& s : {kShapes[1], kShapes[3], kShapes[4], kShapes[6], Shape{1, 130, 5000, 4, 2, 16, false}}) {
    for (bool per_head : {false, true}) {
      Problem pr(s, sa::DType::f32, seed++);
      const std::int64_t G = per_head ? s.Hq : s.Hkv;
      const TileSel t = random_tiles(pr.p, G, 6, seed++, 0);
      sa::HostTensor bits(sa::DType::u32, {s.B, G, pr.p.Tq(), sa::ceil_div(pr.p.Tk(), 32)});
      sa::tile_lists_to_block_bits(t.lists(), sa::BlockBits{bits.view()}, pr.p);
      sa::bits_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::BlockBits{bits.view()}, pr.out.view(),
                      pr.lse.view(), pr.options());
      expect_matches(pr, pr.reference(sa::BlockBits{bits.view()}), "bits_sparse");

      sa::HostTensor out2(pr.dtype, {s.B, s.Lq, s.Hq, s.D}), lse2(sa::DType::f32, {s.B, s.Hq, s.Lq});
      st::poison(out2);
      st::poison(lse2);
      sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), out2.view(), lse2.view(), pr.options());
      EXPECT_TRUE(bitwise_equal(pr.out, out2)) << s.describe();
      EXPECT_TRUE(bitwise_equal(pr.lse, lse2)) << s.describe();
    }
  }
}

// ---- token_sparse --------------------------------------------------------------------------------

TEST(TokenSparse, MatchesFloat64Reference) {
  std::uint64_t seed = 300;
  for (const Shape& s : kShapes) {
    Problem pr(s, sa::DType::f32, seed++);
    // More slots than one gathered block holds for the larger problems, so the online softmax spans
    // several gathered blocks.
    const std::int64_t kt = s.Lk >= 300 ? 200 : 40;
    const sa::HostTensor idx = random_tokens(pr.p, kt, seed++);
    sa::token_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::TokenLists{idx.view()}, pr.out.view(),
                     pr.lse.view(), pr.options());
    expect_matches(pr, pr.reference(sa::TokenLists{idx.view()}), "token_sparse");
  }
}

TEST(TokenSparse, EveryKeyListedEqualsDenseBitwise) {
  // Listing keys 0..Lk-1 in order gathers exactly dense's blocks (causal drops only a suffix), and
  // the mainloop's arithmetic per element does not depend on how rows are grouped.
  Problem pr({2, 140, 300, 8, 2, 32, true}, sa::DType::f32, 321);
  sa::HostTensor idx(sa::DType::i32, {2, 2, 140, 300});
  for (std::int64_t row = 0; row < 2 * 2 * 140; ++row)
    for (std::int64_t j = 0; j < 300; ++j) idx.data<std::int32_t>()[row * 300 + j] = static_cast<std::int32_t>(j);
  sa::token_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::TokenLists{idx.view()}, pr.out.view(), pr.lse.view(),
                   pr.options());
  sa::HostTensor out2(pr.dtype, {2, 140, 8, 32}), lse2(sa::DType::f32, {2, 8, 140});
  st::poison(out2);
  st::poison(lse2);
  sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), out2.view(), lse2.view(), pr.options());
  EXPECT_TRUE(bitwise_equal(pr.out, out2));
  EXPECT_TRUE(bitwise_equal(pr.lse, lse2));
}

TEST(TokenSparse, Bf16Inputs) {
  Problem pr({2, 100, 500, 8, 2, 64, true}, sa::DType::bf16, 311);
  const sa::HostTensor idx = random_tokens(pr.p, 64, 312);
  sa::token_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::TokenLists{idx.view()}, pr.out.view(), pr.lse.view(),
                   pr.options());
  expect_matches(pr, pr.reference(sa::TokenLists{idx.view()}), "token_sparse");
}

// ---- sparse_attention ------------------------------------------------------------------------------

TEST(SparseAttention, DispatchesEachFormatToItsExecutor) {
  Problem pr({2, 140, 300, 4, 2, 32, true}, sa::DType::f32, 401);
  const TileSel t = random_tiles(pr.p, 2, 2, 402, 0);
  sa::HostTensor bits(sa::DType::u32, {2, 2, pr.p.Tq(), 1});
  sa::tile_lists_to_block_bits(t.lists(), sa::BlockBits{bits.view()}, pr.p);
  sa::HostTensor qidx(sa::DType::i32, {2, 2, 140, 2});
  for (std::int64_t r = 0; r < 2 * 2 * 140; ++r) {
    qidx.data<std::int32_t>()[r * 2] = static_cast<std::int32_t>(r % 3);
    qidx.data<std::int32_t>()[r * 2 + 1] = r % 7 == 0 ? -1 : static_cast<std::int32_t>((r + 1) % 3);
  }
  const sa::HostTensor tidx = random_tokens(pr.p, 30, 403);

  const std::vector<sa::Selection> selections = {sa::AllBlocks{}, t.lists(), sa::BlockBits{bits.view()},
                                                 sa::QueryLists{qidx.view()}, sa::TokenLists{tidx.view()}};
  for (const sa::Selection& sel : selections) {
    SCOPED_TRACE(sa::selection_name(sel));
    st::poison(pr.out);
    st::poison(pr.lse);
    sa::sparse_attention(pr.q.view(), pr.k.view(), pr.v.view(), sel, pr.out.view(), pr.lse.view(), pr.options());
    expect_matches(pr, pr.reference(sel), "sparse_attention");
  }
}

// ---- errors ------------------------------------------------------------------------------------

TEST(AttentionErrors, OutOfRangeBlockIdNamesArgumentAndCoordinate) {
  Problem pr({1, 300, 300, 2, 1, 16, false}, sa::DType::f32, 501);
  TileSel t = random_tiles(pr.p, 1, 3, 502);
  t.cnt.data<std::int32_t>()[2] = 2;
  t.idx.data<std::int32_t>()[2 * 3 + 0] = 0;
  t.idx.data<std::int32_t>()[2 * 3 + 1] = 40;  // Tk = 3
  auto run = [&](bool trusted) {
    sa::AttentionOptions o = pr.options();
    o.trusted = trusted;
    sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view(), pr.lse.view(), o);
  };
  expect_error([&] { run(false); }, "tile_sparse", "tiles.idx", {"40", "[0, 0, 2, 1]"});
  // A trusted selection skips validation, but the executor still never reads past K and V.
  expect_error([&] { run(true); }, "tile_sparse", "tiles.idx", {"40", "[0, 0, 2, 1]"});
}

TEST(AttentionErrors, TrustedTokenAndBitsSelectionsAreStillBoundsChecked) {
  Problem pr({1, 20, 300, 2, 1, 16, false}, sa::DType::f32, 511);
  sa::AttentionOptions o = pr.options();
  o.trusted = true;
  sa::HostTensor tidx = random_tokens(pr.p, 4, 512);
  tidx.data<std::int32_t>()[7 * 4 + 2] = 300;
  expect_error([&] {
    sa::token_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::TokenLists{tidx.view()}, pr.out.view(), std::nullopt, o);
  }, "token_sparse", "tokens.idx", {"300", "[0, 0, 7, 2]"});
  sa::HostTensor bits(sa::DType::u32, {1, 1, 1, 1});
  bits.data<std::uint32_t>()[0] = 1u << 5;  // block 5 of Tk = 3
  expect_error([&] {
    sa::bits_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::BlockBits{bits.view()}, pr.out.view(), std::nullopt, o);
  }, "bits_sparse", "bits.bits", {"5"});
}

TEST(AttentionErrors, WrongShapesDtypesAndDevices) {
  Problem pr({1, 64, 64, 4, 2, 16, false}, sa::DType::f32, 521);
  sa::HostTensor bad_out(sa::DType::f32, {1, 64, 2, 16});
  expect_error([&] { sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), bad_out.view()); }, "dense", "out",
               {"[1, 64, 4, 16]", "[1, 64, 2, 16]"});
  sa::HostTensor bad_lse(sa::DType::f32, {1, 64, 4});
  expect_error([&] { sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), bad_lse.view()); }, "dense",
               "lse", {"[1, 4, 64]"});
  sa::HostTensor k3(sa::DType::f32, {1, 64, 3, 16}), v3(sa::DType::f32, {1, 64, 3, 16});
  expect_error([&] { sa::dense(pr.q.view(), k3.view(), v3.view(), pr.out.view()); }, "dense", "k", {"multiple"});

  TileSel t = random_tiles(pr.p, 2, 1, 522);
  sa::TileLists wrong_groups{t.idx.view(), t.cnt.view()};
  wrong_groups.idx.shape[1] = 3;
  wrong_groups.cnt.shape[1] = 3;
  EXPECT_THROW(sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), wrong_groups, pr.out.view()), sa::Error);

  sa::AttentionOptions bad_scale;
  bad_scale.softmax_scale = -1.0f;
  expect_error([&] { sa::dense(pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), std::nullopt, bad_scale); },
               "dense", "softmax_scale", {"-1"});
}

#if !defined(SPARSE_ATTN_WITH_CUDA)
TEST(AttentionErrors, DeviceTensorsWithoutBackendThrow) {
  // Device tensors in a build without the CUDA backend: an Error naming the device, never a silent
  // CPU fallback (the views carry host pointers, which is safe only because nothing may run).
  Problem pr({1, 64, 64, 4, 2, 64, false}, sa::DType::bf16, 541);
  auto on_device = [](sa::TensorView v) {
    v.device = sa::Device::cuda;
    return v;
  };
  expect_error([&] {
    sa::dense(on_device(pr.q.view()), on_device(pr.k.view()), on_device(pr.v.view()), on_device(pr.out.view()));
  }, "dense", "q", {"cuda"});
  const TileSel t = random_tiles(pr.p, 2, 1, 542);
  expect_error([&] {
    sa::tile_sparse(on_device(pr.q.view()), on_device(pr.k.view()), on_device(pr.v.view()),
                    sa::TileLists{on_device(t.idx.view()), on_device(t.cnt.view())}, on_device(pr.out.view()));
  }, "tile_sparse", "q", {"cuda"});
}
#endif

TEST(AttentionErrors, DuplicateAndUnsortedTileIdsRejected) {
  Problem pr({1, 128, 600, 2, 1, 16, false}, sa::DType::f32, 531);
  TileSel t = random_tiles(pr.p, 1, 3, 532);
  t.cnt.data<std::int32_t>()[0] = 3;
  t.idx.data<std::int32_t>()[0] = 1;
  t.idx.data<std::int32_t>()[1] = 3;
  t.idx.data<std::int32_t>()[2] = 3;
  expect_error([&] { sa::tile_sparse(pr.q.view(), pr.k.view(), pr.v.view(), t.lists(), pr.out.view()); },
               "tile_sparse", "tiles.idx", {"[0, 0, 0, 2]"});
}
