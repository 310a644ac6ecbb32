// MSA-style token-max selector on the GPU (DESIGN §5.7), version 3: tensor-core screening with an
// exact float64 decision at the boundary. Kernels on the caller's stream:
//  1. prepare (tc_index.cuh), one launch for both index tensors after one for their amax words (fp8,
//     fp4): for every index row the bf16 codes (exact: value = code * scale up to rounding) and an upper
//     bound of the code row's norm, maxed per 128 rows (Q tile, KV block);
//  2. screen: the 128 query code rows of a Q tile times each KV block's 128 key code rows in bf16 with
//     float32 accumulation, keeping per visible (query, block) the max over the block's keys; TileLists
//     also max over the tile's queries (as partial maxima per consumer warp, maxed by the decision).
//     Only these maxima reach memory, never the [Lq, Lk] scores. The default kernel is warp-specialised
//     (TMA producer, wgmma consumers: screen_ws_kernel); wgmma with cp.async and mma.sync remain
//     selectable for tests (set_token_max_screen);
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
// Each launch after the first is a programmatic dependent of the one before (chain_start), unless
// set_token_max_pdl turns that off or stage events are being recorded.
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
#include <atomic>
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
#include "cuda/selectors/tc_token_max.cuh"

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

constexpr int kScreenThreads = 256;  // 8 warps: 4 x 32 query rows by 2 x 64 keys of a block
constexpr int kMaxDp = 256;          // Q tile + two K stages of 128 x (Dp + 8) bf16: 203 KB at 256
constexpr int kPitchPad = 8;         // row pitch (Dp + 8) * 2 bytes = 16 * odd: ldmatrix rows hit distinct banks
constexpr int kRankThreads = 128;
constexpr int kRescoreThreads = 128;  // see RescoreShape
constexpr int kChunk = 16;            // queries of a tile per re-scoring work item
constexpr int kChunksPerTile = kTileQ / kChunk;

enum Cls : unsigned char { kOut = 0, kUndecided = 1, kIn = 2 };

unsigned long long* g_stats = nullptr;  // optional device counters, see tc_token_max.cuh
int g_screen = 0;                       // screening kernel, see tc_token_max.cuh
std::atomic<bool> g_pdl{true};          // programmatic launches, see tc_token_max.cuh
cudaEvent_t* g_events = nullptr;        // optional stage events, see tc_token_max.cuh

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

struct ScreenParams {
  const __nv_bfloat16* qc;  // [B, Lq, Hkv, Dp]
  const __nv_bfloat16* kc;  // [B, Lk, Hk, Dp]
  float* out;               // QueryLists [B, Hkv, Lq, Tk]; TileLists [B, Hkv, Tq, Tk]
  Shape s;
  std::int64_t per_split;   // mma.sync: KV blocks per CTA (grid z); wgmma: (tile, block) units per CTA
};

std::size_t screen_smem(std::int64_t Dp) {
  return static_cast<std::size_t>(3 * kTileQ * (Dp + kPitchPad)) * 2 + 2 * kTileQ * sizeof(float);
}

// Every kernel after the preparation starts here. With programmatic launches (set_token_max_pdl, on by
// default) each is a dependent of the kernel before it: it may be scheduled while that one drains and
// waits here until it has completed (its memory visible). The short kernels then let the next one be
// scheduled at once (kTrigger); the screens do not, so the decision's CTAs are not resident beside them
// for the whole screen (which cost the 32K fp8 call 22 us on the H200): their trigger is their exit.
// Launched plainly, both are no-ops.
template <bool kTrigger = true>
__device__ __forceinline__ void chain_start() {
  sel::pdl_wait();
  if constexpr (kTrigger) sel::pdl_launch_dependents();
}

