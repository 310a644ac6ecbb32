// GPU tests of the KV-centric query_sparse: every result against the float64 CPU reference with the
// per-query lists applied as an explicit mask (docs/design.md §6), on awkward shapes (Lq = 1, 17, 1013; Lk
// not a multiple of 128; Lq > Lk under causal; a Q tile with no selected block; a block chosen by
// every query, split into many work items; Hq = Hkv and Hq = 16 x Hkv; B > 1 with different lists),
// poisoned outputs, both dtypes, f32 and bf16 partials, bitwise-identical repeated runs, the
// plan()/run() path with a caller-owned workspace, strided (packed QKV) inputs, and device-side
// validation of the lists. The reverse index and the combine are also checked alone, through their
// launchers: the CSR against one built on the host (a multiset per block, work items exact), and
// the combine of random partials against a float64 combine (unchosen slots' partials are NaN, so
// reading one shows).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/query_lists_testing.hpp"
#include "cuda/query_sparse/backend.hpp"
#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/partials.cuh"
#include "sparse_attn/plan.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::query_lists::cuda_ok;
using st::query_lists::DeviceBuffer;
using st::query_lists::Inputs;

struct Case {
  std::string name;
  sa::DType dtype = sa::DType::bf16;
  sa::PartialPrecision partials = sa::PartialPrecision::f32;
  std::int64_t B = 1, Lq = 128, Lk = 256, Hq = 1, Hkv = 1, D = 128;
  bool causal = false;
  std::int64_t kq = 4;
  bool empty_tile = false;    // queries 128..255 select nothing
  bool popular = false;       // every query selects block 0
  int merge = 1;              // options.merge_window (1: off, 0: automatic)
};

// The query_sparse arguments beyond q, k, v, out and lse as the front end resolves them.
sa::detail::QueryCall query_call(const sa::QueryLists& lists, const sa::ProblemShape& p,
                                 const sa::QuerySparseOptions& opt) {
  const std::int64_t Kq = lists.idx.shape[3];
  return {lists, Kq, opt.partials, opt.schedule, sa::query_sparse_merge_window(p, Kq, opt)};
}

sa::ProblemShape shape_of(const Case& c) {
  sa::ProblemShape p;
  p.B = c.B, p.Lq = c.Lq, p.Lk = c.Lk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.D = c.D, p.causal = c.causal;
  return p;
}

Inputs make_inputs(const Case& c, std::uint64_t seed) {
  return st::query_lists::random_inputs(shape_of(c), c.dtype, c.kq, c.empty_tile, c.popular, seed);
}

struct Result {
  sa::HostTensor out, lse;
};

// out and lse equal `ref`'s bit for bit.
void expect_same_bits(const sa::HostTensor& out, const sa::HostTensor& lse, const Result& ref) {
  EXPECT_EQ(0, std::memcmp(out.view().data, ref.out.view().data, static_cast<std::size_t>(out.numel()) * 2));
  EXPECT_EQ(0, std::memcmp(lse.view().data, ref.lse.view().data, static_cast<std::size_t>(lse.numel()) * 4));
}

// Through the public operator (front-end checks, dispatch, cached workspace), or with a tuning through
// the backend's one-call entry point under it (the same workspace cache).
Result run_gpu(const Case& c, const Inputs& in, const std::optional<sa::detail::QuerySparseTuning>& tuning = {}) {
  Result r{sa::HostTensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}), sa::HostTensor(sa::DType::f32, {c.B, c.Hq, c.Lq})};
  st::poison(r.out);
  st::poison(r.lse);
  DeviceBuffer q(in.q), k(in.k), v(in.v), idx(in.idx), out(r.out), lse(r.lse);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.partials = c.partials;
  opt.merge_window = c.merge;
  if (tuning)
    sa::cuda_backend::query_sparse(
        sa::detail::resolve_call("query_sparse", q.view, k.view, v.view, out.view, lse.view, opt),
        query_call(sa::QueryLists{idx.view}, in.p, opt), *tuning);
  else
    sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, out.view, lse.view, opt);
  cuda_ok(cudaDeviceSynchronize(), "query_sparse");
  out.download(r.out);
  lse.download(r.lse);
  return r;
}

struct Tolerance {
  double rel, max_abs_frac, lse_abs;
};

// A plain same-precision implementation (P and out rounded to the 16-bit type) lands near 3e-3
// (bf16) / 4e-4 (f16); bf16 partials add one more bf16 rounding of every partial (about 2e-3). The
// bounds allow 2x that plus a small absolute term.
Tolerance tolerance(const Case& c) {
  double rel = c.dtype == sa::DType::bf16 ? 3e-3 : 4e-4;
  double ulp = c.dtype == sa::DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  if (c.partials == sa::PartialPrecision::bf16) {
    rel += 2e-3;
    ulp = std::max(ulp, std::ldexp(1.0, -8)) * 2;
  }
  return {2 * rel + 1e-4, 4 * ulp, 1e-3};
}

void check_case(const Case& c, std::uint64_t seed,
                const std::optional<sa::detail::QuerySparseTuning>& tuning = std::nullopt) {
  SCOPED_TRACE(c.name);
  const Inputs in = make_inputs(c, seed);
  const Result r = run_gpu(c, in, tuning);
  const st::Reference ref = st::reference_attention(in.q.view(), in.k.view(), in.v.view(),
                                                    sa::Selection{sa::QueryLists{in.idx.view()}}, in.p,
                                                    1.0 / std::sqrt(double(c.D)));
  ASSERT_TRUE(std::any_of(ref.lse.begin(), ref.lse.end(), [](double x) { return std::isfinite(x); }))
      << "degenerate case: no query sees any key";
  EXPECT_TRUE(st::all_finite(r.out)) << "out holds NaN/inf (unwritten or broken)";
  const Tolerance tol = tolerance(c);
  const double rel = st::rel_err(r.out, ref.out);
  double ref_max = 1.0;
  for (double x : ref.out) ref_max = std::max(ref_max, std::abs(x));
  const double max_abs = st::max_abs_err(r.out, ref.out);
  const double lse_err = st::lse_max_err(r.lse, ref.lse);
  EXPECT_LE(rel, tol.rel);
  EXPECT_LE(max_abs, tol.max_abs_frac * ref_max) << "max |ref| " << ref_max;
  EXPECT_LE(lse_err, tol.lse_abs);
  // Queries that see nothing: lse exactly -inf and out exactly 0.
  const std::int64_t empty = st::expect_empty_rows(r.out, r.lse, ref, c.name);
  std::printf("[ %-34s ] relerr %.3e  max_abs %.3e  lse_err %.3e  empty rows %lld\n", c.name.c_str(), rel, max_abs,
              lse_err, static_cast<long long>(empty));
}

