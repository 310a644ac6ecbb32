// Outputs that share memory with another argument are refused (ops.hpp): out or lse overlapping q, k,
// v, the selection's tensors or each other, gated's kept_per_tile and entmax's block_bits overlapping
// any other argument, and query_sparse_run's out overlapping the plan's lists. The Error names the
// operator, the output, the other argument and the bytes shared. Views that only touch end to end,
// and inputs that share memory with each other, are accepted.

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/nonfinite_testing.hpp"
#include "common/testing.hpp"
#include "sparse_attn/plan.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

// One problem with Hq = Hkv and Lq = Lk, so that out may be given k's memory.
constexpr std::int64_t B = 1, L = 160, H = 2, D = 16;

sa::ProblemShape shape() {
  sa::ProblemShape p;
  p.B = B, p.Lq = L, p.Lk = L, p.Hq = H, p.Hkv = H, p.D = D, p.causal = true;
  return p;
}

/// A float32 buffer from which views of [B, rows, H, D] are cut at any row offset.
struct Arena {
  std::vector<float> data;
  explicit Arena(std::int64_t rows) : data(static_cast<std::size_t>(rows * H * D)) {
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = 0.01f * float(i % 97) - 0.4f;
  }
  sa::TensorView rows(std::int64_t first, std::int64_t n = L) {
    return sa::TensorView::contiguous(data.data() + first * H * D, sa::DType::f32, {B, n, H, D});
  }
};

using Call = std::function<void(const sa::TensorView& q, const sa::TensorView& k, const sa::TensorView& v,
                                const sa::TensorView& out, const std::optional<sa::TensorView>& lse)>;

struct Executor {
  std::string op;
  Call call;
};

std::vector<Executor> executors(const st::nonfinite::FullSelections& sel) {
  sa::AttentionOptions o;
  o.causal = true;
  static sa::HostTensor thresholds(sa::DType::f32, {H, 2});
  std::fill(thresholds.data<float>(), thresholds.data<float>() + thresholds.numel(), 0.0f);
  return {
      {"dense", [=](auto q, auto k, auto v, auto out, auto lse) { sa::dense(q, k, v, out, lse, o); }},
      {"tile_sparse",
       [&, o](auto q, auto k, auto v, auto out, auto lse) {
         sa::tile_sparse(q, k, v, {sel.tile_idx.view(), sel.tile_cnt.view()}, out, lse, o);
       }},
      {"bits_sparse", [&, o](auto q, auto k, auto v, auto out, auto lse) { sa::bits_sparse(q, k, v, {sel.bits.view()}, out, lse, o); }},
      {"query_sparse",
       [&, o](auto q, auto k, auto v, auto out, auto lse) {
         sa::QuerySparseOptions qo;
         static_cast<sa::AttentionOptions&>(qo) = o;
         sa::query_sparse(q, k, v, {sel.query_idx.view()}, out, lse, qo);
       }},
      {"token_sparse", [&, o](auto q, auto k, auto v, auto out, auto lse) { sa::token_sparse(q, k, v, {sel.token_idx.view()}, out, lse, o); }},
      {"gated", [](auto q, auto k, auto v, auto out, auto lse) { sa::gated(q, k, v, thresholds.view(), out, lse); }},
      {"entmax", [](auto q, auto k, auto v, auto out, auto) { sa::entmax(q, k, v, out, sa::EntmaxOptions{}); }},
  };
}

void expect_overlap_error(const std::function<void()>& f, const std::string& op, const std::string& out,
                          const std::string& other) {
  try {
    f();
    ADD_FAILURE() << op << ": no error for " << out << " overlapping " << other;
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_EQ(e.argument(), out) << e.what();
    EXPECT_NE(std::string(e.what()).find("overlaps '" + other + "' in memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bytes shared"), std::string::npos) << e.what();
  }
}

TEST(Aliasing, OutOverlappingAnInputIsRefusedByEveryExecutor) {
  const sa::ProblemShape p = shape();
  const st::nonfinite::FullSelections sel(p);
  // Rows: q [0, L), k [L + 8, 2L + 8), v [2L + 16, 3L + 16), spare rows after.
  Arena a(4 * L + 32);
  const sa::TensorView q = a.rows(0), k = a.rows(L + 8), v = a.rows(2 * L + 16);
  sa::HostTensor lse(sa::DType::f32, {B, H, L});
  for (const Executor& ex : executors(sel)) {
    SCOPED_TRACE(ex.op);
    const std::optional<sa::TensorView> l = ex.op == "entmax" ? std::nullopt : std::optional(lse.view());
    expect_overlap_error([&] { ex.call(q, k, v, k, l); }, ex.op, "out", "k");           // out = k
    expect_overlap_error([&] { ex.call(q, k, v, a.rows(1), l); }, ex.op, "out", "q");   // q shifted by one row
    expect_overlap_error([&] { ex.call(q, k, v, a.rows(2 * L + 15), l); }, ex.op, "out", "v");  // one row of v
    // Touching end to end is not overlapping: out right after v.
    EXPECT_NO_THROW(ex.call(q, k, v, a.rows(3 * L + 16), l));
    // Inputs may share memory with each other.
    EXPECT_NO_THROW(ex.call(q, k, k, a.rows(3 * L + 16), l));
  }
}

