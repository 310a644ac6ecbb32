// Timing of the CUDA selectors on the H200 (the former PooledGpu.Timing, TokenMaxGpu.Timing and
// LightningTokensGpu.Timing cases). Each case first checks the device lists against the CPU reference on
// the same inputs, then times back-to-back calls between events. Outcomes are recorded in
// docs/notes/selectors.md.
//
//   selector_timing [pooled] [token_max] [lightning]   (all three without arguments)
//
// pooled: tile16 shape (B = 2, Lq = 4096, Hq = 16, Hkv = 1, D = 128, bf16, top-16, local block forced) at
//   Lk = 4K, 16K, 32K, R1 and R4: warm median of 30 calls queued behind a spin kernel, cold-L2 median of 10
//   calls after a 512 MB memset; the lists equal to the CPU's at 16K (the exit status is 1 where any differs:
//   allowed within the contract's bound, worth a look).
// token_max: the same shape's index vectors (Di = 128, TileLists, top-16, non-causal) per precision at
//   Lk = 4K, 16K, 32K: median of 25 calls and the share of candidate blocks re-scored in float64; QueryLists
//   at 16K, fp8.
// lightning: token form, B = 1, Lq = Lk = 32K, 64 heads of 128, top-2048 causal, fp8 and bf16: median of 3
//   calls (no list check: the GPU tests check the contract).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/selectors/backend.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;

namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Device memory holding a tensor, with a host copy for the CPU reference where asked.
struct DevTensor {
  void* ptr = nullptr;
  std::vector<std::int64_t> shape;
  sa::TensorView view;
  DevTensor(sa::DType dtype, std::vector<std::int64_t> shape_) : shape(std::move(shape_)) {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    ok(cudaMalloc(&ptr, static_cast<std::size_t>(n) * sa::dtype_size(dtype)), "cudaMalloc");
    view = sa::TensorView::contiguous(ptr, dtype, shape, sa::Device::cuda, 0);
  }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
  ~DevTensor() { cudaFree(ptr); }
  sa::HostTensor host() const {
    sa::HostTensor h(view.dtype, shape);
    ok(cudaMemcpy(h.view().data, ptr, static_cast<std::size_t>(h.numel()) * sa::dtype_size(view.dtype),
                  cudaMemcpyDeviceToHost),
       "download");
    return h;
  }
};

