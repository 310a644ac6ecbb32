// Persistent tile scheduler: a grid of at most one CTA per SM walks the work items with a static
// stride. Work items are (b, q tile, head) with the head innermost, so the CTAs running at one time
// hold the heads of one GQA group on the same Q tile: they read the same selected K/V blocks, and all
// but the first read hits L2. Under a causal mask the Q tiles are visited last-first, so the longest
// items start first and the short ones fill the tail.
#pragma once

namespace sparse_attn::cuda_kernels {

struct WorkItem {
  int b, q_tile, head;
};

struct StaticPersistentScheduler {
  int num_items;
  int B, Hq, Tq;
  bool reverse_tiles;

  __device__ __forceinline__ WorkItem decode(int item) const {
    const int head = item % Hq;
    const int bt = item / Hq;
    const int b = bt % B;
    const int rank = bt / B;
    return {b, reverse_tiles ? Tq - 1 - rank : rank, head};
  }
  __device__ __forceinline__ int first() const { return static_cast<int>(blockIdx.x); }
  __device__ __forceinline__ int next(int item) const { return item + static_cast<int>(gridDim.x); }
  __device__ __forceinline__ bool valid(int item) const { return item < num_items; }
};

}  // namespace sparse_attn::cuda_kernels
