// Phase 2 of query_sparse: per-block attention over gathered rows (combine.cu is phase 3).
//
// Persistent CTAs on Hopper, one per SM, warp-specialised. A work item is (bin, up to kRowsPerItem
// gathered (query, head) rows of it), cut into 64-row tiles; consecutive tiles go to consecutive
// consumer warpgroups. A bin is a KV block (in a band of queries when Params::bands > 1), or with
// merged slots (Params::win > 1) a piece: the blocks of one window that a query chose, the same for
// every row of the item.
//  - Producer warpgroup: one thread loads K and V by TMA into a two-slot ring (128B-swizzled, 128 keys
//    x D, rows past Lk read as zero): a single block once per item, a piece's blocks once per round of
//    up to kAttendConsumers tiles. Gather threads copy the Q rows of each tile with cp.async into the
//    owning consumer's next buffer (the 128B-swizzled layout TMA would write) and write the tile's row
//    metadata (the partial row of each Q row) and header (first K/V slot, the blocks, whether the
//    consumer releases the slots). Every global-memory latency of the gather (CSR entries, then Q rows)
//    is the producer's. Without merged slots all 128 threads gather and thread 0 loads K/V in the same
//    walk (`producer`); with them, two warps gather and one more thread loads K/V, each walking the
//    items on its own (`gather_walk`, `kv_walk`), so that a round waiting for ring stages does not
//    hold up the next tiles' gathers.
//  - Consumer warpgroups: per tile, S = Q K^T (SS wgmma) over the first block, its softmax and
//    O = P V with P from registers (RS wgmma); a piece's later blocks continue the online softmax in
//    64-key halves. Then the normalised partial and its LSE are written to the workspace. The Q buffer
//    is released after the last Q K, each K/V slot after its last P V.
// Every row is computed by the same instructions wherever it lands in a tile, so partials (and the
// combine's output) are bitwise identical run to run although the CSR order inside a bin is not.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/smem_limit.hpp"
#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/common/wgmma.cuh"
#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/partials.cuh"

namespace sparse_attn::cuda_kernels::qs {
namespace {

constexpr int kC = kAttendConsumers;
constexpr int kTileRowsQ = 64;  // rows of one consumer tile (one m64 wgmma row block)
// Consumer warpgroups + one producer warpgroup (a whole one, so that register reallocation, which works
// per warpgroup, can hand its registers to the consumers): 3 x 128 x 136 + 128 x 104 = 65536. A
// consumer needs S (64 f32) or P (32) with O (D / 2) and fits 136 without spills; the producer holds
// the CSR entries of two items' tiles (2 x kTilesPerItem) besides its addressing.
constexpr int kAttendThreads = 128 * (kC + 1);
constexpr std::uint32_t kConsumerRegs = 136;
constexpr std::uint32_t kProducerRegs = 104;
static_assert(kC == 3, "the register split above is for three consumer warpgroups");
constexpr int kKvStages = 2;
// The piece instantiation's producer: two gather warps and one K/V thread (see gather_walk).
constexpr int kGatherThreads = 64;
constexpr int kKvThread = 96;
constexpr int kQBuffers = 2;  // per consumer: the tile being computed and the next one's gather
constexpr std::uint32_t kKvHalfBytes = kKeys * 128;      // 128 keys x 64 columns of 16-bit
constexpr std::uint32_t kQHalfBytes = kTileRowsQ * 128;  // 64 rows x 64 columns of 16-bit
static_assert(kRowsPerItem % (kTileRowsQ * kC) == 0, "an item is whole rounds of tiles");
constexpr int kTilesPerItem = kRowsPerItem / kTileRowsQ;

// The CTA's items come from a work queue (Params::queue): every CTA takes the next item when it needs
// one, so CTAs that run faster take more and all finish within about an item of each other (a fixed
// split, items blockIdx.x + k * gridDim.x, left CTAs idle for up to 8 % of the phase). Items are taken
// in CSR order, so at any time the CTAs work on neighbouring blocks of one (b, group), as before. The
// n-th item a CTA takes is sm.ids[n % kIdRing]: the prologue takes positions 0 .. kIdAhead - 1, and at
// the top of its item n the taking thread (ItemQueue) writes position n + kIdAhead, taken an item
// earlier so that the atomic's latency hides behind the item. The walks read position n + 3 (the
// farthest item they load ahead) after a barrier of their threads, and the K/V walk of the piece kernel
// position m + 1 at its item m, written long before (the ring stage it waited for was released after
// tiles gathered later than that write).
constexpr int kIdRing = 16;
constexpr int kIdAhead = 5;

struct TileHeader {
  int kv_stage;
  unsigned kv_phase;
  int block;      // first KV block of the item's window (keys [128 j, 128 j + 128) for block j)
  unsigned mask;  // the item's blocks: bit t for block `block + t` (1 without merged slots)
  int last;       // one block: the consumer's last tile of the item, it releases the K/V slot
  int end;        // no more tiles for this consumer
  int kv_pos;     // pieces: ring position (count of K/V loads before it) of the first block
  int pad;
};

template <int D>
struct alignas(1024) AttendSmem {
  static constexpr int kHalves = D / 64;
  std::uint16_t k[kKvStages][kHalves][kKeys][64];
  std::uint16_t v[kKvStages][kHalves][kKeys][64];
  std::uint16_t q[kC][kQBuffers][kHalves][kTileRowsQ][64];
  int row_part[kC][kQBuffers][kTileRowsQ];  // partial row of each Q row; -1: padding
  TileHeader head[kC][kQBuffers];
  MBarrier kv_full[kKvStages], kv_empty[kKvStages];
  MBarrier q_full[kC][kQBuffers], q_empty[kC][kQBuffers];
  // Pieces: K/V loads issued so far, published by the K/V walk. Its gathers run ahead of the ring, so
  // a consumer can hold a tile whose block is two or more positions past the last load; a parity wait
  // on that stage would then see an older phase as the one it waits for. Consumers wait for the load
  // to be issued first (wait_issued).
  int kv_issued;
  int ids[kIdRing];  // the work queue's item ids, by position in the CTA's walk (ItemQueue)
};

template <int D>
constexpr std::size_t attend_smem_bytes() {
  return sizeof(AttendSmem<D>) + 1024;  // + alignment slack of the dynamic shared base
}
static_assert(attend_smem_bytes<128>() <= 227 * 1024, "shared memory over budget");

struct ItemInfo {
  int b = 0, g = 0, bg = 0;
  int j = 0;          // KV block, or the first block of the piece's window (merged slots)
  unsigned mask = 1;  // blocks j + t for the set bits t
  int e0 = 0;     // first CSR entry of the block
  int y = 0;      // first row of the item inside the block's rows
  int nrows = 0;  // rows of the item
};

// The loads behind an item's ItemInfo: its (block, first row) and the block's two CSR offsets. The
// producer issues them one and two items ahead and derives the ItemInfo only when it needs it, so their
// latency hides behind the current item's tiles.
struct ItemLoads {
  int2 it = make_int2(0, 0);
  int o0 = 0, o1 = 0;
};

// 32-bit arithmetic throughout: check_shape bounds B * Hkv * Tk, every CSR position and every partial
// row by INT_MAX, and a 64-bit division is a long subroutine (registers the producer does not have).
__device__ __forceinline__ ItemInfo item_info(const Params& p, const ItemLoads& l) {
  ItemInfo f;
  const int x = l.it.x;
  f.bg = x / p.bins;
  f.b = f.bg / p.Hkv;
  f.g = f.bg - f.b * p.Hkv;
  const int bin = x - f.bg * p.bins;
  if (p.win > 1) {
    f.j = (bin >> p.win) * p.win;
    f.mask = static_cast<unsigned>(bin) & ((1u << p.win) - 1u);
  } else {
    f.j = p.bands > 1 ? bin % p.Tk : bin;  // bin: band * Tk + block
  }
  f.e0 = l.o0;
  f.y = l.it.y;
  const int rows = (l.o1 - l.o0) * p.group - l.it.y;
  f.nrows = rows < kRowsPerItem ? rows : kRowsPerItem;
  return f;
}

// The taking thread's side of the work queue, and the walk's reads of the ids.
struct ItemQueue {
  int n = 0;     // position of the walk's current item
  int next = 0;  // taker: the id for position n + kIdAhead
  bool taker = false;