// grid: (Tq, B * Hkv, splits). The CTA's 128 query code rows stay in shared memory; KV blocks stream
// through two cp.async stages.
template <bool kTiles>
__global__ void __launch_bounds__(kScreenThreads, 1) screen_kernel(const ScreenParams p) {
  chain_start<false>();
  extern __shared__ __align__(128) unsigned char smem[];
  const Shape& s = p.s;
  const int pitch = static_cast<int>(s.Dp) + kPitchPad;
  auto* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* kst = qs + kTileQ * pitch;
  auto* red = reinterpret_cast<float*>(kst + 2 * kBlockK * pitch);

  const std::int64_t t = blockIdx.x, bg = blockIdx.y, b = bg / s.Hkv, g = bg % s.Hkv;
  const std::int64_t hk = s.Hk == 1 ? 0 : g;
  const std::int64_t i0 = t * kTileQ, i_hi = imin(s.Lq, i0 + kTileQ) - 1;
  const std::int64_t jmax = (s.key_end(i_hi) + kBlockK - 1) / kBlockK;  // blocks some query of the tile sees
  const std::int64_t j_begin = blockIdx.z * p.per_split, j_end = imin(jmax, j_begin + p.per_split);
  if (j_begin >= j_end) return;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wm = warp / 2, wn = warp % 2;
  const int chunks = static_cast<int>(s.Dp) / 8;  // 16-byte pieces of a row

  for (int e = tid; e < kTileQ * chunks; e += kScreenThreads) {
    const int r = e / chunks, c = e % chunks;
    const std::int64_t i = i0 + r;
    const bool valid = i < s.Lq;
    cp_async16(qs + r * pitch + c * 8, p.qc + ((b * s.Lq + (valid ? i : 0)) * s.Hkv + g) * s.Dp + c * 8, valid);
  }
  auto load_block = [&](std::int64_t j, int stage) {
    __nv_bfloat16* dst = kst + stage * kBlockK * pitch;
    for (int e = tid; e < kBlockK * chunks; e += kScreenThreads) {
      const int r = e / chunks, c = e % chunks;
      const std::int64_t key = j * kBlockK + r;
      const bool valid = key < s.Lk;
      cp_async16(dst + r * pitch + c * 8, p.kc + ((b * s.Lk + (valid ? key : 0)) * s.Hk + hk) * s.Dp + c * 8, valid);
    }
  };
  load_block(j_begin, 0);
  cp_async_commit();

  const int ksteps = static_cast<int>(s.Dp) / 16;
  for (std::int64_t j = j_begin; j < j_end; ++j) {
    const int stage = static_cast<int>((j - j_begin) & 1);
    if (j + 1 < j_end) {
      load_block(j + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    float acc[2][8][4];
    for (int mt = 0; mt < 2; ++mt)
      for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
    const __nv_bfloat16* kb = kst + stage * kBlockK * pitch;
    for (int ks = 0; ks < ksteps; ++ks) {
      std::uint32_t a[2][4];
      for (int mt = 0; mt < 2; ++mt)
        ldmatrix_x4(a[mt], qs + (wm * 32 + mt * 16 + lane % 16) * pitch + ks * 16 + (lane / 16) * 8);
      for (int np = 0; np < 4; ++np) {
        std::uint32_t bb[4];
        ldmatrix_x4(bb, kb + (wn * 64 + np * 16 + (lane / 16) * 8 + lane % 8) * pitch + ks * 16 + ((lane / 8) % 2) * 8);
        for (int mt = 0; mt < 2; ++mt) {
          mma_m16n8k16<Bf16Tag>(acc[mt][2 * np], a[mt], bb[0], bb[1]);
          mma_m16n8k16<Bf16Tag>(acc[mt][2 * np + 1], a[mt], bb[2], bb[3]);
        }
      }
    }

    // Max over the visible keys of the block: key k0 + col is visible to query i iff k0 + col < key_end(i)
    // (key_end <= Lk also drops the zero-filled keys past Lk).
    const std::int64_t k0 = j * kBlockK;
    float tile_max = -INFINITY;
    for (int mt = 0; mt < 2; ++mt)
      for (int h = 0; h < 2; ++h) {
        const int r = wm * 32 + mt * 16 + h * 8 + lane / 4;
        const std::int64_t i = i0 + r;
        const std::int64_t lim = i < s.Lq ? s.key_end(i) - k0 : 0;
        float m = -INFINITY;
        for (int nt = 0; nt < 8; ++nt)
          for (int e = 0; e < 2; ++e) {
            const int col = wn * 64 + nt * 8 + 2 * (lane % 4) + e;
            if (col < lim) m = fmaxf(m, acc[mt][nt][h * 2 + e]);
          }
        if constexpr (kTiles) {
          tile_max = fmaxf(tile_max, m);
        } else {
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          if (lane % 4 == 0) red[wn * kTileQ + r] = m;
        }
      }
    if constexpr (kTiles) {
      for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      if (lane == 0) red[warp] = tile_max;
    }
    __syncthreads();
    if constexpr (kTiles) {
      if (tid == 0) {
        float m = red[0];
        for (int w = 1; w < kScreenThreads / 32; ++w) m = fmaxf(m, red[w]);
        p.out[(bg * s.Tq + t) * s.Tk + j] = m;
      }
    } else {
      if (tid < kTileQ && i0 + tid < s.Lq) p.out[(bg * s.Lq + i0 + tid) * s.Tk + j] = fmaxf(red[tid], red[kTileQ + tid]);
    }
    __syncthreads();  // stage and red are rewritten by the next iteration
  }
}

// The same product on wgmma (m64n128k16, both operands K-major in 128B-swizzled shared memory, as
// S = Q K^T of the attention kernels): two warpgroups own 64 query rows each and all 128 keys of the
// block. Tiles are [Dw / 64 halves][128 rows][128 B] with Dw = Dp rounded up to 64 (zero filled);
// cp.async writes the swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), then each writer
// fences the generic proxy against the async proxy before the barrier that precedes wgmma.
constexpr int kWgHalfBytes = kTileQ * 128;  // one 64-column half of a 128-row bf16 tile

__host__ __device__ std::int64_t wg_width(std::int64_t Dp) { return (Dp + 63) / 64 * 64; }
std::size_t screen_wg_smem(std::int64_t Dp) {
  return static_cast<std::size_t>(3 * (wg_width(Dp) / 64) * kWgHalfBytes) + 1024 + 16 * sizeof(float);
}

// Persistent: CTA c owns the units [c U, (c + 1) U) of the (Q tile, KV block) sequence, tile-major, so it
// streams one or two runs of consecutive blocks; a run reloads its Q tile (the pipeline drains between
// runs). One wave of CTAs: no tail of partial waves, one Q load per run.
template <bool kTiles, int kHalves>
__global__ void __launch_bounds__(kScreenThreads, 2) screen_wgmma_kernel(const ScreenParams p) {
  chain_start<false>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Shape& s = p.s;
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  constexpr int halves = kHalves;
  constexpr int tile_bytes = halves * kWgHalfBytes;
  unsigned char* qs = smem;
  unsigned char* kst = smem + tile_bytes;
  auto* red = reinterpret_cast<float*>(smem + 3 * tile_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = tid / 128, w = warp % 4;
  constexpr int chunks = halves * 8;  // 16-byte chunks of a (padded) row
  const int valid_chunks = static_cast<int>(s.Dp) / 8;
  auto load_tile = [&](unsigned char* dst, const __nv_bfloat16* src_rows, std::int64_t first, std::int64_t limit,
                       std::int64_t row_stride) {
    for (int e = tid; e < kTileQ * chunks; e += kScreenThreads) {
      const int r = e / chunks, c = e % chunks;
      const std::int64_t row = first + r;
      const bool valid = row < limit && c < valid_chunks;
      unsigned char* d = dst + (c / 8) * kWgHalfBytes + r * 128 + (((c % 8) ^ (r % 8)) * 16);
      cp_async16(d, src_rows + (valid ? row : 0) * row_stride + (valid ? c * 8 : 0), valid);
    }
  };

  const std::int64_t units = s.B * s.Hkv * s.Tq * s.Tk;
  const std::int64_t u_end = imin(units, (static_cast<std::int64_t>(blockIdx.x) + 1) * p.per_split);
  for (std::int64_t u = static_cast<std::int64_t>(blockIdx.x) * p.per_split; u < u_end;) {
    const std::int64_t tile = u / s.Tk, run_end = imin(u_end, (tile + 1) * s.Tk);
    const std::int64_t t = tile % s.Tq, bg = tile / s.Tq, b = bg / s.Hkv, g = bg % s.Hkv;
    const std::int64_t hk = s.Hk == 1 ? 0 : g;
    const std::int64_t i0 = t * kTileQ, i_hi = imin(s.Lq, i0 + kTileQ) - 1;
    const std::int64_t jmax = (s.key_end(i_hi) + kBlockK - 1) / kBlockK;  // blocks some query of the tile sees
    const std::int64_t j_begin = u - tile * s.Tk, j_end = imin(jmax, run_end - tile * s.Tk);
    u = run_end;
    if (j_begin >= j_end) continue;

    // Row l of (b, head) starts at ((b * L + l) * H + head) * Dp: a row stride of H * Dp from the first.
    const __nv_bfloat16* qbase = p.qc + ((b * s.Lq) * s.Hkv + g) * s.Dp;
    const __nv_bfloat16* kbase = p.kc + ((b * s.Lk) * s.Hk + hk) * s.Dp;
    load_tile(qs, qbase, i0, s.Lq, s.Hkv * s.Dp);
    load_tile(kst, kbase, j_begin * kBlockK, s.Lk, s.Hk * s.Dp);
    cp_async_commit();

    constexpr int ksteps = halves * 4;
    for (std::int64_t j = j_begin; j < j_end; ++j) {
      const int stage = static_cast<int>((j - j_begin) & 1);
      if (j + 1 < j_end) {
        load_tile(kst + (stage ^ 1) * tile_bytes, kbase, (j + 1) * kBlockK, s.Lk, s.Hk * s.Dp);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();

      float d[64];
      const std::uint32_t a_base = smem_addr(qs) + wg * 64 * 128, b_base = smem_addr(kst + stage * tile_bytes);
      cuda_kernels::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < ksteps; ++kk) {
        const std::uint32_t off = (kk / 4) * kWgHalfBytes + (kk % 4) * 32;
        cuda_kernels::wgmma_ss<cuda_kernels::Bf16Tag>(d, cuda_kernels::make_desc_sw128(a_base + off, 16, 1024),
                                                       cuda_kernels::make_desc_sw128(b_base + off, 16, 1024), kk > 0);
      }
      cuda_kernels::wgmma_commit();
      cuda_kernels::wgmma_wait<0>();
      cuda_kernels::fence_operands(d);

      // d[4 c + e]: row 16 w + lane / 4 + 8 (e / 2) of the warpgroup's 64, key 8 c + 2 (lane % 4) + e % 2.
      const std::int64_t k0 = j * kBlockK;
      float m[2];
      for (int h = 0; h < 2; ++h) {
        const int r = wg * 64 + 16 * w + lane / 4 + 8 * h;
        const std::int64_t i = i0 + r;
        const std::int64_t lim = i < s.Lq ? s.key_end(i) - k0 : 0;
        float v = -INFINITY;
        if (lim >= kBlockK) {
          for (int c = 0; c < 16; ++c) v = fmaxf(v, fmaxf(d[4 * c + 2 * h], d[4 * c + 2 * h + 1]));
        } else {
          for (int c = 0; c < 16; ++c)
            for (int e = 0; e < 2; ++e)
              if (8 * c + 2 * (lane % 4) + e < lim) v = fmaxf(v, d[4 * c + 2 * h + e]);
        }
        m[h] = v;
      }
      if constexpr (kTiles) {
        float v = fmaxf(m[0], m[1]);
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) red[warp] = v;
        __syncthreads();
        if (tid == 0) {
          float x = red[0];
          for (int q = 1; q < kScreenThreads / 32; ++q) x = fmaxf(x, red[q]);
          p.out[(bg * s.Tq + t) * s.Tk + j] = x;
        }
      } else {
        for (int h = 0; h < 2; ++h) {
          float v = m[h];
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
          const std::int64_t i = i0 + wg * 64 + 16 * w + lane / 4 + 8 * h;
          if (lane % 4 == 0 && i < s.Lq) p.out[(bg * s.Lq + i) * s.Tk + j] = v;
        }
      }
      __syncthreads();  // the stage, red and (after the run) the Q tile are rewritten next
    }
  }
}

// The same product, warp-specialised (the default screen): a producer warp streams the Q tile and the
// KV blocks with TMA (128B-swizzled boxes of 128 rows x 64 columns, rows past L read as zero, which the
// visibility limits exclude) through a ring of kStages K slots; two consumer warpgroups own 64 query rows
// each and keep two accumulator sets, so the wgmmas of block j + 1 run while the maxima of block j are
// formed. TileLists: each consumer warp writes its own partial maximum (the maximum over its 16 rows), so
// no barrier joins the warps; the decision takes the maximum of the kScreenParts partials. QueryLists: a
// row's maximum is complete in its quad of lanes. Persistent: CTA c owns units [c U, (c + 1) U) of the
// (Q tile, KV block) sequence, tile-major; a new run (Q tile) waits until the consumers are done with the
// previous tile.
constexpr int kScreenParts = 8;               // consumer warps: TileLists partial maxima
constexpr int kWsThreads = 384;               // producer warpgroup + two consumer warpgroups
constexpr int kWsConsumerThreads = 256;

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
                   const TokenMaxOptions& o) {
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
  const std::size_t sc_smem = screen_smem(s.Dp), rk_smem = std::max(rank_smem(s.Tk), finish_smem(s.Tk));
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
  const bool use_ws = g_screen == 0, use_wgmma = g_screen == 2;
  const std::size_t wg_smem = screen_wg_smem(s.Dp);
  using WsFn = void (*)(WsParams);
  constexpr WsFn ws_by_halves[] = {screen_ws_kernel<kTiles, 1>, screen_ws_kernel<kTiles, 2>, screen_ws_kernel<kTiles, 3>,
                                   screen_ws_kernel<kTiles, 4>};
  constexpr std::size_t ws_bytes[] = {WsLayout<1>::kBytes, WsLayout<2>::kBytes, WsLayout<3>::kBytes, WsLayout<4>::kBytes};
  const int halves = static_cast<int>(wg_width(s.Dp) / 64);
  const WsFn ws = ws_by_halves[halves - 1];
  const std::size_t ws_smem = ws_bytes[halves - 1];
  if (use_ws) {
    if (ws_smem > static_cast<std::size_t>(max_smem))
      throw Error(op, "qidx", "index dim Di = " + std::to_string(s.Di) + " needs " + std::to_string(ws_smem) +
                                  " bytes of shared memory for the screening kernel; the device allows " +
                                  std::to_string(max_smem));
    attr(reinterpret_cast<const void*>(ws), ws_smem);
  }
  using ScreenFn = void (*)(ScreenParams);
  ScreenFn screen = screen_kernel<kTiles>;
  if (use_wgmma) {
    constexpr ScreenFn by_halves[] = {screen_wgmma_kernel<kTiles, 1>, screen_wgmma_kernel<kTiles, 2>,
                                      screen_wgmma_kernel<kTiles, 3>, screen_wgmma_kernel<kTiles, 4>};
    screen = by_halves[wg_width(s.Dp) / 64 - 1];
  }
  if (!use_ws) attr(reinterpret_cast<const void*>(screen), use_wgmma ? wg_smem : sc_smem);
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
  // Screened maxima; the warp-specialised screen leaves kScreenParts partial maxima per TileLists entry.
  const int parts = use_ws && kTiles ? kScreenParts : 1;
  const std::size_t o_m = take(static_cast<std::size_t>(R * s.Tk * parts) * 4);
  const std::size_t o_cls = take(static_cast<std::size_t>(R * s.Tk));
  const std::size_t o_ex = take(static_cast<std::size_t>(R * s.Tk) * 8);
  const std::size_t o_pend = take(static_cast<std::size_t>(R) * 4);
  const std::size_t o_queue = take(static_cast<std::size_t>(cap) * sizeof(int2));
  sel::StreamScratch scratch(off, stream, op);
  check_cuda(cudaMemsetAsync(scratch.as<void>(0), 0, zero_bytes, stream), op, "cudaMemsetAsync");
  auto* words = scratch.as<unsigned int>(o_words);  // [0], [1]: amax of qidx, kidx; [2]: queue length
  // Every launch after the first a programmatic dependent of the one before (chain_start), unless the
  // stage events are being recorded between them.
  const bool pdl = g_pdl.load(std::memory_order_relaxed) && g_events == nullptr;
  auto launch = [&](const char* what, auto kernel, dim3 grid, dim3 block, std::size_t smem, const auto& params) {
    sel::launch_kernel(op, what, kernel, grid, block, smem, stream, pdl, params);
  };
  auto mark = [&](int stage) {
    if (g_events != nullptr) check_cuda(cudaEventRecord(g_events[stage], stream), op, "cudaEventRecord");
  };
  mark(0);

  launch_prepare_pair(qidx, kidx, o.precision, words,
                      PrepOut{scratch.as<__nv_bfloat16>(o_qc), scratch.as<float>(o_qn), scratch.as<unsigned int>(o_qmax), s.Dp},
                      PrepOut{scratch.as<__nv_bfloat16>(o_kc), scratch.as<float>(o_kn), scratch.as<unsigned int>(o_kmax), s.Dp},
                      stream, op, pdl);

  mark(1);
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op, "cudaDeviceGetAttribute");
  // The KV blocks of a Q tile are split over several CTAs: about 8 waves of one CTA per SM keep the
  // tail (causal tiles see different numbers of blocks) short; each CTA still streams >= 4 blocks.
  const std::int64_t tiles = s.Tq * s.B * s.Hkv;
  const std::int64_t splits = imin<std::int64_t>(imin<std::int64_t>(ceil_div(s.Tk, 4), 65535),
                                                 imax<std::int64_t>(1, ceil_div(8 * static_cast<std::int64_t>(sms), tiles)));
  ScreenParams sp{scratch.as<__nv_bfloat16>(o_qc), scratch.as<__nv_bfloat16>(o_kc), scratch.as<float>(o_m), s,
                  ceil_div(s.Tk, splits)};
  dim3 sgrid(static_cast<unsigned>(s.Tq), static_cast<unsigned>(s.B * s.Hkv),
             static_cast<unsigned>(ceil_div(s.Tk, sp.per_split)));
  if (use_wgmma) {  // one wave of persistent CTAs (two per SM) over contiguous unit ranges
    const std::int64_t units = tiles * s.Tk;
    const std::int64_t ctas = imin<std::int64_t>(units, 2 * static_cast<std::int64_t>(sms));
    sp.per_split = ceil_div(units, ctas);
    sgrid = dim3(static_cast<unsigned>(ceil_div(units, sp.per_split)));
  }
  if (use_ws) {  // one wave of persistent CTAs (one per SM) over contiguous unit ranges
    WsParams wp{};
    const int dev_ord = dev;
    wp.qmap = cuda_kernels::make_bhld_tensor_map(
        op, "qidx", TensorView::contiguous(scratch.as<void>(o_qc), DType::bf16, {s.B, s.Lq, s.Hkv, s.Dp}, Device::cuda, dev_ord));
    wp.kmap = cuda_kernels::make_bhld_tensor_map(
        op, "kidx", TensorView::contiguous(scratch.as<void>(o_kc), DType::bf16, {s.B, s.Lk, s.Hk, s.Dp}, Device::cuda, dev_ord));
    wp.out = scratch.as<float>(o_m);
    wp.part_stride = R * s.Tk;
    wp.s = s;
    const std::int64_t units = tiles * s.Tk;
    const std::int64_t ctas = imin<std::int64_t>(units, static_cast<std::int64_t>(sms));
    wp.per_cta = ceil_div(units, ctas);
    launch("screen launch", ws, dim3(static_cast<unsigned>(ceil_div(units, wp.per_cta))), dim3(kWsThreads), ws_smem, wp);
  } else {
    launch("screen launch", screen, sgrid, dim3(kScreenThreads), use_wgmma ? wg_smem : sc_smem, sp);
  }
  mark(2);

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
  rp.stats = g_stats;
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
  mark(3);

  RescoreParams xp{index_src(qidx), index_src(kidx), scratch.as<__nv_bfloat16>(o_qc), scratch.as<__nv_bfloat16>(o_kc),
                   sel::in_type(qidx.dtype), sel::in_type(kidx.dtype), rp.prec, words, rp.exact, rp.count, rp.queue, s};
  // Enough CTAs for every unit of a typical queue to start at once (a handful of undecided blocks per
  // list); a long queue is walked by the same CTAs.
  const std::int64_t rgrid = imin<std::int64_t>(4 * static_cast<std::int64_t>(sms), cap * RescoreShape<kTiles>::KS);
  launch("re-scoring launch", rescore_kernel<kTiles>, dim3(static_cast<unsigned>(imax<std::int64_t>(1, rgrid))),
         dim3(kRescoreThreads), rs_smem, xp);
  mark(4);
  launch("ranking launch", finish_kernel<kTiles>, dim3(static_cast<unsigned>(R)), dim3(kRankThreads), rk_smem, rp);
  mark(5);
  check_cuda(cudaGetLastError(), op, "kernel launch");
}

}  // namespace

void set_token_max_stats(unsigned long long* device_counters) { g_stats = device_counters; }
void set_token_max_screen(int kernel) { g_screen = kernel; }
void set_token_max_pdl(bool on) { g_pdl.store(on, std::memory_order_relaxed); }
void set_token_max_events(cudaEvent_t* events) { g_events = events; }

void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out,
                      const TokenMaxOptions& o) {
  run_token_max<false>(qidx, kidx, out.idx, nullptr, o);
}

void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out,
                      const TokenMaxOptions& o) {
  run_token_max<true>(qidx, kidx, out.idx, &out.cnt, o);
}

}  // namespace sparse_attn::cuda_backend