TEST(QuerySparseGpu, Shapes) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using P = sa::PartialPrecision;
  const std::vector<Case> cases = {
      {"qs Hq=Hkv f32 partials", sa::DType::bf16, P::f32, 1, 256, 512, 2, 2, 128, false, 4},
      {"qs GQA16 causal Lq=1013 bf16 part", sa::DType::bf16, P::bf16, 1, 1013, 1000, 16, 1, 64, true, 6, true},
      {"qs GQA16 Lq=1013 f32 popular", sa::DType::bf16, P::f32, 1, 1013, 1000, 16, 1, 128, false, 5, false, true},
      {"qs B=2 Lq=1 f16 causal", sa::DType::f16, P::f32, 2, 1, 777, 4, 2, 128, true, 5},
      {"qs Lq=17 causal D=64 f16", sa::DType::f16, P::f32, 2, 17, 300, 8, 2, 64, true, 3},
      {"qs Lq>Lk causal (empty rows)", sa::DType::bf16, P::f32, 1, 300, 129, 4, 1, 128, true, 2},
      {"qs B=2 Kq=9 f16 bf16 part", sa::DType::f16, P::bf16, 2, 200, 1100, 6, 3, 128, false, 9},
  };
  std::uint64_t seed = 100;
  for (const Case& c : cases) check_case(c, ++seed);
}

// Merged slots: a query's blocks in one window are one piece (online softmax over up to 8 blocks in
// one tile, one partial). Lists dense enough (Kq / Tk up to 1/2) that most pieces hold several blocks:
// each window, causal with the diagonal inside a piece, a last window and block past Lk, an empty tile
// and a popular block, Kq = 40 (two ballots in the combine), D = 64, f16, both partial precisions, and
// the automatic choice on a query16of32-like shape.
TEST(QuerySparseGpu, MergedSlots) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using P = sa::PartialPrecision;
  const std::vector<Case> cases = {
      {"merge8 GQA16 bf16 part", sa::DType::bf16, P::bf16, 1, 700, 2048, 16, 1, 128, false, 8, false, false, 8},
      {"merge4 causal GQA4 f32 part", sa::DType::bf16, P::f32, 2, 900, 1000, 8, 2, 128, true, 5, false, false, 4},
      {"merge2 D=64 f16 last block", sa::DType::f16, P::bf16, 1, 500, 1300, 4, 1, 64, false, 6, false, false, 2},
      {"merge8 Lq>Lk causal empty rows", sa::DType::bf16, P::f32, 1, 300, 129, 4, 1, 128, true, 2, false, false, 8},
      {"merge8 popular empty tile", sa::DType::bf16, P::bf16, 1, 1013, 3000, 16, 1, 128, false, 9, true, true, 8},
      {"merge4 Kq=40", sa::DType::bf16, P::f32, 1, 300, 8192, 4, 2, 128, true, 40, false, false, 4},
      {"merge8 causal D=64 f16", sa::DType::f16, P::f32, 2, 400, 2048, 8, 1, 64, true, 10, false, false, 8},
      {"merge3 causal last window", sa::DType::bf16, P::bf16, 1, 777, 1900, 8, 2, 128, true, 7, false, false, 3},
      {"merge7 GQA16", sa::DType::bf16, P::f32, 1, 600, 4096, 16, 1, 128, false, 16, false, false, 7},
      {"merge5 D=64 popular", sa::DType::f16, P::bf16, 1, 500, 2000, 4, 1, 64, false, 8, false, true, 5},
      {"merge auto q16of32-like", sa::DType::bf16, P::bf16, 1, 1024, 4096, 16, 1, 128, false, 16, false, false, 0},
  };
  std::uint64_t seed = 300;
  for (const Case& c : cases) check_case(c, ++seed);
}

// Small enough for compute-sanitizer (memcheck, racecheck, synccheck): both head dims, causal with a
// partial last block, GQA, B = 2, both partial precisions, an empty tile and a popular block.
TEST(QuerySparseGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using P = sa::PartialPrecision;
  check_case({"qs sanitizer D=128", sa::DType::bf16, P::f32, 2, 260, 300, 4, 2, 128, true, 3, true, true}, 7);
  check_case({"qs sanitizer D=64", sa::DType::f16, P::bf16, 1, 140, 200, 2, 1, 64, false, 2}, 8);
  check_case({"qs sanitizer merged", sa::DType::bf16, P::f32, 2, 200, 1024, 4, 2, 128, true, 4, false, true, 4}, 9);
  sa::detail::QuerySparseTuning bands;
  bands.query_bands = 3;
  check_case({"qs sanitizer 3 query bands", sa::DType::bf16, P::bf16, 2, 301, 700, 8, 2, 128, true, 4, true, true}, 10,
             bands);
}

TEST(QuerySparseGpu, RepeatedRunsAreBitwiseIdentical) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (auto prec : {sa::PartialPrecision::f32, sa::PartialPrecision::bf16}) {
    for (int merge : {1, 8}) {
      const Case c{"qs determinism", sa::DType::bf16, prec, 2, 700, 900, 16, 1, 128, true, 8, false, true, merge};
      SCOPED_TRACE("merge " + std::to_string(merge));
      const Inputs in = make_inputs(c, 55);
      const Result a = run_gpu(c, in), b = run_gpu(c, in);
      expect_same_bits(a.out, a.lse, b);
      EXPECT_TRUE(st::all_finite(a.out));
    }
  }
}

