// Producer and consumer mainloops of the Q-centric kernel.
//
// Producer (one thread of warpgroup 0): per work item, the Q tile (after the consumers released the
// previous one), then for each block of the walk K and V into the next ring slot, each on its own
// mbarrier so QK can start while V is still in flight. The block id from the list is the TMA row
// coordinate; rows past Lk arrive as zeros.
//
// Consumers (warpgroups 1 and 2, 64 query rows each of the same 128-row tile): S = Q K^T (SS wgmma),
// mask if the block straddles the diagonal or Lk, online softmax, O += P V with P from registers (RS
// wgmma), then release the slot; QK of the next block overlaps PV of the current one, and the two
// warpgroups take turns issuing (see consumer_loop). Both warpgroups read every K/V slot, so each
// selected block is loaded once for all 128 rows of the tile.
#pragma once

#include <cstdint>

#include "cuda/attention/block_policy.cuh"
#include "cuda/attention/params.hpp"
#include "cuda/attention/softmax.cuh"
#include "cuda/common/scheduler.cuh"
#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/common/wgmma.cuh"

namespace sparse_attn::cuda_kernels {

inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
inline constexpr int kRowsPerConsumer = kTileRows / kConsumerWarpgroups;  // 64: one m64 wgmma row block

// Ring depths. Two Q buffers let the next item's Q tile land while the current item runs, so a work
// item of 16 blocks (tile16) does not start by waiting for its Q. K and V have rings of their own: a K
// slot is released as soon as its QK retires and a V slot after its PV, and the producer loads K one
// block ahead of V, so 3 K slots give QK two blocks of lead and 2 V slots give PV one. At D = 128 this is
// 2 x 32 + 3 x 32 + 2 x 32 = 224 KB of the 227 KB a CTA may have.
inline constexpr int kQStages = 2;
inline constexpr int kKStages = 3;
inline constexpr int kVStages = 2;

// [half][row][64]: the head dim in 64-column halves (one for D = 64, two for D = 128), each
// 1024-aligned (the swizzle atom); a half-row is one 128-byte swizzle row.
template <class Elem, int kHeadDim>
struct alignas(1024) SharedStorage {
  static constexpr int kHalves = kHeadDim / 64;
  Elem q[kQStages][kHalves][kTileRows][64];
  Elem k[kKStages][kHalves][kBlockKeys][64];
  Elem v[kVStages][kHalves][kBlockKeys][64];
  MBarrier q_full[kQStages], q_empty[kQStages];
  MBarrier k_full[kKStages], k_empty[kKStages];
  MBarrier v_full[kVStages], v_empty[kVStages];
};

inline constexpr std::uint32_t kHalfTileBytes = 64 * 128 * 2;  // one 64-column half of 128 rows, 16-bit
template <int kHeadDim>
inline constexpr std::uint32_t kTileBytes = kHeadDim / 64 * kHalfTileBytes;

template <class Elem, int kHeadDim>
__device__ __forceinline__ void producer_loop(const TileAttentionParams& p, const StaticPersistentScheduler& sched,
                                              SharedStorage<Elem, kHeadDim>& sm, const CUtensorMap* tm_q,
                                              const CUtensorMap* tm_k, const CUtensorMap* tm_v) {
  constexpr int kHalves = kHeadDim / 64;
  PipelineState<kQStages> qs;
  PipelineState<kKStages> ks;
  PipelineState<kVStages> vs;
  // V of the block whose K went last: it is loaded after the next K (of this item or the next one), so
  // K runs one block ahead of V in both rings.
  int pend_j = -1, pend_head = 0, pend_b = 0;
  const auto load_pending_v = [&]() {
    const int s = vs.stage();
    sm.v_empty[s].wait(vs.phase() ^ 1u);
    sm.v_full[s].arrive_expect_tx(kTileBytes<kHeadDim>);
    for (int half = 0; half < kHalves; ++half)
      tma_load_bhld(&sm.v[s][half][0][0], tm_v, 64 * half, pend_head, pend_j * kBlockKeys, pend_b, &sm.v_full[s].word);
    vs.advance();
    pend_j = -1;
  };
  for (auto cur = sched.first(); sched.valid(cur); cur = sched.next(cur)) {
    const WorkItem w = sched.decode(cur);
    const int kv_head = w.head / p.group_size;
    const int qst = qs.stage();
    sm.q_empty[qst].wait(qs.phase() ^ 1u);
    sm.q_full[qst].arrive_expect_tx(kTileBytes<kHeadDim>);
    for (int half = 0; half < kHalves; ++half)
      tma_load_bhld(&sm.q[qst][half][0][0], tm_q, 64 * half, w.head, w.q_tile * kTileRows, w.b, &sm.q_full[qst].word);
    qs.advance();

    const BlockPolicy bp = BlockPolicy::make(p, w.b, w.q_tile, w.head);
    for (int i = 0; i < bp.count; ++i) {
      const int j = bp.block(i);
      if (j < 0) continue;
      const int s = ks.stage();
      sm.k_empty[s].wait(ks.phase() ^ 1u);
      sm.k_full[s].arrive_expect_tx(kTileBytes<kHeadDim>);
      for (int half = 0; half < kHalves; ++half)
        tma_load_bhld(&sm.k[s][half][0][0], tm_k, 64 * half, kv_head, j * kBlockKeys, w.b, &sm.k_full[s].word);
      ks.advance();
      if (pend_j >= 0) load_pending_v();
      pend_j = j, pend_head = kv_head, pend_b = w.b;
    }
  }
  if (pend_j >= 0) load_pending_v();
}

template <class Tag, int kHeadDim>
__device__ __forceinline__ void consumer_loop(const TileAttentionParams& p, const StaticPersistentScheduler& sched,
                                              SharedStorage<typename Tag::Elem, kHeadDim>& sm, int consumer,
                                              int thread);

}  // namespace sparse_attn::cuda_kernels

