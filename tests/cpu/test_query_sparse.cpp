// query_sparse (KV-centric: reverse index -> per-block partials -> LSE combine) against the float64
// reference with the per-query lists as an explicit mask; partial precision, determinism, chunking
// of the partial buffer, and validation of the lists.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "attention/cpu_backend.hpp"
#include "common/testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

// Test shapes are the library's own problem shape: {B, Lq, Lk, Hq, Hkv, D, causal}.
using Shape = sa::ProblemShape;

struct Problem {
  Shape s;
  sa::DType dtype;
  sa::HostTensor q, k, v, out, lse, idx;
  sa::ProblemShape p;

  Problem(const Shape& shape, sa::DType dt, std::int64_t kq, std::uint64_t seed) : s(shape), dtype(dt) {
    q = st::random_tensor(dt, {s.B, s.Lq, s.Hq, s.D}, seed * 5 + 1);
    k = st::random_tensor(dt, {s.B, s.Lk, s.Hkv, s.D}, seed * 5 + 2);
    v = st::random_tensor(dt, {s.B, s.Lk, s.Hkv, s.D}, seed * 5 + 3);
    out = sa::HostTensor(dt, {s.B, s.Lq, s.Hq, s.D});
    lse = sa::HostTensor(sa::DType::f32, {s.B, s.Hq, s.Lq});
    st::poison(out);
    st::poison(lse);
    p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.Hq = s.Hq, p.Hkv = s.Hkv, p.D = s.D, p.causal = s.causal;
    idx = random_lists(kq, seed * 5 + 4);
  }

  // Per (b, g, query): up to kq distinct block ids in random order, -1 in random slots, every 7th
  // row all -1. Rows differ across b and g.
  sa::HostTensor random_lists(std::int64_t kq, std::uint64_t seed) const {
    sa::HostTensor t(sa::DType::i32, {p.B, p.Hkv, p.Lq, kq});
    std::mt19937_64 rng(seed);
    std::vector<std::int32_t> all(static_cast<std::size_t>(p.Tk()));
    std::iota(all.begin(), all.end(), 0);
    for (std::int64_t row = 0; row < p.B * p.Hkv * p.Lq; ++row) {
      std::shuffle(all.begin(), all.end(), rng);
      for (std::int64_t s = 0; s < kq; ++s) {
        const bool empty = row % 7 == 5 || s >= p.Tk() || std::uniform_int_distribution<int>(0, 4)(rng) == 0;
        t.data<std::int32_t>()[row * kq + s] = empty ? -1 : all[static_cast<std::size_t>(s)];
      }
    }
    return t;
  }

  sa::QueryLists lists() const { return {idx.view()}; }
  sa::QuerySparseOptions options(sa::PartialPrecision partials = sa::PartialPrecision::f32) const {
    sa::QuerySparseOptions o;
    o.causal = s.causal;
    o.partials = partials;
    return o;
  }
  void run(sa::PartialPrecision partials = sa::PartialPrecision::f32) {
    sa::query_sparse(q.view(), k.view(), v.view(), lists(), out.view(), lse.view(), options(partials));
  }
  st::Reference reference() const {
    return st::reference_attention(q.view(), k.view(), v.view(), lists(), p, 1.0 / std::sqrt(double(s.D)));
  }
};

void expect_matches(const Problem& pr, const st::Reference& ref, double out_bound, const std::string& what) {
  SCOPED_TRACE(what + " " + pr.s.describe() + " " + sa::dtype_name(pr.dtype));
  ASSERT_TRUE(st::all_finite(pr.out)) << "output has NaN (unwritten or invalid)";
  ASSERT_TRUE(st::all_finite(pr.lse, /*allow_neg_inf=*/true)) << "lse has NaN or +inf";
  EXPECT_LE(st::rel_err(pr.out, ref.out), out_bound);
  EXPECT_LE(st::lse_max_err(pr.lse, ref.lse), 1e-5);
}

