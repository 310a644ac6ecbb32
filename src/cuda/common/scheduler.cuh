// Persistent tile scheduler: a grid of at most one CTA per SM walks the work items with a static
// stride. Work items are (b, kv head, q tile, query head of the group), innermost last, so the CTAs
// running at one time share K/V through L2: the heads of one GQA group on one Q tile read the same
// selected blocks, and consecutive Q tiles of one (b, kv head) stream the same K/V. (v1 put every
// head innermost; for MHA at L = 16K that spread the running CTAs over 32 different K/V streams of
// 8 MB each, over L2, and dense ran at 467 instead of 557 TFLOP/s.) Under a causal mask the Q tiles
// are visited in long/short pairs (below).
//
// Split tail. With N units on G CTAs the static stride leaves N mod G units for a last, partial wave
// (tile16: 1024 items on 132 CTAs, 100 in the last wave, so 32 CTAs idle for an eighth of the run).
// When `tail_ctas` > 0, only the first `dp_units` units (whole waves) go by the stride; the walk
// positions of the remaining units are laid end to end (`tail_len` positions each) and cut into
// `tail_ctas` contiguous ranges, one per CTA. A unit of the tail is then computed in pieces by
// consecutive CTAs, each over a contiguous range of its walk; the pieces meet in a combine
// (epilogue.cuh). The cut depends only on (N, G, tail_len), so the arithmetic of every output is
// the same from run to run.
#pragma once

namespace sparse_attn::cuda_kernels {

struct WorkItem {
  int b, q_tile, head;
  int lo, hi;      // walk positions [lo, hi) of this piece (the whole walk: [0, INT_MAX))
  int pieces;      // pieces of this unit (1: computed whole, written straight out)
  int slot;        // workspace slot of this piece (pieces > 1)
  int first_slot;  // slot of the unit's first piece; its pieces hold first_slot .. first_slot + pieces - 1
  int tail;        // index of the unit in the tail (pieces > 1)
};

struct StaticPersistentScheduler {
  int num_units;  // B * Hkv * group_size * units_per_head
  int B, Hkv, group_size, Tq;
  // Causal: a unit is the pair of Q tiles (Tq - 1 - r, r) of one head, longest first. Every pair
  // holds about Tq + 1 blocks, so a static stride hands each CTA nearly equal work; with single
  // tiles (1..Tq blocks each) the most loaded of 132 CTAs ran ~20% over the mean (v2: causal 16K at
  // 492 against 603 TFLOP/s non-causal).
  bool pair_tiles;
  int dp_units;   // units walked whole with the static stride (num_units without a split tail)
  int tail_ctas;  // CTAs sharing the tail (0: no split tail)
  int tail_len;   // walk positions per unit of the tail

  static constexpr int kWhole = 0x7fffffff;

  struct Cursor {
    int unit, sub;
    int lo, hi;  // positions of the piece (tail units only)
  };

  __device__ __forceinline__ int units_per_head() const { return pair_tiles ? (Tq + 1) / 2 : Tq; }

  // Tail geometry: positions [t * tail_len, (t + 1) * tail_len) belong to tail unit t, and CTA c
  // owns positions [cut(c), cut(c + 1)). The host splits only where tail_total() * tail_ctas < 2^31,
  // so all of it is 32-bit arithmetic (64-bit divisions would not fit the producer's 24 registers).
  __device__ __forceinline__ int tail_total() const { return (num_units - dp_units) * tail_len; }
  __device__ __forceinline__ int cut(int c) const { return c * tail_total() / tail_ctas; }
  /// The CTA whose range holds position x: the largest c with cut(c) <= x.
  __device__ __forceinline__ int owner(int x) const { return ((x + 1) * tail_ctas - 1) / tail_total(); }
  /// This CTA's piece of tail unit t.
  __device__ __forceinline__ Cursor tail_piece(int t) const {
    const int base = t * tail_len;
    const int c = static_cast<int>(blockIdx.x);
    const int lo = max(cut(c), base), hi = min(cut(c + 1), base + tail_len);
    return {dp_units + t, 0, lo - base, hi - base};
  }
  __device__ __forceinline__ Cursor tail_first() const {
    const int c = static_cast<int>(blockIdx.x);
    if (c >= tail_ctas) return {num_units, 0, 0, 0};
    return tail_piece(cut(c) / tail_len);
  }

  __device__ __forceinline__ WorkItem decode(Cursor c) const {
    const int head_in_group = c.unit % group_size;
    int rest = c.unit / group_size;
    const int rank = rest % units_per_head();
    rest /= units_per_head();
    const int kv_head = rest % Hkv;
    const int b = rest / Hkv;
    const int tile = pair_tiles ? (c.sub == 0 ? Tq - 1 - rank : rank) : rank;
    WorkItem w{b, tile, kv_head * group_size + head_in_group, 0, kWhole, 1, 0, 0, 0};
    if (c.unit >= dp_units) {
      const int t = c.unit - dp_units;
      const int base = t * tail_len;
      const int first = owner(base), last = owner(base + tail_len - 1);
      w.lo = c.lo, w.hi = c.hi;
      w.pieces = last - first + 1;
      // CTA c computes pieces of the tail units t_lo(c)..t_hi(c), and t_lo(c + 1) >= t_hi(c): c + t
      // numbers the pieces without gaps or repeats, at most tail_ctas + (tail units) - 1 slots.
      w.slot = static_cast<int>(blockIdx.x) + t;
      w.first_slot = first + t;
      w.tail = t;
    }
    return w;
  }
  __device__ __forceinline__ Cursor first() const {
    const int c = static_cast<int>(blockIdx.x);
    return c < dp_units ? Cursor{c, 0, 0, kWhole} : tail_first();
  }
  __device__ __forceinline__ Cursor next(Cursor c) const {
    if (c.unit >= dp_units) {  // in the tail: the next unit if this CTA's range goes on
      const int t = c.unit - dp_units;
      const int end = t * tail_len + c.hi;
      if (end < cut(static_cast<int>(blockIdx.x) + 1)) return tail_piece(t + 1);
      return {num_units, 0, 0, 0};
    }
    if (pair_tiles && c.sub == 0) {
      const int rank = (c.unit / group_size) % units_per_head();
      if (rank != Tq - 1 - rank) return {c.unit, 1, 0, kWhole};
    }
    const int u = c.unit + static_cast<int>(gridDim.x);
    return u < dp_units ? Cursor{u, 0, 0, kWhole} : tail_first();
  }
  __device__ __forceinline__ bool valid(Cursor c) const { return c.unit < num_units; }
};

}  // namespace sparse_attn::cuda_kernels
