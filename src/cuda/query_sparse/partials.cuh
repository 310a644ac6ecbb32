// Partial-output element types of the KV-centric pipeline and the dispatch over (input type, head
// dim, partial type) that attend.cu and combine.cu share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/query_sparse/mma.cuh"

namespace sparse_attn::cuda_kernels::qs {

struct PartF32 {
  using Elem = float;
  __device__ static void put2(float* dst, float x, float y) { *reinterpret_cast<float2*>(dst) = make_float2(x, y); }
  __device__ static void store2(void* base, long long e, float x, float y) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + e) = make_float2(x, y);
  }
  __device__ static float load(const void* base, long long e) { return static_cast<const float*>(base)[e]; }
};

struct PartBf16 {
  using Elem = __nv_bfloat16;
  __device__ static void put2(__nv_bfloat16* dst, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
  }
  __device__ static void store2(void* base, long long e, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + e) = __floats2bfloat162_rn(x, y);
  }
  __device__ static float load(const void* base, long long e) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[e]);
  }
};

template <template <class, int, class> class F, class... A>
cudaError_t dispatch(bool bf16, int D, bool bf16_partials, A... args) {
  if (bf16) {
    if (D == 128) return bf16_partials ? F<Bf16, 128, PartBf16>::run(args...) : F<Bf16, 128, PartF32>::run(args...);
    return bf16_partials ? F<Bf16, 64, PartBf16>::run(args...) : F<Bf16, 64, PartF32>::run(args...);
  }
  if (D == 128) return bf16_partials ? F<F16, 128, PartBf16>::run(args...) : F<F16, 128, PartF32>::run(args...);
  return bf16_partials ? F<F16, 64, PartBf16>::run(args...) : F<F16, 64, PartF32>::run(args...);
}

}  // namespace sparse_attn::cuda_kernels::qs