// A tuning field that moves work around, never values: every case run with the field at `reference`,
// then at each of `values`, gives the reference's outputs bit for bit.
template <std::size_t N>
void expect_same_bits_across(const Case (&cases)[N], std::uint64_t seed, const std::string& what,
                             int sa::detail::QuerySparseTuning::*field, int reference,
                             std::initializer_list<int> values) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, ++seed);
    sa::detail::QuerySparseTuning tuning;
    tuning.*field = reference;
    const Result ref = run_gpu(c, in, tuning);
    EXPECT_TRUE(st::all_finite(ref.out));
    for (int v : values) {
      SCOPED_TRACE(what + " " + std::to_string(v));
      tuning.*field = v;
      const Result r = run_gpu(c, in, tuning);
      expect_same_bits(r.out, r.lse, ref);
    }
  }
}

// Query bands reorder the bins and work items (a band's rows of every block before the next band's),
// never the values; with merged slots they are not used. Automatic bands (0) on these small shapes
// are one band.
TEST(QuerySparseGpu, QueryBandsDoNotChangeOutputs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"qs bands GQA4 causal", sa::DType::bf16, sa::PartialPrecision::bf16, 2, 1013, 1500, 8, 2, 128, true, 5},
      {"qs bands GQA16 popular f32", sa::DType::f16, sa::PartialPrecision::f32, 1, 2000, 2048, 16, 1, 128, false, 4,
       false, true},
      {"qs bands D=64 empty tile", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 700, 900, 4, 4, 64, false, 3, true},
      {"qs bands merged", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 1200, 2048, 16, 1, 128, true, 6, false, false,
       8},
  };
  expect_same_bits_across(cases, 90, "bands", &sa::detail::QuerySparseTuning::query_bands, 1, {2, 3, 7, 0});
}

// A few CTAs over many work items (the producer's loads run an item ahead across item boundaries, K/V
// slots and Q buffers cycle many times): the outputs equal those of one CTA per SM bit for bit.
TEST(QuerySparseGpu, FewCtasManyItemsEqualFullGrid) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"qs few CTAs GQA16", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 3000, 1024, 16, 1, 128, false, 4},
      {"qs few CTAs causal f32", sa::DType::f16, sa::PartialPrecision::f32, 2, 1500, 1500, 8, 2, 128, true, 5},
      {"qs few CTAs D=64", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 2500, 700, 12, 1, 64, false, 3},
      {"qs few CTAs popular block", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 2000, 2048, 16, 1, 128, false, 4,
       false, true},
      {"qs few CTAs merged causal", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 2000, 2048, 16, 1, 128, true, 6,
       false, false, 8},
      {"qs few CTAs merged D=64", sa::DType::f16, sa::PartialPrecision::f32, 2, 1200, 1024, 4, 2, 64, false, 3, false,
       false, 4},
  };
  expect_same_bits_across(cases, 70, "ctas", &sa::detail::QuerySparseTuning::attend_max_ctas, 0, {1, 2, 3, 7});
}

// plan() once with a caller-owned workspace, run() for two different q: each equals the one-call
// operator bit for bit.
TEST(QuerySparseGpu, PlanOnceRunMany) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // merge_window 0: the automatic choice, which merges on this shape (5 blocks, 4 slots per query).
  const Case c{"qs plan/run", sa::DType::bf16, sa::PartialPrecision::f32, 2, 333, 640, 8, 2, 128, true, 4, false, false,
               0};
  const Inputs in = make_inputs(c, 77);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.merge_window = c.merge;
  const std::size_t bytes = sa::query_sparse_workspace_bytes(in.p, c.kq, opt.partials);
  ASSERT_GT(bytes, 0u);
  DeviceBuffer ws(bytes), k(in.k), v(in.v), idx(in.idx), q0(in.q);
  const sa::QuerySparsePlan plan = sa::query_sparse_plan(q0.view, k.view, v.view, sa::QueryLists{idx.view}, ws.view, opt);
  ASSERT_TRUE(plan.planned);
  EXPECT_GT(plan.merge_window, 1);
  for (std::uint64_t seed : {1u, 2u}) {
    Inputs in2 = in;
    in2.q = st::random_tensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}, 900 + seed);
    DeviceBuffer q(in2.q);
    sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D}), lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
    st::poison(out);
    st::poison(lse);
    DeviceBuffer dout(out), dlse(lse);
    sa::query_sparse_run(plan, q.view, k.view, v.view, dout.view, dlse.view, opt);
    cuda_ok(cudaDeviceSynchronize(), "run");
    dout.download(out);
    dlse.download(lse);
    const Result one = run_gpu(c, in2);
    expect_same_bits(out, lse, one);
    EXPECT_TRUE(st::all_finite(out));
  }
  // A workspace one byte short is refused before anything is launched.
  DeviceBuffer small(bytes - 1);
  EXPECT_THROW(sa::query_sparse_plan(q0.view, k.view, v.view, sa::QueryLists{idx.view}, small.view, opt), sa::Error);
}