  template <class Smem>
  __device__ __forceinline__ void start(const Params& p, const Smem& sm, int n_items, bool is_taker) {
    taker = is_taker;
    if (taker) next = sm.ids[kIdAhead - 1] < n_items ? atomicAdd(p.queue, 1) : n_items;
  }
  /// Position `pos` of the walk (written before the caller's last barrier, or by the prologue).
  template <class Smem>
  __device__ __forceinline__ int id(const Smem& sm, int pos) const {
    return static_cast<const volatile int*>(sm.ids)[pos % kIdRing];
  }
  /// Position `pos` for the K/V walk, which meets the taker through the ring stages' barriers only: a
  /// shared-memory atomic, as the taker's write is (racecheck does not follow that chain).
  template <class Smem>
  __device__ __forceinline__ int id_unsynced(Smem& sm, int pos) const {
    return atomicAdd(&sm.ids[pos % kIdRing], 0);
  }
  /// At the top of item n: the taker publishes position n + kIdAhead and takes the next id (none once
  /// the queue is empty: it stays empty); the walk's `threads` threads meet; returns position n + 3.
  template <class Smem>
  __device__ __forceinline__ int top(const Params& p, Smem& sm, int n_items, std::uint32_t threads) {
    if (taker) {
      atomicExch(&sm.ids[(n + kIdAhead) % kIdRing], next);
      if (next < n_items) next = atomicAdd(p.queue, 1);
    }
    named_barrier_sync(NamedBarrier::kItemWalk, threads);
    return id(sm, n + 3);
  }
  /// The taker's end, once the walk has met an id past the queue: its takes have all returned (`next`
  /// is read), so when every CTA has counted itself here the last one empties the queue words for the
  /// next launch.
  __device__ __forceinline__ void finish(const Params& p) const {
    if (!taker) return;
    asm volatile("" ::"r"(next));
    __threadfence();
    if (atomicAdd(p.queue + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      p.queue[0] = 0;
      p.queue[1] = 0;
    }
  }
};

// The K/V walk publishes and the consumers read the count with shared-memory atomics, after and before
// a CTA fence: the count orders nothing but the parity waits, and atomics keep it out of racecheck's
// hazards.
__device__ __forceinline__ void publish_issued(int* at, int n) {
  __threadfence_block();
  atomicExch(at, n);
}

/// Returns once the K/V load of ring position `pos` has been issued (its full barrier armed). One lane
/// per warp polls, with a short sleep, so that waiting consumers leave the issue slots to the others.
__device__ __forceinline__ void wait_issued(int* at, int pos) {
  if ((threadIdx.x & 31) == 0)
    while (atomicAdd(at, 0) <= pos) __nanosleep(64);
  __syncwarp();
  __threadfence_block();
}

/// One arrival on `bar` once every cp.async this thread has issued so far has landed (counted in the
/// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(MBarrier& bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(&bar.word)) : "memory");
}

/// `count` arrivals at once (on behalf of consumers that have no tile in an item).
__device__ __forceinline__ void arrive_count(MBarrier& bar, std::uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(&bar.word)), "r"(count)
               : "memory");
}

