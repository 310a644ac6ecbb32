// Kernels of the KV-centric query_sparse (backend.hpp gives the pipeline). Plain parameter struct,
// raw pointers and element strides; every index that can exceed 32 bits is computed in 64 bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/fast_div.hpp"

namespace sparse_attn::cuda_kernels::qs {

// Rows (query, head pairs) of one attention work item: 12 tiles of 64 rows, 4 for each of the three
// consumer warpgroups of attend.cu. K and V (64 KB at D = 128) are loaded once per item, so an item
// this long keeps their bytes per row at a quarter of the row's own Q and partial traffic, while a
// block's rows still split into enough items to balance the persistent CTAs.
inline constexpr int kRowsPerItem = 768;
inline constexpr int kAttendConsumers = 3;
inline constexpr int kKeys = 128;  // keys per KV block (kBlockK)
// 8 halves (16 bytes) of padding per shared row of the group-centric kernel: a row stride of 4
// (mod 32) words makes the 8 rows x 4 columns that a quad-organised fragment load touches fall on 32
// distinct banks.
inline constexpr int kPad = 8;

enum : unsigned { kBadRange = 0, kBadDuplicate = 1 };

struct Params {
  int B = 0, Lq = 0, Lk = 0, Hq = 0, Hkv = 0, Tk = 0, Kq = 0, group = 0;
  long long offset = 0;  // Lk - Lq: query i sees key j iff j <= i + offset (causal)
  bool causal = false;
  // Merged slots (merge_window.hpp): with win > 1 a query's chosen blocks in one window of `win`
  // consecutive blocks are one piece, computed and combined as one partial. A piece's bin within its
  // (b, group) is (window << win) | mask, bit t of the mask standing for block window * win + t;
  // `bins` is the number of bins per (b, group): Tk without merging, ceil(Tk / win) << win with it.
  int win = 1, bins = 0;
  // Query bands (win == 1 only, merge_window.hpp): with bands > 1 the bin of query i's block j is
  // (i / band_queries) * Tk + j, so a (b, group)'s work items run band by band (every block's rows of
  // the first band_queries queries, then the next band's) and the Q rows they gather stay in L2;
  // bins = bands * Tk.
  int bands = 1, band_queries = 0;
  long long nblk = 0;   // B * Hkv * bins: the CSR's lists
  long long slots = 0;  // B * Hkv * Lq * Kq

  const std::int32_t* idx = nullptr;
  long long idx_stride[4] = {};
  // [B, Hkv, Lq, Kq] (win > 1): the piece's bin at the first slot of each piece, -1 at every other slot
  std::int32_t* merged = nullptr;

  // workspace
  int* counts = nullptr;        // [nblk]: counts, then fill cursors
  int* offsets = nullptr;       // [nblk + 1]: CSR offsets of entries
  int* item_offsets = nullptr;  // [nblk + 1]: first work item of each block; [nblk] = number of items
  int* entries = nullptr;       // [slots]: query * Kq + slot
  int2* items = nullptr;        // [max items]: (block x, first row)
  // The attention's work queue: [0] the next item to hand out, [1] CTAs done taking items. Zeroed by
  // the reverse index; the last CTA of each attention launch zeroes it again.
  int* queue = nullptr;
  unsigned long long* bad = nullptr;
  float* lse_part = nullptr;    // [B, Hkv, Lq, Kq, group]
  void* part = nullptr;         // [B, Hkv, Lq, Kq, group, D], f32 or bf16

  // attention
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  long long q_stride[3] = {}, k_stride[3] = {}, v_stride[3] = {};
  float scale = 1.0f;       // natural-log units
  float scale_log2 = 1.0f;  // scale * log2(e)
  // Divisions of the attention kernel's index arithmetic (set by launch_attend).
  FastDiv div_group, div_kq, div_lq;

  // combine
  void* out = nullptr;
  long long out_stride[3] = {};
  float* lse = nullptr;
  long long lse_stride[3] = {};
};

/// Whether slot entry j of query i is a block the pipeline computes: a valid id, not entirely in the
/// query's causal future. count, fill and combine all ask this one question, so a slot is combined
/// iff its partial was written.
__device__ __forceinline__ bool chosen(const Params& p, int i, int j) {
  return j >= 0 && j < p.Tk && (!p.causal || static_cast<long long>(j) * kKeys <= i + p.offset);
}

/// The view of `p` that the reverse index and the combine read: with merging, the merged lists, whose
/// entries are bins (already restricted to visible blocks) and whose slots hold one piece each.
__host__ __device__ inline Params index_view(const Params& p) {
  if (p.win <= 1) return p;
  Params q = p;
  q.idx = p.merged;
  q.idx_stride[3] = 1;
  q.idx_stride[2] = p.Kq;
  q.idx_stride[1] = static_cast<long long>(p.Lq) * p.Kq;
  q.idx_stride[0] = q.idx_stride[1] * p.Hkv;
  q.Tk = p.bins;
  q.causal = false;
  return q;
}

__device__ __forceinline__ long long items_of(const Params& p, long long count) {
  return (count * p.group + kRowsPerItem - 1) / kRowsPerItem;
}


// ---- group-centric schedule (group.cu) ----------------------------------------------------------
//
// One warp owns one (query, 16-head tile of its group): those heads are the 16 rows of its m16 MMA
// tile (rows past the group size are zero and never stored). A CTA owns kGroupWarps such units: the
// head tiles of kGroupWarps / head_tiles consecutive queries of one (b, group). It streams the sorted
// union of their lists once through a shared-memory ring; each warp runs the online softmax over the
// streamed blocks its own query selected and writes out and LSE directly.
//
// 16 warps: the CTA's union of random lists is nearly every block whatever its size, so the K/V bytes
// a CTA pulls from L2 are fixed and more queries per CTA divide them over more work. 16 x 32 threads
// leave 128 registers per thread at one CTA per SM, which holds O (64) and a 64-key half of S (32).
inline constexpr int kGroupWarps = 16;
inline constexpr int kGroupThreads = kGroupWarps * 32;

struct GroupParams {
  int B = 0, Lq = 0, Lk = 0, Hq = 0, Hkv = 0, Tk = 0, Kq = 0, group = 0;
  int head_tiles = 1;   // ceil(group / 16)
  int cta_queries = 1;  // kGroupWarps / head_tiles
  int ctas_per_bg = 0;  // ceil(Lq / cta_queries)
  int words = 0;        // ceil(Tk / 32): bitmap of the CTA's union
  int union_cap = 0;    // min(Tk, cta_queries * Kq)
  long long offset = 0; // Lk - Lq (causal: query i sees key j iff j <= i + offset)
  bool causal = false;

  const std::int32_t* idx = nullptr;
  long long idx_stride[4] = {};
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  long long q_stride[3] = {}, k_stride[3] = {}, v_stride[3] = {};
  void* out = nullptr;
  long long out_stride[3] = {};
  float* lse = nullptr;
  long long lse_stride[3] = {};
  float scale = 1.0f;       // natural-log units
  float scale_log2 = 1.0f;  // scale * log2(e)
};

}  // namespace sparse_attn::cuda_kernels::qs
