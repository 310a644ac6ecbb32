// GPU tests of the group-centric query_sparse schedule: every result against the float64 CPU
// reference with the per-query lists applied as an explicit mask (docs/design.md §6), on awkward shapes
// (Lq = 1, 17, 1013; Lk not a multiple of 128; Lq > Lk under causal; empty lists and an empty Q
// tile; group sizes 1, 4, 8, 16, 32 and 24 (a padded second head tile); B > 1 with different lists),
// poisoned outputs, both dtypes and head dims, bitwise-identical repeated runs, agreement with the
// KV-centric schedule, strided inputs, device validation through this schedule, trusted lists with
// bad entries, and the rejected configurations.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/query_lists_testing.hpp"
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
  std::int64_t B = 1, Lq = 128, Lk = 256, Hq = 16, Hkv = 1, D = 128;
  bool causal = false;
  std::int64_t kq = 4;
  bool empty_tile = false;  // queries 128..255 select nothing
};

sa::ProblemShape shape_of(const Case& c) {
  sa::ProblemShape p;
  p.B = c.B, p.Lq = c.Lq, p.Lk = c.Lk, p.Hq = c.Hq, p.Hkv = c.Hkv, p.D = c.D, p.causal = c.causal;
  return p;
}

Inputs make_inputs(const Case& c, std::uint64_t seed) {
  return st::query_lists::random_inputs(shape_of(c), c.dtype, c.kq, c.empty_tile, false, seed);
}

struct Result {
  sa::HostTensor out, lse;
};

Result run_gpu(const Case& c, const Inputs& in, sa::QuerySchedule schedule, bool trusted = false) {
  Result r{sa::HostTensor(c.dtype, {c.B, c.Lq, c.Hq, c.D}), sa::HostTensor(sa::DType::f32, {c.B, c.Hq, c.Lq})};
  st::poison(r.out);
  st::poison(r.lse);
  DeviceBuffer q(in.q), k(in.k), v(in.v), idx(in.idx), out(r.out), lse(r.lse);
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.schedule = schedule;
  opt.trusted = trusted;
  sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, out.view, lse.view, opt);
  cuda_ok(cudaDeviceSynchronize(), "query_sparse");
  out.download(r.out);
  lse.download(r.lse);
  return r;
}

// A plain same-precision implementation (P and out rounded to the 16-bit type) lands near 3e-3
// (bf16) / 4e-4 (f16); the bounds allow 2x that plus a small absolute term.
struct Tolerance {
  double rel, max_abs_frac, lse_abs;
};
Tolerance tolerance(sa::DType dt) {
  const double rel = dt == sa::DType::bf16 ? 3e-3 : 4e-4;
  const double ulp = dt == sa::DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  return {2 * rel + 1e-4, 4 * ulp, 1e-3};
}

void check_against_reference(const Case& c, const Inputs& in, const Result& r) {
  const st::Reference ref = st::reference_attention(in.q.view(), in.k.view(), in.v.view(),
                                                    sa::Selection{sa::QueryLists{in.idx.view()}}, in.p,
                                                    1.0 / std::sqrt(double(c.D)));
  ASSERT_TRUE(std::any_of(ref.lse.begin(), ref.lse.end(), [](double x) { return std::isfinite(x); }))
      << "degenerate case: no query sees any key";
  EXPECT_TRUE(st::all_finite(r.out)) << "out holds NaN/inf (unwritten or broken)";
  const Tolerance tol = tolerance(c.dtype);
  const double rel = st::rel_err(r.out, ref.out);
  double ref_max = 1.0;
  for (double x : ref.out) ref_max = std::max(ref_max, std::abs(x));
  const double max_abs = st::max_abs_err(r.out, ref.out);
  const double lse_err = st::lse_max_err(r.lse, ref.lse);
  EXPECT_LE(rel, tol.rel);
  EXPECT_LE(max_abs, tol.max_abs_frac * ref_max) << "max |ref| " << ref_max;
  EXPECT_LE(lse_err, tol.lse_abs);
  const std::int64_t empty = st::expect_empty_rows(r.out, r.lse, ref, c.name);
  std::printf("[ %-36s ] relerr %.3e  max_abs %.3e  lse_err %.3e  empty rows %lld\n", c.name.c_str(), rel, max_abs,
              lse_err, static_cast<long long>(empty));
}

void check_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name);
  const Inputs in = make_inputs(c, seed);
  check_against_reference(c, in, run_gpu(c, in, sa::QuerySchedule::group_centric));
}