// A tile's gather is done by the whole producer warpgroup: thread t copies row t / 2, 16-byte chunks
// (t % 2) + 2k, so the two threads of a row read 32 contiguous bytes per step.

/// CSR entry (query * Kq + slot) of the thread's row of a tile; -1 past the item.
__device__ __forceinline__ int row_entry(const Params& p, const ItemInfo& f, int tile, int t) {
  const int row = tile * kTileRowsQ + t / 2;
  return row < f.nrows ? p.entries[f.e0 + p.div_group.div(f.y + row)] : -1;
}

// The tile's Q rows into a swizzled buffer, and its partial rows ((bg, query, slot) entry times group
// plus the head). Chunk c of row r goes to half c / 8, position (c % 8) ^ (r % 8) of the row's 128
// bytes (TMA's SWIZZLE_128B pattern on a 1024-aligned base). Rows past the item are zero-filled
// (src-size 0) and get partial row -1.
// The rows are read under an evict-last policy (`policy`): the items run block by block within a (b,
// group), so every row of the group's Q is read Kq times while the group's items run, and the streamed
// partials (store_partials) should not push it out of L2 in between (docs/notes/kv_attention.md, cache
// hints).
template <int D>
__device__ __forceinline__ void gather_q(const Params& p, const ItemInfo& f, int tile, int ent, std::uint32_t buf,
                                         int* row_part, int t, std::uint64_t policy) {
  constexpr int kChunks = D / 8;
  const int r = t / 2;
  const int head = p.div_group.mod(f.y + tile * kTileRowsQ + r);
  const auto* src = static_cast<const std::uint16_t*>(p.q);
  int bytes = 0;
  if (ent >= 0) {
    src += f.b * p.q_stride[0] + p.div_kq.div(ent) * p.q_stride[1] + (f.g * p.group + head) * p.q_stride[2];
    bytes = 16;
  }
  if (t % 2 == 0) row_part[r] = ent >= 0 ? (f.bg * p.Lq * p.Kq + ent) * p.group + head : -1;
  const std::uint32_t dst_row = buf + r * 128;
#pragma unroll
  for (int k = 0; k < kChunks / 2; ++k) {
    const int cc = t % 2 + 2 * k;
    cp_async16_policy(dst_row + (cc / 8) * kQHalfBytes + (((cc % 8) ^ (r % 8)) * 16), src + (bytes ? cc * 8 : 0),
                      bytes, policy);
  }
}

/// One end-of-work tile per consumer after `produced[c]` tiles (two plain arrivals per gathering
/// thread: no copies).
template <int D>
__device__ __forceinline__ void end_of_work(AttendSmem<D>& sm, const int (&produced)[kC], int t) {
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int n = produced[c], b = n & 1;
    sm.q_empty[c][b].wait(((n >> 1) & 1u) ^ 1u);
    if (t == 0) sm.head[c][b].end = 1;
    sm.q_full[c][b].arrive();
    sm.q_full[c][b].arrive();
  }
}

/// ent[tile] without dynamic indexing (which would put the array in local memory).
__device__ __forceinline__ int entry_of(const int (&ent)[kTilesPerItem], int tile) {
  int e = ent[0];
#pragma unroll
  for (int k = 1; k < kTilesPerItem; ++k) e = tile == k ? ent[k] : e;
  return e;
}

/// CSR entry of row t of a tile (the piece producer's gather threads own one row each); -1 past the item.
__device__ __forceinline__ int row_entry_own(const Params& p, const ItemInfo& f, int tile, int t) {
  const int row = tile * kTileRowsQ + t;
  return row < f.nrows ? p.entries[f.e0 + p.div_group.div(f.y + row)] : -1;
}

template <int D>
__device__ __forceinline__ void gather_q_pairs(const Params& p, const ItemInfo& f, int tile, int ent, std::uint32_t buf,
                                         int* row_part, int t, std::uint64_t policy) {
  constexpr int kChunks = D / 8;
  const int head = p.div_group.mod(f.y + tile * kTileRowsQ + t);
  const auto* own = static_cast<const std::uint16_t*>(p.q);
  int own_bytes = 0;
  if (ent >= 0) {
    own += f.b * p.q_stride[0] + p.div_kq.div(ent) * p.q_stride[1] + (f.g * p.group + head) * p.q_stride[2];
    own_bytes = 16;
  }
  row_part[t] = ent >= 0 ? (f.bg * p.Lq * p.Kq + ent) * p.group + head : -1;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r = (t & ~1) | pass;
    const int lane = r % 32;
    const auto* src = reinterpret_cast<const std::uint16_t*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(own), lane));
    const int bytes = __shfl_sync(0xffffffffu, own_bytes, lane);
    const std::uint32_t dst_row = buf + r * 128;
