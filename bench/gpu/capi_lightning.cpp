// A C entry point over the lightning indexer's token form for the Python benchmark (ctypes): torch allocates
// the tensors and passes data pointers, shapes and the current stream. qI [B, Lq, HI, Di] bf16, w [B, Lq, HI]
// float32, kI [B, Lk, Di] bf16, idx [B, G, Lq, Kt] int32, all contiguous on the current CUDA device. The
// counters (rows screened, pairs re-scored in float64, rows on the float64 fallback, buffer compactions) are
// read back when `stats` is non-null (a host array of four; the call then synchronises the stream).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>

#include "cuda/selectors/lightning_tokens.cuh"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;

extern "C" int sa_bench_lightning_tokens(void* q, void* w, void* k, std::int32_t* idx, std::int64_t B, std::int64_t Lq,
                                         std::int64_t Lk, std::int64_t HI, std::int64_t Di, std::int64_t G,
                                         std::int64_t Kt, int top_k, int causal, int fp8, void* stream,
                                         unsigned long long* stats, char* err, int err_len) {
  unsigned long long* dstats = nullptr;
  try {
    const auto qv = sa::TensorView::contiguous(q, sa::DType::bf16, {B, Lq, HI, Di}, sa::Device::cuda);
    const auto wv = sa::TensorView::contiguous(w, sa::DType::f32, {B, Lq, HI}, sa::Device::cuda);
    const auto kv = sa::TensorView::contiguous(k, sa::DType::bf16, {B, Lk, Di}, sa::Device::cuda);
    const auto iv = sa::TensorView::contiguous(idx, sa::DType::i32, {B, G, Lq, Kt}, sa::Device::cuda);
    sa::LightningOptions o;
    o.top_k = top_k;
    o.causal = causal != 0;
    o.precision = fp8 ? sa::IndexPrecision::fp8_e4m3 : sa::IndexPrecision::bf16;
    o.stream = stream;
    if (stats) {
      if (cudaMalloc(&dstats, 4 * sizeof(unsigned long long)) != cudaSuccess ||
          cudaMemset(dstats, 0, 4 * sizeof(unsigned long long)) != cudaSuccess)
        throw sa::Error("sa_bench_lightning_tokens", "stats", "cannot allocate the device counters");
      sa::cuda_backend::set_lightning_stats(dstats);
    }
    sa::lightning_select(qv, wv, kv, sa::TokenLists{iv}, o);
    if (stats) {
      sa::cuda_backend::set_lightning_stats(nullptr);
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
      cudaMemcpy(stats, dstats, 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
      cudaFree(dstats);
    }
    return 0;
  } catch (const std::exception& e) {
    if (dstats) {
      sa::cuda_backend::set_lightning_stats(nullptr);
      cudaFree(dstats);
    }
    if (err && err_len > 0) {
      std::strncpy(err, e.what(), static_cast<std::size_t>(err_len - 1));
      err[err_len - 1] = '\0';
    }
    return 1;
  }
}