__device__ std::uint32_t mix(std::uint32_t h) {
  h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12, h *= 0x297a2d39u, h ^= h >> 15;
  return h;
}
// Values on (-1.7, 1.7) (a triangular distribution) from a hash of the index: bf16 or f32.
__global__ void fill_kernel(void* x, std::int64_t n, bool f32, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t h = mix(static_cast<std::uint32_t>(i) * 2654435761u ^ seed);
    const float u = (((h & 0xffffu) + (h >> 16)) * (1.0f / 65536.0f) - 1.0f) * 1.7f;
    if (f32) static_cast<float*>(x)[i] = u;
    else static_cast<std::uint16_t*>(x)[i] = static_cast<std::uint16_t>(__float_as_uint(u) >> 16);
  }
}
void fill(DevTensor& t, std::uint32_t seed) {
  fill_kernel<<<1024, 256>>>(t.ptr, t.view.numel(), t.view.dtype == sa::DType::f32, seed);
  ok(cudaGetLastError(), "fill");
}

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Microseconds per call of `run` on `s`: `n` calls queued back to back behind a spin kernel (so the host's
// enqueue is hidden), an event pair around each.
std::vector<double> time_warm(cudaStream_t s, int n, const std::function<void()>& run) {
  for (int i = 0; i < 3; ++i) run();
  ok(cudaStreamSynchronize(s), "warm-up");
  std::vector<cudaEvent_t> ev(2 * static_cast<std::size_t>(n));
  for (auto& e : ev) ok(cudaEventCreate(&e), "cudaEventCreate");
  spin_kernel<<<1, 1, 0, s>>>(10'000'000);  // >= 5 ms at the H200's <= 1.98 GHz
  for (int i = 0; i < n; ++i) {
    cudaEventRecord(ev[2 * i], s);
    run();
    cudaEventRecord(ev[2 * i + 1], s);
  }
  ok(cudaStreamSynchronize(s), "timed calls");
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    float ms = 0.0f;
    ok(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
    us.push_back(1000.0 * ms);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return us;
}

bool same_i32(const sa::HostTensor& a, const sa::HostTensor& b) {
  return std::memcmp(a.view().data, b.view().data, static_cast<std::size_t>(a.numel()) * 4) == 0;
}

// Whether the device lists (idx, cnt) equal those `cpu_select` writes into the TileLists it is given.
bool equals_cpu(const DevTensor& idx, const DevTensor& cnt, const std::function<void(const sa::TileLists&)>& cpu_select) {
  sa::HostTensor ridx(sa::DType::i32, idx.shape), rcnt(sa::DType::i32, cnt.shape);
  cpu_select(sa::TileLists{ridx.view(), rcnt.view()});
  return same_i32(idx.host(), ridx) && same_i32(cnt.host(), rcnt);
}

bool pooled() {
  const std::int64_t B = 2, Lq = 4096, Hq = 16, Hkv = 1, D = 128, top_k = 16, Tq = Lq / sa::kTileQ;
  cudaStream_t s = nullptr;
  ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  void* flush = nullptr;
  const std::size_t flush_bytes = std::size_t{512} << 20;
  ok(cudaMalloc(&flush, flush_bytes), "cudaMalloc");
  bool all_equal = true;
  for (std::int64_t Lk : {4096, 16384, 32768}) {
    DevTensor q(sa::DType::bf16, {B, Lq, Hq, D}), k(sa::DType::bf16, {B, Lk, Hkv, D});
    DevTensor idx(sa::DType::i32, {B, Hkv, Tq, top_k}), cnt(sa::DType::i32, {B, Hkv, Tq});
    fill(q, 500 + static_cast<std::uint32_t>(Lk)), fill(k, 600 + static_cast<std::uint32_t>(Lk));
    const sa::TileLists out{idx.view, cnt.view};
    for (int r : {1, 4}) {
      sa::PooledOptions o;
      o.representatives = r, o.top_k = static_cast<int>(top_k), o.stream = s;
      const auto run = [&] { sa::pooled_select(q.view, k.view, out, o); };
      if (Lk == 16384) {  // the lists before the timing: a top-k of the CPU's scores within the kernel's bound, so
                          // only near-ties may differ from the CPU's lists
        run();
        ok(cudaStreamSynchronize(s), "verification call");
        const sa::HostTensor hq = q.host(), hk = k.host();
        sa::PooledOptions co = o;
        co.stream = nullptr;
        sa::HostTensor ridx(sa::DType::i32, idx.shape), rcnt(sa::DType::i32, cnt.shape);
        sa::pooled_select(hq.view(), hk.view(), sa::TileLists{ridx.view(), rcnt.view()}, co);
        const sa::HostTensor gidx = idx.host(), gcnt = cnt.host();
        std::int64_t same = 0;
        for (std::int64_t l = 0; l < gcnt.numel(); ++l)
          same += std::memcmp(gidx.data<std::int32_t>() + l * top_k, ridx.data<std::int32_t>() + l * top_k,
                              top_k * 4) == 0 &&
                  gcnt.data<std::int32_t>()[l] == rcnt.data<std::int32_t>()[l];
        all_equal = all_equal && same == gcnt.numel();
        std::printf("pooled R%d Lk=16384: %lld of %lld lists equal the CPU's\n", r, static_cast<long long>(same),
                    static_cast<long long>(gcnt.numel()));
      }
      const std::vector<double> warm = time_warm(s, 30, run);
      std::vector<double> cold;
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0), cudaEventCreate(&e1);
      for (int i = 0; i < 10; ++i) {
        cudaMemsetAsync(flush, i & 0xff, flush_bytes, s);
        spin_kernel<<<1, 1, 0, s>>>(1'000'000);  // the host queues the call meanwhile
        cudaEventRecord(e0, s);
        run();
        cudaEventRecord(e1, s);
        ok(cudaStreamSynchronize(s), "cold call");
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, e0, e1);
        cold.push_back(1000.0 * ms);
      }
      cudaEventDestroy(e0), cudaEventDestroy(e1);
      std::printf("pooled R%d tile16 Lk=%lld: warm median %.1f us (min %.1f), cold-L2 median %.1f us\n", r,
                  static_cast<long long>(Lk), median(warm), *std::min_element(warm.begin(), warm.end()),
                  median(cold));
    }
  }
  cudaFree(flush);
  cudaStreamDestroy(s);
  return all_equal;
}