#pragma unroll
    for (int k = 0; k < kChunks / 2; ++k) {
      const int cc = t % 2 + 2 * k;
      const std::uint32_t dst = dst_row + (cc / 8) * kQHalfBytes + (((cc % 8) ^ (r % 8)) * 16);
      cp_async16_policy(dst, src + (bytes ? cc * 8 : 0), bytes, policy);
    }
  }
}

// The producer warpgroup of the piece instantiation: warps 0-1 (kGatherThreads) gather each tile's Q
// rows and write its header; lane 0 of warp 3 loads K and V. The two walk the CTA's items (the ids the
// gather walk takes from the work queue, ItemQueue) independently and agree on the ring position of
// every load by counting them the same way, so neither waits for the other: the gathers run ahead as far
// as the Q buffers allow, the K/V loads as far as the ring allows. A single block takes one ring position
// per item; a piece takes one per block and round of up to kC tiles.

// The item walk of both producers. The CTA's n-th tile goes to consumer n % kC (next_consumer), so each
// buffer's barrier phases are waited for in order, and items of one tile spread over the consumers.
//
// Every global load of the walk is issued an item ahead of its use, so no tile waits on one: at the top
// of item n the walk issues the CSR entries of every tile of item n + 1 (entry(f, tile): one per thread
// and tile, held in registers), the CSR offsets of item n + 2 and the (bin, first row) of item n + 3.
// Only the first item's loads are waited for. body(f, ent) runs each item's tiles; thread 0 (t) takes
// the items from the work queue, and the walk's `threads` threads meet once per item.
template <int D, class Entry, class Body>
__device__ __forceinline__ void walk_items(const Params& p, AttendSmem<D>& sm, int n_items, int t,
                                           std::uint32_t threads, Entry&& entry, Body&& body) {
  ItemQueue queue;
  queue.start(p, sm, n_items, t == 0);
  int item = queue.id(sm, 0), item1 = queue.id(sm, 1), item2 = queue.id(sm, 2);
  const auto load_it = [&](int i) { return i < n_items ? p.items[i] : make_int2(0, 0); };
  const auto load_offsets = [&](ItemLoads& l, int i) {
    if (i < n_items) {
      l.o0 = p.offsets[l.it.x];
      l.o1 = p.offsets[l.it.x + 1];
    }
  };
  // The thread's CSR entry in every tile of an item (-1 past it, or for no item).
  const auto load_entries = [&](int (&ent)[kTilesPerItem], const ItemInfo& f, bool valid) {
#pragma unroll
    for (int k = 0; k < kTilesPerItem; ++k) ent[k] = valid ? entry(f, k) : -1;
  };
  if (item < n_items) {
    ItemLoads l1;  // item n + 1: landed at the top of item n
    l1.it = load_it(item);
    load_offsets(l1, item);
    ItemInfo f = item_info(p, l1);
    int ent_cur[kTilesPerItem];
    load_entries(ent_cur, f, true);
    l1.it = load_it(item1);
    load_offsets(l1, item1);
    int2 it2 = load_it(item2);  // item n + 2's (bin, first row)
    while (item < n_items) {
      const int item3 = queue.top(p, sm, n_items, threads);
      int ent_nxt[kTilesPerItem];
      load_entries(ent_nxt, item_info(p, l1), item1 < n_items);
      ItemLoads l2;
      l2.it = it2;
      load_offsets(l2, item2);
      const int2 it3 = load_it(item3);
      body(f, ent_cur);
      f = item_info(p, l1);  // derived again rather than held through the tiles: the producer is short of registers
#pragma unroll
      for (int k = 0; k < kTilesPerItem; ++k) ent_cur[k] = ent_nxt[k];
      l1 = l2;
      it2 = it3;
      item = item1;
      item1 = item2;
      item2 = item3;
      ++queue.n;
    }
  }
  queue.finish(p);
}

/// The consumer of the walk's next tile (in turn) and the count of tiles it had before (its buffer and
/// phase), without dynamic indexing of `produced`.
__device__ __forceinline__ int next_consumer(int& turn, int (&produced)[kC], int& n) {
  const int c = turn;
  turn = turn + 1 == kC ? 0 : turn + 1;
  n = 0;
#pragma unroll
  for (int i = 0; i < kC; ++i) {
    n = i == c ? produced[i] : n;
    produced[i] += i == c ? 1 : 0;
  }
  return c;
}

/// Hands the walk's next tile to the next consumer in turn: waits for that consumer's buffer, runs
/// gather(buffer, row_part) (the thread's cp.async copies and partial rows), arrives on the buffer's full
/// barrier once the copies land, and after thread 0 has written the tile's header (header(h)), once more.
template <int D, class Gather, class Header>
__device__ __forceinline__ void hand_out_tile(AttendSmem<D>& sm, int& turn, int (&produced)[kC], int t,
                                              Gather&& gather, Header&& header) {
  int n;
  const int c = next_consumer(turn, produced, n);
  const int b = n & 1;
  sm.q_empty[c][b].wait(((n >> 1) & 1u) ^ 1u);
  gather(smem_addr(&sm.q[c][b][0][0][0]), sm.row_part[c][b]);
  cp_async_arrive(sm.q_full[c][b]);
  if (t == 0) header(sm.head[c][b]);
  sm.q_full[c][b].arrive();
}

