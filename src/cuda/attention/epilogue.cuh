// Epilogue of one consumer warpgroup: normalise its 64 x D output fragment (N = D / 2 registers) by the
// row sums, write it out, and write the natural-log LSE. A row that saw no visible key has m = -inf and
// l = 0: it gets out = 0 and lse = -inf, never NaN; a faulty item's rows (NaN state) and rows with a
// NaN or +inf score (NaN l, or l = 0 under m = +inf) get NaN (OnlineSoftmax::normaliser, lse). Rows at
// or past Lq are never stored.
//
// Two ways out for the tile: staged into shared memory (the warpgroup's rows of the item's Q buffer,
// in the 128B-swizzled layout a TMA load writes) and stored by TMA, so the warpgroup spends a few
// dozen shared stores instead of waiting on 32 scattered global stores per thread; or, where TMA
// cannot address `out` (base not 16-byte aligned, a stride not a multiple of 8 elements), straight
// from registers with 4-byte stores (each quad writes 16 contiguous bytes per 8 columns). Both
// write the same values.
#pragma once

#include <cstdint>

#include "cuda/attention/block_policy.cuh"
#include "cuda/attention/params.hpp"
#include "cuda/attention/softmax.cuh"
#include "cuda/common/scheduler.cuh"
#include "cuda/common/sync.cuh"

