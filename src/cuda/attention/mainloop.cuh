// Producer and consumer mainloops of the Q-centric kernel.
//
// Producer (one thread of warpgroup 0): per work item, the Q tile (after the consumers released the
// previous one, with the gate's thresholds of the item where there is a gate), then for each block of the walk K and V into the next ring slot, each on its own
// mbarrier so QK can start while V is still in flight. The block id from the list is the TMA row
// coordinate; rows past Lk arrive as zeros. The producer alone reads the lists: it leaves each K slot's
// block id (and whether it ends the item) in shared memory, so the consumers' path has no global loads.
//
// Consumers (warpgroups 1 and 2, 64 query rows each of the same 128-row tile): S = Q K^T (SS wgmma),
// mask if the block straddles the diagonal or Lk, online softmax, O += P V with P from registers (RS
// wgmma), then release the slot; QK of the next block overlaps PV of the current one, and the two
// warpgroups take turns issuing (see consumer_loop). Both warpgroups read every K/V slot, so each
// selected block is loaded once for all 128 rows of the tile.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/attention/block_policy.cuh"
#include "cuda/attention/gate_policy.cuh"
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

// What the producer found for the item in a Q buffer.
enum ItemWalk : int {
  kNoBlocks = 0,   // nothing to visit: out = 0, lse = -inf
  kHasBlocks = 1,  // its blocks follow in the K/V rings
};

struct SlotBlock {
  int j;     // KV block id
  int last;  // nonzero: the last block the item visits
};

// [half][row][64]: the head dim in 64-column halves (one for D = 64, two for D = 128), each
// 1024-aligned (the swizzle atom); a half-row is one 128-byte swizzle row.
template <class Elem, int kHeadDim>
struct alignas(1024) SharedStorage {
  static constexpr int kHalves = kHeadDim / 64;
  Elem q[kQStages][kHalves][kTileRows][64];
  Elem k[kKStages][kHalves][kBlockKeys][64];
  Elem v[kVStages][kHalves][kBlockKeys][64];
  // The walk as the producer found it, so consumers never read the lists from global memory: per Q
  // buffer the item's ItemWalk, per K slot the block and whether it is the item's last. Written
  // before the slot's full barrier is armed, read after it completes, before the slot is released.
  int q_walk[kQStages];
  SlotBlock k_block[kKStages];
  // Per consumer warpgroup: the piece of a split unit whose arrival is pending, and the verdict of its
  // arrival (epilogue.cuh, arrive_piece).
  WorkItem piece_item[kConsumerWarpgroups];
  int piece_last[kConsumerWarpgroups];
  WorkItem combine_item[kConsumerWarpgroups];  // the unit whose pieces this warpgroup is to combine
  MBarrier q_full[kQStages], q_empty[kQStages];
  MBarrier k_full[kKStages], k_empty[kKStages];
  MBarrier v_full[kVStages], v_empty[kVStages];
  // Per Q buffer, the gate's thresholds of the item's two gate tiles (gate_policy.cuh; unused without a
  // gate), staged by the producer beside q_walk so that the consumers' path has no global load.
  float gate_threshold[kQStages][kConsumerWarpgroups];
};

inline constexpr std::uint32_t kHalfTileBytes = 64 * 128 * 2;  // one 64-column half of 128 rows, 16-bit
template <int kHeadDim>
inline constexpr std::uint32_t kTileBytes = kHeadDim / 64 * kHalfTileBytes;