TEST(QueryGroupGpu, ShapesAndGroupSizes) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using sa::DType;
  const std::vector<Case> cases = {
      {"G=16 Lq=1013 Lk=1000 causal", DType::bf16, 1, 1013, 1000, 16, 1, 128, true, 6, true},
      {"G=16 Lq=1013 Lk=1000", DType::bf16, 1, 1013, 1000, 16, 1, 128, false, 5},
      {"G=16 B=2 Lq=17 f16 D=64", DType::f16, 2, 17, 300, 16, 1, 64, false, 3},
      {"G=1 Hq=Hkv=2 Lq=300", DType::bf16, 1, 300, 520, 2, 2, 128, false, 4},
      {"G=4 B=2 Lq=1 causal f16", DType::f16, 2, 1, 777, 8, 2, 128, true, 5},
      {"G=8 Lq=17 causal D=64", DType::bf16, 2, 17, 300, 16, 2, 64, true, 3},
      {"G=32 Lq=200 Lk=900 causal", DType::bf16, 1, 200, 900, 32, 1, 128, true, 4},
      {"G=24 (padded tile) f16", DType::f16, 1, 150, 400, 24, 1, 128, false, 3},
      {"Lq>Lk causal (empty rows)", DType::bf16, 1, 300, 129, 16, 1, 128, true, 2},
      {"G=16 Kq=40 > Tk union", DType::bf16, 2, 70, 1300, 16, 1, 64, false, 40},
  };
  std::uint64_t seed = 300;
  for (const Case& c : cases) check_case(c, ++seed);
}

// Small enough for compute-sanitizer (memcheck, racecheck, synccheck): both head dims, causal with a
// partial last block, a padded head tile, B = 2, an empty tile, and a 2-stage and a 5-stage ring
// wrapping several times.
TEST(QueryGroupGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  check_case({"sanitizer G=16 D=128 causal", sa::DType::bf16, 2, 260, 300, 16, 1, 128, true, 3, true}, 7);
  check_case({"sanitizer G=4 D=64 f16", sa::DType::f16, 1, 40, 700, 8, 2, 64, false, 5}, 8);
}

TEST(QueryGroupGpu, RepeatedRunsAreBitwiseIdentical) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"determinism", sa::DType::bf16, 2, 700, 900, 16, 1, 128, true, 8};
  const Inputs in = make_inputs(c, 55);
  const Result a = run_gpu(c, in, sa::QuerySchedule::group_centric);
  const Result b = run_gpu(c, in, sa::QuerySchedule::group_centric);
  EXPECT_TRUE(st::all_finite(a.out));
  EXPECT_EQ(0, std::memcmp(a.out.view().data, b.out.view().data, static_cast<std::size_t>(a.out.numel()) * 2));
  EXPECT_EQ(0, std::memcmp(a.lse.view().data, b.lse.view().data, static_cast<std::size_t>(a.lse.numel()) * 4));
}

// Both schedules compute the same attention: each within docs/design.md §6 bounds of the reference, and
// within the same bound of each other (with f32 partials the KV-centric combine adds only f32
// rounding).
TEST(QueryGroupGpu, AgreesWithKvCentric) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (const Case& c : {Case{"agree G=16 causal", sa::DType::bf16, 2, 500, 640, 16, 1, 128, true, 6},
                        Case{"agree G=4 f16 D=64", sa::DType::f16, 1, 333, 1000, 16, 4, 64, false, 8}}) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, 91);
    const Result grp = run_gpu(c, in, sa::QuerySchedule::group_centric);
    const Result kv = run_gpu(c, in, sa::QuerySchedule::kv_centric);
    std::vector<double> kv_out(static_cast<std::size_t>(kv.out.numel()));
    for (std::int64_t e = 0; e < kv.out.numel(); ++e) kv_out[static_cast<std::size_t>(e)] = st::element(kv.out, e);
    std::vector<double> kv_lse(static_cast<std::size_t>(kv.lse.numel()));
    for (std::int64_t e = 0; e < kv.lse.numel(); ++e) kv_lse[static_cast<std::size_t>(e)] = st::element(kv.lse, e);
    const double rel = st::rel_err(grp.out, kv_out);
    EXPECT_LE(rel, tolerance(c.dtype).rel);
    EXPECT_LE(st::lse_max_err(grp.lse, kv_lse), 1e-3);
    std::printf("[ %-36s ] group vs kv relerr %.3e\n", c.name.c_str(), rel);
  }
}