// The gather walk (threads t < kGatherThreads) of the piece instantiation (walk_items).
template <int D>
__device__ __forceinline__ void gather_walk(const Params& p, AttendSmem<D>& sm, int n_items, int t) {
  const std::uint64_t policy = evict_last_policy();
  int produced[kC] = {};  // tiles handed to each consumer so far
  int turn = 0;           // the consumer of the next tile
  PipelineState<kKvStages> kv;  // the ring position of the K/V walk's next load
  walk_items<D>(
      p, sm, n_items, t, kGatherThreads, [&](const ItemInfo& f, int tile) { return row_entry_own(p, f, tile, t); },
      [&](const ItemInfo& f, const int (&ent_cur)[kTilesPerItem]) {
        const int tiles = (f.nrows + kTileRowsQ - 1) / kTileRowsQ;
        const bool single = (f.mask & (f.mask - 1u)) == 0;
        const int per_round = single ? 1 : __popc(f.mask);
        int s = kv.stage();
        std::uint32_t ph = kv.phase();
        int pos = static_cast<int>(kv.count);
#pragma unroll 1
        for (int tile = 0; tile < tiles; ++tile) {
          // A piece's round starts at every kC-th tile with the ring position of its first block.
          if (!single && tile % kC == 0) {
            s = kv.stage();
            ph = kv.phase();
            pos = static_cast<int>(kv.count);
            for (int k = 0; k < per_round; ++k) kv.advance();
          }
          const int ent = entry_of(ent_cur, tile);
          // One block: loaded once for the item, released by each consumer after its last tile; a
          // piece's blocks: released after every tile's use.
          hand_out_tile(
              sm, turn, produced, t,
              [&](std::uint32_t buf, int* row_part) { gather_q_pairs<D>(p, f, tile, ent, buf, row_part, t, policy); },
              [&](TileHeader& h) {
                h = TileHeader{s, ph, f.j, f.mask, !single || tile + kC >= tiles, 0, pos, 0};
              });
        }
        if (single) kv.advance();
      });
  end_of_work(sm, produced, t);
}

/// One thread: block j of item f's (b, group) into K/V ring stage s (phase: the stage's current ring
/// phase) once the consumers have freed it, by TMA, with the releases of the `absent` consumers that
/// have no tile reading it at once.
template <int D>
__device__ __forceinline__ void load_kv_stage(AttendSmem<D>& sm, const CUtensorMap& tm_k, const CUtensorMap& tm_v, int s,
                                              std::uint32_t phase, const ItemInfo& f, int j, int absent) {
  constexpr int kHalves = D / 64;
  sm.kv_empty[s].wait(phase ^ 1u);
  sm.kv_full[s].arrive_expect_tx(2u * kHalves * kKvHalfBytes);
  for (int half = 0; half < kHalves; ++half) {
    tma_load_bhld(&sm.k[s][half][0][0], &tm_k, 64 * half, f.g, j * kKeys, f.b, &sm.kv_full[s].word);
    tma_load_bhld(&sm.v[s][half][0][0], &tm_v, 64 * half, f.g, j * kKeys, f.b, &sm.kv_full[s].word);
  }
  if (absent > 0) arrive_count(sm.kv_empty[s], 128u * static_cast<std::uint32_t>(absent));
}

// The K/V walk (one thread): per item, the single block once, or per round of up to kC tiles the
// piece's blocks in ascending order, each into the ring's next stage once the consumers have freed it,
// with the releases of the consumers that have no tile reading it (`absent`) at once, and the count of
// loads issued published after each (kv_issued). The next item's (bin, first row) and offsets are
// loaded an item ahead.
template <int D>
__device__ __forceinline__ void kv_walk(const Params& p, AttendSmem<D>& sm, const CUtensorMap& tm_k,
                                        const CUtensorMap& tm_v, int n_items) {
  tma_prefetch_descriptor(&tm_k);
  tma_prefetch_descriptor(&tm_v);
  ItemQueue queue;  // read only: the gather walk takes the items
  PipelineState<kKvStages> kv;
  const auto load = [&](const ItemInfo& f, int j, int absent) {
    load_kv_stage(sm, tm_k, tm_v, kv.stage(), kv.phase(), f, j, absent);
    kv.advance();
    publish_issued(&sm.kv_issued, static_cast<int>(kv.count));
  };
  ItemLoads next;
  int item = queue.id_unsynced(sm, 0);
  if (item < n_items) {
    next.it = p.items[item];
    next.o0 = p.offsets[next.it.x];
    next.o1 = p.offsets[next.it.x + 1];
  }
  for (; item < n_items; ++queue.n) {
    const ItemInfo f = item_info(p, next);
    item = queue.id_unsynced(sm, queue.n + 1);
    if (item < n_items) {
      next.it = p.items[item];
      next.o0 = p.offsets[next.it.x];
      next.o1 = p.offsets[next.it.x + 1];
    }
    const int tiles = (f.nrows + kTileRowsQ - 1) / kTileRowsQ;
    if ((f.mask & (f.mask - 1u)) != 0) {
#pragma unroll 1
      for (int r0 = 0; r0 < tiles; r0 += kC) {
        const int rt = tiles - r0 < kC ? tiles - r0 : kC;
#pragma unroll 1
        for (unsigned bits = f.mask; bits != 0; bits &= bits - 1u)
          load(f, f.j + __ffs(static_cast<int>(bits)) - 1, kC - rt);
      }
      continue;
    }
    load(f, f.j + __ffs(static_cast<int>(f.mask)) - 1, tiles < kC ? kC - tiles : 0);
  }
}