namespace sparse_attn::cuda_kernels {

__device__ __forceinline__ void store_lse(const TileAttentionParams& p, const OnlineSoftmax& sm, int thread, int b,
                                          int head, int first_row) {
  const int w = thread / 32, g = (thread % 32) / 4, q = thread % 4;
  if (p.lse == nullptr || q != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + 16 * w + g + 8 * r;
    if (row >= p.Lq) continue;
    p.lse[b * p.lse_stride[0] + head * p.lse_stride[1] + static_cast<std::int64_t>(row) * p.lse_stride[2]] = sm.lse(r);
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
    const float inv = sm.normaliser(r);
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
    const float inv = sm.normaliser(r);
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

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// Split units (scheduler.cuh). Each consumer warpgroup leaves its piece in a workspace slot
// (store_piece), counts its arrival (arrive_piece), and the last of a unit's pieces to arrive combines
// them all into out and lse (combine_pieces). No piece ever waits for another, so the scheme needs no
// CTA to be resident at the same time as any other.

/// Leaves the unnormalised fragment `o` and (m, l) of `st` (l quad-reduced) in `slot`: o as float4
/// columns [N / 4][128 threads], then (m0, m1, l0, l1) per thread. Stores bypass L1 (another SM reads them).
template <int N>
__device__ __forceinline__ void store_piece(const TileAttentionParams& p, const float (&o)[N], const OnlineSoftmax& st,
                                            int slot, int consumer, int thread) {
  static_assert(N % 4 == 0 && (N / 4 + 1) * 128 * 4 <= kTailPartFloats, "fragment larger than a slot");
  float4* dst = reinterpret_cast<float4*>(p.tail_part + (static_cast<std::int64_t>(slot) * 2 + consumer) * kTailPartFloats);
#pragma unroll
  for (int c = 0; c < N / 4; ++c) __stcg(dst + c * 128 + thread, make_float4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]));
  __stcg(dst + (N / 4) * 128 + thread, make_float4(st.m[0], st.m[1], st.l[0], st.l[1]));
}

/// Counts the arrival of the piece whose WorkItem thread 0 left in `item` (after its store_piece) and
/// returns, in every thread, whether it was the last of its unit's pieces; if so, thread 0 has copied
/// the item to `due` for the combine. Every thread's stores precede the arrival (the barrier), which
/// thread 0 makes at device scope after a fence; the arrival that completes the count fences again
/// before anyone reads the other pieces. `item`, `flag` and `due` are the warpgroup's words in shared
/// memory; thread 0 writes them only between the two barriers of an arrival, and the others read
/// `flag` before they reach the next arrival's first barrier.
__device__ __forceinline__ bool arrive_piece(const TileAttentionParams& p, int consumer, int thread,
                                             const WorkItem& item, int& flag, WorkItem& due) {
  const NamedBarrier bar = consumer == 0 ? NamedBarrier::kEpilogueWG0 : NamedBarrier::kEpilogueWG1;
  named_barrier_sync(bar, 128);
  if (thread == 0) {
    fence_acq_rel_gpu();
    const unsigned before = atomicInc(p.tail_count + 2 * item.tail + consumer, static_cast<unsigned>(item.pieces - 1));
    const bool last = before == static_cast<unsigned>(item.pieces - 1);
    if (last) {
      fence_acq_rel_gpu();
      due = item;
    }
    *reinterpret_cast<volatile int*>(&flag) = last;
  }
  named_barrier_sync(bar, 128);
  return *reinterpret_cast<volatile int*>(&flag) != 0;
}

/// The combine of a unit's pieces, straight from their slots to out and lse, in piece order: m = max of
/// the pieces' m, l = sum of l_k 2^(m_k - m), o = sum of o_k 2^(m_k - m) / l, so whichever piece arrives
/// last writes the same bits. A piece that saw no visible key (m = -inf) weighs 0; if all did, the row
/// gets 0 and -inf. A NaN piece (NaN l or o, or m = +inf) makes the row NaN: its l times any weight is
/// NaN, and m = +inf gives the weight 2^(inf - inf). kGroup float4 columns are combined at a time (4 kGroup accumulators): small where
/// the caller still holds its accumulators, all N / 4 where it does not.
template <class Tag, int N, int kGroup>
__device__ __forceinline__ void combine_pieces(const TileAttentionParams& p, const WorkItem& w, int consumer, int thread) {
  static_assert((N / 4) % kGroup == 0, "groups must tile the fragment");
  using Elem = typename Tag::Elem;
  const auto part = [&](int k) {
    return reinterpret_cast<const float4*>(p.tail_part +
                                           (static_cast<std::int64_t>(w.first_slot + k) * 2 + consumer) * kTailPartFloats);
  };
  OnlineSoftmax st;
  st.reset();
  // (Unrolled so that the loads of several pieces are in flight at once: each pass is a trip to L2.)
#pragma unroll 4
  for (int k = 0; k < w.pieces; ++k) {
    const float4 ml = __ldcg(part(k) + (N / 4) * 128 + thread);
    st.m[0] = fmaxf(st.m[0], ml.x);
    st.m[1] = fmaxf(st.m[1], ml.y);
  }
  const auto weights = [&](const float4& ml, float (&wt)[2]) {
    wt[0] = ml.x == -INFINITY ? 0.0f : fast_exp2(ml.x - st.m[0]);
    wt[1] = ml.y == -INFINITY ? 0.0f : fast_exp2(ml.y - st.m[1]);
  };
#pragma unroll 4
  for (int k = 0; k < w.pieces; ++k) {
    const float4 ml = __ldcg(part(k) + (N / 4) * 128 + thread);
    float wt[2];
    weights(ml, wt);
    st.l[0] = fmaf(ml.z, wt[0], st.l[0]);
    st.l[1] = fmaf(ml.w, wt[1], st.l[1]);
  }
  const int first_row = w.q_tile * kTileRows + consumer * (kTileRows / 2);
  store_lse(p, st, thread, w.b, w.head, first_row);
  const int wq = thread / 32, g = (thread % 32) / 4, q = thread % 4;
  float inv[2];
  Elem* dst[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    inv[r] = st.normaliser(r);
    const int row = first_row + 16 * wq + g + 8 * r;
    dst[r] = row < p.Lq ? static_cast<Elem*>(p.out) + w.b * p.out_stride[0] + static_cast<std::int64_t>(row) * p.out_stride[1] +
                              w.head * p.out_stride[2]
                        : nullptr;
  }
#pragma unroll 1
  for (int c0 = 0; c0 < N / 4; c0 += kGroup) {
    float a[4 * kGroup];
#pragma unroll
    for (int i = 0; i < 4 * kGroup; ++i) a[i] = 0.0f;
#pragma unroll(kGroup > 2 ? 2 : 1)
    for (int k = 0; k < w.pieces; ++k) {
      const float4* src = part(k);
      float wt[2];
      weights(__ldcg(src + (N / 4) * 128 + thread), wt);
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const float4 v = __ldcg(src + (c0 + j) * 128 + thread);
        // Fragment element 4c + i belongs to row i / 2 of the thread's two rows.
        a[4 * j] = fmaf(v.x, wt[0], a[4 * j]);
        a[4 * j + 1] = fmaf(v.y, wt[0], a[4 * j + 1]);
        a[4 * j + 2] = fmaf(v.z, wt[1], a[4 * j + 2]);
        a[4 * j + 3] = fmaf(v.w, wt[1], a[4 * j + 3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (dst[r] != nullptr)  // columns 8c + 2q, 8c + 2q + 1 of the row, as store_output writes them
          *reinterpret_cast<std::uint32_t*>(dst[r] + 8 * (c0 + j) + 2 * q) =
              Tag::pack(a[4 * j + 2 * r] * inv[r], a[4 * j + 2 * r + 1] * inv[r]);
  }
}

}  // namespace sparse_attn::cuda_kernels
