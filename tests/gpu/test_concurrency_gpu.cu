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
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/testing.hpp"
#include "common/workload.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

#define SKIP_WITHOUT_GPU()                                                                            \
  do {                                                                                                \
    if (!sa::cuda_available()) GTEST_SKIP() << "no supported CUDA device (sm_90): GPU test skipped"; \
  } while (0)

// Errors inside the worker threads are thrown (gtest assertions belong to the main thread).
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct DeviceCopy {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  sa::TensorView view;
  explicit DeviceCopy(const sa::HostTensor& h) : bytes(static_cast<std::size_t>(h.numel()) * sa::dtype_size(h.dtype())) {
    check(cudaMalloc(&ptr, bytes), "cudaMalloc");
    check(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), "upload");
    view = sa::TensorView::contiguous(ptr, h.dtype(), h.shape(), sa::Device::cuda, 0);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy() { cudaFree(ptr); }
};

constexpr int kOperators = 5;
const char* const kNames[kOperators] = {"dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse"};

// One thread's problem on the device, its stream, and an out and lse per operator.
struct Worker {
  st::Workload w;
  cudaStream_t stream = nullptr;
  std::unique_ptr<DeviceCopy> q, k, v, tile_idx, tile_cnt, bits, query_idx, token_idx;
  std::vector<std::unique_ptr<DeviceCopy>> out, lse;

  explicit Worker(st::Workload workload) : w(std::move(workload)) {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    q = std::make_unique<DeviceCopy>(w.q);
    k = std::make_unique<DeviceCopy>(w.k);
    v = std::make_unique<DeviceCopy>(w.v);
    tile_idx = std::make_unique<DeviceCopy>(w.tile_idx);
    tile_cnt = std::make_unique<DeviceCopy>(w.tile_cnt);
    bits = std::make_unique<DeviceCopy>(w.bits);
    query_idx = std::make_unique<DeviceCopy>(w.query_idx);
    token_idx = std::make_unique<DeviceCopy>(w.token_idx);
    const sa::HostTensor o(w.q.dtype(), w.q.shape()), l(sa::DType::f32, {w.p.B, w.p.Hq, w.p.Lq});
    for (int i = 0; i < kOperators; ++i) {
      out.push_back(std::make_unique<DeviceCopy>(o));
      lse.push_back(std::make_unique<DeviceCopy>(l));
    }
  }
  ~Worker() { cudaStreamDestroy(stream); }

  // Every operator once on the worker's stream into poisoned outputs; returns the outputs (out bytes,
  // then lse bytes, per operator).
  std::vector<std::vector<unsigned char>> run() {
    for (int i = 0; i < kOperators; ++i) {
      check(cudaMemsetAsync(out[i]->ptr, 0xff, out[i]->bytes, stream), "poison");
      check(cudaMemsetAsync(lse[i]->ptr, 0xff, lse[i]->bytes, stream), "poison");
    }
    sa::QuerySparseOptions o;
    o.causal = w.p.causal;
    o.stream = stream;
    const sa::TileLists tiles{tile_idx->view, tile_cnt->view};
    sa::dense(q->view, k->view, v->view, out[0]->view, lse[0]->view, o);
    sa::tile_sparse(q->view, k->view, v->view, tiles, out[1]->view, lse[1]->view, o);
    sa::bits_sparse(q->view, k->view, v->view, sa::BlockBits{bits->view}, out[2]->view, lse[2]->view, o);
    sa::query_sparse(q->view, k->view, v->view, sa::QueryLists{query_idx->view}, out[3]->view, lse[3]->view, o);
    sa::token_sparse(q->view, k->view, v->view, sa::TokenLists{token_idx->view}, out[4]->view, lse[4]->view, o);
    std::vector<std::vector<unsigned char>> got;
    for (int i = 0; i < kOperators; ++i)
      for (const DeviceCopy* d : {out[i].get(), lse[i].get()}) {
        got.emplace_back(d->bytes);
        check(cudaMemcpyAsync(got.back().data(), d->ptr, d->bytes, cudaMemcpyDeviceToHost, stream), "download");
      }
    check(cudaStreamSynchronize(stream), "synchronize");
    return got;
  }
};

sa::ProblemShape shape(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
                       std::int64_t D, bool causal) {
  sa::ProblemShape p;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = causal;
  return p;
}

}  // namespace

TEST(ConcurrencyGpu, TwoThreadsTwoStreamsEqualOneThread) {
  SKIP_WITHOUT_GPU();
  // Different shapes, dtypes and head dims, so that the two threads' calls need different workspace
  // sizes and shared memory. The first is non-causal with 24 units (dense splits its last wave).
  std::vector<std::unique_ptr<Worker>> workers;
  workers.push_back(std::make_unique<Worker>(st::random_workload(shape(1, 700, 1500, 4, 2, 128, false), sa::DType::bf16, 1)));
  workers.push_back(std::make_unique<Worker>(st::random_workload(shape(2, 900, 700, 8, 1, 64, true), sa::DType::f16, 2)));

  std::vector<std::vector<std::vector<unsigned char>>> expected;
  for (auto& wk : workers) expected.push_back(wk->run());
  for (std::size_t t = 0; t < workers.size(); ++t)
    for (int i = 0; i < kOperators; ++i) {
      // Written everywhere (no 0xff poison left in out; causal rows with no key have lse -inf, not NaN).
      sa::HostTensor out(workers[t]->w.q.dtype(), workers[t]->w.q.shape());
      std::memcpy(out.view().data, expected[t][2 * i].data(), expected[t][2 * i].size());
      EXPECT_TRUE(st::all_finite(out)) << "thread " << t << " " << kNames[i];
    }

  constexpr int kIterations = 30;
  std::vector<std::string> failures(workers.size());
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < workers.size(); ++t)
    threads.emplace_back([&, t] {
      try {
        for (int it = 0; it < kIterations && failures[t].empty(); ++it) {
          const auto got = workers[t]->run();
          for (std::size_t j = 0; j < got.size(); ++j)
            if (got[j] != expected[t][j]) {
              failures[t] = std::string(kNames[j / 2]) + (j % 2 ? " lse" : " out") + " differs at iteration " +
                            std::to_string(it);
              break;
            }
        }
      } catch (const std::exception& e) {
        failures[t] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (std::size_t t = 0; t < workers.size(); ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}