// q, k, v as views into one packed [B, L, 3, H, D] buffer (a fused QKV projection), out and lse
// into wider buffers: the kernel follows every stride and equals the contiguous run bit for bit.
TEST(QueryGroupGpu, StridedTensors) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"strided", sa::DType::bf16, 2, 300, 300, 4, 4, 128, true, 3};
  const Inputs in = make_inputs(c, 31);
  const Result ref = run_gpu(c, in, sa::QuerySchedule::group_centric);
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
  // out rows twice as wide as needed, lse [B, H, 2 L]
  sa::HostTensor wide(c.dtype, {B, L, H, 2 * D}), wlse(sa::DType::f32, {B, H, 2 * L});
  st::poison(wide);
  st::poison(wlse);
  DeviceBuffer dwide(wide), dwlse(wlse);
  sa::TensorView ov = dwide.view, lv = dwlse.view;
  ov.shape = {B, L, H, D};
  lv.shape = {B, H, L};
  sa::QuerySparseOptions opt;
  opt.causal = c.causal;
  opt.schedule = sa::QuerySchedule::group_centric;
  sa::query_sparse(views[0], views[1], views[2], sa::QueryLists{idx.view}, ov, lv, opt);
  cuda_ok(cudaDeviceSynchronize(), "strided run");
  dwide.download(wide);
  dwlse.download(wlse);
  for (std::int64_t r = 0; r < B * L * H; ++r) {
    ASSERT_EQ(0, std::memcmp(wide.data<std::uint16_t>() + r * 2 * D, ref.out.data<std::uint16_t>() + r * D,
                             static_cast<std::size_t>(D) * 2))
        << "row " << r;
    for (std::int64_t d = D; d < 2 * D; ++d)  // the rest of the wide row stays poisoned
      ASSERT_TRUE(std::isnan(st::element(wide, r * 2 * D + d))) << "row " << r << " column " << d << " written";
  }
  for (std::int64_t r = 0; r < B * H; ++r)
    ASSERT_EQ(0, std::memcmp(wlse.data<float>() + r * 2 * L, ref.lse.data<float>() + r * L, static_cast<std::size_t>(L) * 4));
}

TEST(QueryGroupGpu, ValidationAndRejections) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"validation", sa::DType::bf16, 2, 200, 300, 8, 2, 128, false, 3};
  const Inputs in = make_inputs(c, 5);
  sa::QuerySparseOptions opt;
  opt.schedule = sa::QuerySchedule::group_centric;
  auto expect_error = [&](const sa::HostTensor& lists, const std::string& arg, const std::string& needle) {
    DeviceBuffer q(in.q), k(in.k), v(in.v), idx(lists);
    sa::HostTensor out(c.dtype, {c.B, c.Lq, c.Hq, c.D});
    DeviceBuffer dout(out);
    try {
      sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, dout.view, std::nullopt, opt);
      ADD_FAILURE() << "accepted; expected " << needle;
    } catch (const sa::Error& e) {
      EXPECT_EQ(e.argument(), arg);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  sa::HostTensor bad = in.idx;
  auto* d = bad.data<std::int32_t>();
  const std::int64_t row = ((1 * c.Hkv + 1) * c.Lq + 150) * c.kq;  // (b 1, g 1, query 150)
  d[row + 2] = 3;                                                  // Tk = 3
  expect_error(bad, "lists.idx", "block id 3 at [1, 1, 150, 2] is out of range [0, 3)");
  bad = in.idx;
  d = bad.data<std::int32_t>();
  d[row + 0] = 1, d[row + 1] = -1, d[row + 2] = 1;
  expect_error(bad, "lists.idx", "block id 1 at [1, 1, 150, 2] repeats");

  // trusted: no validation, and bad ids (out of range, below -1, repeated) are skipped or counted
  // once without reading out of bounds: the result equals, bit for bit, that of the lists with the
  // bad slots left empty (a query's blocks are visited in ascending order whatever its slot order).
  bad = in.idx;
  d = bad.data<std::int32_t>();
  d[row + 2] = 1 << 30;
  d[row + 1] = -5;
  d[row + 3] = d[row + 4] = 2;  // query 151's first two slots
  sa::HostTensor clean = in.idx;
  std::int32_t* ok_ids = clean.data<std::int32_t>();
  ok_ids[row + 2] = ok_ids[row + 1] = -1;
  ok_ids[row + 3] = 2;
  ok_ids[row + 4] = -1;
  Inputs bad_in = in, clean_in = in;
  bad_in.idx = bad;
  clean_in.idx = clean;
  const Result r = run_gpu(c, bad_in, sa::QuerySchedule::group_centric, /*trusted=*/true);
  const Result r_clean = run_gpu(c, clean_in, sa::QuerySchedule::group_centric);
  EXPECT_TRUE(st::all_finite(r.out));
  EXPECT_EQ(0, std::memcmp(r.out.view().data, r_clean.out.view().data, static_cast<std::size_t>(r.out.numel()) * 2));
  EXPECT_EQ(0, std::memcmp(r.lse.view().data, r_clean.lse.view().data, static_cast<std::size_t>(r.lse.numel()) * 4));

  // More than 256 query heads per KV head: 17 head tiles do not fit one CTA.
  const Case big{"G=272", sa::DType::bf16, 1, 2, 128, 272, 1, 64, false, 1};
  const Inputs bin = make_inputs(big, 6);
  DeviceBuffer q(bin.q), k(bin.k), v(bin.v), idx(bin.idx);
  sa::HostTensor out(big.dtype, {1, 2, 272, 64});
  DeviceBuffer dout(out);
  try {
    sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{idx.view}, dout.view, std::nullopt, opt);
    ADD_FAILURE() << "G = 272 accepted";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "options.schedule");
    EXPECT_NE(std::string(e.what()).find("272"), std::string::npos) << e.what();
  }
}

}  // namespace