#include "cuda/attention/epilogue.cuh"

namespace sparse_attn::cuda_kernels {

template <class Tag, int kHeadDim>
__device__ __forceinline__ void issue_qk(float (&acc_s)[64], std::uint32_t s_q, std::uint32_t s_k) {
  // k-step kk covers head-dim columns [16kk, 16kk + 16): half kk / 4, +32 B inside the swizzled row.
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk)
    wgmma_ss<Tag>(acc_s, make_desc_sw128(s_q + (kk / 4) * kHalfTileBytes + (kk % 4) * 32, 16, 1024),
                  make_desc_sw128(s_k + (kk / 4) * kHalfTileBytes + (kk % 4) * 32, 16, 1024), kk > 0);
  wgmma_commit();
}

template <class Tag, int N>
__device__ __forceinline__ void issue_pv(float (&acc_o)[N], const std::uint32_t (&pa)[8][4], std::uint32_t s_v) {
  // B = V rows [16kk, 16kk + 16) x D head-dim columns, MN-major: LBO = the distance between the
  // 64-column halves (unused for D = 64), a k-step is 16 rows = 2048 B.
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_rs_tb<Tag>(acc_o, pa[kk], make_desc_sw128(s_v + kk * 16 * 128, kHalfTileBytes, 1024), 1);
  wgmma_commit();
}

