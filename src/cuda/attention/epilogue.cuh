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

#include "cuda/attention/block_policy.cuh"
#include "cuda/attention/params.hpp"
#include "cuda/attention/softmax.cuh"
#include "cuda/common/scheduler.cuh"
#include "cuda/common/sync.cuh"

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

/// This thread's row r (0 or 1) of the warpgroup's 64 rows starting at `first_row`, in `out`; nullptr
/// for a row at or past Lq, which is never stored.
template <class Tag>
__device__ __forceinline__ typename Tag::Elem* output_row(const TileAttentionParams& p, int thread, int b, int head,
                                                          int first_row, int r) {
  const int row = first_row + 16 * (thread / 32) + (thread % 32) / 4 + 8 * r;
  if (row >= p.Lq) return nullptr;
  return static_cast<typename Tag::Elem*>(p.out) + b * p.out_stride[0] + static_cast<std::int64_t>(row) * p.out_stride[1] +
         head * p.out_stride[2];
}

/// Columns 8c + 2q and 8c + 2q + 1 of a row (q = thread % 4): where fragment elements 4c + 2r and
/// 4c + 2r + 1 of row r belong.
template <class Tag>
__device__ __forceinline__ void store_pair(typename Tag::Elem* row, int c, int thread, float x, float y) {
  *reinterpret_cast<std::uint32_t*>(row + 8 * c + 2 * (thread % 4)) = Tag::pack(x, y);
}

template <class Tag, int N>
__device__ __forceinline__ void store_output(const TileAttentionParams& p, const float (&o)[N],
                                             const OnlineSoftmax& sm, int thread, int b, int head, int first_row) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    typename Tag::Elem* dst = output_row<Tag>(p, thread, b, head, first_row, r);
    if (dst == nullptr) continue;
    const float inv = sm.l[r] > 0.0f ? 1.0f / sm.l[r] : 0.0f;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) store_pair<Tag>(dst, i, thread, o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
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

/// `*src` through L2 where `pred`, else `fallback`; predicated rather than branched, so the loads of a
/// batch are issued together and the ones not taken move no data.
__device__ __forceinline__ float4 load_cg_if(bool pred, const float4* src, float4 fallback) {
  float4 v = fallback;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n @p ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%5];\n}\n"
      : "+f"(v.x), "+f"(v.y), "+f"(v.z), "+f"(v.w)
      : "r"(static_cast<int>(pred)), "l"(src));
  return v;
}

/// The combine of a unit's pieces, straight from their slots to out and lse, in piece order: m = max of
/// the pieces' m, l = sum of l_k 2^(m_k - m), o = sum of o_k 2^(m_k - m) / l, so whichever piece arrives
/// last writes the same bits. A piece that saw no visible key (m = -inf) weighs 0; if all did, the row
/// gets 0 and -inf.
///
/// Every load is a trip to L2 (the slots were written by other SMs), so the loads of kBatch pieces go
/// out together as predicated loads (a load behind a loop guard would wait for the previous trip).
/// (m, l) is combined online batch by batch; o then kGroup float4 columns at a time (4 kGroup
/// accumulators and up to kBatch (kGroup + 1) float4 loads in registers: small where the caller's
/// registers are in use, larger after the last item). Where the caller still holds its own piece's
/// fragment (`own` = its piece index, -1 if none; kOwn), that piece's columns come from registers
/// rather than L2, which halves what a combine of two pieces reads.
template <class Tag, int N, int kGroup, int kBatch, bool kOwn>
__device__ __forceinline__ void combine_pieces(const TileAttentionParams& p, const WorkItem& w, int consumer, int thread,
                                               const float (&own_o)[N], int own) {
  static_assert((N / 4) % kGroup == 0, "groups must tile the fragment");
  const auto part = [&](int k) {
    const int slot = w.first_slot + min(k, w.pieces - 1);  // a valid address even where not loaded
    return reinterpret_cast<const float4*>(p.tail_part + (static_cast<std::int64_t>(slot) * 2 + consumer) * kTailPartFloats);
  };
  const float4 no_ml = make_float4(-INFINITY, -INFINITY, 0.0f, 0.0f), zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const auto ml_of = [&](int k) { return load_cg_if(k < w.pieces, part(k) + (N / 4) * 128 + thread, no_ml); };
  // The weight 2^(m_k - m) of a piece whose row maximum is m_k, 0 for a row that saw no key.
  const auto weight = [](float mk, float m) { return mk == -INFINITY ? 0.0f : fast_exp2(mk - m); };
  OnlineSoftmax st;
  st.reset();
#pragma unroll 1
  for (int k0 = 0; k0 < w.pieces; k0 += kBatch) {
    float4 ml[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) ml[i] = ml_of(k0 + i);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = st.m[r];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) m = fmaxf(m, r == 0 ? ml[i].x : ml[i].y);
      float l = st.l[r] * weight(st.m[r], m);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) l = fmaf(r == 0 ? ml[i].z : ml[i].w, weight(r == 0 ? ml[i].x : ml[i].y, m), l);
      st.m[r] = m;
      st.l[r] = l;
    }
  }
  const int first_row = w.q_tile * kTileRows + consumer * (kTileRows / 2);
  store_lse(p, st, thread, w.b, w.head, first_row);
  float inv[2];
  typename Tag::Elem* dst[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    inv[r] = st.l[r] > 0.0f ? 1.0f / st.l[r] : 0.0f;
    dst[r] = output_row<Tag>(p, thread, w.b, w.head, first_row, r);
  }
  // With the own fragment the columns must be compile-time indices into it: every group unrolled.
#pragma unroll(kOwn ? N / 4 / kGroup : 1)
  for (int c0 = 0; c0 < N / 4; c0 += kGroup) {
    float a[4 * kGroup];
#pragma unroll
    for (int i = 0; i < 4 * kGroup; ++i) a[i] = 0.0f;
#pragma unroll 1
    for (int k0 = 0; k0 < w.pieces; k0 += kBatch) {
      float4 ml[kBatch], v[kBatch][kGroup];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int k = k0 + i;
        ml[i] = ml_of(k);
        const bool from_l2 = k < w.pieces && !(kOwn && k == own);
#pragma unroll
        for (int j = 0; j < kGroup; ++j) v[i][j] = load_cg_if(from_l2, part(k) + (c0 + j) * 128 + thread, zero);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (kOwn && k0 + i == own) {
#pragma unroll
          for (int j = 0; j < kGroup; ++j)
            v[i][j] = make_float4(own_o[4 * (c0 + j)], own_o[4 * (c0 + j) + 1], own_o[4 * (c0 + j) + 2],
                                  own_o[4 * (c0 + j) + 3]);
        }
        const float w0 = weight(ml[i].x, st.m[0]), w1 = weight(ml[i].y, st.m[1]);
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {  // fragment element 4c + e belongs to row e / 2
          a[4 * j] = fmaf(v[i][j].x, w0, a[4 * j]);
          a[4 * j + 1] = fmaf(v[i][j].y, w0, a[4 * j + 1]);
          a[4 * j + 2] = fmaf(v[i][j].z, w1, a[4 * j + 2]);
          a[4 * j + 3] = fmaf(v[i][j].w, w1, a[4 * j + 3]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (dst[r] != nullptr) store_pair<Tag>(dst[r], c0 + j, thread, a[4 * j + 2 * r] * inv[r], a[4 * j + 2 * r + 1] * inv[r]);
  }
}

}  // namespace sparse_attn::cuda_kernels