// The bins (merge window, query bands) are resolved once, for the plan, and handed to its runs: a plan
// made under forced bands runs under them (the automatic plan's outputs bit for bit), a workspace sized
// without them is refused, and so are bins that no plan makes.
TEST(QuerySparseGpu, PlanKeepsItsBins) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  namespace cb = sa::cuda_backend;
  const Case c{"qs bins", sa::DType::bf16, sa::PartialPrecision::bf16, 1, 1013, 1500, 8, 2, 128, true, 5};
  const Inputs in = make_inputs(c, 95);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.partials = c.partials;
  opt.merge_window = 1;
  // 64 bands of 12 blocks: more bins than any merge window makes, so the workspace grows.
  sa::detail::QuerySparseTuning tuning;
  tuning.query_bands = 64;
  const cb::QuerySparseBins bins = cb::query_sparse_bins(in.p, c.kq, 1, tuning);
  EXPECT_EQ(bins.window, 1);
  EXPECT_EQ(bins.bands, 64);
  EXPECT_EQ(cb::query_sparse_bins(in.p, c.kq, 1).bands, 1);
  const std::size_t bytes = cb::query_sparse_workspace_bytes(in.p, c.kq, c.partials, tuning);
  const std::size_t automatic = cb::query_sparse_workspace_bytes(in.p, c.kq, c.partials);
  ASSERT_GT(bytes, automatic);
  DeviceBuffer ws(bytes), q(in.q), k(in.k), v(in.v), idx(in.idx);
  const sa::QueryLists lists{idx.view};
  sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D}), lse(sa::DType::f32, {c.B, c.Hq, c.Lq});
  st::poison(out);
  st::poison(lse);
  DeviceBuffer dout(out), dlse(lse);
  const sa::detail::AttentionCall a =
      sa::detail::resolve_call("query_sparse", q.view, k.view, v.view, dout.view, dlse.view, opt);
  const sa::detail::QueryCall qc = query_call(lists, in.p, opt);
  cb::query_sparse_plan(a, qc, bins, ws.ptr, bytes);
  for (int run = 0; run < 2; ++run) {
    cb::query_sparse_attend(a, qc, bins, ws.ptr, bytes);
    cb::query_sparse_combine(a, qc, bins, ws.ptr, bytes);
  }
  cuda_ok(cudaDeviceSynchronize(), "phases");
  dout.download(out);
  dlse.download(lse);
  expect_same_bits(out, lse, run_gpu(c, in));
  EXPECT_THROW(cb::query_sparse_plan(a, qc, bins, ws.ptr, automatic), sa::Error);
  // Bands with a merge window, and more bands than the shared histogram holds for 12 blocks.
  for (const cb::QuerySparseBins bad : {cb::QuerySparseBins{8, 2}, cb::QuerySparseBins{1, 5000}}) {
    SCOPED_TRACE("window " + std::to_string(bad.window) + " bands " + std::to_string(bad.bands));
    try {
      cb::query_sparse_plan(a, qc, bad, ws.ptr, bytes);
      ADD_FAILURE() << "bins no plan makes were accepted";
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), "bins.bands") << e.what();
    }
  }
}

// q, k, v as views into one packed [B, L, 3, H, D] buffer (a fused QKV projection): the gathers
// follow the strides, and the result equals the contiguous run bit for bit.
TEST(QuerySparseGpu, PackedQkvStrides) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"qs packed qkv", sa::DType::bf16, sa::PartialPrecision::f32, 2, 300, 300, 4, 4, 128, true, 3};
  const Inputs in = make_inputs(c, 31);
  const Result ref = run_gpu(c, in);
  const std::int64_t B = c.B, L = c.Lq, H = c.Hq, D = c.D;
  sa::HostTensor packed(c.dtype, {B, L, 3, H, D});
  auto* dst = packed.data<std::uint16_t>();
  const sa::HostTensor* parts[3] = {&in.q, &in.k, &in.v};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < L; ++l)
      for (int w = 0; w < 3; ++w)
        std::memcpy(dst + (((b * L + l) * 3 + w) * H) * D, parts[w]->data<std::uint16_t>() + ((b * L + l) * H) * D,
                    static_cast<std::size_t>(H * D) * 2);
  DeviceBuffer dpacked(packed), idx(in.idx);
  sa::TensorView views[3];
  for (int w = 0; w < 3; ++w) {
    views[w] = sa::TensorView::contiguous(static_cast<std::uint16_t*>(dpacked.ptr) + w * H * D, c.dtype, {B, L, H, D},
                                          sa::Device::cuda, 0);
    views[w].stride = {L * 3 * H * D, 3 * H * D, D, 1};
  }
  sa::HostTensor out(c.dtype, {B, L, H, D}), lse(sa::DType::f32, {B, H, L});
  st::poison(out);
  st::poison(lse);
  DeviceBuffer dout(out), dlse(lse);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.merge_window = c.merge;
  sa::query_sparse(views[0], views[1], views[2], sa::QueryLists{idx.view}, dout.view, dlse.view, opt);
  cuda_ok(cudaDeviceSynchronize(), "packed run");
  dout.download(out);
  dlse.download(lse);
  EXPECT_TRUE(st::all_finite(out));
  expect_same_bits(out, lse, ref);
}

TEST(QuerySparseGpu, ValidationReportsFirstBadEntry) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"qs validation", sa::DType::bf16, sa::PartialPrecision::f32, 2, 200, 300, 4, 2, 128, false, 3};
  const Inputs in = make_inputs(c, 5);
  auto expect_error = [&](const sa::HostTensor& lists, const std::string& needle) {
    DeviceBuffer q(in.q), k(in.k), v(in.v), idx(lists);
    sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D});
    DeviceBuffer dout(out);
    try {
      sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, dout.view);
      ADD_FAILURE() << "bad lists accepted; expected " << needle;
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), "lists.idx");
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  sa::HostTensor bad = in.idx;
  auto* d = bad.data<std::int32_t>();
  const std::int64_t row = ((1 * c.Hkv + 1) * c.Lq + 150) * c.kq;  // (b 1, g 1, query 150)
  d[row + 2] = 3;                                                  // Tk = 3
  d[row + 5 * c.kq + 0] = -7;                                      // a later row: not the first
  expect_error(bad, "block id 3 at [1, 1, 150, 2] is out of range [0, 3)");
  bad = in.idx;
  d = bad.data<std::int32_t>();
  d[row + 0] = 1, d[row + 1] = -1, d[row + 2] = 1;
  expect_error(bad, "block id 1 at [1, 1, 150, 2] repeats");

  // trusted: no validation, and bad ids are skipped without reading out of bounds.
  bad = in.idx;
  d = bad.data<std::int32_t>();
  d[row + 2] = 1 << 30;
  d[row + 1] = -5;
  DeviceBuffer q(in.q), k(in.k), v(in.v), idx(bad);
  sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D});
  st::poison(out);
  DeviceBuffer dout(out);
  sa::QuerySparseOptions opt;
  opt.trusted = true;
  sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, dout.view, std::nullopt, opt);
  cuda_ok(cudaDeviceSynchronize(), "trusted run");
  dout.download(out);
  EXPECT_TRUE(st::all_finite(out));
}

