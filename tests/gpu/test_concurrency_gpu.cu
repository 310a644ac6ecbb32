// Two host threads, each with a CUDA stream of its own, call dense, tile_sparse, bits_sparse,
// query_sparse and token_sparse on different problems at the same time, many times over: every result
// must equal, bit for bit, what the same calls gave one thread at a time. The calls validate their
// selections (the fault word and a synchronisation per call), dense splits its last wave (the split
// tail's workspace per stream), query_sparse plans into its per-stream workspace, and the kernels'
// shared memory limits are set per call: the process-wide state each of those touches must hold up.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "common/workload.hpp"
#include "gpu/query_lists_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::query_lists::DeviceBuffer;
using Bytes = std::vector<unsigned char>;

// Errors inside the worker threads are thrown (gtest assertions belong to the main thread).
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// One thread's problem on the device, its stream, and an out and lse per executor.
struct Worker {
  st::Workload w;
  cudaStream_t stream = nullptr;
  DeviceBuffer q, k, v, tile_idx, tile_cnt, bits, query_idx, token_idx;
  std::vector<std::unique_ptr<DeviceBuffer>> out, lse;

  explicit Worker(st::Workload workload)
      : w(std::move(workload)), q(w.q), k(w.k), v(w.v), tile_idx(w.tile_idx), tile_cnt(w.tile_cnt), bits(w.bits),
        query_idx(w.query_idx), token_idx(w.token_idx) {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const sa::HostTensor o(w.q.dtype(), w.q.shape()), l(sa::DType::f32, {w.p.B, w.p.Hq, w.p.Lq});
    for (int i = 0; i < st::kExecutors; ++i) {
      out.push_back(std::make_unique<DeviceBuffer>(o));
      lse.push_back(std::make_unique<DeviceBuffer>(l));
    }
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() { cudaStreamDestroy(stream); }

  // Every executor once on the worker's stream into poisoned outputs; returns their bytes (out, then
  // lse, per executor).
  std::vector<Bytes> run() {
    for (int i = 0; i < st::kExecutors; ++i) {
      check(cudaMemsetAsync(out[i]->ptr, 0xff, out[i]->bytes, stream), "poison");
      check(cudaMemsetAsync(lse[i]->ptr, 0xff, lse[i]->bytes, stream), "poison");
    }
    sa::QuerySparseOptions o;
    o.causal = w.p.causal;
    o.stream = stream;
    const sa::TileLists tiles{tile_idx.view, tile_cnt.view};
    sa::dense(q.view, k.view, v.view, out[0]->view, lse[0]->view, o);
    sa::tile_sparse(q.view, k.view, v.view, tiles, out[1]->view, lse[1]->view, o);
    sa::bits_sparse(q.view, k.view, v.view, sa::BlockBits{bits.view}, out[2]->view, lse[2]->view, o);
    sa::query_sparse(q.view, k.view, v.view, sa::QueryLists{query_idx.view}, out[3]->view, lse[3]->view, o);
    sa::token_sparse(q.view, k.view, v.view, sa::TokenLists{token_idx.view}, out[4]->view, lse[4]->view, o);
    std::vector<Bytes> got;
    for (int i = 0; i < st::kExecutors; ++i)
      for (const DeviceBuffer* d : {out[i].get(), lse[i].get()}) {
        got.emplace_back(d->bytes);
        check(cudaMemcpyAsync(got.back().data(), d->ptr, d->bytes, cudaMemcpyDeviceToHost, stream), "download");
      }
    check(cudaStreamSynchronize(stream), "synchronize");
    return got;
  }
};

}  // namespace

TEST(ConcurrencyGpu, TwoThreadsTwoStreamsEqualOneThread) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // Different shapes, dtypes and head dims, so that the two threads' calls need different workspace
  // sizes and shared memory. The first is non-causal with 24 units (dense splits its last wave).
  std::vector<std::unique_ptr<Worker>> workers;
  workers.push_back(
      std::make_unique<Worker>(st::random_workload(st::problem(1, 700, 1500, 4, 2, 128, false), sa::DType::bf16, 1)));
  workers.push_back(
      std::make_unique<Worker>(st::random_workload(st::problem(2, 900, 700, 8, 1, 64, true), sa::DType::f16, 2)));

  std::vector<std::vector<Bytes>> expected;
  for (auto& wk : workers) expected.push_back(wk->run());
  for (std::size_t t = 0; t < workers.size(); ++t)
    for (int i = 0; i < st::kExecutors; ++i) {
      // Written everywhere: no 0xff poison (a NaN) left in out.
      sa::HostTensor out(workers[t]->w.q.dtype(), workers[t]->w.q.shape());
      std::memcpy(out.view().data, expected[t][2 * i].data(), expected[t][2 * i].size());
      EXPECT_TRUE(st::all_finite(out)) << "thread " << t << " " << st::kExecutorNames[i];
    }

  const auto failures = st::on_threads(expected, 30, [&](std::size_t t) { return workers[t]->run(); },
                                       [](const Bytes& a, const Bytes& b) { return a == b; });
  for (std::size_t t = 0; t < failures.size(); ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}
