// Epilogue of one consumer warpgroup: normalise its 64 x D output fragment (N = D / 2 registers) by the row sums and
// store it straight from registers (4-byte stores of column pairs; each quad writes 16 contiguous bytes
// per 8 columns), plus the natural-log LSE. Rows at or past Lq are never stored. A row that saw no
// visible key has l = 0: it gets out = 0 and lse = -inf, never NaN.
#pragma once

#include <cstdint>

#include "cuda/attention/params.hpp"
#include "cuda/attention/softmax.cuh"

namespace sparse_attn::cuda_kernels {

template <class Tag, int N>
__device__ __forceinline__ void store_output(const TileAttentionParams& p, const float (&o)[N],
                                             const OnlineSoftmax& sm, int thread, int b, int head, int first_row) {
  using Elem = typename Tag::Elem;
  const int w = thread / 32, g = (thread % 32) / 4, q = thread % 4;
  constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + 16 * w + g + 8 * r;
    if (row >= p.Lq) continue;
    const float inv = sm.l[r] > 0.0f ? 1.0f / sm.l[r] : 0.0f;
    Elem* dst = static_cast<Elem*>(p.out) + b * p.out_stride[0] + static_cast<std::int64_t>(row) * p.out_stride[1] +
                head * p.out_stride[2];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const std::uint32_t v = Tag::pack(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
      *reinterpret_cast<std::uint32_t*>(dst + 8 * i + 2 * q) = v;
    }
    if (p.lse != nullptr && q == 0) {
      const float lse = sm.l[r] > 0.0f ? (sm.m[r] + __log2f(sm.l[r])) * kLn2 : -INFINITY;
      p.lse[b * p.lse_stride[0] + head * p.lse_stride[1] + static_cast<std::int64_t>(row) * p.lse_stride[2]] = lse;
    }
  }
}

}  // namespace sparse_attn::cuda_kernels