// The producer warpgroup of the single-block instantiation: all 128 threads walk the items and gather
// (walk_items); thread 0 also loads the items' K and V, one block per item.
template <int D>
__device__ __forceinline__ void producer(const Params& p, AttendSmem<D>& sm, const CUtensorMap& tm_k,
                                         const CUtensorMap& tm_v, int n_items, int t) {
  if (t == 0) {
    tma_prefetch_descriptor(&tm_k);
    tma_prefetch_descriptor(&tm_v);
  }
  const std::uint64_t policy = evict_last_policy();
  int produced[kC] = {};  // tiles handed to each consumer so far
  int turn = 0;           // the consumer of the next tile
  PipelineState<kKvStages> kv;
  walk_items<D>(
      p, sm, n_items, t, 128, [&](const ItemInfo& f, int tile) { return row_entry(p, f, tile, t); },
      [&](const ItemInfo& f, const int (&ent_cur)[kTilesPerItem]) {
        const int tiles = (f.nrows + kTileRowsQ - 1) / kTileRowsQ;
        // Block j into the ring's next stage (thread 0), with the releases of the `absent` consumers
        // that have no tile reading it, at once.
        const auto load_kv = [&](int j, int absent) {
          if (t == 0) load_kv_stage(sm, tm_k, tm_v, kv.stage(), kv.phase(), f, j, absent);
          kv.advance();
        };
        // Tile `tile` to the next consumer in turn: its Q rows and header. Consecutive tiles go to
        // consecutive consumers (across items too, so that items of one tile spread over all of them).
        const auto hand_out = [&](int tile, int kv_stage, std::uint32_t kv_phase, bool last) {
          const int ent = entry_of(ent_cur, tile);
          hand_out_tile(
              sm, turn, produced, t,
              [&](std::uint32_t buf, int* row_part) { gather_q<D>(p, f, tile, ent, buf, row_part, t, policy); },
              [&](TileHeader& h) { h = TileHeader{kv_stage, kv_phase, f.j, f.mask, last, 0, 0, 0}; });
        };
        // One block: loaded once for the whole item; each consumer releases it after its last tile.
        const int s = kv.stage();
        const std::uint32_t ph = kv.phase();
        load_kv(f.j + __ffs(static_cast<int>(f.mask)) - 1, tiles < kC ? kC - tiles : 0);
#pragma unroll 1
        for (int tile = 0; tile < tiles; ++tile) hand_out(tile, s, ph, tile + kC >= tiles);
      });
  end_of_work(sm, produced, t);
}

// The tile's normalised partial rows and their LSE (rows[r] < 0: padding, not stored). Streaming stores
// (st.global.cs): L2 evicts the partials first, keeping the Q rows that gather_q reads again.
template <class Part, int N>
__device__ __forceinline__ void store_partials(const Params& p, const int (&rows)[2], const float (&acc_o)[N],
                                               RowSoftmax& softmax, int q4) {
  constexpr int D = 2 * N;
  softmax.finish();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = softmax.normaliser(r);
    const float lse = softmax.lse(r, p.scale);
    if (rows[r] < 0) continue;
    auto* dst = static_cast<typename Part::Elem*>(p.part) + static_cast<long long>(rows[r]) * D;
    Part::put_row(dst, acc_o, r, inv, q4);
    if (q4 == 0) __stcs(p.lse_part + rows[r], lse);
  }
}

// The last key each of the thread's two rows may see (absolute index): Lk - 1, or under causal masking
// the query's diagonal if that comes first. Padding rows see everything (never stored).
__device__ __forceinline__ void row_limits(const Params& p, const int (&rows)[2], long long (&last)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    last[r] = p.Lk - 1;
    if (p.causal && rows[r] >= 0) {
      const int qi = p.div_lq.mod(p.div_kq.div(p.div_group.div(rows[r])));
      if (qi + p.offset < last[r]) last[r] = qi + p.offset;
    }
  }
}

// Helpers over a 64-row score fragment of N values per thread: 2N keys per row, value 4i + 2r + e at
// row r of the thread and key 8i + 2 q4 + e (wgmma.cuh gives the layout).

/// Keys past each row's last visible key (`last`, absolute) masked to -inf; key0 is the fragment's
/// first key.
template <int N>
__device__ __forceinline__ void mask_keys(float (&acc)[N], const long long (&last)[2], long long key0, int q4) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const long long rel = last[r] - key0;
    const int lim = rel < -1 ? -1 : rel > 2 * N - 1 ? 2 * N - 1 : static_cast<int>(rel);
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (8 * i + 2 * q4 + e > lim) acc[4 * i + 2 * r + e] = -INFINITY;
  }
}

