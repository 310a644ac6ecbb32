// MSA-style token-max selector on the GPU (docs/design.md §5.7), version 3: tensor-core screening with an
// exact float64 decision at the boundary. Kernels on the caller's stream:
//  1. prepare (tc_index.cuh), one launch for both index tensors after one for their amax words (fp8,
//     fp4): for every index row the bf16 codes (exact: value = code * scale up to rounding) and an upper
//     bound of the code row's norm, maxed per 128 rows (Q tile, KV block);
//  2. screen: the 128 query code rows of a Q tile times each KV block's 128 key code rows in bf16 with
//     float32 accumulation, keeping per visible (query, block) the max over the block's keys; TileLists
//     also max over the tile's queries (as partial maxima per consumer warp, maxed by the decision).
//     Only these maxima reach memory, never the [Lq, Lk] scores. The kernel is warp-specialised (TMA
//     producer, wgmma consumers: screen_ws_kernel);
//  3. decide: per list, every candidate gets an interval [lo, hi] that provably holds its exact
//     (CPU) score (tc_index.cuh: score_interval). A block that at most k - 1 others can rank before is
//     in; one that at least k others certainly rank before is out; the rest are undecided. A list
//     without undecided blocks is written here;
//  4. rescore: the undecided (list, block) pairs, queued by (3), get their exact block score: the
//     float64 dots of the dequantised values (recomputed from the inputs as the CPU computes them) in d order (products of floats are exact in float64, so
//     fma equals the CPU's multiply-add) maxed over the visible keys (and the tile's queries), NaN as
//     -inf; spread over the grid in units of 16 queries x 32 keys (TileLists; one query x 128 keys for
//     QueryLists) with the values staged as doubles, combined by an atomic max on an order-preserving
//     integer encoding;
//  5. finish: lists with undecided blocks rank (class, exact score, id) and are written.
// Each launch after the first is a programmatic dependent of the one before (chain_start).
//
// Why the ids equal the CPU's: let T be the CPU's top-k set under its strict total order (score
// descending, id ascending; reserved blocks score +inf), and let every candidate's exact score lie in
// its interval. If fewer than k candidates can possibly rank before j, fewer than k do, so j is in T;
// if k candidates certainly rank before j, j is not in T. So IN is a subset of T, T is a subset of
// IN + UNDECIDED, and T minus IN is exactly the best k - |IN| undecided blocks under the exact order,
// because every member of T ranks before every non-member. Step 5 picks IN first, then the undecided by
// exact score (ties to the lower id), never an OUT block; when no block is undecided, T = IN.
// "Can rank before": hi_i > lo_j, or hi_i == lo_j and i < j; "certainly": lo_i > hi_j, or lo_i == hi_j
// and i < j (equal bounds force equal scores, and the tie goes to the lower id).
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/common/wgmma.cuh"
#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"
#include "cuda/selectors/tc_index.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using namespace tc;
using namespace cuda_kernels;  // mma_sync.cuh
using sel::check_cuda;
using sel::imax;
using sel::imin;

