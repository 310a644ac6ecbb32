// Input element type tags of the tensor-core wrappers (wgmma.cuh, mma_sync.cuh): the PTX type suffix
// and the packing of two float32 values into one 16-bit pair differ per type, the fragment layouts do
// not.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace sparse_attn::cuda_kernels {

struct Bf16Tag {
  using Elem = __nv_bfloat16;
  /// (lo, hi) rounded to nearest, lo in the low half: one register of an A fragment.
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
};
struct F16Tag {
  using Elem = __half;
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
};

}  // namespace sparse_attn::cuda_kernels