TEST(QuerySparseGpu, RejectsUnsupportedArguments) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  Case c{"qs D=96", sa::DType::bf16, sa::PartialPrecision::f32, 1, 64, 128, 2, 1, 96, false, 2};
  const Inputs in = make_inputs(c, 3);
  DeviceBuffer q(in.q), k(in.k), v(in.v), idx(in.idx);
  sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D});
  DeviceBuffer dout(out);
  try {
    sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, dout.view);
    ADD_FAILURE() << "D = 96 accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "q");
  }
  // A q row that is not 16-byte aligned (stride of 4 elements between heads).
  c.D = 128;
  const Inputs in2 = make_inputs(c, 4);
  DeviceBuffer q2(in2.q), k2(in2.k), v2(in2.v), idx2(in2.idx);
  sa::HostTensor out2(c.dtype, {c.B, c.Lq, c.Hq, c.D});
  DeviceBuffer dout2(out2);
  sa::TensorView qv = q2.view;
  qv.shape[2] = 1;
  qv.stride[2] = 4;
  sa::TensorView ov = dout2.view;
  ov.shape[2] = 1;
  sa::TensorView kv = k2.view;
  const sa::QuerySparseOptions defaults;
  const sa::detail::AttentionCall a =
      sa::detail::resolve_call("query_sparse", qv, kv, v2.view, ov, std::nullopt, defaults);
  EXPECT_THROW(sa::cuda_backend::query_sparse(a, query_call(sa::QueryLists{idx2.view}, a.p, defaults)), sa::Error);
}

// ---- the reverse index and the combine alone, through their launchers ------------------------------

namespace qs = sa::cuda_kernels::qs;

enum class IdxLayout { contiguous, padded_rows, slot_major };

// The lists [B, Hkv, Lq, Kq] as stored on the device in `layout`, with its element strides.
struct DeviceLists {
  std::vector<std::int32_t> host;
  long long stride[4] = {};
  std::unique_ptr<DeviceBuffer> buf;
};

