// The gate policy of the Q-centric mainloop (docs/design.md §5.5): which of the blocks a consumer
// warpgroup walks leave a trace. NoGate (dense, tile_sparse) keeps every block and compiles to
// nothing; BlockMaxGate is `gated` (BSFA).
//
// The gate tile is a consumer warpgroup's 64 rows (kGateRows): after QK, the maximum of the block's
// raw scores over the warpgroup's rows below Lq, times the softmax scale, is compared with the
// threshold of (head, gate tile). Below it the block leaves no trace: no exponentials, no P V, no update
// of m or l. Each thread tests its share of its two rows' maxima (the maximum over the scores it holds,
// scaled; the scaling is monotone, so every share below is the tile maximum below) and one named barrier
// of the warpgroup ANDs the 128 votes (barrier.red): no shuffles or shared memory. Blocks straddling the
// gate tile's causal diagonal and the first sink_blocks blocks are always kept; blocks no row of the
// gate tile sees are skipped without being counted (they would add nothing). Deciding per warpgroup costs
// one barrier of 128 threads per block; a 128-row gate would have to exchange maxima between the two
// warpgroups.
//
// V of a skipped block is loaded anyway (the producer does not wait for the gate): the consumer waits
// for it and releases the slot, which keeps the rings in step without any signal back to the producer.
// The alternative, the producer waiting for both warpgroups' verdicts before loading V, would put the
// gate's latency on the producer's path.
//
// Counters (GatedStats units: (b, h, gate tile, block) visits): the visible blocks and the candidates
// follow from the gate tile's geometry, the passed candidates are counted in a register (uniform across
// the warpgroup); one thread per item adds them to device memory: no host synchronisation.
//
// An open gate (threshold -inf) costs nothing per block where both gate tiles of the Q tile are open:
// the mainloop walks such an item with dense's loop (open()), without the gate's vote, barrier or branch
// per block. Otherwise both warpgroups take the gated walk, and a warpgroup whose own gate is open keeps
// every candidate without a vote.
#pragma once

#include <cstdint>

#include "cuda/attention/block_policy.cuh"
#include "cuda/attention/gate_geometry.hpp"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/scheduler.cuh"
#include "cuda/common/sync.cuh"

namespace sparse_attn::cuda_kernels {

inline constexpr int kGateRows = 64;  // rows of a gate tile: one consumer warpgroup's

/// What the launcher gives BlockMaxGate (a kernel argument of its own, after the tensor maps).
struct GateParams {
  const float* thresholds = nullptr;  // [Hq, T], strides in elements
  std::int64_t thr_stride[2] = {0, 0};
  int T = 1;
  float scale = 1.0f;  // softmax scale: the threshold is on scale * q.k, computed as the CPU does
  int sink_blocks = 0;
  int* kept_per_tile = nullptr;  // int32 [B, Hq, Tg] or null
  std::int64_t kept_stride[3] = {0, 0, 0};
  unsigned long long* counts64 = nullptr;  // the four counters of GatedStats, added to (one of these two)
  int* counts32 = nullptr;
  std::int64_t counts32_stride = 1;
};

/// The policy of dense and tile_sparse: every walked block is kept.
struct NoGate {
  static constexpr bool kEnabled = false;
  struct Params {};
  struct Staged {
    __device__ __forceinline__ void store(float (&)[2]) const {}
  };
  __device__ __forceinline__ static Staged stage(const Params&, const TileAttentionParams&, const WorkItem&) { return {}; }
  __device__ __forceinline__ void begin(const Params&, const TileAttentionParams&, const WorkItem&, int, const float (&)[2]) {}
  __device__ __forceinline__ constexpr bool keep(const Params&, const TileAttentionParams&, const float (&)[2], int,
                                                 int) {
    return true;
  }
  __device__ __forceinline__ void finish(const Params&, const TileAttentionParams&, const WorkItem&, int, int, bool) {}
};

struct BlockMaxGate {
  static constexpr bool kEnabled = true;
  using Params = GateParams;

  float threshold;  // this item's threshold; -inf: nothing to compare (every block kept)
  int key_end_first, key_end_last;  // visible key ends of the gate tile's first and last row below Lq
  bool exists;          // the gate tile has a row below Lq (else: nothing is counted or skipped)
  bool item_open;       // both gate tiles of the item are open (see open())
  bool row_in[2];       // the thread's two rows are below Lq
  int passed;           // candidates the gated walk let through

  /// The item's two thresholds (gate tiles 2 q_tile and 2 q_tile + 1, the last column of the table for
  /// tiles past it), loaded by the producer before it waits for the item's Q buffer and stored in shared
  /// memory beside the item's walk flag.
  struct Staged {
    float t[2];
    __device__ __forceinline__ void store(float (&dst)[2]) const { dst[0] = t[0], dst[1] = t[1]; }
  };
  __device__ __forceinline__ static Staged stage(const Params& g, const TileAttentionParams&, const WorkItem& w) {
    Staged s;
#pragma unroll
    for (int c = 0; c < 2; ++c)
      s.t[c] = __ldg(g.thresholds + w.head * g.thr_stride[0] + min(w.q_tile * 2 + c, g.T - 1) * g.thr_stride[1]);
    return s;
  }

