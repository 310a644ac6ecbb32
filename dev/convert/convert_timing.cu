// Time of query_lists_to_tile_lists on the device (src/cuda/convert/query_to_tiles.cu) on the shapes of
// the planner's fit: trusted (one launch) and checked (the launch, the fault word read back and a
// synchronisation), CUDA events around back-to-back calls. Each output is first compared with the CPU
// conversion where that is quick. One line per shape: the tiles, the trusted and the checked time per
// call in microseconds, and the comparison. Exits 1 if an output differs from the CPU's.
// Its measurements, and the kernel versions compared, are in docs/notes/convert.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

struct DeviceCopy {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  sa::TensorView view;
  explicit DeviceCopy(const sa::HostTensor& h) : bytes(static_cast<std::size_t>(h.numel()) * sa::dtype_size(h.dtype())) {
    cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc");
    cuda_ok(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), "upload");
    view = sa::TensorView::contiguous(ptr, h.dtype(), h.shape(), sa::Device::cuda, 0);
  }
  ~DeviceCopy() { cudaFree(ptr); }
  void download(sa::HostTensor& h) const { cuda_ok(cudaMemcpy(h.view().data, ptr, bytes, cudaMemcpyDeviceToHost), "download"); }
};

struct Tiles {
  sa::HostTensor idx, cnt;
};

Tiles poisoned_tiles(const sa::ProblemShape& p, std::int64_t kmax) {
  Tiles t{sa::HostTensor(sa::DType::i32, {p.B, p.Hkv, p.Tq(), kmax}), sa::HostTensor(sa::DType::i32, {p.B, p.Hkv, p.Tq()})};
  std::memset(t.idx.view().data, 0x5a, static_cast<std::size_t>(t.idx.numel()) * 4);
  std::memset(t.cnt.view().data, 0x5a, static_cast<std::size_t>(t.cnt.numel()) * 4);
  return t;
}

bool same(const sa::HostTensor& a, const sa::HostTensor& b) {
  return std::memcmp(a.view().data, b.view().data, static_cast<std::size_t>(a.numel()) * 4) == 0;
}

}  // namespace

int main() {
  if (!sa::cuda_available()) {
    std::printf("no supported CUDA device (sm_90)\n");
    return 1;
  }
  struct Shape {
    const char* name;
    std::int64_t B, Lq, Lk, Hkv, kq;
  };
  const Shape shapes[] = {{"tile16 Lk=16K", 2, 4096, 16384, 1, 16},   {"query16of32", 8, 4096, 4096, 1, 16},
                          {"query-long", 1, 32768, 32768, 8, 16},     {"query-long B=4", 4, 32768, 32768, 8, 16},
                          {"Lk=256K Hkv=8", 1, 8192, 262144, 8, 16}};
  std::mt19937_64 rng(99);
  cudaEvent_t e0, e1;
  cuda_ok(cudaEventCreate(&e0), "event");
  cuda_ok(cudaEventCreate(&e1), "event");
  int failed = 0;
  for (const Shape& sh : shapes) {
    sa::ProblemShape p;
    p.B = sh.B, p.Lq = sh.Lq, p.Lk = sh.Lk, p.Hq = 2 * sh.Hkv, p.Hkv = sh.Hkv, p.D = 128;
    // Distinct random ids per query by rejection (16 of >= 32 blocks).
    sa::HostTensor lists(sa::DType::i32, {p.B, p.Hkv, p.Lq, sh.kq});
    auto* d = lists.data<std::int32_t>();
    for (std::int64_t r = 0; r < p.B * p.Hkv * p.Lq; ++r)
      for (std::int64_t s = 0; s < sh.kq; ++s) {
        std::int32_t v;
        do v = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(p.Tk()));
        while (std::find(d + r * sh.kq, d + r * sh.kq + s, v) != d + r * sh.kq + s);
        d[r * sh.kq + s] = v;
      }
    const std::int64_t kmax = p.Tk();
    const bool compare = p.B * p.Hkv * p.Lq <= 262144;
    Tiles want = poisoned_tiles(p, kmax);
    if (compare) sa::query_lists_to_tile_lists(sa::QueryLists{lists.view()}, sa::TileLists{want.idx.view(), want.cnt.view()}, p);
    Tiles got = poisoned_tiles(p, kmax);
    DeviceCopy dl(lists), di(got.idx), dc(got.cnt);
    const sa::QueryLists in{dl.view};
    const sa::TileLists out{di.view, dc.view};
    double us[2] = {0, 0};
    for (int checked = 0; checked < 2; ++checked) {
      sa::ConvertOptions o;
      o.trusted = checked == 0;
      constexpr int kWarm = 3, kIters = 20;
      for (int it = 0; it < kWarm; ++it) sa::query_lists_to_tile_lists(in, out, p, o);
      cuda_ok(cudaEventRecord(e0), "record");
      for (int it = 0; it < kIters; ++it) sa::query_lists_to_tile_lists(in, out, p, o);
      cuda_ok(cudaEventRecord(e1), "record");
      cuda_ok(cudaEventSynchronize(e1), "sync");
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
      us[checked] = 1e3 * ms / kIters;
    }
    const char* verdict = "not compared";
    if (compare) {
      di.download(got.idx);
      dc.download(got.cnt);
      const bool ok = same(want.idx, got.idx) && same(want.cnt, got.cnt);
      failed += !ok;
      verdict = ok ? "equals the CPU" : "DIFFERS FROM THE CPU";
    }
    std::printf("%-16s tiles %6lld:  %7.2f / %7.2f us  (trusted / checked)  %s\n", sh.name,
                static_cast<long long>(p.B * p.Hkv * p.Tq()), us[0], us[1], verdict);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return failed ? 1 : 0;
}