bool bitwise_equal(const sa::HostTensor& a, const sa::HostTensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.view().data, b.view().data, static_cast<std::size_t>(a.numel()) * sa::dtype_size(a.dtype())) == 0;
}

// Restores the OpenMP thread count when a test changes it.
class Threads {
 public:
  explicit Threads(int n) {
#if defined(_OPENMP)
    saved_ = omp_get_max_threads();
    omp_set_num_threads(n);
#else
    (void)n;
#endif
  }
  ~Threads() {
#if defined(_OPENMP)
    omp_set_num_threads(saved_);
#endif
  }

 private:
  int saved_ = 1;
};

const std::vector<Shape> kShapes = {
    {2, 300, 300, 4, 4, 64, false},   // B > 1, Hq = Hkv
    {2, 300, 300, 4, 4, 64, true},
    {1, 1, 1000, 16, 1, 128, true},   // Lq = 1, Hq = 16 x Hkv, Lk not a multiple of 128
    {1, 17, 260, 8, 2, 48, true},     // Lq < Lk causal, GQA 4
    {1, 1013, 1013, 16, 1, 16, true}, // Lq = 1013, GQA 16
    {2, 300, 140, 4, 1, 16, true},    // Lq > Lk causal: early queries see nothing
    {1, 200, 700, 4, 1, 32, false},
};

}  // namespace

TEST(QuerySparse, MatchesFloat64ReferenceWithF32Partials) {
  std::uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    Problem pr(s, sa::DType::f32, 4, seed++);
    pr.run();
    expect_matches(pr, pr.reference(), 1e-5, "query_sparse f32 partials");
  }
}

TEST(QuerySparse, Bf16PartialsWithinBf16Bounds) {
  std::uint64_t seed = 20;
  for (const Shape& s : {kShapes[1], kShapes[3], kShapes[4]}) {
    Problem pr(s, sa::DType::f32, 4, seed++);
    pr.run(sa::PartialPrecision::bf16);
    const st::Reference ref = pr.reference();
    // Each partial output is rounded once to bf16 (relative 2^-9); their weighted sum stays within
    // about that, and the partial LSEs stay float32.
    expect_matches(pr, ref, 8e-3, "query_sparse bf16 partials");
    const sa::HostTensor bf16_out = pr.out;
    pr.run(sa::PartialPrecision::f32);
    EXPECT_GT(st::rel_err(bf16_out, ref.out), 10 * st::rel_err(pr.out, ref.out))
        << "the bf16 option must actually store bf16 partials";
  }
}

TEST(QuerySparse, Bf16AndF16Inputs) {
  for (sa::DType dt : {sa::DType::bf16, sa::DType::f16}) {
    Problem pr({2, 150, 600, 8, 2, 64, true}, dt, 3, 31);
    pr.run();
    expect_matches(pr, pr.reference(), dt == sa::DType::bf16 ? 8e-3 : 2e-3, "query_sparse");
  }
}

TEST(QuerySparse, PopularBlockSplitAcrossWorkItems) {
  // Every query of the group picks block 0 (plus others): block 0's list holds all 1013 x 4 rows,
  // which the attention phase splits into many work items.
  Problem pr({1, 1013, 1013, 4, 1, 32, false}, sa::DType::f32, 3, 41);
  for (std::int64_t i = 0; i < 1013; ++i) {
    auto* row = pr.idx.data<std::int32_t>() + i * 3;
    if (std::find(row, row + 3, 0) == row + 3) row[i % 3] = 0;
  }
  pr.run();
  expect_matches(pr, pr.reference(), 1e-5, "query_sparse popular block");
}