  /// Per work item and consumer warpgroup: the geometry of its gate tile and its threshold (`staged`:
  /// the item's thresholds as the producer left them).
  __device__ __forceinline__ void begin(const Params& g, const TileAttentionParams& p, const WorkItem& w, int consumer,
                                        const float (&staged)[2]) {
    const int first_row = w.q_tile * kTileRows + consumer * kGateRows;
    const int last_row = min(first_row + kGateRows, p.Lq) - 1;
    exists = first_row < p.Lq;
    // Bottom-right causal: row i sees keys [0, clamp(i + Lk - Lq + 1, 0, Lk)).
    key_end_first = max(0, min(first_row + p.Lk - p.Lq + 1, p.Lk));
    key_end_last = max(0, min(last_row + p.Lk - p.Lq + 1, p.Lk));
    threshold = exists ? staged[consumer] : -INFINITY;
    // The Q tile's other gate tile (rows first_row -/+ 64): both warpgroups find the same item_open.
    const int other_first = w.q_tile * kTileRows + (1 - consumer) * kGateRows;
    item_open = (!exists || threshold == -INFINITY) && (other_first >= p.Lq || staged[1 - consumer] == -INFINITY);
    const int lane_row = first_row + 16 * ((static_cast<int>(threadIdx.x) % 128) / 32) + (static_cast<int>(threadIdx.x) % 32) / 4;
    row_in[0] = lane_row < p.Lq;
    row_in[1] = lane_row + 8 < p.Lq;
    passed = 0;
  }

  /// Whether the gate keeps every block of the item: both gate tiles of the Q tile have a threshold of
  /// -inf (or no row below Lq). The mainloop then walks the item as dense does, with no vote or branch
  /// per block, and finish() takes the counts from the geometry alone (gate_counts). Both warpgroups
  /// find the same answer, so they take the same walk.
  __device__ __forceinline__ bool open() const { return item_open; }

  /// Whether block j is kept; mx: the thread's share of its two rows' raw maxima over the block
  /// (OnlineSoftmax::thread_maxima<true>). Uniform across the warpgroup (every thread of it calls this
  /// for every block of the gated walk: the vote is a barrier).
  __device__ __forceinline__ bool keep(const Params& g, const TileAttentionParams& p, const float (&mx)[2], int j,
                                       int consumer) {
    if (!exists) return true;  // no row below Lq: nothing to skip or count
    if (j * kBlockKeys >= key_end_last) return false;  // no row of the gate tile sees the block
    if (j < g.sink_blocks || min((j + 1) * kBlockKeys, p.Lk) > key_end_first) return true;  // sink or diagonal
    if (threshold == -INFINITY) {  // this tile's gate is open, the other's is not: every candidate passes
      ++passed;
      return true;
    }
    // Skipped iff every thread's share of every row's maximum, scaled as the CPU scales each score, is
    // below the threshold (the scaling is monotone, so this is the tile maximum's test); a NaN share (a
    // NaN score) keeps it.
    const bool below = (!row_in[0] || mx[0] * g.scale < threshold) && (!row_in[1] || mx[1] * g.scale < threshold);
    const bool pass = !named_barrier_and(consumer == 0 ? NamedBarrier::kGateWG0 : NamedBarrier::kGateWG1, 128, below);
    passed += pass;
    return pass;
  }

  /// After the item's last block (or before an open walk, `open_walk`: every candidate passes): its
  /// counters to device memory (one thread of the warpgroup).
  __device__ __forceinline__ void finish(const Params& g, const TileAttentionParams& p, const WorkItem& w, int consumer,
                                         int thread, bool open_walk) {
    if (thread != 0 || !exists) return;
    int visible, candidates;
    gate_counts(key_end_first, key_end_last, p.Lk, g.sink_blocks, kBlockKeys, visible, candidates);
    if (open_walk) passed = candidates;
    const int kept = visible - candidates + passed;
    if (g.kept_per_tile != nullptr)
      g.kept_per_tile[w.b * g.kept_stride[0] + w.head * g.kept_stride[1] + (w.q_tile * 2 + consumer) * g.kept_stride[2]] = kept;
    if (visible == 0) return;
    if (g.counts64 != nullptr) {
      atomicAdd(g.counts64 + 0, static_cast<unsigned long long>(kept));
      atomicAdd(g.counts64 + 1, static_cast<unsigned long long>(visible));
      atomicAdd(g.counts64 + 2, static_cast<unsigned long long>(candidates));
      atomicAdd(g.counts64 + 3, static_cast<unsigned long long>(passed));
    } else {
      atomicAdd(g.counts32, kept);
      atomicAdd(g.counts32 + g.counts32_stride, visible);
      atomicAdd(g.counts32 + 2 * g.counts32_stride, candidates);
      atomicAdd(g.counts32 + 3 * g.counts32_stride, passed);
    }
  }
};

}  // namespace sparse_attn::cuda_kernels