// Doubles (never NaN) to unsigned integers of the same order, so atomicMax on the integer is a max on
// the double: positives get the sign bit set, negatives are complemented.
__device__ __forceinline__ unsigned long long ordered_key(double v) {
  const auto u = static_cast<unsigned long long>(__double_as_longlong(v));
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
__device__ __forceinline__ double ordered_value(unsigned long long k) {
  const unsigned long long u = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
  return __longlong_as_double(static_cast<long long>(u));
}

constexpr int kMaxDp = 256;          // WsLayout<4>: the Q tile and two K stages of 128 x 256 bf16, 194 KB
constexpr int kRankThreads = 128;
constexpr int kRescoreThreads = 128;  // see RescoreShape
constexpr int kChunk = 16;            // queries of a tile per re-scoring work item
constexpr int kChunksPerTile = kTileQ / kChunk;

enum Cls : unsigned char { kOut = 0, kUndecided = 1, kIn = 2 };

struct Shape {
  std::int64_t B, Lq, Lk, Hkv, Hk, Di, Dp, Tq, Tk;
  bool causal;
  __host__ __device__ std::int64_t key_end(std::int64_t i) const {
    const std::int64_t e = i + (Lk - Lq) + 1;
    return causal ? (e < 0 ? 0 : (e > Lk ? Lk : e)) : Lk;
  }
  __host__ __device__ std::int64_t aligned(std::int64_t i) const {
    const std::int64_t a = i + (Lk - Lq);
    if (causal) return a >= 0 ? a : -1;
    return a < 0 ? 0 : (a > Lk - 1 ? Lk - 1 : a);
  }
};

// ---- 2. screening GEMM ---------------------------------------------------------------------------------

// Every kernel after the preparation starts here. Each is a programmatic dependent of the kernel before
// it: it may be scheduled while that one drains and waits here until it has completed (its memory
// visible). The short kernels then let the next one be scheduled at once (kTrigger); the screen does not,
// so the decision's CTAs are not resident beside it for the whole screen (which cost the 32K fp8 call
// 22 us on the H200): its trigger is its exit.
template <bool kTrigger = true>
__device__ __forceinline__ void chain_start() {
  sel::pdl_wait();
  if constexpr (kTrigger) sel::pdl_launch_dependents();
}

// The screen: the 128 query code rows of a Q tile times each KV block's 128 key code rows on wgmma
// (m64n128k16, bf16 products, float32 accumulation), both operands K-major in 128B-swizzled shared memory
// as S = Q K^T of the attention kernels; a tile is [Dw / 64 halves][128 rows][128 B] with Dw = Dp rounded
// up to 64 (zero filled). Warp-specialised: a producer warp streams the Q tile and the KV blocks with
// TMA (128B-swizzled boxes of 128 rows x 64 columns, rows past L read as zero, which the visibility
// limits exclude) through a ring of kStages K slots; two consumer warpgroups own 64 query rows each and
// keep two accumulator sets, so the wgmmas of block j + 1 run while the maxima of block j are formed. TileLists: each consumer warp writes its own partial maximum (the maximum over its 16 rows), so
// no barrier joins the warps; the decision takes the maximum of the kScreenParts partials. QueryLists: a
// row's maximum is complete in its quad of lanes. Persistent: CTA c owns units [c U, (c + 1) U) of the
// (Q tile, KV block) sequence, tile-major; a new run (Q tile) waits until the consumers are done with the
// previous tile.
constexpr int kWgHalfBytes = kTileQ * 128;  // one 64-column half of a 128-row bf16 tile
constexpr int kScreenParts = 8;               // consumer warps: TileLists partial maxima
constexpr int kWsThreads = 384;               // producer warpgroup + two consumer warpgroups
constexpr int kWsConsumerThreads = 256;

std::int64_t wg_width(std::int64_t Dp) { return (Dp + 63) / 64 * 64; }

template <int kHalves>
struct WsLayout {
  static constexpr int kTile = kHalves * kWgHalfBytes;                 // a 128-row tile of codes
  static constexpr int kStages = kHalves <= 2 ? 4 : 2;                 // K ring
  static constexpr int kBarOffset = (1 + kStages) * kTile;             // after Q and the ring
  static constexpr std::size_t kBytes = kBarOffset + 1024 + 1024;      // barriers, alignment slack
};

struct WsParams {
  CUtensorMap qmap, kmap;  // codes [B, Lq, Hkv, Dp] and [B, Lk, Hk, Dp]
  float* out;              // QueryLists [B, Hkv, Lq, Tk]; TileLists kScreenParts x [B, Hkv, Tq, Tk]
  std::int64_t part_stride;
  Shape s;
  std::int64_t per_cta;    // (tile, block) units per CTA
};

// The run of units [u, ...) of one Q tile: its coordinates and the visible blocks [j_begin, j_end).
struct WsRun {
  std::int64_t t, bg, b, g, hk, i0, j_begin, j_end, next;
};
__device__ __forceinline__ WsRun ws_run(const Shape& s, std::int64_t u, std::int64_t u_end) {
  WsRun r;
  const std::int64_t tile = u / s.Tk, run_end = imin(u_end, (tile + 1) * s.Tk);
  r.t = tile % s.Tq, r.bg = tile / s.Tq, r.b = r.bg / s.Hkv, r.g = r.bg % s.Hkv;
  r.hk = s.Hk == 1 ? 0 : r.g;
  r.i0 = r.t * kTileQ;
  const std::int64_t i_hi = imin(s.Lq, r.i0 + kTileQ) - 1;
  const std::int64_t jmax = (s.key_end(i_hi) + kBlockK - 1) / kBlockK;  // blocks some query of the tile sees
  r.j_begin = u - tile * s.Tk;
  r.j_end = imin(jmax, run_end - tile * s.Tk);
  r.next = run_end;
  return r;
}

template <bool kTiles, int kHalves>
__global__ void __launch_bounds__(kWsThreads, 1) screen_ws_kernel(const __grid_constant__ WsParams p) {
  chain_start<false>();
  using Lay = WsLayout<kHalves>;
  constexpr int kStages = Lay::kStages;
  namespace ck = cuda_kernels;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* qs = smem;
  unsigned char* ks = smem + Lay::kTile;
  auto* bars = reinterpret_cast<ck::MBarrier*>(smem + Lay::kBarOffset);
  ck::MBarrier* full = bars;               // [kStages]: K slot loaded
  ck::MBarrier* empty = bars + kStages;    // [kStages]: K slot released by every consumer thread
  ck::MBarrier& q_full = bars[2 * kStages];
  ck::MBarrier& q_empty = bars[2 * kStages + 1];
  const Shape& s = p.s;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) full[i].init(1), empty[i].init(kWsConsumerThreads);
    q_full.init(1);
    q_empty.init(kWsConsumerThreads);
    ck::fence_barrier_init();
  }
  __syncthreads();
  const std::int64_t units = s.B * s.Hkv * s.Tq * s.Tk;
  const std::int64_t u_first = static_cast<std::int64_t>(blockIdx.x) * p.per_cta, u_end = imin(units, u_first + p.per_cta);

  if (tid < 128) {  // producer warpgroup: one thread issues every load
    ck::warpgroup_reg_dealloc<40>();
    if (tid != 0) return;
    ck::tma_prefetch_descriptor(&p.qmap);
    ck::tma_prefetch_descriptor(&p.kmap);
    ck::PipelineState<kStages> ring;
    int run = 0;
    for (std::int64_t u = u_first; u < u_end;) {
      const WsRun r = ws_run(s, u, u_end);
      u = r.next;
      if (r.j_begin >= r.j_end) continue;
      if (run > 0) q_empty.wait(static_cast<std::uint32_t>((run - 1) & 1));
      q_full.arrive_expect_tx(Lay::kTile);
      for (int h = 0; h < kHalves; ++h)
        ck::tma_load_bhld(qs + h * kWgHalfBytes, &p.qmap, h * 64, static_cast<int>(r.g), static_cast<int>(r.i0),
                          static_cast<int>(r.b), &q_full.word);
      ++run;
      for (std::int64_t j = r.j_begin; j < r.j_end; ++j) {
        const int st = ring.stage();
        empty[st].wait(ring.phase() ^ 1u);
        full[st].arrive_expect_tx(Lay::kTile);
        for (int h = 0; h < kHalves; ++h)
          ck::tma_load_bhld(ks + st * Lay::kTile + h * kWgHalfBytes, &p.kmap, h * 64, static_cast<int>(r.hk),
                            static_cast<int>(j * kBlockK), static_cast<int>(r.b), &full[st].word);
        ring.advance();
      }
    }
    return;
  }

  ck::warpgroup_reg_alloc<232>();
  const int ctid = tid - 128, wg = ctid / 128, warp = ctid / 32, w = warp % 4, lane = tid % 32;
  constexpr int ksteps = kHalves * 4;
  const std::uint32_t a_base = smem_addr(qs) + wg * 64 * 128;
  ck::PipelineState<kStages> ring;
  float acc[2][64];

  // Maxima of block j from the accumulators `d` (complete), then the K slot goes back to the producer.
  auto epilogue = [&](const float (&d)[64], const WsRun& r, std::int64_t j, int st) {
    const std::int64_t k0 = j * kBlockK;
    float m[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t i = r.i0 + wg * 64 + 16 * w + lane / 4 + 8 * h;
      const std::int64_t lim = i < s.Lq ? s.key_end(i) - k0 : 0;
      float v = -INFINITY;
      if (lim >= kBlockK) {
#pragma unroll
        for (int c = 0; c < 16; ++c) v = fmaxf(v, fmaxf(d[4 * c + 2 * h], d[4 * c + 2 * h + 1]));
      } else {
#pragma unroll
        for (int c = 0; c < 16; ++c)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (8 * c + 2 * (lane % 4) + e < lim) v = fmaxf(v, d[4 * c + 2 * h + e]);
      }
      m[h] = v;
    }
    empty[st].arrive();  // the accumulators hold everything this thread needs from the slot
    if constexpr (kTiles) {
      float v = fmaxf(m[0], m[1]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0) p.out[warp * p.part_stride + (r.bg * s.Tq + r.t) * s.Tk + j] = v;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = m[h];
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
        const std::int64_t i = r.i0 + wg * 64 + 16 * w + lane / 4 + 8 * h;
        if (lane % 4 == 0 && i < s.Lq) p.out[(r.bg * s.Lq + i) * s.Tk + j] = v;
      }
    }
  };
  // Issues the wgmmas of block j into `d` (K slot `st` loaded).
  auto issue = [&](float (&d)[64], int st) {
    const std::uint32_t b_base = smem_addr(ks + st * Lay::kTile);
    ck::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < ksteps; ++kk) {
      const std::uint32_t off = (kk / 4) * kWgHalfBytes + (kk % 4) * 32;
      ck::wgmma_ss<ck::Bf16Tag>(d, ck::make_desc_sw128(a_base + off, 16, 1024), ck::make_desc_sw128(b_base + off, 16, 1024),
                                kk > 0);
    }
    ck::wgmma_commit();
  };

  int run = 0;
  for (std::int64_t u = u_first; u < u_end;) {
    const WsRun r = ws_run(s, u, u_end);
    u = r.next;
    if (r.j_begin >= r.j_end) continue;
    q_full.wait(static_cast<std::uint32_t>(run & 1));
    ++run;
    // Blocks in pairs: acc[0] takes j, acc[1] takes j + 1; each block's epilogue follows the issue of the
    // next block, so the tensor cores are busy while it runs. Every path waits before it reads.
    auto next_slot = [&]() {
      const int st = ring.stage();
      full[st].wait(ring.phase());
      ring.advance();
      return st;
    };
    int st0 = next_slot(), st1 = 0;
    issue(acc[0], st0);
    for (std::int64_t j = r.j_begin;; j += 2) {
      if (j + 1 < r.j_end) {
        st1 = next_slot();
        issue(acc[1], st1);
        ck::wgmma_wait<1>();
        ck::fence_operands(acc[0]);
        epilogue(acc[0], r, j, st0);
      } else {
        ck::wgmma_wait<0>();
        ck::fence_operands(acc[0]);
        epilogue(acc[0], r, j, st0);
        break;
      }
      if (j + 2 < r.j_end) {
        st0 = next_slot();
        issue(acc[0], st0);
        ck::wgmma_wait<1>();
        ck::fence_operands(acc[1]);
        epilogue(acc[1], r, j + 1, st1);
      } else {
        ck::wgmma_wait<0>();
        ck::fence_operands(acc[1]);
        epilogue(acc[1], r, j + 1, st1);
        break;
      }
    }
    q_empty.arrive();  // every wgmma that read the Q tile is complete
  }
}

