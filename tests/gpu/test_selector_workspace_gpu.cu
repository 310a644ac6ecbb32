// The selectors' device scratch from a caller's workspace (options.workspace, *_workspace_bytes): the
// lists equal those of a call that uses the library's own workspace, bit for bit; a workspace that is too
// small, of another dtype or on the host is an Error naming options.workspace; a call with a workspace of
// its own is captured into a CUDA graph and replayed with the same lists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::cuda_ok;
using st::Dev;

// A device u8 buffer of `bytes` (at least 1), freed on destruction.
struct Bytes {
  void* ptr = nullptr;
  sa::TensorView view;
  explicit Bytes(std::size_t bytes) {
    cuda_ok(cudaMalloc(&ptr, bytes > 0 ? bytes : 1), "cudaMalloc");
    view = sa::TensorView::contiguous(ptr, sa::DType::u8, {static_cast<std::int64_t>(bytes)}, sa::Device::cuda, 0);
  }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  ~Bytes() { cudaFree(ptr); }
};

// A copy of a selector's options that takes `workspace` and runs on `stream`.
template <class Options>
Options with_workspace(const Options& o, const sa::TensorView& workspace, cudaStream_t stream) {
  Options p = o;
  p.workspace = workspace, p.stream = stream;
  return p;
}

// Runs select(workspace) into `out` (poisoned first) and returns the lists it wrote.
sa::HostTensor lists_of(const std::function<void(const sa::TensorView&, cudaStream_t)>& select, Dev& out, const sa::HostTensor& like,
                        const sa::TensorView& workspace) {
  cuda_ok(cudaMemset(out.ptr, 0x5a, out.bytes), "poison");
  select(workspace, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "select");
  return out.download(like);
}