template <class Tag>
__device__ __forceinline__ void scores_to_p(const TileAttentionParams& p, float (&acc_s)[64], OnlineSoftmax& softmax,
                                            float (&factor)[2], std::uint32_t (&pa)[8][4], int j, int first_row,
                                            int thread) {
  if (BlockPolicy::needs_mask(p, j, first_row))
    OnlineSoftmax::apply_mask(acc_s, thread, first_row, j * kBlockKeys, p.Lk, p.causal, p.Lk - p.Lq);
  softmax.update(acc_s, p.scale_log2, factor);
  // Accumulator chunks (2kk, 2kk + 1) are exactly k-step kk's A fragment: no shuffles.
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = Tag::pack(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
}

template <class Tag>
__device__ __forceinline__ void scores_to_p_keep(const TileAttentionParams& p, float (&acc_s)[64],
                                                 OnlineSoftmax& softmax, float (&factor)[2], int j, int first_row,
                                                 int thread) {
  if (BlockPolicy::needs_mask(p, j, first_row))
    OnlineSoftmax::apply_mask(acc_s, thread, first_row, j * kBlockKeys, p.Lk, p.causal, p.Lk - p.Lq);
  softmax.update(acc_s, p.scale_log2, factor);
}

// Pingpong (FA3): the two consumer warpgroups take turns issuing their wgmmas, so the tensor cores run
// one warpgroup's GEMMs while the other does its softmax, instead of both contending at once and both
// idling the tensor cores during their softmax. Warpgroup c waits on its own barrier (its 128 threads
// plus the other warpgroup's 128 arrivals) and, once its wgmmas are issued, arrives on the other's.
struct MmaTurns {
  bool enabled;
  int consumer;
  __device__ __forceinline__ NamedBarrier mine() const {
    return consumer == 0 ? NamedBarrier::kMmaTurnWG0 : NamedBarrier::kMmaTurnWG1;
  }
  __device__ __forceinline__ NamedBarrier other() const {
    return consumer == 0 ? NamedBarrier::kMmaTurnWG1 : NamedBarrier::kMmaTurnWG0;
  }
  /// Warpgroup 0 takes the first turn: its own arrival stands in for the other's.
  __device__ __forceinline__ void init() const {
    if (enabled && consumer == 0) named_barrier_arrive(mine(), kConsumerThreads);
  }
  __device__ __forceinline__ void begin() const {
    if (enabled) named_barrier_sync(mine(), kConsumerThreads);
  }
  __device__ __forceinline__ void end() const {
    if (enabled) named_barrier_arrive(other(), kConsumerThreads);
  }
  /// Both warpgroups take the same number of turns; warpgroup 0 consumes the last arrival of
  /// warpgroup 1 so the barriers end balanced.
  __device__ __forceinline__ void finish() const {
    if (enabled && consumer == 0) named_barrier_sync(mine(), kConsumerThreads);
  }
};

// Intra-warpgroup overlap (FA3): while the tensor cores run O += P_i V_i, the warpgroup already has
// S_{i+1} = Q K_{i+1} in flight and does the softmax of block i + 1 as soon as that lands; the O
// rescale waits until PV has retired. K slots are released when their QK retires, V slots after their
// PV, and the Q buffer after the item's last QK.
template <class Tag, int kHeadDim>
__device__ __forceinline__ void consumer_loop(const TileAttentionParams& p, const StaticPersistentScheduler& sched,
                                              SharedStorage<typename Tag::Elem, kHeadDim>& sm, int consumer,
                                              int thread) {
  PipelineState<kQStages> qs;
  PipelineState<kKStages> ks;
  PipelineState<kVStages> vs;
  const auto k_addr = [&](int s) { return static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.k[s][0][0][0])); };
  const auto v_addr = [&](int s) { return static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.v[s][0][0][0])); };
  float acc_s[64];
  float acc_o[kHeadDim / 2];  // 64 x D output fragment of this warpgroup
  std::uint32_t pa[8][4];
  const MmaTurns turns{p.pingpong, consumer};
  turns.init();
  for (auto cur = sched.first(); sched.valid(cur); cur = sched.next(cur)) {
    const WorkItem w = sched.decode(cur);
    const int first_row = w.q_tile * kTileRows + consumer * kRowsPerConsumer;
    const BlockPolicy bp = BlockPolicy::make(p, w.b, w.q_tile, w.head);
    OnlineSoftmax softmax;
    softmax.reset();
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.0f;
    const int qst = qs.stage();
    // This warpgroup's 64 rows of the Q buffer: +8 KB inside each 16 KB half, 1024-aligned.
    const std::uint32_t s_q = static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.q[qst][0][0][0])) +
                              consumer * kRowsPerConsumer * 128;
    sm.q_full[qst].wait(qs.phase());

    int pos = 0;
    int j = bp.next(pos);
    if (j >= 0) {
      float factor[2];
      sm.k_full[ks.stage()].wait(ks.phase());
      turns.begin();
      wgmma_fence();
      issue_qk<Tag, kHeadDim>(acc_s, s_q, k_addr(ks.stage()));
      turns.end();
      wgmma_wait<0>();
      fence_operands(acc_s);
      sm.k_empty[ks.stage()].arrive();
      ks.advance();
      scores_to_p<Tag>(p, acc_s, softmax, factor, pa, j, first_row, thread);  // o is 0: no rescale needed
      // Steady state: one iteration per further block. The last block's PV is peeled off below, so the
      // commit groups inside the loop are unconditional and wait<1> always retires the QK group.
      for (int j_next = bp.next(++pos); j_next >= 0; j_next = bp.next(++pos)) {
        sm.k_full[ks.stage()].wait(ks.phase());
        sm.v_full[vs.stage()].wait(vs.phase());
        turns.begin();
        wgmma_fence();
        issue_qk<Tag, kHeadDim>(acc_s, s_q, k_addr(ks.stage()));
        issue_pv<Tag>(acc_o, pa, v_addr(vs.stage()));
        turns.end();
        wgmma_wait<1>();  // S_{i+1} has landed; P_i V_i may still run
        fence_operands(acc_s);
        sm.k_empty[ks.stage()].arrive();
        ks.advance();
        scores_to_p_keep<Tag>(p, acc_s, softmax, factor, j_next, first_row, thread);
        wgmma_wait<0>();
        fence_operands(acc_o);
        keep_live(pa);
        sm.v_empty[vs.stage()].arrive();
        vs.advance();
        OnlineSoftmax::rescale(acc_o, factor);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[kk][r] = Tag::pack(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
      }
      // Every QK of the item has retired: the Q buffer may take the item after next.
      sm.q_empty[qst].arrive();
      sm.v_full[vs.stage()].wait(vs.phase());
      turns.begin();
      wgmma_fence();
      issue_pv<Tag>(acc_o, pa, v_addr(vs.stage()));
      turns.end();
      wgmma_wait<0>();
      fence_operands(acc_o);
      keep_live(pa);
      sm.v_empty[vs.stage()].arrive();
      vs.advance();
    } else {
      sm.q_empty[qst].arrive();  // nothing to visit: out = 0, lse = -inf
    }
    qs.advance();
    softmax.finish();
    store_output<Tag, kHeadDim / 2>(p, acc_o, softmax, thread, w.b, w.head, first_row);
  }
  turns.finish();
}

}  // namespace sparse_attn::cuda_kernels