TEST(QuerySparse, DeterministicAcrossRunsAndThreadCounts) {
  Problem pr({2, 400, 900, 8, 2, 32, true}, sa::DType::f32, 6, 51);
  sa::HostTensor out1, lse1;
  {
    Threads two(2);
    pr.run();
    out1 = pr.out;
    lse1 = pr.lse;
    st::poison(pr.out);
    st::poison(pr.lse);
    pr.run();
    EXPECT_TRUE(bitwise_equal(out1, pr.out));
    EXPECT_TRUE(bitwise_equal(lse1, pr.lse));
  }
  {
    Threads one(1);
    st::poison(pr.out);
    pr.run();
    EXPECT_TRUE(bitwise_equal(out1, pr.out)) << "the combine order must not depend on the schedule";
  }
  expect_matches(pr, pr.reference(), 1e-5, "query_sparse");
}

TEST(QuerySparse, ChunkedPartialBufferGivesTheSameResult) {
  // A budget of a few queries' partials forces many chunks per (batch, group); the result must not
  // change, bit for bit, because every query's partials and combine are the same.
  Problem pr({2, 300, 500, 8, 2, 32, true}, sa::DType::f32, 5, 61);
  pr.run();
  const sa::HostTensor whole = pr.out, whole_lse = pr.lse;
  st::poison(pr.out);
  st::poison(pr.lse);
  const sa::detail::AttentionCall a = sa::detail::resolve_call("query_sparse", pr.q.view(), pr.k.view(), pr.v.view(),
                                                               pr.out.view(), pr.lse.view(), pr.options());
  const std::int64_t per_query = 5 * 4 * 32 * 4;  // Kq * group * D * sizeof(float)
  sa::detail::cpu::query_sparse(a, {pr.lists(), 5, sa::PartialPrecision::f32}, 7 * per_query);
  EXPECT_TRUE(bitwise_equal(whole, pr.out));
  EXPECT_TRUE(bitwise_equal(whole_lse, pr.lse));
}

TEST(QuerySparse, AllEmptyRowsAndEmptyCapacity) {
  Problem pr({1, 130, 300, 4, 2, 16, false}, sa::DType::f32, 3, 71);
  std::fill(pr.idx.data<std::int32_t>(), pr.idx.data<std::int32_t>() + pr.idx.numel(), -1);
  pr.run();
  for (std::int64_t i = 0; i < pr.out.numel(); ++i) ASSERT_EQ(pr.out.data<float>()[i], 0.0f);
  for (std::int64_t i = 0; i < pr.lse.numel(); ++i) ASSERT_EQ(pr.lse.data<float>()[i], -INFINITY);

  // Kq = 0: a list capacity of zero (the view needs a non-null pointer even with no elements).
  Problem none({1, 20, 300, 2, 1, 16, false}, sa::DType::f32, 1, 72);
  std::int32_t unused = 0;
  const sa::TensorView empty_lists = sa::TensorView::contiguous(&unused, sa::DType::i32, {1, 1, 20, 0});
  sa::query_sparse(none.q.view(), none.k.view(), none.v.view(), sa::QueryLists{empty_lists}, none.out.view(),
                   none.lse.view(), none.options());
  for (std::int64_t i = 0; i < none.out.numel(); ++i) ASSERT_EQ(none.out.data<float>()[i], 0.0f);
  for (std::int64_t i = 0; i < none.lse.numel(); ++i) ASSERT_EQ(none.lse.data<float>()[i], -INFINITY);
}

TEST(QuerySparse, InvalidListsAreRejectedWithTheirCoordinate) {
  Problem pr({1, 50, 300, 2, 1, 16, false}, sa::DType::f32, 3, 81);
  auto* row = pr.idx.data<std::int32_t>() + 9 * 3;
  auto expect = [&](const std::string& part, bool trusted) {
    sa::QuerySparseOptions o = pr.options();
    o.trusted = trusted;
    try {
      sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), pr.out.view(), pr.lse.view(), o);
      ADD_FAILURE() << "expected an Error mentioning " << part;
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.op(), "query_sparse") << e.what();
      EXPECT_EQ(e.argument(), "lists.idx") << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  row[0] = 2, row[1] = 1, row[2] = 2;  // duplicate id
  expect("[0, 0, 9, 2]", false);
  row[0] = 2, row[1] = 7, row[2] = -1;  // Tk = 3
  expect("[0, 0, 9, 1]", false);
  expect("[0, 0, 9, 1]", true);  // trusted: still never reads past K and V
  row[0] = -3, row[1] = -1, row[2] = -1;
  expect("[0, 0, 9, 0]", false);
}