TEST(Aliasing, LseOverlappingAnInputOrOutIsRefused) {
  const sa::ProblemShape p = shape();
  const st::nonfinite::FullSelections sel(p);
  Arena a(5 * L);
  const sa::TensorView q = a.rows(0), k = a.rows(L), v = a.rows(2 * L), out = a.rows(3 * L);
  const auto lse_at = [&](std::int64_t row) {
    return sa::TensorView::contiguous(a.data.data() + row * H * D, sa::DType::f32, {B, H, L});
  };
  for (const Executor& ex : executors(sel)) {
    if (ex.op == "entmax") continue;  // no lse
    SCOPED_TRACE(ex.op);
    expect_overlap_error([&] { ex.call(q, k, v, out, lse_at(L + 3)); }, ex.op, "lse", "k");
    expect_overlap_error([&] { ex.call(q, k, v, out, lse_at(4 * L - 1)); }, ex.op, "lse", "out");
    EXPECT_NO_THROW(ex.call(q, k, v, out, lse_at(4 * L)));
  }
}

TEST(Aliasing, OutOverlappingTheSelectionIsRefused) {
  // One query, one head: each selection is copied to the start of an int32 buffer, and out (16
  // floats) is viewed over the same buffer, so even a call that wrote it would stay in bounds.
  sa::ProblemShape p = shape();
  p.Lq = 1, p.Hq = 1, p.Hkv = 1;
  const st::nonfinite::FullSelections sel(p);
  const sa::HostTensor q = st::random_tensor(sa::DType::f32, {B, 1, 1, D}, 3);
  const sa::HostTensor k = st::random_tensor(sa::DType::f32, {B, L, 1, D}, 4);
  sa::AttentionOptions o;
  o.causal = true;
  std::vector<std::int32_t> buf(static_cast<std::size_t>(2 * L + D));
  const auto over = [&](const sa::HostTensor& t) {  // t's contents at buf[0], viewed with t's shape
    std::copy(t.data<std::int32_t>(), t.data<std::int32_t>() + t.numel(), buf.begin());
    return sa::TensorView::contiguous(buf.data(), t.dtype(), t.shape());
  };
  const sa::TensorView out = sa::TensorView::contiguous(buf.data(), sa::DType::f32, {B, 1, 1, D});
  const auto qv = q.view(), kv = k.view();
  expect_overlap_error([&] { sa::tile_sparse(qv, kv, kv, {sel.tile_idx.view(), over(sel.tile_cnt)}, out, std::nullopt, o); },
                       "tile_sparse", "out", "tiles.cnt");
  expect_overlap_error([&] { sa::bits_sparse(qv, kv, kv, {over(sel.bits)}, out, std::nullopt, o); }, "bits_sparse", "out",
                       "bits.bits");
  expect_overlap_error([&] { sa::query_sparse(qv, kv, kv, {over(sel.query_idx)}, out, std::nullopt, {}); },
                       "query_sparse", "out", "lists.idx");
  expect_overlap_error([&] { sa::token_sparse(qv, kv, kv, {over(sel.token_idx)}, out, std::nullopt, o); }, "token_sparse",
                       "out", "tokens.idx");
  // A plan's lists are read by every run.
  const sa::QuerySparsePlan plan = sa::query_sparse_plan(qv, kv, kv, {over(sel.query_idx)}, sa::TensorView{}, {});
  expect_overlap_error([&] { sa::query_sparse_run(plan, qv, kv, kv, out, std::nullopt, {}); }, "query_sparse_run", "out",
                       "plan.lists.idx");
}

TEST(Aliasing, GatedAndEntmaxSideOutputsMustNotOverlap) {
  const sa::ProblemShape p = shape();
  Arena a(4 * L);
  const sa::TensorView q = a.rows(0), k = a.rows(L), v = a.rows(2 * L), out = a.rows(3 * L);
  sa::HostTensor thresholds(sa::DType::f32, {H, 2});
  std::fill(thresholds.data<float>(), thresholds.data<float>() + thresholds.numel(), 0.0f);
  sa::GatedOptions g;
  g.kept_per_tile = sa::TensorView::contiguous(a.data.data() + 3 * L * H * D, sa::DType::i32, {B, H, (p.Lq + 63) / 64});
  expect_overlap_error([&] { sa::gated(q, k, v, thresholds.view(), out, std::nullopt, g); }, "gated",
                       "options.kept_per_tile", "out");
  g.kept_per_tile = sa::TensorView::contiguous(thresholds.data<float>(), sa::DType::i32, {B, H, (p.Lq + 63) / 64});
  expect_overlap_error([&] { sa::gated(q, k, v, thresholds.view(), out, std::nullopt, g); }, "gated",
                       "options.kept_per_tile", "thresholds");
  sa::HostTensor big_thresholds(sa::DType::f32, {H, L * D});  // out viewed over it stays in bounds
  std::fill(big_thresholds.data<float>(), big_thresholds.data<float>() + big_thresholds.numel(), 0.0f);
  const sa::TensorView out_over = sa::TensorView::contiguous(big_thresholds.data<float>(), sa::DType::f32, {B, L, H, D});
  expect_overlap_error([&] { sa::gated(q, k, v, big_thresholds.view(), out_over, std::nullopt, {}); }, "gated", "out",
                       "thresholds");
  sa::EntmaxOptions e;
  e.block_bits = sa::TensorView::contiguous(a.data.data() + L * H * D, sa::DType::u32, {B, H, p.Tq(), 1});
  expect_overlap_error([&] { sa::entmax(q, k, v, out, e); }, "entmax", "options.block_bits", "k");
}

}  // namespace
