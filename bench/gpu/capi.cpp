// A C entry point over the CUDA backend's dense / tile_sparse for the Python benchmark (ctypes):
// torch allocates the tensors and passes data pointers, shapes and the current stream. Contiguous
// [B, L, H, D] tensors; idx == nullptr means dense. The shapes come from the caller, who built the
// tensors from them, so the backend is called directly.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <optional>

#include "cuda/backend.hpp"
#include "cuda/selectors/tc_token_max.cuh"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;

namespace {

/// The message of `e` into the caller's buffer (truncated, always terminated).
void copy_error(const std::exception& e, char* err, int err_len) {
  if (err && err_len > 0) {
    const std::size_t n = std::min<std::size_t>(std::strlen(e.what()), static_cast<std::size_t>(err_len - 1));
    std::memcpy(err, e.what(), n);
    err[n] = '\0';
  }
}

}  // namespace

// token_max's launches after the first as a programmatic chain (1, the default) or plain launches (0): for
// A/B timings of the pipeline.
extern "C" void sa_bench_set_token_max_pdl(int on) { sa::cuda_backend::set_token_max_pdl(on != 0); }

extern "C" int sa_bench_attention(int dtype_code, void* q, void* k, void* v, void* out, float* lse, std::int64_t B,
                                  std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv, std::int64_t D,
                                  int causal, std::int32_t* idx, std::int32_t* cnt, std::int64_t G, std::int64_t Kmax,
                                  int trusted, void* stream, char* err, int err_len) {
  try {
    const sa::DType dt = dtype_code == 0 ? sa::DType::bf16 : sa::DType::f16;
    const auto qv = sa::TensorView::contiguous(q, dt, {B, Lq, Hq, D}, sa::Device::cuda);
    const auto kv = sa::TensorView::contiguous(k, dt, {B, Lk, Hkv, D}, sa::Device::cuda);
    const auto vv = sa::TensorView::contiguous(v, dt, {B, Lk, Hkv, D}, sa::Device::cuda);
    const auto ov = sa::TensorView::contiguous(out, dt, {B, Lq, Hq, D}, sa::Device::cuda);
    std::optional<sa::TensorView> lv;
    if (lse) lv = sa::TensorView::contiguous(lse, sa::DType::f32, {B, Hq, Lq}, sa::Device::cuda);
    sa::AttentionOptions opt;
    opt.causal = causal != 0;
    opt.trusted = trusted != 0;
    opt.stream = stream;
    sa::ProblemShape p;
    p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = opt.causal;
    if (idx == nullptr) {
      sa::cuda_backend::dense(p, qv, kv, vv, ov, lv, opt);
    } else {
      const std::int64_t Tq = sa::ceil_div(Lq, sa::kTileQ);
      const sa::TileLists tiles{sa::TensorView::contiguous(idx, sa::DType::i32, {B, G, Tq, Kmax}, sa::Device::cuda),
                                sa::TensorView::contiguous(cnt, sa::DType::i32, {B, G, Tq}, sa::Device::cuda)};
      sa::cuda_backend::tile_sparse(p, qv, kv, vv, tiles, ov, lv, opt);
    }
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

// ---- selectors ---------------------------------------------------------------------------------------
// Times the CUDA selectors through the public functions on one shape (the `tile16` one at a given Lk):
// q [B, Lq, Hq, D] and k [B, Lk, Hkv, D] bf16 of fresh normal values; token_max reads index vectors
// qidx [B, Lq, Hkv, D], kidx [B, Lk, 1, D] and writes TileLists. times_us receives, in order: pooled
// R1, pooled R4, token_max bf16, token_max fp8 e4m3, token_max fp4 e2m1 (mean over `iters` runs after
// one warm-up, CUDA events on a private stream). Before timing, pooled R1 on this input is checked
// against the CPU selector (ids and counts equal); token_max is checked by the GPU tests.
#include <cuda_runtime.h>

#include <random>
#include <string>
#include <vector>

#include "sparse_attn/dtype.hpp"

namespace {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed");
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
};

std::vector<std::uint16_t> random_bf16(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::uint16_t> h(static_cast<std::size_t>(n));
  for (auto& x : h) x = sa::float_to_bf16(dist(rng));
  return h;
}

void check_cuda_bench(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Owned so that a library Error thrown between creation and the end of a timing leaks nothing.
struct OwnedStream {
  cudaStream_t s = nullptr;
  OwnedStream() { check_cuda_bench(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() { cudaStreamDestroy(s); }
};

struct OwnedEvent {
  cudaEvent_t e = nullptr;
  OwnedEvent() { check_cuda_bench(cudaEventCreate(&e), "cudaEventCreate"); }
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  ~OwnedEvent() { cudaEventDestroy(e); }
};

}  // namespace

extern "C" int sa_bench_selectors(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
                                  std::int64_t D, int top_k, int iters, double* times_us, char* err, int err_len) {
  try {
    const std::int64_t Tq = sa::ceil_div(Lq, sa::kTileQ);
    const auto hq = random_bf16(B * Lq * Hq * D, 1), hk = random_bf16(B * Lk * Hkv * D, 2);
    const auto hqi = random_bf16(B * Lq * Hkv * D, 3), hki = random_bf16(B * Lk * D, 4);
    DevBuf q(hq.size() * 2), k(hk.size() * 2), qi(hqi.size() * 2), ki(hki.size() * 2);
    DevBuf idx(static_cast<std::size_t>(B * Hkv * Tq * top_k) * 4), cnt(static_cast<std::size_t>(B * Hkv * Tq) * 4);
    check_cuda_bench(cudaMemcpy(q.p, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice), "upload");
    check_cuda_bench(cudaMemcpy(k.p, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice), "upload");
    check_cuda_bench(cudaMemcpy(qi.p, hqi.data(), hqi.size() * 2, cudaMemcpyHostToDevice), "upload");
    check_cuda_bench(cudaMemcpy(ki.p, hki.data(), hki.size() * 2, cudaMemcpyHostToDevice), "upload");
    const auto dev = sa::Device::cuda;
    const auto qv = sa::TensorView::contiguous(q.p, sa::DType::bf16, {B, Lq, Hq, D}, dev);
    const auto kv = sa::TensorView::contiguous(k.p, sa::DType::bf16, {B, Lk, Hkv, D}, dev);
    const auto qiv = sa::TensorView::contiguous(qi.p, sa::DType::bf16, {B, Lq, Hkv, D}, dev);
    const auto kiv = sa::TensorView::contiguous(ki.p, sa::DType::bf16, {B, Lk, 1, D}, dev);
    const sa::TileLists tiles{sa::TensorView::contiguous(idx.p, sa::DType::i32, {B, Hkv, Tq, top_k}, dev),
                              sa::TensorView::contiguous(cnt.p, sa::DType::i32, {B, Hkv, Tq}, dev)};
    cudaStream_t stream = nullptr;
    check_cuda_bench(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    sa::PooledOptions po;
    po.top_k = top_k, po.causal = false, po.stream = stream;
    sa::TokenMaxOptions to;
    to.top_k = top_k, to.causal = false, to.stream = stream;

    {  // verify R1 against the CPU selector
      sa::pooled_select(qv, kv, tiles, po);
      check_cuda_bench(cudaStreamSynchronize(stream), "pooled R1");
      std::vector<std::int32_t> gi(static_cast<std::size_t>(B * Hkv * Tq * top_k)), gc(static_cast<std::size_t>(B * Hkv * Tq));
      check_cuda_bench(cudaMemcpy(gi.data(), idx.p, gi.size() * 4, cudaMemcpyDeviceToHost), "download");
      check_cuda_bench(cudaMemcpy(gc.data(), cnt.p, gc.size() * 4, cudaMemcpyDeviceToHost), "download");
      sa::HostTensor cq(sa::DType::bf16, {B, Lq, Hq, D}), ck(sa::DType::bf16, {B, Lk, Hkv, D});
      std::memcpy(cq.data<std::uint16_t>(), hq.data(), hq.size() * 2);
      std::memcpy(ck.data<std::uint16_t>(), hk.data(), hk.size() * 2);
      sa::HostTensor ci(sa::DType::i32, {B, Hkv, Tq, top_k}), cc(sa::DType::i32, {B, Hkv, Tq});
      sa::PooledOptions cpo = po;
      cpo.stream = nullptr;
      sa::pooled_select(cq.view(), ck.view(), sa::TileLists{ci.view(), cc.view()}, cpo);
      if (std::memcmp(gi.data(), ci.data<std::int32_t>(), gi.size() * 4) != 0 ||
          std::memcmp(gc.data(), cc.data<std::int32_t>(), gc.size() * 4) != 0)
        throw std::runtime_error("pooled R1 on the GPU differs from the CPU selector");
    }

    cudaEvent_t e0, e1;
    check_cuda_bench(cudaEventCreate(&e0), "cudaEventCreate");
    check_cuda_bench(cudaEventCreate(&e1), "cudaEventCreate");
    auto time = [&](auto&& fn) {
      fn();
      check_cuda_bench(cudaStreamSynchronize(stream), "warm-up");
      check_cuda_bench(cudaEventRecord(e0, stream), "cudaEventRecord");
      for (int i = 0; i < iters; ++i) fn();
      check_cuda_bench(cudaEventRecord(e1, stream), "cudaEventRecord");
      check_cuda_bench(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0.0f;
      check_cuda_bench(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      return 1000.0 * ms / iters;
    };
    int slot = 0;
    for (int r : {1, 4}) {
      po.representatives = r;
      times_us[slot++] = time([&] { sa::pooled_select(qv, kv, tiles, po); });
    }
    for (auto p : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3, sa::IndexPrecision::fp4_e2m1}) {
      to.precision = p;
      times_us[slot++] = time([&] { sa::token_max_select(qiv, kiv, tiles, to); });
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(stream);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

// ---- query_sparse on generated inputs ------------------------------------------------------------------
// Times one query_sparse schedule on one shape (e.g. query16of32: B=8, Hq=16, Hkv=1, Lq=Lk=4096, K=16) with
// fresh normal bf16 q, k, v and K distinct uniformly random blocks per query. `schedule` is a
// QuerySchedule code (0 kv_centric, 1 group_centric); a schedule the backend lacks comes back as the
// library's Error message. times_ms receives, in order: reverse index (plan, trusted lists), attention
// (partials), combine -- these three only for kv_centric, NaN otherwise -- and the one-call public
// query_sparse (lists validated on the device): means over `iters` runs after one warm-up, CUDA
// events on a private stream. Before timing, batch 0 of the one-call output is compared with the CPU
// query_sparse on the same inputs; *relerr receives ||gpu - cpu|| / ||cpu||.
#include <cmath>

#include "cuda/query_sparse/backend.hpp"
#include "sparse_attn/plan.hpp"

// Cache hints of the KV-centric attention kernel (bits as set_query_sparse_attend_hints), for A/B timings.
extern "C" void sa_bench_set_kv_attend_hints(int hints) {
  sa::cuda_backend::set_query_sparse_attend_hints(static_cast<unsigned>(hints));
}

namespace {

sa::QuerySchedule schedule_from_code(const char* op, int code) {
  // Codes inside the enum's range go to the library unchanged, so its front end names an unknown one.
  if (code < 0 || code > 255) throw sa::Error(op, "schedule", "schedule code " + std::to_string(code) + " is not a QuerySchedule");
  return static_cast<sa::QuerySchedule>(code);
}

}  // namespace

extern "C" int sa_bench_query_sparse_schedule(std::int64_t B, std::int64_t L, std::int64_t Hq, std::int64_t Hkv,
                                              std::int64_t D, std::int64_t K, int causal, int bf16_partials,
                                              int schedule, int iters, double* times_ms, double* relerr, char* err,
                                              int err_len) {
  try {
    const sa::QuerySchedule sched = schedule_from_code("sa_bench_query_sparse", schedule);
    sa::ProblemShape p;
    p.B = B, p.Lq = L, p.Lk = L, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = causal != 0;
    const std::int64_t Tk = p.Tk();
    if (K > Tk) throw std::runtime_error("K = " + std::to_string(K) + " exceeds the " + std::to_string(Tk) + " blocks");
    const auto hq = random_bf16(B * L * Hq * D, 11), hk = random_bf16(B * L * Hkv * D, 12),
               hv = random_bf16(B * L * Hkv * D, 13);
    std::vector<std::int32_t> hidx(static_cast<std::size_t>(B * Hkv * L * K));
    std::mt19937_64 rng(14);
    std::vector<std::int32_t> all(static_cast<std::size_t>(Tk));
    for (std::int64_t r = 0; r < B * Hkv * L; ++r) {
      for (std::int64_t j = 0; j < Tk; ++j) all[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(j);
      for (std::int64_t s = 0; s < K; ++s) {  // partial Fisher-Yates: K distinct ids
        std::swap(all[static_cast<std::size_t>(s)], all[static_cast<std::size_t>(s + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(Tk - s)))]);
        hidx[static_cast<std::size_t>(r * K + s)] = all[static_cast<std::size_t>(s)];
      }
    }
    DevBuf q(hq.size() * 2), k(hk.size() * 2), v(hv.size() * 2), idx(hidx.size() * 4), out(hq.size() * 2),
        lse(static_cast<std::size_t>(B * Hq * L) * 4);
    check_cuda_bench(cudaMemcpy(q.p, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice), "upload");
    check_cuda_bench(cudaMemcpy(k.p, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice), "upload");
    check_cuda_bench(cudaMemcpy(v.p, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice), "upload");
    check_cuda_bench(cudaMemcpy(idx.p, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice), "upload");
    const auto dt = sa::DType::bf16;
    const auto qv = sa::TensorView::contiguous(q.p, dt, {B, L, Hq, D}, sa::Device::cuda);
    const auto kv = sa::TensorView::contiguous(k.p, dt, {B, L, Hkv, D}, sa::Device::cuda);
    const auto vv = sa::TensorView::contiguous(v.p, dt, {B, L, Hkv, D}, sa::Device::cuda);
    const auto ov = sa::TensorView::contiguous(out.p, dt, {B, L, Hq, D}, sa::Device::cuda);
    const auto lv = sa::TensorView::contiguous(lse.p, sa::DType::f32, {B, Hq, L}, sa::Device::cuda);
    const sa::QueryLists lists{sa::TensorView::contiguous(idx.p, sa::DType::i32, {B, Hkv, L, K}, sa::Device::cuda)};

    OwnedStream owned_stream;
    const cudaStream_t stream = owned_stream.s;
    sa::QuerySparseOptions opt;
    opt.causal = p.causal;
    opt.partials = bf16_partials ? sa::PartialPrecision::bf16 : sa::PartialPrecision::f32;
    opt.schedule = sched;
    opt.stream = stream;

    // Verify batch 0 of the one-call result against the CPU executor.
    sa::query_sparse(qv, kv, vv, lists, ov, lv, opt);
    check_cuda_bench(cudaStreamSynchronize(stream), "query_sparse");
    {
      const std::int64_t n = L * Hq * D;
      std::vector<std::uint16_t> got(static_cast<std::size_t>(n));
      check_cuda_bench(cudaMemcpy(got.data(), out.p, got.size() * 2, cudaMemcpyDeviceToHost), "download");
      sa::HostTensor cq(dt, {1, L, Hq, D}), ck(dt, {1, L, Hkv, D}), cv(dt, {1, L, Hkv, D}), co(dt, {1, L, Hq, D});
      sa::HostTensor ci(sa::DType::i32, {1, Hkv, L, K});
      std::memcpy(cq.data<std::uint16_t>(), hq.data(), static_cast<std::size_t>(n) * 2);
      std::memcpy(ck.data<std::uint16_t>(), hk.data(), static_cast<std::size_t>(L * Hkv * D) * 2);
      std::memcpy(cv.data<std::uint16_t>(), hv.data(), static_cast<std::size_t>(L * Hkv * D) * 2);
      std::memcpy(ci.data<std::int32_t>(), hidx.data(), static_cast<std::size_t>(Hkv * L * K) * 4);
      sa::QuerySparseOptions copt;
      copt.causal = p.causal;
      sa::query_sparse(cq.view(), ck.view(), cv.view(), sa::QueryLists{ci.view()}, co.view(), std::nullopt, copt);
      double num = 0.0, den = 0.0;
      for (std::int64_t e = 0; e < n; ++e) {
        const double r = sa::bf16_to_float(co.data<std::uint16_t>()[e]);
        const double g = sa::bf16_to_float(got[static_cast<std::size_t>(e)]);
        num += (g - r) * (g - r);
        den += r * r;
      }
      *relerr = std::isfinite(num) && den > 0.0 ? std::sqrt(num / den) : INFINITY;
    }

    const std::size_t bytes = sa::query_sparse_workspace_bytes(p, K, opt.partials);
    DevBuf ws(bytes);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    sa::QuerySparseOptions topt = opt;
    topt.trusted = true;
    OwnedEvent e0, e1;
    auto time = [&](auto&& fn) {
      fn();
      check_cuda_bench(cudaStreamSynchronize(stream), "warm-up");
      check_cuda_bench(cudaEventRecord(e0.e, stream), "cudaEventRecord");
      for (int i = 0; i < iters; ++i) fn();
      check_cuda_bench(cudaEventRecord(e1.e, stream), "cudaEventRecord");
      check_cuda_bench(cudaEventSynchronize(e1.e), "cudaEventSynchronize");
      float ms = 0.0f;
      check_cuda_bench(cudaEventElapsedTime(&ms, e0.e, e1.e), "cudaEventElapsedTime");
      return double(ms) / iters;
    };
    if (sched == sa::QuerySchedule::kv_centric) {
      times_ms[0] = time([&] { sa::cuda_backend::query_sparse_plan(p, lists, ws.p, bytes, topt); });
      times_ms[1] = time([&] { sa::cuda_backend::query_sparse_attend(p, qv, kv, vv, lists, ws.p, bytes, scale, topt); });
      times_ms[2] = time([&] { sa::cuda_backend::query_sparse_combine(p, lists, ws.p, bytes, ov, lv, topt); });
    } else {
      times_ms[0] = times_ms[1] = times_ms[2] = NAN;
    }
    times_ms[3] = time([&] { sa::query_sparse(qv, kv, vv, lists, ov, lv, opt); });
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

/// The KV-centric form of the hook above, as the query stage of scripts/gpu_run.sh calls it.
extern "C" int sa_bench_query_sparse(std::int64_t B, std::int64_t L, std::int64_t Hq, std::int64_t Hkv, std::int64_t D,
                                     std::int64_t K, int causal, int bf16_partials, int iters, double* times_ms,
                                     double* relerr, char* err, int err_len) {
  return sa_bench_query_sparse_schedule(B, L, Hq, Hkv, D, K, causal, bf16_partials,
                                        static_cast<int>(sa::QuerySchedule::kv_centric), iters, times_ms, relerr, err,
                                        err_len);
}

// ---- hooks on the caller's tensors (bench/gpu/bench_query.py) ------------------------------------------
// torch allocates every tensor and times every call with CUDA events on its current stream, so all
// implementations, ours and the peers, see the same inputs and the same clock. Tensors are contiguous:
// q, out [B, Lq, Hq, D]; k, v [B, Lk, Hkv, D]; lse float32 [B, Hq, Lq] (may be null); lists int32
// [B, Hkv, Lq, Kq] on the device (on the host for sa_plan_query). dtype_code: 0 bf16, 1 f16. Every hook
// returns 0, or 1 with the library's message in `err`.

namespace {

sa::ProblemShape problem(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv,
                         std::int64_t D, int causal) {
  sa::ProblemShape p;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.causal = causal != 0;
  return p;
}

sa::DType dtype_from_code(const char* op, int code) {
  if (code == 0) return sa::DType::bf16;
  if (code == 1) return sa::DType::f16;
  throw sa::Error(op, "dtype_code", "dtype code " + std::to_string(code) + " is neither 0 (bf16) nor 1 (f16)");
}

struct Operands {
  sa::TensorView q, k, v, out;
  std::optional<sa::TensorView> lse;
};

Operands operands(const sa::ProblemShape& p, sa::DType dt, void* q, void* k, void* v, void* out, float* lse) {
  const auto dev = sa::Device::cuda;
  Operands o{sa::TensorView::contiguous(q, dt, {p.B, p.Lq, p.Hq, p.D}, dev),
             sa::TensorView::contiguous(k, dt, {p.B, p.Lk, p.Hkv, p.D}, dev),
             sa::TensorView::contiguous(v, dt, {p.B, p.Lk, p.Hkv, p.D}, dev),
             sa::TensorView::contiguous(out, dt, {p.B, p.Lq, p.Hq, p.D}, dev), std::nullopt};
  if (lse) o.lse = sa::TensorView::contiguous(lse, sa::DType::f32, {p.B, p.Hq, p.Lq}, dev);
  return o;
}

// options.merge_window of every later query_sparse call made through this library (0: automatic).
int g_merge_window = 0;

sa::QuerySparseOptions query_options(const sa::ProblemShape& p, int bf16_partials, int schedule, int trusted,
                                     void* stream) {
  sa::QuerySparseOptions opt;
  opt.merge_window = g_merge_window;
  opt.causal = p.causal;
  opt.partials = bf16_partials ? sa::PartialPrecision::bf16 : sa::PartialPrecision::f32;
  opt.schedule = schedule_from_code("sa_query_sparse", schedule);
  opt.trusted = trusted != 0;
  opt.stream = stream;
  return opt;
}

// The planner reports the estimates of the schedules it knows; one it does not know reads as NaN.
template <class Estimate>
double group_centric_estimate(const Estimate& e) {
  if constexpr (requires { e.group_centric_ms; }) {
    return static_cast<double>(e.group_centric_ms);
  } else {
    return NAN;
  }
}

// Statistics of the group-centric CTAs, where the planner computes them (NaN otherwise).
template <class Stats>
void group_cta_stats(const Stats& st, double* out) {
  if constexpr (requires { st.group_ctas; st.group_cta_union; st.union_per_group_cta; }) {
    out[0] = double(st.group_ctas), out[1] = double(st.group_cta_union), out[2] = st.union_per_group_cta;
  } else {
    out[0] = out[1] = out[2] = NAN;
  }
}

void copy_text(const std::string& text, char* buf, int len) {
  if (buf && len > 0) {
    const std::size_t n = std::min<std::size_t>(text.size(), static_cast<std::size_t>(len - 1));
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
}

}  // namespace

/// options.merge_window of the KV-centric calls that follow (sa_query_sparse, sa_bench_query_sparse*,
/// sa_kv_phases_create): 0 automatic, 1 off, 2, 4 or 8.
extern "C" void sa_bench_set_kv_merge_window(int window) { g_merge_window = window; }
/// Query bands of later KV-centric plans (0 automatic, n > 0 forced; set_query_sparse_bands).
extern "C" void sa_bench_set_kv_bands(int bands) { sa::cuda_backend::set_query_sparse_bands(bands); }

/// One call of the public query_sparse with the given schedule (QuerySchedule code) and partials.
extern "C" int sa_query_sparse(int dtype_code, void* q, void* k, void* v, void* out, float* lse, std::int64_t B,
                               std::int64_t Lq, std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv, std::int64_t D,
                               int causal, std::int32_t* idx, std::int64_t Kq, int schedule, int bf16_partials,
                               int trusted, void* stream, char* err, int err_len) {
  try {
    const auto p = problem(B, Lq, Lk, Hq, Hkv, D, causal);
    const auto o = operands(p, dtype_from_code("sa_query_sparse", dtype_code), q, k, v, out, lse);
    const sa::QueryLists lists{sa::TensorView::contiguous(idx, sa::DType::i32, {B, Hkv, Lq, Kq}, sa::Device::cuda)};
    sa::query_sparse(o.q, o.k, o.v, lists, o.out, o.lse, query_options(p, bf16_partials, schedule, trusted, stream));
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

// The three phases of the KV-centric schedule, callable one at a time so that each can be timed:
// create() validates the lists on the device once and owns a workspace; run(phase) launches phase
// 0 (reverse index, lists trusted), 1 (attention into the partials) or 2 (combine into out, lse).
// A phase reads what the earlier ones left in the workspace, so run them in order at least once.
namespace {

struct KvPhases {
  sa::ProblemShape p;
  sa::QueryLists lists;
  sa::QuerySparseOptions opt;
  std::size_t bytes = 0;
  DevBuf ws;
  KvPhases(const sa::ProblemShape& shape, const sa::QueryLists& l, const sa::QuerySparseOptions& o, std::size_t b)
      : p(shape), lists(l), opt(o), bytes(b), ws(b) {}
};

}  // namespace

extern "C" void* sa_kv_phases_create(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq,
                                     std::int64_t Hkv, std::int64_t D, int causal, std::int32_t* idx, std::int64_t Kq,
                                     int bf16_partials, void* stream, char* err, int err_len) {
  try {
    const auto p = problem(B, Lq, Lk, Hq, Hkv, D, causal);
    const sa::QueryLists lists{sa::TensorView::contiguous(idx, sa::DType::i32, {B, Hkv, Lq, Kq}, sa::Device::cuda)};
    auto opt = query_options(p, bf16_partials, static_cast<int>(sa::QuerySchedule::kv_centric), 0, stream);
    auto* h = new KvPhases(p, lists, opt, sa::cuda_backend::query_sparse_workspace_bytes(p, Kq, opt.partials));
    try {
      sa::cuda_backend::query_sparse_plan(p, lists, h->ws.p, h->bytes, opt);  // validates the lists
    } catch (...) {
      delete h;
      throw;
    }
    h->opt.trusted = true;
    return h;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return nullptr;
  }
}

extern "C" int sa_kv_phases_run(void* handle, int phase, int dtype_code, void* q, void* k, void* v, void* out,
                                float* lse, char* err, int err_len) {
  try {
    if (handle == nullptr) throw sa::Error("sa_kv_phases_run", "handle", "null handle (create failed?)");
    auto& h = *static_cast<KvPhases*>(handle);
    const auto o = operands(h.p, dtype_from_code("sa_kv_phases_run", dtype_code), q, k, v, out, lse);
    switch (phase) {
      case 0: sa::cuda_backend::query_sparse_plan(h.p, h.lists, h.ws.p, h.bytes, h.opt); break;
      case 1:
        sa::cuda_backend::query_sparse_attend(h.p, o.q, o.k, o.v, h.lists, h.ws.p, h.bytes,
                                              sa::resolve_scale("sa_kv_phases_run", std::nullopt, h.p.D), h.opt);
        break;
      case 2: sa::cuda_backend::query_sparse_combine(h.p, h.lists, h.ws.p, h.bytes, o.out, o.lse, h.opt); break;
      default: throw sa::Error("sa_kv_phases_run", "phase", "phase " + std::to_string(phase) + " is not 0, 1 or 2");
    }
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

extern "C" void sa_kv_phases_destroy(void* handle) { delete static_cast<KvPhases*>(handle); }

/// The Q-centric schedule's conversion on the host, kept for comparison: the lists come to the host,
/// query_lists_to_tile_lists (validation included) forms each tile's union, and the TileLists go back
/// to tidx [B, Hkv, Tq, Kmax] and tcnt [B, Hkv, Tq] on the device. Synchronises `stream`.
extern "C" int sa_query_lists_to_tile_lists(std::int32_t* idx, std::int64_t B, std::int64_t Lq, std::int64_t Lk,
                                            std::int64_t Hq, std::int64_t Hkv, std::int64_t D, int causal,
                                            std::int64_t Kq, std::int32_t* tidx, std::int32_t* tcnt, std::int64_t Kmax,
                                            void* stream, char* err, int err_len) {
  try {
    const auto p = problem(B, Lq, Lk, Hq, Hkv, D, causal);
    const std::int64_t Tq = p.Tq();
    const auto s = static_cast<cudaStream_t>(stream);
    sa::HostTensor hl(sa::DType::i32, {B, Hkv, Lq, Kq}), ht(sa::DType::i32, {B, Hkv, Tq, Kmax}),
        hc(sa::DType::i32, {B, Hkv, Tq});
    check_cuda_bench(cudaMemcpyAsync(hl.data<std::int32_t>(), idx, static_cast<std::size_t>(B * Hkv * Lq * Kq) * 4,
                                     cudaMemcpyDeviceToHost, s),
                     "lists to the host");
    check_cuda_bench(cudaStreamSynchronize(s), "lists to the host");
    sa::query_lists_to_tile_lists(sa::QueryLists{hl.view()}, sa::TileLists{ht.view(), hc.view()}, p);
    check_cuda_bench(cudaMemcpyAsync(tidx, ht.data<std::int32_t>(), static_cast<std::size_t>(B * Hkv * Tq * Kmax) * 4,
                                     cudaMemcpyHostToDevice, s),
                     "tile lists to the device");
    check_cuda_bench(cudaMemcpyAsync(tcnt, hc.data<std::int32_t>(), static_cast<std::size_t>(B * Hkv * Tq) * 4,
                                     cudaMemcpyHostToDevice, s),
                     "tile counts to the device");
    // The host tensors die on return; the copies must have read them by then.
    check_cuda_bench(cudaStreamSynchronize(s), "tile lists to the device");
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

/// The Q-centric schedule's conversion on the device: query_lists_to_tile_lists on idx [B, Hkv, Lq, Kq]
/// into tidx [B, Hkv, Tq, Kmax] and tcnt [B, Hkv, Tq], all device memory, on `stream`. Unless `trusted`
/// the lists and the capacity are checked by the kernel and its fault word is read back (one
/// synchronisation); trusted, it is one launch and returns without waiting.
extern "C" int sa_query_lists_to_tile_lists_device(std::int32_t* idx, std::int64_t B, std::int64_t Lq,
                                                   std::int64_t Lk, std::int64_t Hq, std::int64_t Hkv, std::int64_t D,
                                                   int causal, std::int64_t Kq, std::int32_t* tidx, std::int32_t* tcnt,
                                                   std::int64_t Kmax, int trusted, void* stream, char* err, int err_len) {
  try {
    const auto p = problem(B, Lq, Lk, Hq, Hkv, D, causal);
    const std::int64_t Tq = p.Tq();
    sa::ConvertOptions opt;
    opt.trusted = trusted != 0;
    opt.stream = stream;
    sa::query_lists_to_tile_lists(
        sa::QueryLists{sa::TensorView::contiguous(idx, sa::DType::i32, {B, Hkv, Lq, Kq}, sa::Device::cuda)},
        sa::TileLists{sa::TensorView::contiguous(tidx, sa::DType::i32, {B, Hkv, Tq, Kmax}, sa::Device::cuda),
                      sa::TensorView::contiguous(tcnt, sa::DType::i32, {B, Hkv, Tq}, sa::Device::cuda)},
        p, opt);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

/// The planner on host lists. est receives the estimated ms of q_centric, kv_centric and group_centric
/// (NaN for a schedule the planner does not estimate); stats receives tiles, queries, query_blocks,
/// tile_union, max_tile_union, selected_pairs, blocks_per_query, union_per_tile, neighbour_overlap,
/// union_utilisation, group_ctas, group_cta_union, union_per_group_cta (13 values; NaN for those the
/// planner does not compute); choice the chosen schedule's name; reason the planner's one-line reason.
extern "C" int sa_plan_query(std::int32_t* idx, std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq,
                             std::int64_t Hkv, std::int64_t D, int causal, std::int64_t Kq, int bf16_partials,
                             double* est, double* stats, char* choice, int choice_len, char* reason, int reason_len,
                             char* err, int err_len) {
  try {
    const auto p = problem(B, Lq, Lk, Hq, Hkv, D, causal);
    const sa::QueryLists lists{sa::TensorView::contiguous(idx, sa::DType::i32, {B, Hkv, Lq, Kq}, sa::Device::cpu)};
    const sa::PlanEstimate e =
        sa::plan_schedule(lists, p, bf16_partials ? sa::PartialPrecision::bf16 : sa::PartialPrecision::f32);
    est[0] = e.q_centric_ms;
    est[1] = e.kv_centric_ms;
    est[2] = group_centric_estimate(e);
    const sa::SelectionStats& st = e.stats;
    const double values[] = {double(st.tiles),          double(st.queries),        double(st.query_blocks),
                             double(st.tile_union),     double(st.max_tile_union), double(st.selected_pairs),
                             st.blocks_per_query,       st.union_per_tile,         st.neighbour_overlap,
                             st.union_utilisation};
    std::copy(std::begin(values), std::end(values), stats);
    group_cta_stats(st, stats + std::size(values));
    copy_text(sa::schedule_name(e.schedule), choice, choice_len);
    copy_text(e.reason, reason, reason_len);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}

// ---- a selector on the caller's tensors (bench/gpu/bench_pipeline.py) ----------------------------------
// One call of a public selector into TileLists idx int32 [B, Hkv, Tq, Kmax] and cnt int32 [B, Hkv, Tq],
// device tensors the caller owns, on `stream`; nothing is synchronised, so a caller can queue the selector
// and an executor back to back. q [B, Lq, Hq, D] and k [B, Lk, Hkv, D] are contiguous with the dtype of
// dtype_code (0 bf16, 1 f16). selector: 0 pooled R1, 1 pooled R4, 2 token_max bf16, 3 token_max fp8 e4m3,
// 4 token_max fp4 e2m1 (the order of sa_bench_selectors). Other than top_k and causal, the options are the
// library's defaults, as the pipeline workload of `sparse-attn bench` leaves them: pooled forces the local
// block, token_max reserves it. token_max reads index vectors: with qidx == kidx == nullptr the first query
// head of each group of q and k itself (what the pipeline workload does; Di and Hki are then ignored),
// otherwise contiguous qidx [B, Lq, Hkv, Di] and kidx [B, Lk, Hki, Di] (Hki 1 or Hkv) of the same dtype.
// q and k are required for every selector. Returns 0, or 1 with the message in `err`.
#include <utility>

namespace {

constexpr int kSelectorCodes = 5;

void require_arg(bool ok, const char* argument, const std::string& message) {
  if (!ok) throw sa::Error("sa_bench_select_tiles", argument, message);
}

}  // namespace

extern "C" int sa_bench_select_tiles(int selector, int dtype_code, void* q, void* k, void* qidx, void* kidx,
                                     std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hq,
                                     std::int64_t Hkv, std::int64_t D, std::int64_t Di, std::int64_t Hki, int causal,
                                     int top_k, std::int32_t* idx, std::int32_t* cnt, std::int64_t Kmax, void* stream,
                                     char* err, int err_len) {
  try {
    const char* op = "sa_bench_select_tiles";
    require_arg(selector >= 0 && selector < kSelectorCodes, "selector",
                "selector code " + std::to_string(selector) +
                    " is not 0 (pooled R1), 1 (pooled R4), 2 (token_max bf16), 3 (token_max fp8) or 4 (token_max fp4)");
    const sa::DType dt = dtype_from_code(op, dtype_code);
    for (const auto& [name, value] : {std::pair<const char*, std::int64_t>{"B", B}, {"Lq", Lq}, {"Lk", Lk}, {"Hq", Hq},
                                      {"Hkv", Hkv}, {"D", D}, {"Kmax", Kmax}})
      require_arg(value > 0, name, std::string(name) + " = " + std::to_string(value) + " must be > 0");
    require_arg(Hq % Hkv == 0, "Hkv",
                "Hq = " + std::to_string(Hq) + " is not a multiple of Hkv = " + std::to_string(Hkv));
    require_arg(top_k >= 1, "top_k", "top_k = " + std::to_string(top_k) + " must be >= 1");
    require_arg(top_k <= Kmax, "top_k",
                "top_k = " + std::to_string(top_k) + " exceeds the list capacity Kmax = " + std::to_string(Kmax));
    require_arg(q != nullptr, "q", "null data pointer");
    require_arg(k != nullptr, "k", "null data pointer");
    require_arg(idx != nullptr, "idx", "null data pointer");
    require_arg(cnt != nullptr, "cnt", "null data pointer");
    const auto dev = sa::Device::cuda;
    const std::int64_t Tq = sa::ceil_div(Lq, sa::kTileQ);
    const auto qv = sa::TensorView::contiguous(q, dt, {B, Lq, Hq, D}, dev);
    const auto kv = sa::TensorView::contiguous(k, dt, {B, Lk, Hkv, D}, dev);
    const sa::TileLists tiles{sa::TensorView::contiguous(idx, sa::DType::i32, {B, Hkv, Tq, Kmax}, dev),
                              sa::TensorView::contiguous(cnt, sa::DType::i32, {B, Hkv, Tq}, dev)};
    if (selector <= 1) {
      sa::PooledOptions o;
      o.representatives = selector == 0 ? 1 : 4;
      o.top_k = top_k;
      o.causal = causal != 0;
      o.stream = stream;
      sa::pooled_select(qv, kv, tiles, o);
      return 0;
    }
    sa::TokenMaxOptions o;
    o.top_k = top_k;
    o.causal = causal != 0;
    o.stream = stream;
    o.precision = selector == 2 ? sa::IndexPrecision::bf16
                  : selector == 3 ? sa::IndexPrecision::fp8_e4m3
                                  : sa::IndexPrecision::fp4_e2m1;
    require_arg((qidx == nullptr) == (kidx == nullptr), qidx == nullptr ? "qidx" : "kidx",
                "qidx and kidx must be given together or both be null (null: q's first head per group and k)");
    if (qidx == nullptr) {
      sa::TensorView qi = qv;  // the first query head of each group
      qi.shape[2] = Hkv;
      qi.stride[2] *= Hq / Hkv;
      sa::token_max_select(qi, kv, tiles, o);
    } else {
      require_arg(Di > 0, "Di", "Di = " + std::to_string(Di) + " must be > 0");
      require_arg(Hki == 1 || Hki == Hkv, "Hki",
                  "Hki = " + std::to_string(Hki) + " is neither 1 nor Hkv = " + std::to_string(Hkv));
      sa::token_max_select(sa::TensorView::contiguous(qidx, dt, {B, Lq, Hkv, Di}, dev),
                           sa::TensorView::contiguous(kidx, dt, {B, Lk, Hki, Di}, dev), tiles, o);
    }
    return 0;
  } catch (const std::exception& e) {
    copy_error(e, err, err_len);
    return 1;
  }
}