DeviceLists upload_lists(const sa::HostTensor& lists, IdxLayout layout) {
  const auto& sh = lists.shape();
  const long long B = sh[0], H = sh[1], L = sh[2], K = sh[3];
  DeviceLists d;
  long long* s = d.stride;
  if (layout == IdxLayout::contiguous) s[3] = 1, s[2] = K, s[1] = L * K, s[0] = H * L * K;
  if (layout == IdxLayout::padded_rows) s[3] = 1, s[2] = K + 3, s[1] = L * (K + 3) + 5, s[0] = H * s[1];
  if (layout == IdxLayout::slot_major) s[2] = 1, s[3] = L, s[1] = K * L, s[0] = H * K * L;
  d.host.assign(static_cast<std::size_t>(B * s[0]), -7);  // gaps hold an invalid id: reading one shows
  const auto* src = lists.data<std::int32_t>();
  for (long long b = 0; b < B; ++b)
    for (long long h = 0; h < H; ++h)
      for (long long i = 0; i < L; ++i)
        for (long long k = 0; k < K; ++k)
          d.host[static_cast<std::size_t>(b * s[0] + h * s[1] + i * s[2] + k * s[3])] = src[((b * H + h) * L + i) * K + k];
  d.buf = std::make_unique<DeviceBuffer>(d.host.size() * sizeof(std::int32_t));
  cuda_ok(cudaMemcpy(d.buf->ptr, d.host.data(), d.host.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
          "lists upload");
  return d;
}

qs::Params kernel_params(const sa::ProblemShape& p, std::int64_t Kq, const DeviceLists& lists, int bands = 1) {
  qs::Params q;
  q.B = static_cast<int>(p.B), q.Lq = static_cast<int>(p.Lq), q.Lk = static_cast<int>(p.Lk);
  q.Hq = static_cast<int>(p.Hq), q.Hkv = static_cast<int>(p.Hkv), q.Tk = static_cast<int>(p.Tk());
  q.Kq = static_cast<int>(Kq), q.group = static_cast<int>(p.group_size());
  q.offset = p.offset();
  q.causal = p.causal;
  q.bands = bands;
  q.band_queries = static_cast<int>((p.Lq + bands - 1) / bands);
  q.bins = q.Tk * bands;
  q.nblk = p.B * p.Hkv * q.bins;
  q.slots = p.B * p.Hkv * p.Lq * Kq;
  q.idx = static_cast<const std::int32_t*>(lists.buf->ptr);
  for (int i = 0; i < 4; ++i) q.idx_stride[i] = lists.stride[i];
  return q;
}

bool chosen_host(const sa::ProblemShape& p, std::int64_t i, std::int32_t j) {
  return j >= 0 && j < p.Tk() && (!p.causal || static_cast<std::int64_t>(j) * qs::kKeys <= i + p.offset());
}

template <class T>
std::vector<T> download_array(const void* ptr, std::size_t n) {
  std::vector<T> v(n);
  if (n) cuda_ok(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}

struct IndexCase {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 256, Hq = 1, Hkv = 1, Kq = 4;
  bool causal = false, empty_tile = false, popular = false, no_selection = false;
  IdxLayout layout = IdxLayout::contiguous;
  int bands = 1;  // query bands: query i's block j is bin (i / ceil(Lq / bands)) * Tk + j
};

void check_reverse_index(const IndexCase& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name);
  sa::ProblemShape p;
  p.B = c.B, p.Lq = c.Lq, p.Lk = c.Lk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.D = 128, p.causal = c.causal;
  sa::HostTensor lists = st::query_lists::random_lists(p, c.Kq, c.empty_tile, c.popular, seed);
  if (c.no_selection) std::fill_n(lists.data<std::int32_t>(), lists.numel(), -1);
  const DeviceLists dl = upload_lists(lists, c.layout);
  qs::Params q = kernel_params(p, c.Kq, dl, c.bands);
  const std::int64_t nblk = q.nblk, slots = q.slots, G = p.group_size();
  const std::int64_t max_items = (slots * G + qs::kRowsPerItem - 1) / qs::kRowsPerItem + nblk;

  // The CSR built on the host: each bin's entries (query * Kq + slot), sorted.
  std::vector<std::vector<int>> want(static_cast<std::size_t>(nblk));
  const auto* l = lists.data<std::int32_t>();
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg)
    for (std::int64_t i = 0; i < p.Lq; ++i)
      for (std::int64_t s = 0; s < c.Kq; ++s) {
        const std::int32_t j = l[(bg * p.Lq + i) * c.Kq + s];
        const std::int64_t bin = i / q.band_queries * p.Tk() + j;
        if (chosen_host(p, i, j))
          want[static_cast<std::size_t>(bg * q.bins + bin)].push_back(static_cast<int>(i * c.Kq + s));
      }
  std::int64_t total = 0, total_items = 0;
  for (const auto& w : want) {
    total += static_cast<std::int64_t>(w.size());
    total_items += (static_cast<std::int64_t>(w.size()) * G + qs::kRowsPerItem - 1) / qs::kRowsPerItem;
  }

  // Arrays poisoned with 0xff bytes: the second run starts from the first run's leftovers.
  DeviceBuffer counts(sizeof(int) * nblk), offsets(sizeof(int) * (nblk + 1)), item_offsets(sizeof(int) * (nblk + 1)),
      entries(sizeof(int) * slots), items(sizeof(int2) * max_items);
  for (const DeviceBuffer* b : {&counts, &offsets, &item_offsets, &entries, &items})
    cuda_ok(cudaMemset(b->ptr, 0xff, std::max<std::size_t>(b->bytes, 1)), "poison");
  q.counts = static_cast<int*>(counts.ptr);
  q.offsets = static_cast<int*>(offsets.ptr);
  q.item_offsets = static_cast<int*>(item_offsets.ptr);
  q.entries = static_cast<int*>(entries.ptr);
  q.items = static_cast<int2*>(items.ptr);
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    cuda_ok(qs::launch_reverse_index(q, nullptr), "reverse index launch");
    cuda_ok(cudaDeviceSynchronize(), "reverse index");
    const auto off = download_array<int>(offsets.ptr, static_cast<std::size_t>(nblk + 1));
    const auto ioff = download_array<int>(item_offsets.ptr, static_cast<std::size_t>(nblk + 1));
    const auto ent = download_array<int>(entries.ptr, static_cast<std::size_t>(slots));
    const auto its = download_array<int2>(items.ptr, static_cast<std::size_t>(max_items));
    ASSERT_EQ(off[0], 0);
    ASSERT_EQ(ioff[0], 0);
    ASSERT_EQ(off[static_cast<std::size_t>(nblk)], total);
    ASSERT_EQ(ioff[static_cast<std::size_t>(nblk)], total_items);
    for (std::int64_t x = 0; x < nblk; ++x) {
      const auto xs = static_cast<std::size_t>(x);
      std::vector<int> got(ent.begin() + off[xs], ent.begin() + off[xs + 1]);
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, want[xs]) << "entries of block " << x;
      const std::int64_t n = (static_cast<std::int64_t>(want[xs].size()) * G + qs::kRowsPerItem - 1) / qs::kRowsPerItem;
      ASSERT_EQ(ioff[xs + 1] - ioff[xs], n) << "items of block " << x;
      for (std::int64_t t = 0; t < n; ++t) {
        const int2 it = its[static_cast<std::size_t>(ioff[xs] + t)];
        ASSERT_TRUE(it.x == x && it.y == t * qs::kRowsPerItem) << "item " << t << " of block " << x;
      }
    }
    // Nothing past the totals is written.
    for (std::int64_t e = total; e < slots; ++e) ASSERT_EQ(ent[static_cast<std::size_t>(e)], -1) << "entry " << e;
    for (std::int64_t t = total_items; t < max_items; ++t)
      ASSERT_TRUE(its[static_cast<std::size_t>(t)].x == -1 && its[static_cast<std::size_t>(t)].y == -1) << "item " << t;
  }
  std::printf("[ %-34s ] %lld blocks, %lld entries, %lld items\n", c.name.c_str(), static_cast<long long>(nblk),
              static_cast<long long>(total), static_cast<long long>(total_items));
}

TEST(QuerySparseGpu, ReverseIndexMatchesHostCsr) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using L = IdxLayout;
  const std::vector<IndexCase> cases = {
      {"ri GQA4 causal Lq=1013", 2, 1013, 5000, 12, 3, 7, true, true},
      {"ri Lq>Lk causal slot-major", 1, 700, 300, 4, 2, 5, true, false, false, false, L::slot_major},
      {"ri popular GQA16 padded rows", 1, 1500, 1000, 16, 1, 6, false, false, true, false, L::padded_rows},
      {"ri nblk 3600 (> one scan tile)", 3, 200, 300 * 128, 8, 4, 5},
      {"ri Tk 5000 (shared cursors)", 1, 300, 5000 * 128, 4, 2, 8},
      {"ri Tk 12289 (global-atomic path)", 1, 64, 12289 * 128 - 5, 2, 1, 8},
      // 48 KB of dynamic shared memory exactly (plus the kernels' static bytes): the fill's staging at
      // 2048 bins and 4096-slot chunks, the count's histogram at 12288 bins.
      {"ri Tk 2048 (staging 48 KB)", 1, 300, 2048 * 128, 4, 2, 8},
      {"ri Tk 12288 (histogram 48 KB)", 1, 64, 12288 * 128, 2, 1, 8},
      {"ri 8 bands x Tk 256 (staging 48 KB)", 1, 2000, 256 * 128, 8, 2, 16, false, false, false, false, L::contiguous,
       8},
      {"ri Lq=1 Kq=1", 2, 1, 129, 2, 2, 1},
      {"ri no block chosen", 2, 100, 512, 4, 2, 4, false, false, false, true},
      {"ri 3 bands GQA4 causal Lq=1013", 2, 1013, 5000, 12, 3, 7, true, true, false, false, L::contiguous, 3},
      {"ri 7 bands popular slot-major", 1, 1500, 1000, 16, 1, 6, false, false, true, false, L::slot_major, 7},
      {"ri 5 bands Lq=5", 2, 5, 640, 4, 2, 3, false, false, false, false, L::contiguous, 5},
      {"ri 48 bands shared cursors", 1, 3000, 250 * 128, 4, 1, 8, false, false, false, false, L::contiguous, 48},
  };
  std::uint64_t seed = 300;
  for (const IndexCase& c : cases) check_reverse_index(c, ++seed);
}

