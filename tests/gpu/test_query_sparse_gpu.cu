// GPU tests of the KV-centric query_sparse: every result against the float64 CPU reference with the
// per-query lists applied as an explicit mask (DESIGN §6), on awkward shapes (Lq = 1, 17, 1013; Lk
// not a multiple of 128; Lq > Lk under causal; a Q tile with no selected block; a block chosen by
// every query, split into many work items; Hq = Hkv and Hq = 16 x Hkv; B > 1 with different lists),
// poisoned outputs, both dtypes, f32 and bf16 partials, bitwise-identical repeated runs, the
// plan()/run() path with a caller-owned workspace, strided (packed QKV) inputs, and device-side
// validation of the lists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/query_lists_testing.hpp"
#include "cuda/query_sparse/backend.hpp"
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
};

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

// Through the public operator (front-end checks, dispatch, cached workspace).
Result run_gpu(const Case& c, const Inputs& in) {
  Result r{sa::HostTensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}), sa::HostTensor(sa::DType::f32, {c.B, c.Hq, c.Lq})};
  st::poison(r.out);
  st::poison(r.lse);
  DeviceBuffer q(in.q), k(in.k), v(in.v), idx(in.idx), out(r.out), lse(r.lse);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.partials = c.partials;
  sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, out.view, lse.view, opt);
  cuda_ok(cudaDeviceSynchronize(), "query_sparse");
  out.download(r.out);
  lse.download(r.lse);
  return r;
}

std::string coord(std::int64_t b, std::int64_t i, std::int64_t h) {
  return "(b " + std::to_string(b) + ", query " + std::to_string(i) + ", head " + std::to_string(h) + ")";
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

void check_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name);
  const Inputs in = make_inputs(c, seed);
  const Result r = run_gpu(c, in);
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
  std::int64_t empty = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Lq; ++i) {
        const std::int64_t li = (b * c.Hq + h) * c.Lq + i;
        if (!std::isinf(ref.lse[static_cast<std::size_t>(li)])) continue;
        ++empty;
        ASSERT_TRUE(std::isinf(st::element(r.lse, li)) && st::element(r.lse, li) < 0) << "lse[" << li << "]";
        for (std::int64_t d = 0; d < c.D; ++d)
          ASSERT_EQ(st::element(r.out, ((b * c.Lq + i) * c.Hq + h) * c.D + d), 0.0) << "empty row " << coord(b, i, h);
      }
  std::printf("[ %-34s ] relerr %.3e  max_abs %.3e  lse_err %.3e  empty rows %lld\n", c.name.c_str(), rel, max_abs,
              lse_err, static_cast<long long>(empty));
}

TEST(QuerySparseGpu, Shapes) {
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
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

// Small enough for compute-sanitizer (memcheck, racecheck, synccheck): both head dims, causal with a
// partial last block, GQA, B = 2, both partial precisions, an empty tile and a popular block.
TEST(QuerySparseGpu, SanitizerSmall) {
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
  using P = sa::PartialPrecision;
  check_case({"qs sanitizer D=128", sa::DType::bf16, P::f32, 2, 260, 300, 4, 2, 128, true, 3, true, true}, 7);
  check_case({"qs sanitizer D=64", sa::DType::f16, P::bf16, 1, 140, 200, 2, 1, 64, false, 2}, 8);
}

TEST(QuerySparseGpu, RepeatedRunsAreBitwiseIdentical) {
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
  for (auto prec : {sa::PartialPrecision::f32, sa::PartialPrecision::bf16}) {
    const Case c{"qs determinism", sa::DType::bf16, prec, 2, 700, 900, 16, 1, 128, true, 8, false, true};
    const Inputs in = make_inputs(c, 55);
    const Result a = run_gpu(c, in), b = run_gpu(c, in);
    EXPECT_EQ(0, std::memcmp(a.out.view().data, b.out.view().data, static_cast<std::size_t>(a.out.numel()) * 2));
    EXPECT_EQ(0, std::memcmp(a.lse.view().data, b.lse.view().data, static_cast<std::size_t>(a.lse.numel()) * 4));
    EXPECT_TRUE(st::all_finite(a.out));
  }
}

// plan() once with a caller-owned workspace, run() for two different q: each equals the one-call
// operator bit for bit.
TEST(QuerySparseGpu, PlanOnceRunMany) {
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
  const Case c{"qs plan/run", sa::DType::bf16, sa::PartialPrecision::f32, 2, 333, 640, 8, 2, 128, true, 4};
  const Inputs in = make_inputs(c, 77);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  const std::size_t bytes = sa::query_sparse_workspace_bytes(in.p, c.kq, opt.partials);
  ASSERT_GT(bytes, 0u);
  DeviceBuffer ws(bytes), k(in.k), v(in.v), idx(in.idx), q0(in.q);
  const sa::QuerySparsePlan plan = sa::query_sparse_plan(q0.view, k.view, v.view, sa::QueryLists{idx.view}, ws.view, opt);
  ASSERT_TRUE(plan.planned);
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
    EXPECT_EQ(0, std::memcmp(out.view().data, one.out.view().data, static_cast<std::size_t>(out.numel()) * 2));
    EXPECT_EQ(0, std::memcmp(lse.view().data, one.lse.view().data, static_cast<std::size_t>(lse.numel()) * 4));
    EXPECT_TRUE(st::all_finite(out));
  }
  // A workspace one byte short is refused before anything is launched.
  DeviceBuffer small(bytes - 1);
  EXPECT_THROW(sa::query_sparse_plan(q0.view, k.view, v.view, sa::QueryLists{idx.view}, small.view, opt), sa::Error);
}

// q, k, v as views into one packed [B, L, 3, H, D] buffer (a fused QKV projection): the gathers
// follow the strides, and the result equals the contiguous run bit for bit.
TEST(QuerySparseGpu, PackedQkvStrides) {
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
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
  sa::query_sparse(views[0], views[1], views[2], sa::QueryLists{idx.view}, dout.view, dlse.view, opt);
  cuda_ok(cudaDeviceSynchronize(), "packed run");
  dout.download(out);
  dlse.download(lse);
  EXPECT_TRUE(st::all_finite(out));
  EXPECT_EQ(0, std::memcmp(out.view().data, ref.out.view().data, static_cast<std::size_t>(out.numel()) * 2));
  EXPECT_EQ(0, std::memcmp(lse.view().data, ref.lse.view().data, static_cast<std::size_t>(lse.numel()) * 4));
}

TEST(QuerySparseGpu, ValidationReportsFirstBadEntry) {
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
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
  QUERY_SPARSE_SKIP_WITHOUT_GPU();
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
  EXPECT_THROW(sa::cuda_backend::query_sparse(sa::ProblemShape{1, 64, 128, 1, 1, 128, false}, qv, kv, v2.view,
                                              sa::QueryLists{idx2.view}, ov, std::nullopt, {}),
               sa::Error);
}

}  // namespace