TEST(QuerySparse, WrongShapesAreRejected) {
  Problem pr({1, 50, 300, 4, 2, 16, false}, sa::DType::f32, 3, 91);
  sa::HostTensor wrong(sa::DType::i32, {1, 4, 50, 3});  // groups must be Hkv = 2
  EXPECT_THROW(sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), sa::QueryLists{wrong.view()}, pr.out.view()),
               sa::Error);
  sa::HostTensor bad_out(sa::DType::f32, {1, 49, 4, 16});
  try {
    sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), bad_out.view());
    ADD_FAILURE() << "expected an Error for the out shape";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "out") << e.what();
  }
  sa::QuerySparseOptions o;
  o.partials = static_cast<sa::PartialPrecision>(7);
  try {
    sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), pr.out.view(), std::nullopt, o);
    ADD_FAILURE() << "expected an Error for options.partials";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "options.partials") << e.what();
  }
  o.partials = sa::PartialPrecision::f32;
  for (int w : {9, -1, 16}) {
    o.merge_window = w;
    try {
      sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), pr.out.view(), std::nullopt, o);
      ADD_FAILURE() << "expected an Error for options.merge_window " << w;
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), "options.merge_window") << e.what();
    }
  }
}

// The merge window is a GPU schedule detail: on the CPU every accepted value gives the same result, and
// run() holds a plan to the window it was made with.
TEST(QuerySparse, MergeWindowOnTheCpu) {
  Problem pr({1, 96, 1024, 4, 2, 32, false}, sa::DType::f32, 6, 9);
  sa::QuerySparseOptions o = pr.options();
  o.merge_window = 1;
  sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), pr.out.view(), std::nullopt, o);
  const sa::HostTensor ref = pr.out;
  for (int w : {0, 2, 3, 4, 7, 8}) {
    o.merge_window = w;
    st::poison(pr.out);
    sa::query_sparse(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), pr.out.view(), std::nullopt, o);
    EXPECT_EQ(0, std::memcmp(pr.out.view().data, ref.view().data, static_cast<std::size_t>(ref.numel()) * 4))
        << "merge_window " << w;
  }
  // What the GPU would run. Automatic: 2 x 96 query rows leave the bins of a window of 8 blocks nearly
  // empty, so no merging here, while query16of32 (16 x 4096 rows, 16 of 32 blocks) merges windows of 8.
  o.merge_window = 0;
  EXPECT_EQ(sa::query_sparse_merge_window(pr.p, 6, o), 1);
  sa::ProblemShape q16;
  q16.B = 8, q16.Lq = 4096, q16.Lk = 4096, q16.Hq = 16, q16.Hkv = 1, q16.D = 128;
  EXPECT_EQ(sa::query_sparse_merge_window(q16, 16), 8);
  o.merge_window = 3;
  EXPECT_EQ(sa::query_sparse_merge_window(pr.p, 6, o), 3);
  o.merge_window = 9;
  EXPECT_THROW(sa::query_sparse_merge_window(pr.p, 6, o), sa::Error);
  o.merge_window = 8;
  const sa::QuerySparsePlan plan =
      sa::query_sparse_plan(pr.q.view(), pr.k.view(), pr.v.view(), pr.lists(), sa::TensorView{}, o);
  EXPECT_EQ(plan.merge_window, 8);
  o.merge_window = 1;
  try {
    sa::query_sparse_run(plan, pr.q.view(), pr.k.view(), pr.v.view(), pr.out.view(), std::nullopt, o);
    ADD_FAILURE() << "expected an Error for a merge window other than the plan's";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "options.merge_window") << e.what();
  }
}