struct CombineCase {
  std::string name;
  sa::DType dtype = sa::DType::bf16;
  bool bf16_partials = false;
  std::int64_t B = 1, Lq = 64, Lk = 2048, Hq = 4, Hkv = 1, D = 128, Kq = 8;
  bool causal = false;
  std::int64_t head_pad = 0;  // out's head stride is D + head_pad
  bool lse_transposed = false, no_lse = false;
  IdxLayout layout = IdxLayout::contiguous;
};

struct CombineRun {
  std::vector<std::uint16_t> out;
  std::vector<float> lse;
};

void check_combine(const CombineCase& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name);
  sa::ProblemShape p;
  p.B = c.B, p.Lq = c.Lq, p.Lk = c.Lk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.D = c.D, p.causal = c.causal;
  const std::int64_t G = p.group_size(), D = c.D, Kq = c.Kq;
  sa::HostTensor lists = st::query_lists::random_lists(p, Kq, false, false, seed);
  const DeviceLists dl = upload_lists(lists, c.layout);
  qs::Params q = kernel_params(p, Kq, dl);
  const std::int64_t rows = q.slots * G;

  // Partials of chosen slots: LSE in [-6, 6], values normal; every other slot's are NaN.
  std::mt19937_64 rng(seed * 13 + 5);
  std::uniform_real_distribution<float> lse_dist(-6.0f, 6.0f);
  std::normal_distribution<float> val_dist(0.0f, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> lse_part(static_cast<std::size_t>(rows), nan);
  std::vector<float> part(static_cast<std::size_t>(rows * D), nan);
  const auto* l = lists.data<std::int32_t>();
  for (std::int64_t slot = 0; slot < q.slots; ++slot) {
    const std::int64_t i = (slot / Kq) % p.Lq;
    if (!chosen_host(p, i, l[slot])) continue;
    for (std::int64_t h = 0; h < G; ++h) {
      lse_part[static_cast<std::size_t>(slot * G + h)] = lse_dist(rng);
      for (std::int64_t d = 0; d < D; ++d) {
        const float v = val_dist(rng);
        part[static_cast<std::size_t>((slot * G + h) * D + d)] = c.bf16_partials ? sa::round_bf16(v) : v;
      }
    }
  }
  DeviceBuffer dlse_part(lse_part.size() * sizeof(float));
  cuda_ok(cudaMemcpy(dlse_part.ptr, lse_part.data(), dlse_part.bytes, cudaMemcpyHostToDevice), "upload");
  DeviceBuffer dpart(part.size() * (c.bf16_partials ? 2 : 4));
  if (c.bf16_partials) {  // stored in the attention kernel's fragment order (qs::bf16_part_position)
    std::vector<std::uint16_t> h(part.size());
    for (std::size_t e = 0; e < part.size(); ++e) {
      const std::size_t row = e / static_cast<std::size_t>(D);
      const int d = static_cast<int>(e % static_cast<std::size_t>(D));
      h[row * static_cast<std::size_t>(D) + static_cast<std::size_t>(qs::bf16_part_position(d))] =
          sa::float_to_bf16(part[e]);
    }
    cuda_ok(cudaMemcpy(dpart.ptr, h.data(), dpart.bytes, cudaMemcpyHostToDevice), "upload");
  } else {
    cuda_ok(cudaMemcpy(dpart.ptr, part.data(), dpart.bytes, cudaMemcpyHostToDevice), "upload");
  }
  q.lse_part = static_cast<float*>(dlse_part.ptr);
  q.part = dpart.ptr;

  // out [B, Lq, Hq, D] with a head stride of D + head_pad; lse [B, Hq, Lq] or [B, Lq, Hq].
  const std::int64_t hs = D + c.head_pad;
  const std::int64_t out_elems = c.B * c.Lq * c.Hq * hs;
  DeviceBuffer dout(static_cast<std::size_t>(out_elems) * 2), dlse(static_cast<std::size_t>(c.B * c.Hq * c.Lq) * 4);
  q.out = dout.ptr;
  q.out_stride[0] = c.Lq * c.Hq * hs, q.out_stride[1] = c.Hq * hs, q.out_stride[2] = hs;
  if (!c.no_lse) {
    q.lse = static_cast<float*>(dlse.ptr);
    if (c.lse_transposed) q.lse_stride[0] = c.Hq * c.Lq, q.lse_stride[1] = 1, q.lse_stride[2] = c.Hq;
    else q.lse_stride[0] = c.Hq * c.Lq, q.lse_stride[1] = c.Lq, q.lse_stride[2] = 1;
  }
  auto run = [&] {
    cuda_ok(cudaMemset(dout.ptr, 0xff, dout.bytes), "poison");  // 0xffff: NaN in bf16 and f16
    cuda_ok(cudaMemset(dlse.ptr, 0xff, dlse.bytes), "poison");
    cuda_ok(qs::launch_combine(q, c.dtype == sa::DType::bf16, static_cast<int>(D), c.bf16_partials, nullptr),
            "combine launch");
    cuda_ok(cudaDeviceSynchronize(), "combine");
    return CombineRun{download_array<std::uint16_t>(dout.ptr, static_cast<std::size_t>(out_elems)),
                      download_array<float>(dlse.ptr, static_cast<std::size_t>(c.B * c.Hq * c.Lq))};
  };
  const CombineRun a = run();
  const CombineRun b = run();
  EXPECT_TRUE(a.out == b.out) << "out differs between two runs";
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4)) << "lse differs between two runs";

  // float64 combine of the same partials.
  const double ulp = c.dtype == sa::DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  double worst = 0.0;
  std::int64_t empty = 0;
  std::vector<double> acc(static_cast<std::size_t>(D)), mag(static_cast<std::size_t>(D));
  for (std::int64_t bb = 0; bb < c.B; ++bb)
    for (std::int64_t g = 0; g < c.Hkv; ++g)
      for (std::int64_t i = 0; i < c.Lq; ++i)
        for (std::int64_t hh = 0; hh < G; ++hh) {
          const std::int64_t slot0 = ((bb * c.Hkv + g) * c.Lq + i) * Kq, h = g * G + hh;
          double m = -INFINITY;
          for (std::int64_t s = 0; s < Kq; ++s)
            if (chosen_host(p, i, l[slot0 + s])) m = std::max(m, double(lse_part[static_cast<std::size_t>((slot0 + s) * G + hh)]));
          double sum = 0.0;
          for (std::int64_t s = 0; s < Kq; ++s)
            if (chosen_host(p, i, l[slot0 + s])) sum += std::exp(lse_part[static_cast<std::size_t>((slot0 + s) * G + hh)] - m);
          const double lse_ref = m == -INFINITY ? -INFINITY : m + std::log(sum);
          std::fill(acc.begin(), acc.end(), 0.0);
          std::fill(mag.begin(), mag.end(), 0.0);
          for (std::int64_t s = 0; s < Kq; ++s) {
            if (!chosen_host(p, i, l[slot0 + s])) continue;
            const std::int64_t r = (slot0 + s) * G + hh;
            const double w = std::exp(lse_part[static_cast<std::size_t>(r)] - lse_ref);
            for (std::int64_t d = 0; d < D; ++d) {
              acc[static_cast<std::size_t>(d)] += w * part[static_cast<std::size_t>(r * D + d)];
              mag[static_cast<std::size_t>(d)] += w * std::abs(part[static_cast<std::size_t>(r * D + d)]);
            }
          }
          const std::int64_t lo = bb * c.Lq * c.Hq * hs + i * c.Hq * hs + h * hs;
          for (std::int64_t d = 0; d < D; ++d) {
            const std::uint16_t raw = a.out[static_cast<std::size_t>(lo + d)];
            const double got = c.dtype == sa::DType::bf16 ? sa::bf16_to_float(raw) : sa::f16_to_float(raw);
            const double want = acc[static_cast<std::size_t>(d)];
            const double err = std::abs(got - want);
            ASSERT_LE(err, ulp * std::abs(want) + 1e-5 * mag[static_cast<std::size_t>(d)] + 1e-7)
                << "out (b " << bb << ", query " << i << ", head " << h << ", d " << d << "): " << got << " vs " << want;
            worst = std::max(worst, err);
          }
          for (std::int64_t d = D; d < hs; ++d)
            ASSERT_EQ(a.out[static_cast<std::size_t>(lo + d)], 0xffff) << "padding written at head " << h;
          if (c.no_lse) continue;
          const std::int64_t li = c.lse_transposed ? (bb * c.Lq + i) * c.Hq + h : (bb * c.Hq + h) * c.Lq + i;
          const float got_lse = a.lse[static_cast<std::size_t>(li)];
          if (lse_ref == -INFINITY) {
            ++empty;
            ASSERT_TRUE(std::isinf(got_lse) && got_lse < 0) << "lse of an empty row: " << got_lse;
          } else {
            ASSERT_LE(std::abs(got_lse - lse_ref), 2e-5 * std::max(1.0, std::abs(lse_ref))) << "lse " << got_lse << " vs " << lse_ref;
          }
        }
  if (c.no_lse) {
    for (float x : a.lse) ASSERT_TRUE(std::isnan(x)) << "lse written while absent";
  }
  std::printf("[ %-34s ] max |out - ref| %.3e, empty rows %lld\n", c.name.c_str(), worst, static_cast<long long>(empty));
}

