// The mask policy the mainloop asks: which KV blocks a work item visits, and which of them need the
// element mask. Dense and tile_sparse differ only here (dense lists every block), so both run the
// same mainloop. The producer and the consumers walk the same sequence, which keeps the K/V ring in
// step without any communication beyond the mbarriers.
//
// Validated calls (p.fault set) check each tile's list as the producer takes the item, before any of
// it is walked: a faulty list walks no block, and the consumers give its tile NaN rows and record the
// fault (mainloop.cuh; fault_word.hpp). The check runs on the producer thread only, which waits for
// ring slots most of the time; the recording (a spin lock and a dozen stores, more than the
// producer's 24 registers hold without spilling) is left to a consumer thread, off its path for valid
// items.
#pragma once

#include <cstdint>

#include "cuda/attention/params.hpp"
#include "cuda/common/fault_word.hpp"
#include "cuda/common/scheduler.cuh"

namespace sparse_attn::cuda_kernels {

inline constexpr int kTileRows = 128;  // queries per Q tile (docs/design.md §2)
inline constexpr int kBlockKeys = 128;  // keys per KV block

/// The first broken rule of a validated list as the producer found it (kind kNone: the list is valid),
/// with the values read: the slot (-1 for the count), the count or id there, the id before it.
struct FoundFault {
  ListFault kind;
  int slot, value, prev;
};

struct BlockPolicy {
  const std::int32_t* list = nullptr;  // ids of this tile's list (null for dense)
  std::int64_t list_stride = 1;        // elements between consecutive entries (idx stride 3)
  int begin = 0;                       // first position of the walk (a piece of a split unit starts later)
  int count = 0;                       // end of the walk: cnt, or Tk for dense, cut at the piece's end
  int Tk = 0;
  int last_visible_key = 0;            // keys past this are in every row's future (causal); Lk - 1 otherwise
  FoundFault fault{ListFault::kNone, 0, 0, 0};  // validated call, list breaks a rule: nothing is walked

  /// kCausal: p.causal; kValidate: p.fault != nullptr (the lists are checked). Both are known at compile
  /// time: each kernel instantiation serves one setting, so a trusted or dense launch carries none of
  /// the checking and recording code.
  template <bool kCausal, bool kValidate>
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
      // A trusted list's count is clamped so that it never reads past its row.
      bp.count = c < 0 ? 0 : (c > p.Kmax ? p.Kmax : c);
      if constexpr (kValidate) {
        bp.fault = check_list(p, bp.list, bp.list_stride, c);
        if (bp.fault.kind != ListFault::kNone) bp.count = 0;
      }
    }
    bp.begin = w.lo;
    bp.count = min(bp.count, w.hi);
    const int last_row = min((q_tile + 1) * kTileRows, p.Lq) - 1;
    bp.last_visible_key = kCausal ? min(last_row + (p.Lk - p.Lq), p.Lk - 1) : p.Lk - 1;
    return bp;
  }

  /// The first rule of the CPU's validation (detail::tile_row_message) that a list breaks: its count
  /// c as read in [0, Kmax], its first c ids in [0, Tk) and strictly ascending. Reads no id past the
  /// count, nor past Kmax. The ids are loaded kCheckBatch at a time, each batch's loads issued before
  /// any of them is used, so a list costs about c / kCheckBatch load latencies rather than c (the
  /// producer must be back at the K ring before the consumers drain it); the walk then reads them
  /// again from L1.
  static constexpr int kCheckBatch = 8;
  __device__ __forceinline__ static FoundFault check_list(const TileAttentionParams& p, const std::int32_t* list,
                                                          std::int64_t stride, int c) {
    if (c < 0 || c > p.Kmax) return {ListFault::kCount, -1, c, -1};
    int prev = -1;
    for (int s0 = 0; s0 < c; s0 += kCheckBatch) {
      int ids[kCheckBatch];
#pragma unroll
      for (int u = 0; u < kCheckBatch; ++u) ids[u] = s0 + u < c ? __ldg(list + (s0 + u) * stride) : 0;
#pragma unroll
      for (int u = 0; u < kCheckBatch; ++u) {
        const int s = s0 + u, j = ids[u];
        if (s >= c) break;
        if (j < 0 || j >= p.Tk) return {ListFault::kRange, s, j, prev};
        if (j <= prev) return {ListFault::kOrder, s, j, prev};
        prev = j;
      }
    }
    return {ListFault::kNone, 0, 0, 0};
  }

  /// Records `f`, found in the list of work item w, in the device's fault record, ordered as the CPU
  /// scans: tile (b, g, t) row-major, its count before its slots.
  __device__ __forceinline__ static void record(const TileAttentionParams& p, const FoundFault& f, const WorkItem& w) {
    const int g = w.head / p.heads_per_list, G = p.Hq / p.heads_per_list;
    const unsigned long long tile = (static_cast<unsigned long long>(w.b) * G + g) * p.Tq + w.q_tile;
    const unsigned long long position = tile * (static_cast<unsigned long long>(p.Kmax) + 1) + (f.slot + 1);
    record_list_fault(FaultSink{p.fault, p.fault_flag},
                      DeviceFault{(position << 2) | static_cast<unsigned>(f.kind), 0, f.kind, w.b, g, w.q_tile, f.slot,
                                  f.value, f.prev, p.Kmax, p.Tk});
  }

  /// Block id at position i of the walk, or -1 when it is skipped (entirely in the future, or an id
  /// out of range in a trusted list).
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
