// Persistent tile scheduler: a grid of at most one CTA per SM walks the work items with a static
// stride. Work items are (b, kv head, q tile, query head of the group), innermost last, so the CTAs
// running at one time share K/V through L2: the heads of one GQA group on one Q tile read the same
// selected blocks, and consecutive Q tiles of one (b, kv head) stream the same K/V. (v1 put every
// head innermost; for MHA at L = 16K that spread the running CTAs over 32 different K/V streams of
// 8 MB each, over L2, and dense ran at 467 instead of 557 TFLOP/s.) Under a causal mask the Q tiles
// are visited in long/short pairs (below).
#pragma once

namespace sparse_attn::cuda_kernels {

struct WorkItem {
  int b, q_tile, head;
};

struct StaticPersistentScheduler {
  int num_units;  // B * Hkv * group_size * units_per_head
  int B, Hkv, group_size, Tq;
  // Causal: a unit is the pair of Q tiles (Tq - 1 - r, r) of one head, longest first. Every pair
  // holds about Tq + 1 blocks, so a static stride hands each CTA nearly equal work; with single
  // tiles (1..Tq blocks each) the most loaded of 132 CTAs ran ~20% over the mean (v2: causal 16K at
  // 492 against 603 TFLOP/s non-causal).
  bool pair_tiles;

  struct Cursor {
    int unit, sub;
  };

  __device__ __forceinline__ int units_per_head() const { return pair_tiles ? (Tq + 1) / 2 : Tq; }

  __device__ __forceinline__ WorkItem decode(Cursor c) const {
    const int head_in_group = c.unit % group_size;
    int rest = c.unit / group_size;
    const int rank = rest % units_per_head();
    rest /= units_per_head();
    const int kv_head = rest % Hkv;
    const int b = rest / Hkv;
    const int tile = pair_tiles ? (c.sub == 0 ? Tq - 1 - rank : rank) : rank;
    return {b, tile, kv_head * group_size + head_in_group};
  }
  __device__ __forceinline__ Cursor first() const { return {static_cast<int>(blockIdx.x), 0}; }
  __device__ __forceinline__ Cursor next(Cursor c) const {
    if (pair_tiles && c.sub == 0) {
      const int rank = (c.unit / group_size) % units_per_head();
      if (rank != Tq - 1 - rank) return {c.unit, 1};
    }
    return {c.unit + static_cast<int>(gridDim.x), 0};
  }
  __device__ __forceinline__ bool valid(Cursor c) const { return c.unit < num_units; }
};

}  // namespace sparse_attn::cuda_kernels