TEST(QuerySparseGpu, CombineMatchesFloat64) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using L = IdxLayout;
  const auto bf = sa::DType::bf16, f16 = sa::DType::f16;
  const std::vector<CombineCase> cases = {
      {"cb GQA4 D128 f32 part", bf, false, 1, 300, 2048, 8, 2, 128, 16},
      {"cb GQA4 D128 bf16 part", bf, true, 1, 300, 2048, 8, 2, 128, 16},
      {"cb GQA16 D128 f32 part (4 tiles)", bf, false, 2, 130, 4096, 16, 1, 128, 16},
      {"cb GQA16 D128 bf16 part f16 out", f16, true, 2, 130, 4096, 16, 1, 128, 16},
      {"cb G3 D64 causal Lq>Lk f16", f16, true, 1, 257, 200, 6, 2, 64, 5, true},
      {"cb MHA D64 Kq=40 bf16 part (4 slot groups)", bf, true, 1, 100, 6000, 2, 2, 64, 40},
      {"cb MHA D128 bf16 part causal (2 groups)", bf, true, 2, 150, 700, 3, 3, 128, 6, true},
      {"cb MHA D64 f32 part (2 slot groups)", f16, false, 1, 120, 1200, 2, 2, 64, 7},
      {"cb G40 D128 Kq=3 f32 part", bf, false, 1, 50, 1000, 40, 1, 128, 3},
      {"cb G33 D64 bf16 part slot-major", bf, true, 1, 70, 3000, 33, 1, 64, 6, false, 0, false, false, L::slot_major},
      {"cb padded heads (vector stores)", bf, false, 2, 90, 1500, 8, 2, 128, 4, true, 8, true},
      {"cb odd head stride (scalar)", f16, true, 1, 90, 1500, 4, 1, 64, 4, false, 3, false, true, L::padded_rows},
      {"cb Kq=1 causal", bf, false, 2, 200, 256, 4, 2, 128, 1, true},
  };
  std::uint64_t seed = 500;
  for (const CombineCase& c : cases) check_combine(c, ++seed);
}

}  // namespace