// ---- 3.-5. ranking -------------------------------------------------------------------------------------

struct RankParams {
  const float* m;                 // screened maxima [parts][R, Tk] (code space)
  int parts;                      // partial maxima per entry (their maximum is the screened maximum)
  std::int64_t part_stride;       // R * Tk
  const float* qnorm;             // [B, Lq, Hkv] code-norm bounds (QueryLists)
  const unsigned int* qmax;       // [B, Hkv, Tq] float bits (TileLists)
  const unsigned int* kmax;       // [B, Hk, Tk] float bits
  const unsigned int* amax;       // [2]: qidx, kidx
  int prec;
  BoundConsts bc;
  unsigned char* cls;             // [R, Tk]
  unsigned long long* exact;      // [R, Tk] ordered keys
  int* pending;                   // [R]
  unsigned int* count;            // queue length
  int2* queue;                    // (row, block * kChunksPerTile + chunk)
  unsigned long long* stats;      // optional: [0] candidates, [1] re-scored blocks
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, width;
  std::int32_t* cnt;              // TileLists only
  std::int64_t cs0, cs1, cs2;
  Shape s;
  int top_k;
  bool reserve_local;
};

// One list: which candidates, which are reserved, where it goes.
struct ListRow {
  std::int64_t b, g, hk, pos;  // pos: query i (QueryLists) or tile t (TileLists)
  std::int64_t n;              // candidates: blocks 0 .. n - 1
  std::int64_t r_lo, r_hi;     // reserved blocks (empty when r_lo > r_hi)
  std::int32_t* out;
};

