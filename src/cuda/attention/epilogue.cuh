// Epilogue of one consumer warpgroup: normalise its 64 x D output fragment (N = D / 2 registers) by the
// row sums, write it out, and write the natural-log LSE. A row that saw no visible key has l = 0: it
// gets out = 0 and lse = -inf, never NaN. Rows at or past Lq are never stored.
//
// Two ways out for the tile: staged into shared memory (the warpgroup's rows of the item's Q buffer,
// in the 128B-swizzled layout a TMA load writes) and stored by TMA, so the warpgroup spends a few
// dozen shared stores instead of waiting on 32 scattered global stores per thread; or, where TMA
// cannot address `out` (base not 16-byte aligned, a stride not a multiple of 8 elements), straight
// from registers with 4-byte stores (each quad writes 16 contiguous bytes per 8 columns). Both
// write the same values.
#pragma once

#include <cstdint>

#include "cuda/attention/params.hpp"
#include "cuda/attention/softmax.cuh"

namespace sparse_attn::cuda_kernels {

__device__ __forceinline__ void store_lse(const TileAttentionParams& p, const OnlineSoftmax& sm, int thread, int b,
                                          int head, int first_row) {
  const int w = thread / 32, g = (thread % 32) / 4, q = thread % 4;
  constexpr float kLn2 = 0.69314718055994530942f;
  if (p.lse == nullptr || q != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + 16 * w + g + 8 * r;
    if (row >= p.Lq) continue;
    const float lse = sm.l[r] > 0.0f ? (sm.m[r] + __log2f(sm.l[r])) * kLn2 : -INFINITY;
    p.lse[b * p.lse_stride[0] + head * p.lse_stride[1] + static_cast<std::int64_t>(row) * p.lse_stride[2]] = lse;
  }
}

/// Writes the normalised fragment into this warpgroup's 64 rows of a [half][128 rows][64] swizzled
/// tile at `tile` (generic pointer to its first byte; `row0` = 0 or 64, the warpgroup's first row in
/// it). Element (row, col) lives in half col / 64, 16-byte chunk (col % 64) / 8 XOR row % 8; a warp's
/// store covers 8 rows x 16 bytes in 8 distinct chunks, so it is free of bank conflicts.
template <class Tag, int N>
__device__ __forceinline__ void stage_output(const float (&o)[N], const OnlineSoftmax& sm, int thread,
                                             std::uint8_t* tile, int row0) {
  const int w = thread / 32, g = (thread % 32) / 4, q = thread % 4;
  constexpr int kHalfBytes = 64 * 128 * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = sm.l[r] > 0.0f ? 1.0f / sm.l[r] : 0.0f;
    std::uint8_t* row = tile + (row0 + 16 * w + g + 8 * r) * 128 + 4 * q;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const std::uint32_t v = Tag::pack(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
      *reinterpret_cast<std::uint32_t*>(row + (i / 8) * kHalfBytes + (((i % 8) ^ g) * 16)) = v;
    }
  }
}

template <class Tag, int N>
__device__ __forceinline__ void store_output(const TileAttentionParams& p, const float (&o)[N],
                                             const OnlineSoftmax& sm, int thread, int b, int head, int first_row) {
  using Elem = typename Tag::Elem;
  const int w = thread / 32, g = (thread % 32) / 4, q = thread % 4;
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
  }
  store_lse(p, sm, thread, b, head, first_row);
}

}  // namespace sparse_attn::cuda_kernels
