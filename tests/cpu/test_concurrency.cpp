// Two host threads call the CPU executors (dense, tile_sparse, bits_sparse, query_sparse, token_sparse)
// on different problems at the same time, many times over: every result must equal, bit for bit, what
// the same calls gave one thread at a time (each call runs its own OpenMP team).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/testing.hpp"
#include "common/workload.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

// Every operator once on `w` into fresh poisoned outputs: out and lse per operator.
std::vector<sa::HostTensor> run_all(const st::Workload& w) {
  std::vector<sa::HostTensor> got;
  for (int i = 0; i < st::kExecutors; ++i) {
    got.emplace_back(w.q.dtype(), w.q.shape());
    got.emplace_back(sa::DType::f32, std::vector<std::int64_t>{w.p.B, w.p.Hq, w.p.Lq});
    st::poison(got[got.size() - 2]);
    st::poison(got.back());
  }
  sa::QuerySparseOptions o;
  o.causal = w.p.causal;
  const auto out = [&](int i) { return got[2 * static_cast<std::size_t>(i)].view(); };
  const auto lse = [&](int i) { return got[2 * static_cast<std::size_t>(i) + 1].view(); };
  sa::dense(w.q.view(), w.k.view(), w.v.view(), out(0), lse(0), o);
  sa::tile_sparse(w.q.view(), w.k.view(), w.v.view(), sa::TileLists{w.tile_idx.view(), w.tile_cnt.view()}, out(1),
                  lse(1), o);
  sa::bits_sparse(w.q.view(), w.k.view(), w.v.view(), sa::BlockBits{w.bits.view()}, out(2), lse(2), o);
  sa::query_sparse(w.q.view(), w.k.view(), w.v.view(), sa::QueryLists{w.query_idx.view()}, out(3), lse(3), o);
  sa::token_sparse(w.q.view(), w.k.view(), w.v.view(), sa::TokenLists{w.token_idx.view()}, out(4), lse(4), o);
  return got;
}

bool same_bits(const sa::HostTensor& a, const sa::HostTensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.view().data, b.view().data, static_cast<std::size_t>(a.numel()) * sa::dtype_size(a.dtype())) == 0;
}

}  // namespace

TEST(Concurrency, TwoThreadsEqualOneThread) {
  const st::Workload workloads[] = {st::random_workload(st::problem(1, 300, 500, 4, 2, 64, false), sa::DType::f32, 1),
                                    st::random_workload(st::problem(2, 260, 200, 4, 1, 32, true), sa::DType::bf16, 2)};
  std::vector<std::vector<sa::HostTensor>> expected;
  for (const auto& w : workloads) expected.push_back(run_all(w));
  for (std::size_t t = 0; t < expected.size(); ++t)
    for (int i = 0; i < st::kExecutors; ++i)
      EXPECT_TRUE(st::all_finite(expected[t][2 * static_cast<std::size_t>(i)]))
          << "thread " << t << " " << st::kExecutorNames[i];

  const auto failures = st::on_threads(expected, 20, [&](std::size_t t) { return run_all(workloads[t]); }, same_bits);
  for (std::size_t t = 0; t < failures.size(); ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}