template <bool kTiles>
__device__ ListRow list_row(const RankParams& p, std::int64_t row) {
  const Shape& s = p.s;
  ListRow L{};
  const std::int64_t per = kTiles ? s.Tq : s.Lq;
  L.pos = row % per;
  L.g = (row / per) % s.Hkv;
  L.b = row / (per * s.Hkv);
  L.hk = s.Hk == 1 ? 0 : L.g;
  L.r_lo = 1, L.r_hi = 0;
  if constexpr (kTiles) {
    const std::int64_t i_first = L.pos * kTileQ, i_last = imin(s.Lq, i_first + kTileQ) - 1;
    L.n = (s.key_end(i_last) + kBlockK - 1) / kBlockK;
    if (p.reserve_local) {
      // The aligned key grows with i: the reserved blocks are a contiguous range.
      std::int64_t first_seen = -1;
      if (s.aligned(i_last) >= 0) first_seen = s.causal ? imax(i_first, s.Lq - s.Lk) : i_first;
      if (first_seen >= 0) {
        L.r_lo = s.aligned(first_seen) / kBlockK;
        L.r_hi = s.aligned(i_last) / kBlockK;
      }
    }
  } else {
    L.n = (s.key_end(L.pos) + kBlockK - 1) / kBlockK;
    if (p.reserve_local && s.aligned(L.pos) >= 0) L.r_lo = L.r_hi = s.aligned(L.pos) / kBlockK;
  }
  L.out = p.idx + L.b * p.is0 + L.g * p.is1 + L.pos * p.is2;
  return L;
}

// Writes the flagged ids of [0, n) ascending to out[s * stride], pads to `width` with -1, returns the
// count (to every thread). `part`: blockDim.x + 1 ints of shared memory.
__device__ int write_ascending(const unsigned char* flags, int n, int* part, std::int32_t* out, std::int64_t stride,
                               std::int64_t width) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int chunk = (n + nt - 1) / nt;
  const int lo = imin(n, tid * chunk), hi = imin(n, lo + chunk);
  int mine = 0;
  for (int j = lo; j < hi; ++j) mine += flags[j];
  // Exclusive scan of the per-thread counts: inclusive scan within each warp, then the warp totals
  // (blockDim.x is a multiple of 32).
  const int lane = tid % 32, warp = tid / 32, warps = nt / 32;
  int incl = mine;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) part[warp] = incl;
  __syncthreads();
  int pos = incl - mine, cnt = 0;
  for (int w = 0; w < warps; ++w) {
    pos += w < warp ? part[w] : 0;
    cnt += part[w];
  }
  for (int j = lo; j < hi; ++j)
    if (flags[j]) out[static_cast<std::int64_t>(pos++) * stride] = j;
  for (std::int64_t q = cnt + tid; q < width; q += nt) out[q * stride] = -1;
  __syncthreads();
  return cnt;
}

std::size_t rank_smem(std::int64_t Tk) {
  return static_cast<std::size_t>(Tk) * (2 * sizeof(float) + 2) + 16 + (kRankThreads + 1) * sizeof(int);
}
std::size_t finish_smem(std::int64_t Tk) {
  return static_cast<std::size_t>(Tk) * (sizeof(double) + 2) + 16 + (kRankThreads + 1) * sizeof(int);
}

// grid: R lists.
template <bool kTiles>
__global__ void __launch_bounds__(kRankThreads) decide_kernel(const RankParams p) {
  chain_start();
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  float* lo = reinterpret_cast<float*>(smem);
  float* hi = lo + s.Tk;
  unsigned char* cls = reinterpret_cast<unsigned char*>(hi + s.Tk);
  unsigned char* flags = cls + s.Tk;
  int* part = reinterpret_cast<int*>(smem + ((static_cast<std::size_t>(s.Tk) * 10 + 15) / 16) * 16);

  const std::int64_t row = blockIdx.x;
  const ListRow L = list_row<kTiles>(p, row);
  const int n = static_cast<int>(L.n), k = p.top_k, tid = threadIdx.x;
  const float sq = tensor_scale(p.prec, p.amax), sk = tensor_scale(p.prec, p.amax + 1);
  const float nq = kTiles ? __uint_as_float(p.qmax[(L.b * s.Hkv + L.g) * s.Tq + L.pos])
                          : p.qnorm[(L.b * s.Lq + L.pos) * s.Hkv + L.g];
  const float* mrow = p.m + row * s.Tk;
  for (int j = tid; j < n; j += kRankThreads) {
    if (j >= L.r_lo && j <= L.r_hi) {
      lo[j] = hi[j] = INFINITY;
    } else {
      const float nk = __uint_as_float(p.kmax[(L.b * s.Hk + L.hk) * s.Tk + j]);
      float screened = mrow[j];
      for (int q = 1; q < p.parts; ++q) screened = fmaxf(screened, mrow[q * p.part_stride + j]);
      score_interval(screened, sq, sk, nq, nk, p.bc, lo[j], hi[j]);
    }
  }
  __syncthreads();
  int mine_undecided = 0;
  for (int j = tid; j < n; j += kRankThreads) {
    unsigned char c = kIn;
    if (n > k) {
      int can = 0, sure = 0;
      const float lj = lo[j], hj = hi[j];
      // Branch-free and unrolled: the loads of several i are in flight at once (an early exit would
      // serialise the loop on shared-memory latency). i == j never counts as surely before itself.
#pragma unroll 8
      for (int i = 0; i < n; ++i) {
        const float hi_i = hi[i], lo_i = lo[i];
        can += (i != j) & ((hi_i > lj) | ((hi_i == lj) & (i < j)));
        sure += (lo_i > hj) | ((lo_i == hj) & (i < j));
      }
      c = can < k ? kIn : (sure >= k ? kOut : kUndecided);
    }
    cls[j] = c;
    flags[j] = c == kIn ? 1 : 0;
    mine_undecided += c == kUndecided ? 1 : 0;
  }
  const int any_undecided = __syncthreads_count(mine_undecided > 0);
  if (p.stats != nullptr && tid == 0) atomicAdd(p.stats, static_cast<unsigned long long>(n));
  if (any_undecided == 0) {
    if (tid == 0) p.pending[row] = 0;
    const int c = write_ascending(flags, n, part, L.out, p.is3, p.width);
    if constexpr (kTiles)
      if (tid == 0) p.cnt[L.b * p.cs0 + L.g * p.cs1 + L.pos * p.cs2] = c;
    return;
  }
  if (tid == 0) p.pending[row] = 1;
  for (int j = tid; j < n; j += kRankThreads) {
    p.cls[row * s.Tk + j] = cls[j];
    if (cls[j] != kUndecided) continue;
    const bool reserved = j >= L.r_lo && j <= L.r_hi;
    p.exact[row * s.Tk + j] = ordered_key(reserved ? INFINITY : -INFINITY);
    if (reserved) continue;  // reserved blocks score +inf; nothing to compute
    if (p.stats != nullptr) atomicAdd(p.stats + 1, 1ull);
    if constexpr (kTiles) {
      const std::int64_t k0 = static_cast<std::int64_t>(j) * kBlockK;
      int2 items[kChunksPerTile];
      int m = 0;
      for (int c = 0; c < kChunksPerTile; ++c) {
        const std::int64_t qa = L.pos * kTileQ + c * kChunk;
        if (qa >= s.Lq) break;
        if (s.key_end(imin(s.Lq, qa + kChunk) - 1) > k0) items[m++] = make_int2(static_cast<int>(row), j * kChunksPerTile + c);
      }
      const unsigned int at = atomicAdd(p.count, static_cast<unsigned int>(m));
      for (int q = 0; q < m; ++q) p.queue[at + q] = items[q];
    } else {
      p.queue[atomicAdd(p.count, 1u)] = make_int2(static_cast<int>(row), j * kChunksPerTile);
    }
  }
}

