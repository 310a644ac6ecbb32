// The mask policy the mainloop asks: which KV blocks a work item visits, and which of them need the
// element mask. Dense and tile_sparse differ only here (dense lists every block), so both run the
// same mainloop. The producer and the consumers walk the same sequence, which keeps the K/V ring in
// step without any communication beyond the mbarriers.
//
// The walk never leaves the list's row and never visits an id outside [0, Tk), whatever the list
// holds: a count is clamped to [0, Kmax] and an id out of range is skipped. Validated calls check the
// lists in a kernel of their own after the attention (list_check.cu), which gives a faulty tile NaN
// rows; the attention kernel is the same for both.
#pragma once

#include <cstdint>

#include "cuda/attention/params.hpp"
#include "cuda/common/scheduler.cuh"

namespace sparse_attn::cuda_kernels {

inline constexpr int kTileRows = 128;  // queries per Q tile (docs/design.md §2)
inline constexpr int kBlockKeys = 128;  // keys per KV block

struct BlockPolicy {
  const std::int32_t* list = nullptr;  // ids of this tile's list (null for dense)
  std::int64_t list_stride = 1;        // elements between consecutive entries (idx stride 3)
  int begin = 0;                       // first position of the walk (a piece of a split unit starts later)
  int count = 0;                       // end of the walk: cnt, or Tk for dense, cut at the piece's end
  int Tk = 0;
  int last_visible_key = 0;            // keys past this are in every row's future (causal); Lk - 1 otherwise

  /// kCausal: p.causal, known at compile time.
  template <bool kCausal>
  __device__ __forceinline__ static BlockPolicy make(const TileAttentionParams& p, const WorkItem& w) {
    const int b = w.b, q_tile = w.q_tile, head = w.head;
    BlockPolicy bp;
    bp.Tk = p.Tk;
    if (p.dense) {
      bp.count = p.Tk;
    } else {
      const int g = head / p.heads_per_list;
      bp.list = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + q_tile * p.idx_stride[2];
      bp.list_stride = p.idx_stride[3];
      const int c = __ldg(p.cnt + b * p.cnt_stride[0] + g * p.cnt_stride[1] + q_tile * p.cnt_stride[2]);
      // The count is clamped so that the walk never reads past the list's row.
      bp.count = c < 0 ? 0 : (c > p.Kmax ? p.Kmax : c);
    }
    bp.begin = w.lo;
    bp.count = min(bp.count, w.hi);
    const int last_row = min((q_tile + 1) * kTileRows, p.Lq) - 1;
    bp.last_visible_key = kCausal ? min(last_row + (p.Lk - p.Lq), p.Lk - 1) : p.Lk - 1;
    return bp;
  }

  /// Block id at position i of the walk, or -1 when it is skipped (entirely in the future, or an id
  /// out of range (a list that breaks its format)).
  __device__ __forceinline__ int block(int i) const {
    const int j = list ? __ldg(list + i * list_stride) : i;
    if (j < 0 || j >= Tk) return -1;
    return j * kBlockKeys <= last_visible_key ? j : -1;
  }

  /// Advances i to the next position whose block is visited and returns that block, or -1 (with
  /// i = count) when the walk is over.
  __device__ __forceinline__ int next(int& i) const {
    for (; i < count; ++i) {
      const int j = block(i);
      if (j >= 0) return j;
    }
    return -1;
  }

  /// Whether block j needs the element mask for rows starting at `first_row` (a consumer's 64 rows):
  /// it straddles the causal diagonal of those rows or runs past Lk.
  template <bool kCausal>
  __device__ __forceinline__ static bool needs_mask(const TileAttentionParams& p, int j, int first_row) {
    const int key_end = (j + 1) * kBlockKeys;  // exclusive
    if (key_end > p.Lk) return true;
    return kCausal && key_end - 1 > first_row + (p.Lk - p.Lq);
  }
};

}  // namespace sparse_attn::cuda_kernels