// The GPU lists are a top-k of the exact scores within the kernel's eps (docs/design.md §5.7), not the
// CPU's ids: the count of lists equal to the CPU's is printed, not required (the GPU tests check eps).
void token_max() {
  const std::int64_t B = 2, Lq = 4096, Di = 128, Tq = Lq / sa::kTileQ;
  const int top_k = 16;
  cudaStream_t s = nullptr;
  ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  for (std::int64_t Lk : {4096, 16384, 32768}) {
    DevTensor q(sa::DType::bf16, {B, Lq, 1, Di}), k(sa::DType::bf16, {B, Lk, 1, Di});
    DevTensor idx(sa::DType::i32, {B, 1, Tq, top_k}), cnt(sa::DType::i32, {B, 1, Tq});
    fill(q, 11), fill(k, 12);
    const sa::TileLists out{idx.view, cnt.view};
    for (auto prec : {sa::IndexPrecision::fp8_e4m3, sa::IndexPrecision::bf16, sa::IndexPrecision::fp4_e2m1}) {
      sa::TokenMaxOptions o;
      o.top_k = top_k, o.precision = prec, o.causal = false, o.stream = s;
      if (Lk == 4096) {
        sa::token_max_select(q.view, k.view, out, o);
        ok(cudaStreamSynchronize(s), "call");
        const sa::HostTensor hq = q.host(), hk = k.host();
        sa::TokenMaxOptions co = o;
        co.stream = nullptr;
        const bool equal =
            equals_cpu(idx, cnt, [&](const sa::TileLists& ref) { sa::token_max_select(hq.view(), hk.view(), ref, co); });
        std::printf("token_max %s Lk=4096: lists %s the CPU's\n", sa::precision_name(prec), equal ? "equal" : "differ from");
      }
      const std::vector<double> us = time_warm(s, 25, [&] { sa::token_max_select(q.view, k.view, out, o); });
      std::printf("token_max %s TileLists Lk=%lld: median %.1f us (min %.1f)\n", sa::precision_name(prec),
                  static_cast<long long>(Lk), median(us), *std::min_element(us.begin(), us.end()));
    }
    if (Lk == 16384) {
      DevTensor qidx(sa::DType::i32, {B, 1, Lq, top_k});
      sa::TokenMaxOptions o;
      o.top_k = top_k, o.precision = sa::IndexPrecision::fp8_e4m3, o.causal = false, o.stream = s;
      const std::vector<double> us =
          time_warm(s, 25, [&] { sa::token_max_select(q.view, k.view, sa::QueryLists{qidx.view}, o); });
      std::printf("token_max fp8_e4m3 QueryLists Lk=16384: median %.1f us\n", median(us));
    }
  }
  cudaStreamDestroy(s);
}

// No CPU check at this size (the CPU reference takes minutes); the GPU tests cover the ids.
void lightning() {
  const std::int64_t L = 32768, HI = 64, Di = 128;
  DevTensor q(sa::DType::bf16, {1, L, HI, Di}), k(sa::DType::bf16, {1, L, Di}), w(sa::DType::f32, {1, L, HI});
  fill(q, 11), fill(k, 12), fill(w, 13);
  for (const auto prec : {sa::IndexPrecision::fp8_e4m3, sa::IndexPrecision::bf16}) {
    const int top_k = 2048;
    DevTensor idx(sa::DType::i32, {1, 1, L, top_k});
    sa::LightningOptions o;
    o.top_k = top_k, o.causal = true, o.precision = prec;
    sa::lightning_select(q.view, w.view, k.view, sa::TokenLists{idx.view}, o);
    ok(cudaDeviceSynchronize(), "warm-up call");
    std::vector<double> ms;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    for (int it = 0; it < 3; ++it) {
      cudaEventRecord(e0);
      sa::lightning_select(q.view, w.view, k.view, sa::TokenLists{idx.view}, o);
      cudaEventRecord(e1);
      ok(cudaEventSynchronize(e1), "timed call");
      float x = 0;
      cudaEventElapsedTime(&x, e0, e1);
      ms.push_back(x);
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    const double pairs = static_cast<double>(L) * static_cast<double>(L + 1) / 2.0;
    const double m = median(ms);
    std::printf("lightning tokens L=%lld top-%d causal %s: %.3f ms, %.1f TFLOP/s\n", static_cast<long long>(L), top_k,
                sa::precision_name(prec), m, 2.0 * HI * Di * pairs / (m * 1e-3) / 1e12);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!sa::cuda_available()) {
    std::fprintf(stderr, "no supported CUDA device (sm_90)\n");
    return 1;
  }
  auto want = [&](const char* what) {
    if (argc == 1) return true;
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]) == what) return true;
    return false;
  };
  bool equal = true;
  if (want("pooled")) equal = pooled() && equal;
  if (want("token_max")) token_max();
  if (want("lightning")) lightning();
  return equal ? 0 : 1;
}