struct RescoreParams {
  IndexSrc q, k;  // the inputs; fp4 values (and any with a zero scale) are recomputed (group_values)
  const __nv_bfloat16* qc;  // codes [B, Lq, Hkv, Dp]: bf16 and fp8 values are fl(code * scale), as prepared
  const __nv_bfloat16* kc;  // [B, Lk, Hk, Dp]
  In qt, kt;
  int prec;
  const unsigned int* amax;  // [2]: qidx, kidx
  unsigned long long* exact;
  const unsigned int* count;
  const int2* queue;
  Shape s;
};

// How a re-scoring work unit is laid out. TileLists: a queued item (16 queries x one KV block) is split
// into 4 units of 32 keys; warp w of the CTA takes queries 4 w .. 4 w + 3 and lane l key l, so each
// thread runs 4 independent float64 chains (ILP) and the 16 queries' values are read as warp-wide
// broadcasts. QueryLists: a unit is the item (1 query x 128 keys), one key per thread. The values are
// staged once per unit in shared memory already converted to double where more than one thread reads
// them (keys of TileLists, queries), so the inner loop is loads and DFMAs only.
template <bool kTiles>
struct RescoreShape {
  static constexpr int QC = kTiles ? kChunk : 1;           // queries per item
  static constexpr int KU = kTiles ? 32 : kBlockK;         // keys per unit
  static constexpr int KS = kBlockK / KU;                  // units per item
  static constexpr int QT = QC * KU / kRescoreThreads;     // queries per thread
  using KeyT = std::conditional_t<kTiles, double, float>;  // staged key values
  static_assert(QT >= 1 && QT * (kRescoreThreads / KU) == QC);
  // Key row pitch: odd (in elements), so the 32 lanes' rows at one column fall on distinct banks.
  __host__ __device__ static std::int64_t key_pitch(std::int64_t Di) { return Di | 1; }
};

template <bool kTiles>
std::size_t rescore_smem(std::int64_t Di) {
  using RS = RescoreShape<kTiles>;
  return 16 * sizeof(double) + static_cast<std::size_t>(RS::QC * Di) * sizeof(double) +
         static_cast<std::size_t>(RS::KU * RS::key_pitch(Di)) * sizeof(typename RS::KeyT);
}