/// S = Q K^T for the 128 keys of a stage (acc_s[64]) or, from a key-half's base, its 64 keys (acc_s[32]).
template <class Tag, int D, int N>
__device__ __forceinline__ void issue_qk(float (&acc_s)[N], std::uint32_t s_q, std::uint32_t s_k) {
  const std::uint64_t da = make_desc_sw128(s_q, 16, 1024), db = make_desc_sw128(s_k, 16, 1024);
  wgmma_ss_first<Tag>(acc_s, da, db);
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk)
    wgmma_ss<Tag>(acc_s, desc_advance(da, (kk / 4) * kQHalfBytes + (kk % 4) * 32),
                  desc_advance(db, (kk / 4) * kKvHalfBytes + (kk % 4) * 32), 1);
  wgmma_commit();
}

template <class Tag, int N>
__device__ __forceinline__ void issue_pv(float (&acc_o)[N], const std::uint32_t (&pa)[8][4], std::uint32_t s_v) {
  const std::uint64_t dv = make_desc_sw128(s_v, kKvHalfBytes, 1024);
  wgmma_rs_tb_first<Tag, N>(acc_o, pa[0], dv);
#pragma unroll
  for (int kk = 1; kk < 8; ++kk) wgmma_rs_tb<Tag>(acc_o, pa[kk], desc_advance(dv, kk * 16 * 128), 1);
  wgmma_commit();
}