template <class Elem, int kHeadDim, bool kCausal, class Gate>
__device__ __forceinline__ void producer_loop(const TileAttentionParams& p, const typename Gate::Params& gp,
                                              const StaticPersistentScheduler& sched,
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
    const BlockPolicy bp = BlockPolicy::make<kCausal>(p, w);
    int pos = bp.begin;
    int j = bp.next(pos);
    // An item without blocks loads no K, so the previous item's last V cannot wait for the next K: the
    // consumers need that V to finish the previous item, and with the TMA store they release its Q
    // buffer (which the item after this one waits for) only then.
    if (j < 0 && pend_j >= 0) load_pending_v();
    const int qst = qs.stage();
    const typename Gate::Staged staged = Gate::stage(gp, p, w);  // loads in flight during the wait
    sm.q_empty[qst].wait(qs.phase() ^ 1u);
    sm.q_walk[qst] = j >= 0 ? kHasBlocks : kNoBlocks;
    staged.store(sm.gate_threshold[qst]);
    sm.q_full[qst].arrive_expect_tx(kTileBytes<kHeadDim>);
    for (int half = 0; half < kHalves; ++half)
      tma_load_bhld(&sm.q[qst][half][0][0], tm_q, 64 * half, w.head, w.q_tile * kTileRows, w.b, &sm.q_full[qst].word);
    qs.advance();

    for (; j >= 0;) {
      const int j_next = bp.next(++pos);
      const int s = ks.stage();
      sm.k_empty[s].wait(ks.phase() ^ 1u);
      sm.k_block[s] = SlotBlock{j, j_next < 0};
      sm.k_full[s].arrive_expect_tx(kTileBytes<kHeadDim>);
      for (int half = 0; half < kHalves; ++half)
        tma_load_bhld(&sm.k[s][half][0][0], tm_k, 64 * half, kv_head, j * kBlockKeys, w.b, &sm.k_full[s].word);
      ks.advance();
      if (pend_j >= 0) load_pending_v();
      pend_j = j, pend_head = kv_head, pend_b = w.b;
      j = j_next;
    }
  }
  if (pend_j >= 0) load_pending_v();
}

template <class Tag, int kHeadDim, bool kCausal, bool kSplit, class Gate,
          class Transform = OnlineSoftmax>
__device__ __forceinline__ void consumer_loop(const TileAttentionParams& p, const typename Gate::Params& gp,
                                              const typename Transform::Params& tp,
                                              const StaticPersistentScheduler& sched,
                                              SharedStorage<typename Tag::Elem, kHeadDim>& sm, int consumer,
                                              int thread, const CUtensorMap* tm_out);

}  // namespace sparse_attn::cuda_kernels

#include "cuda/attention/epilogue.cuh"