// grid: any; each CTA walks the units of the queue (item u / KS, key part u % KS).
template <bool kTiles>
__global__ void __launch_bounds__(kRescoreThreads) rescore_kernel(const RescoreParams p) {
  chain_start();
  using RS = RescoreShape<kTiles>;
  using KeyT = typename RS::KeyT;
  constexpr int QC = RS::QC, KU = RS::KU, KS = RS::KS, QT = RS::QT;
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  const int Di = static_cast<int>(s.Di), kp = static_cast<int>(RS::key_pitch(Di));
  double* red = reinterpret_cast<double*>(smem);
  double* qs = red + 16;                               // [QC][Di]
  KeyT* kb = reinterpret_cast<KeyT*>(qs + QC * Di);    // [KU][kp]
  const int tid = threadIdx.x;
  const unsigned int units = *p.count * KS;
  const float sq = tensor_scale(p.prec, p.amax), sk = tensor_scale(p.prec, p.amax + 1);
  const bool from_codes = p.prec != static_cast<int>(Prec::fp4) && sq != 0.0f && sk != 0.0f;
  for (unsigned int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int2 it = p.queue[unit / KS];
    const int part = static_cast<int>(unit % KS);
    const std::int64_t row = it.x, j = it.y / kChunksPerTile, chunk = it.y % kChunksPerTile;
    const std::int64_t per = kTiles ? s.Tq : s.Lq;
    const std::int64_t pos = row % per, g = (row / per) % s.Hkv, b = row / (per * s.Hkv);
    const std::int64_t hk = s.Hk == 1 ? 0 : g;
    const std::int64_t qa = kTiles ? pos * kTileQ + chunk * kChunk : pos;
    const int qn = static_cast<int>(imin<std::int64_t>(QC, s.Lq - qa));
    const std::int64_t k0 = j * kBlockK + part * KU;
    const int nk = static_cast<int>(imax<std::int64_t>(0, imin<std::int64_t>(KU, s.Lk - k0)));
    __syncthreads();  // the previous unit's readers are done with kb and qs
    if (from_codes) {
      // value = fl(code * scale) exactly as prepare_pair_kernel computed it (scale 1 for bf16: the code itself);
      // 8 codes per 16-byte load (code rows are Dp >= Di bf16, Dp a multiple of 16), every load of a
      // thread's batch in flight before the first store.
      const int vecs = (Di + 7) / 8, total = (nk + qn) * vecs;
      constexpr int kBatch = 8;
      for (int base = tid; base < total; base += kBatch * kRescoreThreads) {
        uint4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int e = base + u * kRescoreThreads;
          if (e < total) {
            const int r = e / vecs, c = e - r * vecs;
            const __nv_bfloat16* src = r < nk ? p.kc + ((b * s.Lk + k0 + r) * s.Hk + hk) * s.Dp
                                              : p.qc + ((b * s.Lq + qa + (r - nk)) * s.Hkv + g) * s.Dp;
            v[u] = __ldg(reinterpret_cast<const uint4*>(src) + c);
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int e = base + u * kRescoreThreads;
          if (e < total) {
            const int r = e / vecs, d0 = (e - r * vecs) * 8;
            const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v[u]);
            for (int i = 0; i < 8 && d0 + i < Di; ++i) {
              const float c = __bfloat162float(h[i]);
              if (r < nk) kb[r * kp + d0 + i] = static_cast<KeyT>(__fmul_rn(c, sk));
              else qs[(r - nk) * Di + d0 + i] = static_cast<double>(__fmul_rn(c, sq));
            }
          }
        }
      }
    } else {
      const int ng = (Di + kGroup - 1) / kGroup;
      for (int e = tid; e < (nk + qn) * ng; e += kRescoreThreads) {
        const int r = e / ng, d0 = (e - r * ng) * kGroup;
        const int cnt = imin(kGroup, Di - d0);
        float v[kGroup];
        if (r < nk) {
          group_values(p.k, p.kt, p.prec, sk, p.k.offset((b * s.Lk + k0 + r) * s.Hk + hk), d0, cnt, v);
          for (int i = 0; i < cnt; ++i) kb[r * kp + d0 + i] = static_cast<KeyT>(v[i]);
        } else {
          const int rq = r - nk;
          group_values(p.q, p.qt, p.prec, sq, p.q.offset((b * s.Lq + qa + rq) * s.Hkv + g), d0, cnt, v);
          for (int i = 0; i < cnt; ++i) qs[rq * Di + d0 + i] = static_cast<double>(v[i]);
        }
      }
    }
    __syncthreads();
    // The CPU's dot: one float64 chain over d in order per (query, key); products of floats are exact
    // in float64, so the fma rounds as the CPU's multiply and add.
    const int key = tid % KU, m0 = (tid / KU) * QT;
    double best = -INFINITY;
    if (key < nk && m0 < qn) {
      double acc[QT];
#pragma unroll
      for (int m = 0; m < QT; ++m) acc[m] = 0.0;
      const KeyT* kr = kb + key * kp;
      const double* qr = qs + m0 * Di;
#pragma unroll 4
      for (int d = 0; d < Di; ++d) {
        const double kd = static_cast<double>(kr[d]);
#pragma unroll
        for (int m = 0; m < QT; ++m) acc[m] = fma(qr[m * Di + d], kd, acc[m]);
      }
#pragma unroll
      for (int m = 0; m < QT; ++m)
        if (m0 + m < qn && k0 + key < s.key_end(qa + m0 + m)) best = fmax(best, sel::sanitize(acc[m]));
    }
    for (int o = 16; o > 0; o >>= 1) best = fmax(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (tid % 32 == 0) red[tid / 32] = best;
    __syncthreads();
    if (tid == 0) {
      double v = red[0];
      for (int w = 1; w < kRescoreThreads / 32; ++w) v = fmax(v, red[w]);
      if (v > -INFINITY) atomicMax(p.exact + row * s.Tk + j, ordered_key(v));
    }
  }
}

// grid: R lists; only lists with undecided blocks work.
template <bool kTiles>
__global__ void __launch_bounds__(kRankThreads) finish_kernel(const RankParams p) {
  chain_start();
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  const std::int64_t row = blockIdx.x;
  if (p.pending[row] == 0) return;
  double* ex = reinterpret_cast<double*>(smem);
  unsigned char* cls = reinterpret_cast<unsigned char*>(ex + s.Tk);
  unsigned char* flags = cls + s.Tk;
  int* part = reinterpret_cast<int*>(smem + ((static_cast<std::size_t>(s.Tk) * 10 + 15) / 16) * 16);
  const ListRow L = list_row<kTiles>(p, row);
  const int n = static_cast<int>(L.n), k = p.top_k, tid = threadIdx.x;
  for (int j = tid; j < n; j += kRankThreads) {
    cls[j] = p.cls[row * s.Tk + j];
    ex[j] = cls[j] == kUndecided ? ordered_value(p.exact[row * s.Tk + j]) : 0.0;
  }
  __syncthreads();
  for (int j = tid; j < n; j += kRankThreads) {
    int before = 0;
    const unsigned char cj = cls[j];
    const double ej = ex[j];
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      const unsigned char ci = cls[i];
      const double ei = ex[i];
      before += (ci > cj) | ((ci == cj) & (ci == kUndecided ? ((ei > ej) | ((ei == ej) & (i < j))) : (i < j)));
    }
    flags[j] = before < k ? 1 : 0;
  }
  __syncthreads();
  const int c = write_ascending(flags, n, part, L.out, p.is3, p.width);
  if constexpr (kTiles)
    if (tid == 0) p.cnt[L.b * p.cs0 + L.g * p.cs1 + L.pos * p.cs2] = c;
}

