// Non-finite scores on the GPU (docs/design.md §2), the cases of the CPU suite (common/nonfinite_testing.hpp)
// on device tensors: NaN in q or k, +inf in k, finite bf16 inputs whose score overflows float32 and a
// softmax_scale whose product overflows make exactly the rows that see them NaN in out and lse, in
// dense, tile_sparse, bits_sparse, query_sparse (kv_centric one call and plan/run, group_centric)
// and token_sparse, causal and not (the non-causal dense calls of this size split their tail, so the
// split combine is covered); a -inf score weighs 0; every other row matches the float64 reference and
// rows that see no key stay out = 0, lse = -inf.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/nonfinite_testing.hpp"
#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/plan.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;
namespace nf = sparse_attn::testing::nonfinite;

namespace {

const std::vector<std::string> kExecutors = {"dense",        "tile_sparse",         "bits_sparse",
                                             "query_sparse", "query_sparse_group",  "query_sparse_plan_run",
                                             "token_sparse"};

// Runs `executor` on device copies of the case's tensors and returns out and lse on the host.
std::pair<sa::HostTensor, sa::HostTensor> run(const nf::Case& c, const std::string& executor, const nf::FullSelections& sel) {
  const sa::ProblemShape& p = c.p;
  sa::HostTensor out(c.q.dtype(), {p.B, p.Lq, p.Hq, p.D}), lse(sa::DType::f32, {p.B, p.Hq, p.Lq});
  st::poison(out);
  st::poison(lse);
  st::Dev q(c.q), k(c.k), v(c.v), d_out(out), d_lse(lse);
  st::Dev tile_idx(sel.tile_idx), tile_cnt(sel.tile_cnt), bits(sel.bits), query_idx(sel.query_idx), token_idx(sel.token_idx);
  sa::QuerySparseOptions o;
  o.causal = p.causal;
  o.softmax_scale = c.scale;
  if (executor == "dense") sa::dense(q.view, k.view, v.view, d_out.view, d_lse.view, o);
  if (executor == "tile_sparse") sa::tile_sparse(q.view, k.view, v.view, {tile_idx.view, tile_cnt.view}, d_out.view, d_lse.view, o);
  if (executor == "bits_sparse") sa::bits_sparse(q.view, k.view, v.view, {bits.view}, d_out.view, d_lse.view, o);
  if (executor == "query_sparse") sa::query_sparse(q.view, k.view, v.view, {query_idx.view}, d_out.view, d_lse.view, o);
  if (executor == "query_sparse_group") {
    o.schedule = sa::QuerySchedule::group_centric;
    sa::query_sparse(q.view, k.view, v.view, {query_idx.view}, d_out.view, d_lse.view, o);
  }
  if (executor == "query_sparse_plan_run") {
    const std::size_t bytes = sa::query_sparse_workspace_bytes(p, p.Tk(), o.partials);
    sa::HostTensor ws_host(sa::DType::u8, {static_cast<std::int64_t>(bytes)});
    st::Dev ws(ws_host);
    const sa::QuerySparsePlan plan = sa::query_sparse_plan(q.view, k.view, v.view, {query_idx.view}, ws.view, o);
    sa::query_sparse_run(plan, q.view, k.view, v.view, d_out.view, d_lse.view, o);
    st::cuda_ok(cudaDeviceSynchronize(), executor.c_str());
  }
  if (executor == "token_sparse") sa::token_sparse(q.view, k.view, v.view, {token_idx.view}, d_out.view, d_lse.view, o);
  st::cuda_ok(cudaDeviceSynchronize(), executor.c_str());
  return {d_out.download(out), d_lse.download(lse)};
}

TEST(NonFiniteGpu, EveryExecutorGivesNaNRowsAndLeavesTheOthers) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  for (const std::int64_t D : {64, 128})
    for (const bool causal : {true, false}) {
      sa::ProblemShape shape;
      shape.B = 1, shape.Lq = 256, shape.Lk = 256, shape.Hq = 4, shape.Hkv = 2, shape.D = D, shape.causal = causal;
      for (const nf::Case& c : nf::make_cases(shape, sa::DType::bf16, 100 + D)) {
        const nf::FullSelections sel(c.p);
        const double scale = c.scale ? double(*c.scale) : 1.0 / std::sqrt(double(D));
        const st::Reference ref = st::reference_attention(c.q.view(), c.k.view(), c.v.view(), sa::AllBlocks{}, c.p, scale);
        for (const std::string& ex : kExecutors) {
          const auto [out, lse] = run(c, ex, sel);
          nf::expect_rows(c, out, lse, ref.out, ref.lse, 3e-2, 1e-3,
                          ex + " D " + std::to_string(D) + (c.p.causal ? " causal" : ""));
        }
      }
    }
}

TEST(NonFiniteGpu, RowsThatSeeNoKeyStayZeroAndMinusInfNextToNaNRows) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // Lq > Lk under the causal mask: the first 100 queries see no key; head 0 holds a NaN in every row.
  sa::ProblemShape p;
  p.B = 1, p.Lq = 300, p.Lk = 200, p.Hq = 4, p.Hkv = 2, p.D = 64, p.causal = true;
  sa::HostTensor q = st::random_tensor(sa::DType::bf16, {p.B, p.Lq, p.Hq, p.D}, 21);
  for (std::int64_t i = 0; i < p.Lq; ++i) nf::set(q, nf::at4(p, p.Lq, p.Hq, 0, i, 0, 0), std::numeric_limits<float>::quiet_NaN());
  nf::Case c{"no_key_next_to_nan", q, st::random_tensor(sa::DType::bf16, {p.B, p.Lk, p.Hkv, p.D}, 22),
             st::random_tensor(sa::DType::bf16, {p.B, p.Lk, p.Hkv, p.D}, 23), p, std::nullopt,
             std::vector<char>(static_cast<std::size_t>(p.Hq * p.Lq), 0)};
  for (std::int64_t i = 100; i < p.Lq; ++i) c.nan_row[static_cast<std::size_t>(i)] = 1;
  const nf::FullSelections sel(p);
  const st::Reference ref = st::reference_attention(c.q.view(), c.k.view(), c.v.view(), sa::AllBlocks{}, p, 0.125);
  for (const std::string& ex : kExecutors) {
    const auto [out, lse] = run(c, ex, sel);
    nf::expect_rows(c, out, lse, ref.out, ref.lse, 3e-2, 1e-3, ex);
    EXPECT_EQ(st::expect_empty_rows(out, lse, ref, ex), 100 * p.Hq) << ex;
  }
}

TEST(NonFiniteGpu, OverlappingOutputIsRefusedOnTheDevice) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  sa::ProblemShape p;
  p.B = 1, p.Lq = 128, p.Lk = 128, p.Hq = 2, p.Hkv = 2, p.D = 64;
  const sa::HostTensor h = st::random_tensor(sa::DType::bf16, {p.B, 3 * p.Lq + 1, p.Hq, p.D}, 31);
  st::Dev buf(h);
  const auto rows = [&](std::int64_t first) {
    return sa::TensorView::contiguous(static_cast<std::uint16_t*>(buf.ptr) + first * p.Hq * p.D, sa::DType::bf16,
                                      {p.B, p.Lq, p.Hq, p.D}, sa::Device::cuda, 0);
  };
  try {
    sa::dense(rows(0), rows(p.Lq), rows(2 * p.Lq), rows(1));
    ADD_FAILURE() << "no error for out overlapping q on the device";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "out") << e.what();
    EXPECT_NE(std::string(e.what()).find("overlaps 'q'"), std::string::npos) << e.what();
  }
}

}  // namespace