namespace sparse_attn::cuda_kernels {

template <class Tag, int kHeadDim>
__device__ __forceinline__ void issue_qk(float (&acc_s)[64], std::uint32_t s_q, std::uint32_t s_k) {
  // k-step kk covers head-dim columns [16kk, 16kk + 16): half kk / 4, +32 B inside the swizzled row.
  const std::uint64_t da = make_desc_sw128(s_q, 16, 1024), db = make_desc_sw128(s_k, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const std::uint32_t off = (kk / 4) * kHalfTileBytes + (kk % 4) * 32;
    wgmma_ss<Tag>(acc_s, desc_advance(da, off), desc_advance(db, off), kk > 0);
  }
  wgmma_commit();
}

template <class Tag, int N>
__device__ __forceinline__ void issue_pv(float (&acc_o)[N], const std::uint32_t (&pa)[8][4], std::uint32_t s_v) {
  // B = V rows [16kk, 16kk + 16) x D head-dim columns, MN-major: LBO = the distance between the
  // 64-column halves (unused for D = 64), a k-step is 16 rows = 2048 B.
  const std::uint64_t dv = make_desc_sw128(s_v, kHalfTileBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) wgmma_rs_tb<Tag>(acc_o, pa[kk], desc_advance(dv, kk * 16 * 128), 1);
  wgmma_commit();
}

// Pingpong (FA3): the two consumer warpgroups take turns issuing their wgmmas, so the tensor cores run
// one warpgroup's GEMMs while the other does its softmax, instead of both contending at once and both
// idling the tensor cores during their softmax. Warpgroup c waits on its own barrier (its 128 threads
// plus the other warpgroup's 128 arrivals) and, once its wgmmas are issued, arrives on the other's.
//
// The same alternation guards each warpgroup's exponentials (ExpTurns): they keep the SFU (16 ex2 per SM
// per clock, 512 cycles for a warpgroup's 64 x 128 block) to one warpgroup at a time, so that a
// warpgroup's softmax does not run at half speed next to the other's.
template <NamedBarrier kTurn0, NamedBarrier kTurn1>
struct Turns {
  int consumer;
  __device__ __forceinline__ NamedBarrier mine() const { return consumer == 0 ? kTurn0 : kTurn1; }
  __device__ __forceinline__ NamedBarrier other() const { return consumer == 0 ? kTurn1 : kTurn0; }
  /// Warpgroup 0 takes the first turn: its own arrival stands in for the other's.
  __device__ __forceinline__ void init() const {
    if (consumer == 0) named_barrier_arrive(mine(), kConsumerThreads);
  }
  __device__ __forceinline__ void begin() const {
    named_barrier_sync(mine(), kConsumerThreads);
  }
  __device__ __forceinline__ void end() const {
    named_barrier_arrive(other(), kConsumerThreads);
  }
  /// Both warpgroups take the same number of turns; warpgroup 0 consumes the last arrival of
  /// warpgroup 1 so the barriers end balanced.
  __device__ __forceinline__ void finish() const {
    if (consumer == 0) named_barrier_sync(mine(), kConsumerThreads);
  }
};
using MmaTurns = Turns<NamedBarrier::kMmaTurnWG0, NamedBarrier::kMmaTurnWG1>;
using ExpTurns = Turns<NamedBarrier::kExpTurnWG0, NamedBarrier::kExpTurnWG1>;

// Intra-warpgroup overlap (FA3): while the tensor cores run O += P_i V_i, the warpgroup already has
// S_{i+1} = Q K_{i+1} in flight and does the softmax of block i + 1 as soon as that lands; the O
// rescale waits until PV has retired. K slots are released when their QK retires, V slots after their
// PV, and the Q buffer after the item's last QK (or, with the TMA store, once the staged output has
// been read).
//
// Items are chained: an item's last P V goes out in the same turn as the next item's first QK, and the
// item's epilogue runs after the next item's first softmax, so an item boundary costs no turn of its
// own and no exposed QK + softmax.
//
// kCausal and kSplit are p.causal and whether the launch has a split tail (p.tail_ctas > 0), fixed per
// instantiation: a kernel without them carries neither the causal mask nor the pieces' stores,
// arrivals and combine.
//
// Gate (gate_policy.cuh) decides after each QK whether the block leaves a trace; NoGate keeps all and
// its branches fold away. The gated walk takes no turns: the warpgroups gate independently, and a
// skipped block would take empty turns only to keep them paired. A skipped block's V slot is
// waited for and released without a P V. An item whose gates are both open (BlockMaxGate::open: a
// threshold of -inf) walks the NoGate loop with its turns, its counts written before the walk; both
// warpgroups take the same walk, so the turns stay paired.
//
// Transform turns a kept block's scores into P (OnlineSoftmax: softmax; entmax_transform.cuh: entmax
// with thresholds already known); its (m, l) are what the epilogue and the combine normalise by.
template <class Tag, int kHeadDim, bool kCausal, bool kSplit, class Gate, class Transform>
__device__ __forceinline__ void consumer_loop(const TileAttentionParams& p, const typename Gate::Params& gp,
                                              const typename Transform::Params& tp,
                                              const StaticPersistentScheduler& sched,
                                              SharedStorage<typename Tag::Elem, kHeadDim>& sm, int consumer,
                                              int thread, const CUtensorMap* tm_out) {
  constexpr int kHalves = kHeadDim / 64;
  // Every consumer thread arrives on the empty barriers (count kConsumerThreads): each has read the slot's
  // metadata (k_block, q_walk) that the producer overwrites once the barrier completes.
  const auto release = [&](MBarrier& bar) { bar.arrive(); };
  // Q buffer release. With the TMA store the buffer holds the staged output until the store has read
  // it: the storing thread arrives only after that read, so the buffer's phase cannot complete before
  // it. This happens once the next turn is issued (or before the next Q wait), so the wait for the read
  // rarely costs anything.
  int staged_q = -1;
  const auto release_staged_q = [&]() {
    if (staged_q < 0) return;
    if (thread == 0) tma_store_wait_read<0>();
    sm.q_empty[staged_q].arrive();
    staged_q = -1;
  };
  PipelineState<kQStages> qs;
  PipelineState<kKStages> ks;
  PipelineState<kVStages> vs;
  const auto k_addr = [&](int s) { return static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.k[s][0][0][0])); };
  const auto v_addr = [&](int s) { return static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.v[s][0][0][0])); };
  float acc_s[64];
  float acc_o[kHeadDim / 2];  // 64 x D output fragment of this warpgroup
  std::uint32_t pa[8][4];
  const MmaTurns turns{consumer};
  const ExpTurns exp_turns{consumer};

  Gate gate;
  // The item whose last P V has not been issued yet (pa holds its P unless the gate skipped its last
  // block: pending_kept false), and what its epilogue needs.
  bool pending = false, pending_kept = true;
  Transform done_softmax;
  WorkItem done_w{0, 0, 0};
  int done_qst = 0;
  // A piece of a split unit leaves its partial in the workspace at its epilogue; its arrival (a fence
  // and an atomic, a round trip to L2 that the warpgroup must wait for) is deferred to just after the
  // next wgmmas are issued, where the tensor cores have work while it completes. Where it completes its
  // unit, the combine is due: it runs at the next epilogue, a few columns at a time since accumulators
  // are live there (kTightGroup), or after the last item with all columns at once.
  constexpr int kTightGroup = 2, kRoomyGroup = kHeadDim / 8;
  bool arrival = false, combine_due = false;
  const auto settle_arrival = [&]() {
    if (!kSplit || !arrival) return;
    arrival = false;
    combine_due = arrive_piece(p, consumer, thread, sm.piece_item[consumer], sm.piece_last[consumer],
                               sm.combine_item[consumer]);
  };
  const auto run_combine = [&](auto group) {
    if (!kSplit || !combine_due) return;
    combine_due = false;
    combine_pieces<Tag, kHeadDim / 2, decltype(group)::value>(p, sm.combine_item[consumer], consumer, thread);
  };
  const auto epilogue = [&](const OnlineSoftmax& sm_state, const WorkItem& w, int qst) {
    const int first_row = w.q_tile * kTileRows + consumer * kRowsPerConsumer;
    settle_arrival();  // an earlier piece still pending (two epilogues in a row)
    run_combine(std::integral_constant<int, kTightGroup>{});
    if (kSplit && w.pieces > 1) {
      store_piece(p, acc_o, sm_state, w.slot, consumer, thread);
      if (thread == 0) sm.piece_item[consumer] = w;
      arrival = true;
      if (p.tma_store) sm.q_empty[qst].arrive();  // nothing staged: the Q buffer is free now
      return;
    }
    if (p.tma_store) {
      release_staged_q();  // two epilogues in a row (an item without blocks after a pending one)
      auto* tile = reinterpret_cast<std::uint8_t*>(&sm.q[qst][0][0][0]);
      stage_output<Tag, kHeadDim / 2>(acc_o, sm_state, thread, tile, consumer * kRowsPerConsumer);
      store_lse(p, sm_state, thread, w.b, w.head, first_row);
      fence_async_shared();  // this thread's staging writes -> visible to the TMA engine
      named_barrier_sync(consumer == 0 ? NamedBarrier::kEpilogueWG0 : NamedBarrier::kEpilogueWG1, 128);
      if (thread == 0) {
        for (int half = 0; half < kHalves; ++half)
          tma_store_bhld(tm_out, tile + half * kHalfTileBytes + consumer * kRowsPerConsumer * 128, 64 * half, w.head,
                         first_row, w.b);
        tma_store_commit();
      }
      staged_q = qst;
    } else {
      store_output<Tag, kHeadDim / 2>(p, acc_o, sm_state, thread, w.b, w.head, first_row);
    }
  };
  // Once the wait for the pending item's last P V has been issued: release its V slot, run its epilogue.
  const auto retire_pending = [&]() {
    fence_operands(acc_o);
    keep_live(pa);
    release(sm.v_empty[vs.stage()]);
    vs.advance();
    done_softmax.finish();
    epilogue(done_softmax, done_w, done_qst);
    pending = false;
  };
  // The pending item's last P V in a turn of its own, then its epilogue.
  const auto finish_pending = [&]() {
    if (!pending) return;
    sm.v_full[vs.stage()].wait(vs.phase());
    if (!Gate::kEnabled || pending_kept) {
      turns.begin();
      wgmma_fence();
      issue_pv<Tag>(acc_o, pa, v_addr(vs.stage()));
      turns.end();
      release_staged_q();
      settle_arrival();
      wgmma_wait<0>();
    } else {
      turns.begin();
      turns.end();
      release_staged_q();
      settle_arrival();
    }
    retire_pending();
  };

  turns.init();
  exp_turns.init();
  for (auto cur = sched.first(); sched.valid(cur); cur = sched.next(cur)) {
    const WorkItem w = sched.decode(cur);
    const int first_row = w.q_tile * kTileRows + consumer * kRowsPerConsumer;
    const int qst = qs.stage();
    // This warpgroup's 64 rows of the Q buffer: +8 KB inside each 16 KB half, 1024-aligned.
    const std::uint32_t s_q = static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.q[qst][0][0][0])) +
                              consumer * kRowsPerConsumer * 128;
    release_staged_q();  // the producer may be waiting for it before it can fill this item's Q
    sm.q_full[qst].wait(qs.phase());
    qs.advance();
    Transform softmax;
    softmax.start(tp, p, w.b, w.head, first_row, thread);

    const int walk = sm.q_walk[qst];
    gate.begin(gp, p, w, consumer, sm.gate_threshold[qst]);
    if (walk != kHasBlocks) {  // nothing to visit: out = 0, lse = -inf
      gate.finish(gp, p, w, consumer, thread, false);  // no blocks: no candidates
      finish_pending();
      if (!p.tma_store) sm.q_empty[qst].arrive();
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.0f;
      softmax.finish();
      epilogue(softmax, w, qst);
      continue;
    }

    // The item's walk. kGated: the gate decides per block; otherwise every block is kept and the loop is
    // dense's (NoGate, or an open gate: a threshold of -inf, whose counts follow from the geometry).
    bool kept;  // whether the item's last block is kept
    const auto walk_item = [&](auto gated) {
      constexpr bool kGated = decltype(gated)::value;
      // The gated walk takes no turns: the warpgroups gate independently, so a skipped block would take
      // empty turns only to stay paired (no slower without them, measured: docs/notes/gated.md).
      const auto turn_begin = [&] { if constexpr (!kGated) turns.begin(); };
      const auto turn_end = [&] { if constexpr (!kGated) turns.end(); };
      const auto exp_begin = [&] { if constexpr (!kGated) exp_turns.begin(); };
      const auto exp_end = [&] { if constexpr (!kGated) exp_turns.end(); };
      float factor[2];
      sm.k_full[ks.stage()].wait(ks.phase());
      const SlotBlock first = sm.k_block[ks.stage()];
      bool last = first.last != 0;
      // Block j's softmax, once its QK has retired: its K slot goes back, then the mask, the gate and
      // the online update (for the item's first block o starts at 0: no rescale follows). Returns
      // whether the block is kept.
      const auto softmax_block = [&](int j) {
        fence_operands(acc_s);
        release(sm.k_empty[ks.stage()]);
        ks.advance();
        if (BlockPolicy::needs_mask<kCausal>(p, j, first_row))
          OnlineSoftmax::apply_mask(acc_s, thread, first_row, j * kBlockKeys, p.Lk, kCausal, p.Lk - p.Lq);
        float mx[2];
        if constexpr (kGated) {
          // The vote needs only each thread's share of its rows' maxima (the warpgroup's AND covers the
          // quad), so a skipped block pays no shuffle; a kept one completes the maxima after the vote.
          // The verdict is the warpgroup's (a barrier vote); warp_uniform keeps the ring state merged
          // after the branch on it, and the wgmma descriptors built from that, in uniform registers.
          OnlineSoftmax::thread_maxima<true>(acc_s, mx);
          if (!warp_uniform(gate.keep(gp, p, mx, j, consumer))) return false;
          OnlineSoftmax::quad_maxima<true>(mx);
        } else {
          OnlineSoftmax::row_maxima<false>(acc_s, mx);
        }
        softmax.update(acc_s, mx, p.scale_log2, factor, exp_begin, exp_end);
        return true;
      };
      // Accumulator chunks (2kk, 2kk + 1) are exactly k-step kk's A fragment: no shuffles.
      const auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[kk][r] = Tag::pack(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
      };
      // Straight-line paths: a wgmma group issued under a condition makes ptxas serialise them all.
      // The QK of block j alone, in a turn of its own: the item's first block with nothing pending, or
      // where the block before it was skipped by the gate (its V slot is waited for and released all
      // the same).
      // `meanwhile` runs while the QK is in flight (after a skipped block: the release of its V slot).
      const auto qk_alone = [&](int j, auto meanwhile) {
        turn_begin();
        wgmma_fence();
        issue_qk<Tag, kHeadDim>(acc_s, s_q, k_addr(ks.stage()));
        turn_end();
        release_staged_q();
        settle_arrival();
        meanwhile();
        wgmma_wait<0>();
        return softmax_block(j);
      };
      const auto nothing = [] {};
      if (pending && (!Gate::kEnabled || pending_kept)) {
        sm.v_full[vs.stage()].wait(vs.phase());
        turn_begin();
        wgmma_fence();
        issue_qk<Tag, kHeadDim>(acc_s, s_q, k_addr(ks.stage()));
        issue_pv<Tag>(acc_o, pa, v_addr(vs.stage()));  // the previous item's last P V
        turn_end();
        release_staged_q();
        settle_arrival();
        wgmma_wait<1>();
        kept = softmax_block(first.j);
        wgmma_wait<0>();
        retire_pending();
      } else if (pending) {
        sm.v_full[vs.stage()].wait(vs.phase());
        kept = qk_alone(first.j, nothing);
        retire_pending();
      } else {
        kept = qk_alone(first.j, nothing);
      }
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) acc_o[i] = 0.0f;
      if (!kGated || kept) pack_p();

      // Steady state: one turn per further block (none in the gated walk), QK of the next block and P V
      // of the current one (QK alone where the gate skipped the current one).
      while (!last) {
        sm.k_full[ks.stage()].wait(ks.phase());
        const SlotBlock nb = sm.k_block[ks.stage()];
        last = nb.last != 0;
        bool next_kept;
        if (!kGated || kept) {
          sm.v_full[vs.stage()].wait(vs.phase());
          turn_begin();
          wgmma_fence();
          issue_qk<Tag, kHeadDim>(acc_s, s_q, k_addr(ks.stage()));
          issue_pv<Tag>(acc_o, pa, v_addr(vs.stage()));
          turn_end();
          release_staged_q();
          settle_arrival();
          wgmma_wait<1>();  // S_{i+1} has landed; P_i V_i may still run
          next_kept = softmax_block(nb.j);
          wgmma_wait<0>();
          fence_operands(acc_o);
          keep_live(pa);
          release(sm.v_empty[vs.stage()]);
          vs.advance();
        } else {
          // The skipped block's V slot: waited for and released while the next QK runs, so the producer
          // may refill it before the vote.
          next_kept = qk_alone(nb.j, [&] {
            sm.v_full[vs.stage()].wait(vs.phase());
            release(sm.v_empty[vs.stage()]);
            vs.advance();
          });
        }
        kept = next_kept;
        if (!kGated || kept) {
          Transform::rescale(acc_o, factor);
          pack_p();
        }
      }
    };
    if constexpr (Gate::kEnabled) {
      // open() is the same in both warpgroups (warp_uniform: see softmax_block).
      if (warp_uniform(gate.open())) {  // the counts are known before the walk
        gate.finish(gp, p, w, consumer, thread, true);
        walk_item(std::false_type{});
      } else {
        walk_item(std::true_type{});
        gate.finish(gp, p, w, consumer, thread, false);
      }
    } else {
      walk_item(std::false_type{});
    }
    // Every QK of the item has retired: unless the output is staged there, the Q buffer may take the
    // item after next.
    if (!p.tma_store) sm.q_empty[qst].arrive();
    pending = true;
    pending_kept = kept;
    done_softmax = softmax;
    done_w = w;
    done_qst = qst;
  }
  finish_pending();
  release_staged_q();
  settle_arrival();
  run_combine(std::integral_constant<int, kRoomyGroup>{});
  turns.finish();
  exp_turns.finish();
}

}  // namespace sparse_attn::cuda_kernels