// ---- host ----------------------------------------------------------------------------------------------

template <bool kTiles>
void run_token_max(const TensorView& qidx, const TensorView& kidx, const TensorView& idx, const TensorView* cnt,
                   const TokenMaxOptions& o, const detail::SelectorTuning& tuning) {
  const std::string op = "token_max_select";
  const int max_smem = sel::usable_device_smem(op, "qidx", qidx);
  sel::check_device_memory(op, "qidx", qidx);
  sel::check_device_memory(op, "kidx", kidx);
  sel::check_device_memory(op, "out.idx", idx);
  if (cnt != nullptr) sel::check_device_memory(op, "out.cnt", *cnt);

  Shape s{};
  s.B = qidx.shape[0], s.Lq = qidx.shape[1], s.Hkv = qidx.shape[2], s.Di = qidx.shape[3];
  s.Lk = kidx.shape[1], s.Hk = kidx.shape[2];
  s.Dp = padded_dim(s.Di), s.Tq = ceil_div(s.Lq, kTileQ), s.Tk = ceil_div(s.Lk, kBlockK);
  s.causal = o.causal;
  const auto stream = static_cast<cudaStream_t>(o.stream);

  if (s.Dp > kMaxDp)
    throw Error(op, "qidx", "index dim Di = " + std::to_string(s.Di) + " exceeds the CUDA token_max selector's limit of " +
                                std::to_string(kMaxDp));
  if (s.B * s.Hkv > 65535)
    throw Error(op, "qidx", "B x Hkv = " + std::to_string(s.B * s.Hkv) + " exceeds the CUDA selector's limit of 65535");
  const std::size_t rk_smem = std::max(rank_smem(s.Tk), finish_smem(s.Tk));
  const std::size_t rs_smem = rescore_smem<kTiles>(s.Di);
  if (rk_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "kidx", "Lk = " + std::to_string(s.Lk) + " gives " + std::to_string(s.Tk) +
                                " blocks, more than the CUDA selector's shared-memory ranking holds");
  const std::int64_t R = s.B * s.Hkv * (kTiles ? s.Tq : s.Lq);
  if (R > 0x7fffffff || s.Tk * kChunksPerTile > 0x7fffffff)
    throw Error(op, "qidx", "the problem has more lists or blocks than the CUDA token_max selector indexes");

  // The opt-in shared-memory size is set once per (kernel, device) and raised when a call needs more:
  // repeating cudaFuncSetAttribute on every call costs host time in front of every selection.
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), op, "cudaGetDevice");
  auto attr = [&](const void* f, std::size_t bytes) {
    static std::mutex mu;
    static std::map<std::pair<const void*, int>, std::size_t> done;
    const std::lock_guard<std::mutex> lock(mu);
    std::size_t& have = done[{f, dev}];
    if (have >= bytes) return;
    check_cuda(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
               "cudaFuncSetAttribute");
    have = bytes;
  };
  using WsFn = void (*)(WsParams);
  constexpr WsFn ws_by_halves[] = {screen_ws_kernel<kTiles, 1>, screen_ws_kernel<kTiles, 2>, screen_ws_kernel<kTiles, 3>,
                                   screen_ws_kernel<kTiles, 4>};
  constexpr std::size_t ws_bytes[] = {WsLayout<1>::kBytes, WsLayout<2>::kBytes, WsLayout<3>::kBytes, WsLayout<4>::kBytes};
  const int halves = static_cast<int>(wg_width(s.Dp) / 64);
  const WsFn ws = ws_by_halves[halves - 1];
  const std::size_t ws_smem = ws_bytes[halves - 1];
  if (ws_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "qidx", "index dim Di = " + std::to_string(s.Di) + " needs " + std::to_string(ws_smem) +
                                " bytes of shared memory for the screening kernel; the device allows " +
                                std::to_string(max_smem));
  attr(reinterpret_cast<const void*>(ws), ws_smem);
  attr(reinterpret_cast<const void*>(decide_kernel<kTiles>), rk_smem);
  attr(reinterpret_cast<const void*>(finish_kernel<kTiles>), rk_smem);
  attr(reinterpret_cast<const void*>(rescore_kernel<kTiles>), rs_smem);

  // Scratch; the zeroed words (amax, queue length, group maxima) come first so one memset clears them.
  const std::int64_t q_rows = s.B * s.Lq * s.Hkv, k_rows = s.B * s.Lk * s.Hk;
  const std::int64_t qgroups = s.B * s.Hkv * s.Tq, kgroups = s.B * s.Hk * s.Tk;
  const std::int64_t cap = R * s.Tk * (kTiles ? kChunksPerTile : 1);
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += sel::align_up(bytes);
    return at;
  };
  const std::size_t o_words = take(4 * sizeof(unsigned int));
  const std::size_t o_kmax = take(static_cast<std::size_t>(kgroups) * 4);
  const std::size_t o_qmax = take(static_cast<std::size_t>(qgroups) * 4);
  const std::size_t zero_bytes = off;
  const std::size_t o_qc = take(static_cast<std::size_t>(q_rows * s.Dp) * 2);
  const std::size_t o_kc = take(static_cast<std::size_t>(k_rows * s.Dp) * 2);
  const std::size_t o_qn = take(static_cast<std::size_t>(q_rows) * 4);
  const std::size_t o_kn = take(static_cast<std::size_t>(k_rows) * 4);
  // Screened maxima; the screen leaves kScreenParts partial maxima per TileLists entry.
  const int parts = kTiles ? kScreenParts : 1;
  const std::size_t o_m = take(static_cast<std::size_t>(R * s.Tk * parts) * 4);
  const std::size_t o_cls = take(static_cast<std::size_t>(R * s.Tk));
  const std::size_t o_ex = take(static_cast<std::size_t>(R * s.Tk) * 8);
  const std::size_t o_pend = take(static_cast<std::size_t>(R) * 4);
  const std::size_t o_queue = take(static_cast<std::size_t>(cap) * sizeof(int2));
  sel::StreamScratch scratch(off, stream, op);
  check_cuda(cudaMemsetAsync(scratch.as<void>(0), 0, zero_bytes, stream), op, "cudaMemsetAsync");
  auto* words = scratch.as<unsigned int>(o_words);  // [0], [1]: amax of qidx, kidx; [2]: queue length
  // Every launch after the first a programmatic dependent of the one before (chain_start).
  auto launch = [&](const char* what, auto kernel, dim3 grid, dim3 block, std::size_t smem, const auto& params) {
    sel::launch_dependent(op, what, kernel, grid, block, smem, stream, params);
  };

  launch_prepare_pair(qidx, kidx, o.precision, words,
                      PrepOut{scratch.as<__nv_bfloat16>(o_qc), scratch.as<float>(o_qn), scratch.as<unsigned int>(o_qmax), s.Dp},
                      PrepOut{scratch.as<__nv_bfloat16>(o_kc), scratch.as<float>(o_kn), scratch.as<unsigned int>(o_kmax), s.Dp},
                      stream, op, true);

  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op, "cudaDeviceGetAttribute");
  // One wave of persistent CTAs (one per SM) over contiguous ranges of (Q tile, KV block) units.
  WsParams wp{};
  wp.qmap = cuda_kernels::make_bhld_tensor_map(
      op, "qidx", TensorView::contiguous(scratch.as<void>(o_qc), DType::bf16, {s.B, s.Lq, s.Hkv, s.Dp}, Device::cuda, dev));
  wp.kmap = cuda_kernels::make_bhld_tensor_map(
      op, "kidx", TensorView::contiguous(scratch.as<void>(o_kc), DType::bf16, {s.B, s.Lk, s.Hk, s.Dp}, Device::cuda, dev));
  wp.out = scratch.as<float>(o_m);
  wp.part_stride = R * s.Tk;
  wp.s = s;
  const std::int64_t units = s.Tq * s.B * s.Hkv * s.Tk;
  const std::int64_t ctas = imin<std::int64_t>(units, static_cast<std::int64_t>(sms));
  wp.per_cta = ceil_div(units, ctas);
  launch("screen launch", ws, dim3(static_cast<unsigned>(ceil_div(units, wp.per_cta))), dim3(kWsThreads), ws_smem, wp);

  RankParams rp{};
  rp.m = scratch.as<float>(o_m);
  rp.parts = parts;
  rp.part_stride = R * s.Tk;
  rp.qnorm = scratch.as<float>(o_qn);
  rp.qmax = scratch.as<unsigned int>(o_qmax);
  rp.kmax = scratch.as<unsigned int>(o_kmax);
  rp.amax = words;
  rp.prec = o.precision == IndexPrecision::bf16 ? static_cast<int>(Prec::bf16)
            : o.precision == IndexPrecision::fp8_e4m3 ? static_cast<int>(Prec::fp8)
                                                      : static_cast<int>(Prec::fp4);
  rp.bc = bound_consts(s.Di, s.Dp);
  rp.cls = scratch.as<unsigned char>(o_cls);
  rp.exact = scratch.as<unsigned long long>(o_ex);
  rp.pending = scratch.as<int>(o_pend);
  rp.count = words + 2;
  rp.queue = scratch.as<int2>(o_queue);
  rp.stats = tuning.token_max_counters;
  rp.idx = idx.ptr<std::int32_t>();
  rp.is0 = idx.stride[0], rp.is1 = idx.stride[1], rp.is2 = idx.stride[2], rp.is3 = idx.stride[3];
  rp.width = idx.shape[3];
  if (cnt != nullptr) {
    rp.cnt = cnt->ptr<std::int32_t>();
    rp.cs0 = cnt->stride[0], rp.cs1 = cnt->stride[1], rp.cs2 = cnt->stride[2];
  }
  rp.s = s;
  rp.top_k = o.top_k;
  rp.reserve_local = o.reserve_local;
  launch("decision launch", decide_kernel<kTiles>, dim3(static_cast<unsigned>(R)), dim3(kRankThreads), rk_smem, rp);

  RescoreParams xp{index_src(qidx), index_src(kidx), scratch.as<__nv_bfloat16>(o_qc), scratch.as<__nv_bfloat16>(o_kc),
                   sel::in_type(qidx.dtype), sel::in_type(kidx.dtype), rp.prec, words, rp.exact, rp.count, rp.queue, s};
  // Enough CTAs for every unit of a typical queue to start at once (a handful of undecided blocks per
  // list); a long queue is walked by the same CTAs.
  const std::int64_t rgrid = imin<std::int64_t>(4 * static_cast<std::int64_t>(sms), cap * RescoreShape<kTiles>::KS);
  launch("re-scoring launch", rescore_kernel<kTiles>, dim3(static_cast<unsigned>(imax<std::int64_t>(1, rgrid))),
         dim3(kRescoreThreads), rs_smem, xp);
  launch("ranking launch", finish_kernel<kTiles>, dim3(static_cast<unsigned>(R)), dim3(kRankThreads), rk_smem, rp);
  check_cuda(cudaGetLastError(), op, "kernel launch");
}

}  // namespace

void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out, const TokenMaxOptions& o,
                      const detail::SelectorTuning& tuning) {
  run_token_max<false>(qidx, kidx, out.idx, nullptr, o, tuning);
}

void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out, const TokenMaxOptions& o,
                      const detail::SelectorTuning& tuning) {
  run_token_max<true>(qidx, kidx, out.idx, &out.cnt, o, tuning);
}

}  // namespace sparse_attn::cuda_backend