template <class Tag, int N>
__device__ __forceinline__ void issue_pv_half(float (&acc_o)[N], const std::uint32_t (&pa)[4][4], std::uint32_t s_v) {
  const std::uint64_t dv = make_desc_sw128(s_v, kKvHalfBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<Tag>(acc_o, pa[kk], desc_advance(dv, kk * 16 * 128), 1);
  wgmma_commit();
}

// One tile: attention of its rows over the blocks of h.mask in ascending order (one block, or a merged
// piece of several). The first block runs whole: S of 128 keys, its softmax, and a P V that writes O,
// so nothing but S is live during its Q K. Later blocks (pieces only) continue the online softmax in
// two 64-key halves, so that S (32 registers) and the live O fit the consumer's registers. Each
// block's stage is released after its P V when the header says so (a piece's tiles always; a single
// block's last tile of each consumer), the Q buffer after the last Q K. The later blocks' P V always
// accumulate: a branch between an overwriting and an accumulating wgmma made ptxas serialise every
// wgmma of the kernel (C7520).
template <class Tag, int D, class Part, bool kPieces>
__device__ __forceinline__ void attend_tile(const Params& p, AttendSmem<D>& sm, int c, int b, const TileHeader& h,
                                           const int (&rows)[2], int q4) {
  constexpr std::uint32_t kHalfKeyBytes = 64 * 128;  // 64 keys of one 64-column half
  const std::uint32_t s_q = smem_addr(&sm.q[c][b][0][0][0]);
  int stage = h.kv_stage;
  std::uint32_t phase = h.kv_phase;
  int pos = h.kv_pos;
  unsigned bits = h.mask;
  int j = h.block + __ffs(static_cast<int>(bits)) - 1;
  bits &= bits - 1u;
  const auto release_stage = [&] {
    if (h.last) sm.kv_empty[stage].arrive();
    ++pos;
    if (++stage == kKvStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  if constexpr (kPieces) wait_issued(&sm.kv_issued, pos);
  sm.kv_full[stage].wait(phase);

  float acc_s[64];  // written by the first k-step (wgmma_ss_first): live only for the first block
  wgmma_fence();
  issue_qk<Tag, D>(acc_s, s_q, smem_addr(&sm.k[stage][0][0][0]));
  wgmma_wait<0>();
  fence_operands(acc_s);
  if (bits == 0) sm.q_empty[c][b].arrive();

  // Keys past Lk, and (causal) keys past the query's diagonal, are masked; only a block that reaches
  // past Lk, or any block under causal masking, can hold such keys. lim: the row's last visible key
  // relative to the block, clamped to [-1, 127]; padding rows (their Q is zero, so their scores are
  // finite) are never stored and need no mask.
  if (p.causal || static_cast<long long>(j + 1) * kKeys > p.Lk) {
    long long last[2];
    row_limits(p, rows, last);
    mask_keys(acc_s, last, static_cast<long long>(j) * kKeys, q4);
  }
  RowSoftmax softmax;
  softmax.first(acc_s, p.scale_log2);
  std::uint32_t pa[8][4];
  pack_a<Tag>(acc_s, pa);

  float acc_o[D / 2];
  wgmma_fence();
  issue_pv<Tag>(acc_o, pa, smem_addr(&sm.v[stage][0][0][0]));
  wgmma_wait<0>();
  fence_operands(acc_o);
  keep_live(pa);
  release_stage();

  while (kPieces && bits != 0) {
    j = h.block + __ffs(static_cast<int>(bits)) - 1;
    bits &= bits - 1u;
    wait_issued(&sm.kv_issued, pos);
    sm.kv_full[stage].wait(phase);
    const bool edge = p.causal || static_cast<long long>(j + 1) * kKeys > p.Lk;
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      float acc_h[32];
      wgmma_fence();
      issue_qk<Tag, D>(acc_h, s_q, smem_addr(&sm.k[stage][0][0][0]) + half * kHalfKeyBytes);
      wgmma_wait<0>();
      fence_operands(acc_h);
      if (bits == 0 && half == 1) sm.q_empty[c][b].arrive();
      if (edge) {
        long long last[2];
        row_limits(p, rows, last);
        mask_keys(acc_h, last, static_cast<long long>(j) * kKeys + 64 * half, q4);
      }
      float alpha[2];
      softmax.update(acc_h, p.scale_log2, alpha);
      RowSoftmax::rescale(acc_o, alpha);
      std::uint32_t ph[4][4];
      pack_a<Tag>(acc_h, ph);
      wgmma_fence();
      issue_pv_half<Tag>(acc_o, ph, smem_addr(&sm.v[stage][0][0][0]) + half * kHalfKeyBytes);
      wgmma_wait<0>();
      fence_operands(acc_o);
      keep_live(ph);
    }
    release_stage();
  }
  store_partials<Part>(p, rows, acc_o, softmax, q4);
}

template <class Tag, int D, class Part, bool kPieces>
__device__ __forceinline__ void consumer(const Params& p, AttendSmem<D>& sm, int c) {
  // The thread index is read here, after the register reallocation: values derived from it before the
  // role split would be carried across it, and ptxas spills them there.
  std::uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int t = static_cast<int>(tid % 128);
  const int warp = t / 32, g8 = (t % 32) / 4, q4 = t % 4;
  for (int n = 0;; ++n) {
    const int b = n & 1;
    sm.q_full[c][b].wait((n >> 1) & 1u);
    const TileHeader h = sm.head[c][b];
    if (h.end) break;
    const int rows[2] = {sm.row_part[c][b][16 * warp + g8], sm.row_part[c][b][16 * warp + g8 + 8]};
    fence_async_shared();  // the gathered rows (generic-proxy writes) before wgmma reads them
    attend_tile<Tag, D, Part, kPieces>(p, sm, c, b, h, rows, q4);
  }
}

// kPieces: the instantiation for merged slots (Params::win > 1), which carries the multi-block code;
// without merging the kernel runs the instantiation without it, whose registers and schedule are those
// of the single-block kernel.
template <class Tag, int D, class Part, bool kPieces>
__global__ void __launch_bounds__(kAttendThreads, 1)
    attend_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tm_k,
                  const __grid_constant__ CUtensorMap tm_v) {
  extern __shared__ std::uint8_t smem_raw[];
  // Aligned by an offset into the shared array (not by rounding a generic address), so that every access
  // through `sm` stays a 32-bit shared-window access.
  const std::uint32_t raw = smem_addr(smem_raw);
  auto& sm = *reinterpret_cast<AttendSmem<D>*>(smem_raw + ((1024u - (raw & 1023u)) & 1023u));
  const int tid = threadIdx.x;
  const int n_items = p.item_offsets[p.nblk];
  if (tid == 0) {
    for (int s = 0; s < kKvStages; ++s) {
      sm.kv_full[s].init(1);
      sm.kv_empty[s].init(128 * kC);  // every consumer thread arrives (the producer for absent ones)
    }
    for (int c = 0; c < kC; ++c)
      for (int b = 0; b < kQBuffers; ++b) {
        // per gathering producer thread: its copies landed + its metadata written
        sm.q_full[c][b].init(2 * (kPieces ? kGatherThreads : 128));
        sm.q_empty[c][b].init(128);
      }
    if constexpr (kPieces) sm.kv_issued = 0;
    // The first kIdAhead items of the walk, taken at once.
    const int first = atomicAdd(p.queue, kIdAhead);
    for (int k = 0; k < kIdAhead; ++k) sm.ids[k] = first + k;
    fence_barrier_init();
  }
  __syncthreads();
  if (tid >= 128 * kC) {
    warpgroup_reg_dealloc<kProducerRegs>();
    const int t = tid - 128 * kC;
    if constexpr (kPieces) {
      if (t < kGatherThreads)
        gather_walk<D>(p, sm, n_items, t);
      else if (t == kKvThread)
        kv_walk<D>(p, sm, tm_k, tm_v, n_items);
    } else {
      producer<D>(p, sm, tm_k, tm_v, n_items, t);
    }
  } else {
    warpgroup_reg_alloc<kConsumerRegs>();
    consumer<Tag, D, Part, kPieces>(p, sm, tid / 128);
  }
}

template <class T, int D, class Part>
struct AttendOp {
  static cudaError_t run(const Params& p, const CUtensorMap* tm_k, const CUtensorMap* tm_v, int ctas,
                         long long max_items, cudaStream_t stream) {
    auto* kernel = p.win > 1 ? attend_kernel<T, D, Part, true> : attend_kernel<T, D, Part, false>;
    constexpr std::size_t smem = attend_smem_bytes<D>();
    const long long grid = max_items < ctas ? max_items : ctas;
    return launch_with_smem(
        kernel, smem, [&] { kernel<<<static_cast<unsigned>(grid), kAttendThreads, smem, stream>>>(p, *tm_k, *tm_v); });
  }
};

}  // namespace

std::size_t attend_smem(int D) { return D == 128 ? attend_smem_bytes<128>() : attend_smem_bytes<64>(); }

cudaError_t launch_attend(const Params& p, bool bf16, int D, bool bf16_partials, const CUtensorMap* tm_k,
                          const CUtensorMap* tm_v, int ctas, long long max_items, cudaStream_t stream) {
  if (max_items <= 0) return cudaSuccess;
  Params q = p;
  q.div_group = FastDiv::make(p.group);
  q.div_kq = FastDiv::make(p.Kq);
  q.div_lq = FastDiv::make(p.Lq);
  return dispatch<AttendOp>(bf16, D, bf16_partials, q, tm_k, tm_v, ctas, max_items, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