// The same lists with and without a workspace of exactly `bytes`; a workspace one byte short, of dtype
// i32 or a host view is refused naming options.workspace.
void check_workspace(const std::string& name, std::size_t bytes,
                     const std::function<void(const sa::TensorView&, cudaStream_t)>& select, Dev& out, const sa::HostTensor& like) {
  SCOPED_TRACE(name);
  ASSERT_GT(bytes, 0u) << "a CUDA selector call takes scratch";
  const sa::HostTensor own = lists_of(select, out, like, sa::TensorView{});
  Bytes ws(bytes);
  const sa::HostTensor given = lists_of(select, out, like, ws.view);
  st::expect_equal_i32(given, own, name + " with a caller's workspace");

  sa::TensorView short_view = ws.view;
  short_view.shape[0] = static_cast<std::int64_t>(bytes) - 1;
  sa::TensorView wrong_dtype = sa::TensorView::contiguous(ws.ptr, sa::DType::i32, {static_cast<std::int64_t>(bytes / 4)},
                                                        sa::Device::cuda, 0);
  std::vector<std::uint8_t> host(bytes);
  sa::TensorView on_host = sa::TensorView::contiguous(host.data(), sa::DType::u8, {static_cast<std::int64_t>(bytes)});
  for (const sa::TensorView& bad : {short_view, wrong_dtype, on_host}) {
    try {
      select(bad, nullptr);
      ADD_FAILURE() << "workspace " << bad.describe() << " was accepted";
    } catch (const sa::Error& e) {
      EXPECT_NE(std::string(e.what()).find("options.workspace"), std::string::npos) << e.what();
    }
  }

  // Captured into a graph with its own workspace: no allocation inside the capture; the replay writes the
  // same lists.
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_ok(cudaMemset(out.ptr, 0x5a, out.bytes), "poison");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  select(ws.view, s);
  cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cuda_ok(cudaGraphLaunch(exec, s), "replay");
  cuda_ok(cudaStreamSynchronize(s), "replay");
  st::expect_equal_i32(out.download(like), own, name + " replayed from a graph");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace

TEST(SelectorWorkspaceGpu, CallerWorkspaceGivesTheSameListsAndIsChecked) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {2, 300, 4, 64}, 91);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {2, 1000, 2, 64}, 92);
  Dev dq(q), dk(k);

  {  // pooled R4, TileLists
    const sa::HostTensor like(sa::DType::i32, {2, 2, 3, 5});
    Dev idx(like), cnt(sa::HostTensor(sa::DType::i32, {2, 2, 3}));
    sa::PooledOptions o;
    o.representatives = 4, o.top_k = 5, o.causal = true;
    const std::size_t bytes = sa::pooled_workspace_bytes(dq.view, dk.view, o);
    check_workspace("pooled R4", bytes, [&](const sa::TensorView& ws, cudaStream_t s) {
      sa::pooled_select(dq.view, dk.view, sa::TileLists{idx.view, cnt.view}, with_workspace(o, ws, s));
    }, idx, like);
  }
  {  // token_max fp8, TileLists and QueryLists (index vectors: q's first head of each group, k)
    const sa::HostTensor qi = st::random_tensor(sa::DType::bf16, {2, 300, 2, 64}, 93);
    Dev dqi(qi);
    sa::TokenMaxOptions o;
    o.top_k = 4, o.precision = sa::IndexPrecision::fp8_e4m3, o.causal = true, o.force_block0 = true;
    const sa::HostTensor tiles_like(sa::DType::i32, {2, 2, 3, 4});
    Dev idx(tiles_like), cnt(sa::HostTensor(sa::DType::i32, {2, 2, 3}));
    check_workspace("token_max tiles", sa::token_max_workspace_bytes(dqi.view, dk.view, true, o),
                    [&](const sa::TensorView& ws, cudaStream_t s) {
                      sa::token_max_select(dqi.view, dk.view, sa::TileLists{idx.view, cnt.view},
                                           with_workspace(o, ws, s));
                    }, idx, tiles_like);
    const sa::HostTensor query_like(sa::DType::i32, {2, 2, 300, 4});
    Dev qidx(query_like);
    check_workspace("token_max queries", sa::token_max_workspace_bytes(dqi.view, dk.view, false, o),
                    [&](const sa::TensorView& ws, cudaStream_t s) {
                      sa::token_max_select(dqi.view, dk.view, sa::QueryLists{qidx.view}, with_workspace(o, ws, s));
                    }, qidx, query_like);
  }
  {  // lightning fp8, TokenLists
    const sa::HostTensor qI = st::random_tensor(sa::DType::bf16, {2, 300, 8, 64}, 94);
    const sa::HostTensor kI = st::random_tensor(sa::DType::bf16, {2, 1000, 64}, 95);
    sa::HostTensor w(sa::DType::f32, {2, 300, 8});
    for (std::int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] = 0.125f * static_cast<float>(1 + i % 5);
    Dev dqI(qI), dkI(kI), dw(w);
    sa::LightningOptions o;
    o.top_k = 64, o.causal = true, o.sink_keys = 4;
    const sa::HostTensor like(sa::DType::i32, {2, 1, 300, 64});
    Dev idx(like);
    check_workspace("lightning tokens", sa::lightning_workspace_bytes(dqI.view, dkI.view, true, o),
                    [&](const sa::TensorView& ws, cudaStream_t s) {
                      sa::lightning_select(dqI.view, dw.view, dkI.view, sa::TokenLists{idx.view},
                                           with_workspace(o, ws, s));
                    }, idx, like);
  }
}

TEST(SelectorWorkspace, NothingOnTheCpu) {
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {1, 256, 2, 64}, 96);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {1, 512, 1, 64}, 97);
  EXPECT_EQ(sa::pooled_workspace_bytes(q.view(), k.view()), 0u);
  EXPECT_EQ(sa::token_max_workspace_bytes(q.view(), k.view(), true), 0u);
  const sa::HostTensor kI = st::random_tensor(sa::DType::bf16, {1, 512, 64}, 98);
  EXPECT_EQ(sa::lightning_workspace_bytes(q.view(), kI.view(), true), 0u);
  EXPECT_THROW(sa::lightning_workspace_bytes(q.view(), k.view(), true), sa::Error);  // kI must be [B, Lk, Di]
}
