// MSA-style token_max selector on the GPU (docs/design.md §5.7): block scores on the tensor cores with
// float32 accumulation, each list a top-k of the exact scores within the bound eps derived below. Three or
// four launches on the caller's stream (after a memset of the two amax words where 1 and 2 are separate):
//  1. amax (prep.cuh, shared with lightning): the largest |x| of qidx and of kidx (float bits, atomicMax);
//  2. codes (prep.cuh's codes_kernel with RowLayout, a programmatic dependent of 1: its first loads are
//     issued before it waits; 1 and 2 are one cooperative launch, prep::launch_fused, where both inputs are
//     contiguous 16-bit rows that fit in one resident wave, read once and held in registers across the grid
//     barrier): every index row rounded through the precision exactly as the CPU's
//     load_quantized (tc_index.cuh; QuantisationEqualsCpu, Fp8CodesEqualCpu), stored as codes, value = code x
//     per-tensor scale up to one or two float32 roundings: fp8 as e4m3 bytes (scale amax / 448), fp4 as bf16
//     (an NVFP4 value, e2m1 x its e4m3 block scale, has up to 6 significant bits: exact in bf16, not in
//     e4m3; scale amax / 2688), bf16 as itself times 2^-e, 2^e the power of two above amax (exact unless the
//     result is subnormal; it keeps every dot of codes far from float32 overflow, whatever the inputs'
//     magnitude). Rows are padded with zero codes to Dc = Di rounded up to 16;
//  3. screen (screen_kernel, a programmatic dependent of 2): persistent and warp-specialised, every K tile
//     loaded once for two Q tiles (one at Dc > 192 bf16 codes); per (Q tile, KV block) the 128 x 128 code
//     dots on wgmma (fp8: m64n128k32 e4m3 x e4m3; bf16, fp4: m64n128k16 bf16; the k-steps chained on one
//     float32 accumulator), keeping per query the max over
//     the block's visible keys (QueryLists) or one partial max per consumer warp as an order key (TileLists);
//  4. rank (rank_kernel, a programmatic dependent of 3): per list, the forced blocks (reserved local
//     blocks, block 0 with force_block0) first, among themselves by id as the CPU's +inf scores, then the
//     screened maxima, ties to the lower id (select.cuh's group_top_k); top_k ids ascending, -1 padded, and
//     the count.
// No atomics on scores and a fixed reduction order, so two runs give the same bits.
//
// Bytes that reach HBM per call (tile16 TileLists at Lk = 16K, fp8, bf16 inputs: B = 2, Lq = 4096,
// Lk = 16384, Di = 128): the inputs are read by the amax (10.5 MB) and again by the codes (mostly from L2),
// the codes written once (fp8: 5.2 MB; bf16, fp4: 10.5 MB) and read by the screen (the K codes once per Q
// group of two tiles, from L2 after the first: 67 MB per call), the partial maxima (8 x 64 lists x 128
// blocks x 4 B = 262 KB) written and read once, the lists written. QueryLists write one maximum per (query, block): 4 MB there.
//
// ---- the bound eps ---------------------------------------------------------------------------------------
//
// Exact score (the CPU's): s = sum_d vq_d vk_d in float64 of the dequantised values. The screen computes
// T^ = the tensor-core dot of the codes cq, ck in float32; vq_d = cq_d sq up to rounding (sq, sk the
// per-tensor scales; 2^e <= 2 amax for bf16). Ranking by T^ is ranking by s^ = sq sk T^ (sq sk >= 0 is
// common to the list). Let S = sum_d |cq_d ck_d| <= |cq| |ck|, n the MMA instructions per dot (4 per 128 code bytes of
// a row: n = 4 ceil(Dc / 128) for fp8, 4 ceil(Dc / 64) for bf16 codes, zero k-steps included), and NQ, NK
// bounds of the 2-norms of the dequantised query and key rows.
//  1. Accumulation. Products of codes are exact (e4m3 x e4m3: 8 significant bits; bf16 x bf16: 16).
//     bf16 wgmma (tc_index.cuh's analysis), the block's k16 steps chained on one accumulator: terms aligned
//     to the largest and truncated with >= 24 bits kept, <= 2^-18 (|acc| + the step's |products|) <= 2^-18 S
//     (1 + rho) per step, rho <= n 2^-18: |T^ - T| <= A S (1 + rho) with A = n 2^-18.
//     fp8 wgmma: Hopper keeps fewer bits (DeepSeek-V3 reports about 14; others an e8m13 accumulator with
//     truncation; TokenMaxGpu.Fp8AccumulationWithinModel checks the model). Relied on, conservatively, for
//     one m64n128k32 instruction: it adds its 32 products to its incoming accumulator in at most 4 steps, each
//     aligning its terms (the running value and <= 32 products) to the largest magnitude and keeping >= 13
//     bits below that leading bit (truncation), then normalising the result to >= 13 bits. The kernel chains
//     the n instructions of a dot on one accumulator (as DeepGEMM does over k128), so every magnitude inside
//     instruction k is <= M_k = (S_1 + ... + S_k) (1 + 2^-7)^k, S_i the sum of instruction i's |products|
//     (the incoming value is the previous instructions' result, each within 40 x 2^-13 < 2^-7 of its own
//     magnitudes): each term loses < 2^-13 M_k, a step with m products errs by <= (m + 2) 2^-13 M_k and the
//     instruction by <= (32 + 2 x 4) 2^-13 M_k = 40 x 2^-13 M_k. Summed, with sum_k (S_1 + ... + S_k) <= n S
//     and (1 + 2^-7)^n <= 1 + 2^-6 for n <= 8 (Dc <= 256): |T^ - T| <= A S, A = n x 40 x 2^-13 (1 + 2^-6),
//     and the result below S (1 + 2^-6). (Starting every instruction from zero and adding the n results in
//     float32 would give 40 x 2^-13 + n 2^-24, n times tighter, at the price of a wait and 64 additions per
//     instruction on the CUDA cores; docs/notes/selectors_token_max.md, v6 and v7, has both measured.)
//     Products or sums below 2^-126 may be flushed: only bf16 codes can be that small (e4m3 products are
//     >= 2^-18, fp4 code products >= 2^-20): <= n 2^-121 sq sk.
//  2. Dequantisation (tc_index.cuh header): fp8, fp4: vq vk = cq ck sq sk (1 + 4 x 2^-24) plus underflow
//     terms <= 2^-146 sqrt(Di) (NQ + NK), and sq |cq| <= (1 + 2^-22) (|vq| + 2^-143) for Di <= 256. bf16:
//     vq = cq sq exactly unless the code is subnormal, |vq - cq sq| <= 2^-134 sq per element, so the
//     products differ by <= 2^-130 (sq NK + sk NQ) + 2^-260 sq sk in all, and sq |cq| <= |vq| + 2^-130 sq.
//  3. The CPU's float64 sum differs from the real s by <= Di 2^-53 NQ NK <= 2^-40 NQ NK.
//  4. A block score is a max over pairs, and |max a - max b| <= max |a - b|.
// Hence, for every candidate block j of a list (NQ over the list's query rows, NK over block j's keys):
//   |s^_j - s_j| <= e_j = (A (1 + 2^-4) + 2^-20) NQ NK + 2^-140 (NQ + NK) + 2^-128 (sq NK + sk NQ)
//                         + n 2^-120 sq sk + 2^-280,
// (token_max_score_error below). A selected a and an unselected b have s^_a >= s^_b, so
// s_a >= s_b - e_a - e_b: every list satisfies min(exact selected) >= max(exact unselected) - eps with
// eps = 2 max_j e_j over its candidates. At Di = 128: A = 2^-14 (bf16, fp4: eps ~ 2^-13 NQ NK) and
// 4 x 40 x 2^-13 (1 + 2^-6) ~ 2^-5.7 (fp8: eps ~ 0.042 NQ NK). Non-finite inputs (the CPU rejects them; the
// device does not synchronise to look) give NaN dots, which the maxima skip: a block whose every dot is
// NaN ranks as -inf.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/common/wgmma.cuh"
#include "cuda/common/wgmma_fp8.cuh"
#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"
#include "cuda/selectors/prep.cuh"
#include "cuda/selectors/scratch.hpp"
#include "cuda/selectors/select.cuh"
#include "cuda/selectors/tc_index.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using sel::check_cuda;
using sel::imax;
using sel::imin;
using sel::order_key;
using sel::In;
using sel::Prec;

constexpr int kMaxDi = 256;
constexpr int kRankThreads = 128;

struct Shape {
  std::int64_t B, Lq, Lk, Hkv, Hk, Di, Dc, Tq, Tk;
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

/// Code bytes per element: e4m3 for fp8, bf16 otherwise.
constexpr int code_bytes(IndexPrecision p) { return p == IndexPrecision::fp8_e4m3 ? 1 : 2; }

/// 128-byte halves of a code row (the TMA box width and the swizzle span).
std::int64_t code_halves(std::int64_t Dc, IndexPrecision p) { return (Dc * code_bytes(p) + 127) / 128; }

// ---- 3. screen ------------------------------------------------------------------------------------------

// The 128 query code rows of a Q tile times each KV block's 128 key code rows, both K-major in 128B-swizzled
// shared memory as S = Q K^T of the attention kernels: a tile is [kHalves][128 rows][128 B], halves
// 1024-aligned, bytes past the row's codes zero (TMA fills past Dc and past L with zeros; the visibility
// limits exclude rows past L). A k-step reads 32 B of each row: k16 of bf16, k32 of e4m3.
// Warp-specialised: one producer thread streams a group of kQTiles consecutive Q tiles of one (batch, head)
// and the KV blocks with TMA (128-row x 128-byte boxes) through a ring of kStages K slots; every K tile is
// multiplied by each tile of the group that sees it before its slot goes back, so a K tile crosses from L2
// once per group, not once per Q tile (the screen's L2 traffic: 16 KB per (tile, block) at Di = 128 fp8,
// 134 MB per call at tile16 16K with one tile per load). Four consumer warpgroups, one per 64-row half of
// each of the group's (up to) two Q tiles, walk every K slot of the run and multiply the blocks their tile
// sees, one job at a time (issue, wait, maxima, store): a job's maxima are a dependent chain several times
// longer than its wgmmas, so the tensor cores are kept busy by the other warpgroups' jobs, not by double
// buffering inside one (measured: docs/notes/selectors_token_max.md, v7). 640 threads leave 96 registers a
// thread, enough for one 64-float accumulator. Persistent: CTA c owns units [c U, (c + 1) U) of the (Q group,
// KV block) sequence, group-major; a new run (Q group) waits until the consumers are done with the previous
// group's Q tiles.
constexpr int kHalfBytes = 128 * 128;  // one 128-byte-wide half of a 128-row tile
constexpr int kScreenParts = 8;        // consumer warps per Q tile: TileLists partial maxima
constexpr int kConsumerWGs = 4;        // warpgroup w: 64 rows (half w % 2) of the group's Q tile w / 2
constexpr int kScreenThreads = 128 * (kConsumerWGs + 1);  // + the producer warpgroup
constexpr int kConsumerThreads = 128 * kConsumerWGs;

template <int kHalves>
struct ScreenLayout {
  static constexpr int kTile = kHalves * kHalfBytes;  // 128 rows of codes
  // Q tiles per K load: 2 (half the K traffic), except at 4 halves where two Q tiles would leave room for
  // one K slot only. K slots: as many as fit beside them in 194 KB, at most 8.
  static constexpr int kQTiles = kHalves == 4 ? 1 : 2;
  static constexpr int kStages = kHalves == 1 ? 8 : kHalves == 2 ? 4 : 2;
  static constexpr int kBarOffset = (kQTiles + kStages) * kTile;  // after Q and the ring
  static constexpr std::size_t kBytes = kBarOffset + 1024 + 1024;  // barriers, alignment slack
};

struct ScreenParams {
  CUtensorMap qmap, kmap;  // codes [B, Lq, Hkv, Dc] and [B, Lk, Hk, Dc] as 16-bit columns
  float* out;              // QueryLists [B, Hkv, Lq, Tk] maxima; TileLists kScreenParts x [B, Hkv, Tq, Tk] order keys
  std::int64_t part_stride;
  Shape s;
  std::int64_t per_cta;    // (group, block) units per CTA
};

// The run of units [u, ...) of one Q group: tiles t0 .. t0 + nt - 1 of (b, g), the blocks [j_begin, j_end)
// some tile of it sees; tile q sees blocks below jmax[q], which grows with q (a suffix of the group's tiles
// sees any block, the last tile every block of the run).
template <int kQTiles>
struct Run {
  std::int64_t bg, b, g, hk, t0, j_begin, j_end, next;
  std::int64_t jmax[kQTiles];
  int nt;
};
template <int kQTiles>
__device__ __forceinline__ Run<kQTiles> run_of(const Shape& s, std::int64_t u, std::int64_t u_end) {
  Run<kQTiles> r;
  const std::int64_t groups = (s.Tq + kQTiles - 1) / kQTiles;
  const std::int64_t grp = u / s.Tk, run_end = imin(u_end, (grp + 1) * s.Tk);
  r.bg = grp / groups, r.b = r.bg / s.Hkv, r.g = r.bg % s.Hkv;
  r.hk = s.Hk == 1 ? 0 : r.g;
  r.t0 = grp % groups * kQTiles;
  r.nt = static_cast<int>(imin<std::int64_t>(kQTiles, s.Tq - r.t0));
#pragma unroll
  for (int q = 0; q < kQTiles; ++q) {
    const std::int64_t i_hi = imin(s.Lq, (r.t0 + imin(q, r.nt - 1) + 1) * kTileQ) - 1;
    r.jmax[q] = (s.key_end(i_hi) + kBlockK - 1) / kBlockK;  // blocks some query of tile q sees
  }
  r.j_begin = u - grp * s.Tk;
  r.j_end = imin(r.jmax[kQTiles - 1], run_end - grp * s.Tk);
  r.next = run_end;
  return r;
}

template <bool kTiles, bool kFp8, int kHalves>
__global__ void __launch_bounds__(kScreenThreads, 1) screen_kernel(const __grid_constant__ ScreenParams p) {
  // Waits for the codes; does not let the ranking start early (its CTAs would sit beside the screen).
  sel::pdl_wait();
  using Lay = ScreenLayout<kHalves>;
  constexpr int kStages = Lay::kStages, kQTiles = Lay::kQTiles;
  namespace ck = cuda_kernels;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (ck::smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* qs = smem;                      // [kQTiles] Q tiles
  unsigned char* ks = smem + kQTiles * Lay::kTile;  // [kStages] K slots
  auto* bars = reinterpret_cast<ck::MBarrier*>(smem + Lay::kBarOffset);
  ck::MBarrier* full = bars;             // [kStages]: K slot loaded
  ck::MBarrier* empty = bars + kStages;  // [kStages]: K slot released by every consumer thread
  ck::MBarrier& q_full = bars[2 * kStages];
  ck::MBarrier& q_empty = bars[2 * kStages + 1];
  const Shape& s = p.s;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) full[i].init(1), empty[i].init(kConsumerThreads);
    q_full.init(1);
    q_empty.init(kConsumerThreads);
    ck::fence_barrier_init();
  }
  __syncthreads();
  const std::int64_t units = s.B * s.Hkv * ((s.Tq + kQTiles - 1) / kQTiles) * s.Tk;
  const std::int64_t u_first = static_cast<std::int64_t>(blockIdx.x) * p.per_cta, u_end = imin(units, u_first + p.per_cta);

  if (tid < 128) {  // producer warpgroup: one thread issues every load
    ck::warpgroup_reg_dealloc<40>();
    if (tid != 0) return;
    ck::tma_prefetch_descriptor(&p.qmap);
    ck::tma_prefetch_descriptor(&p.kmap);
    ck::PipelineState<kStages> ring;
    int run = 0;
    for (std::int64_t u = u_first; u < u_end;) {
      const Run<kQTiles> r = run_of<kQTiles>(s, u, u_end);
      u = r.next;
      if (r.j_begin >= r.j_end) continue;
      if (run > 0) q_empty.wait(static_cast<std::uint32_t>((run - 1) & 1));
      q_full.arrive_expect_tx(r.nt * Lay::kTile);
      for (int q = 0; q < r.nt; ++q)
        for (int h = 0; h < kHalves; ++h)
          ck::tma_load_bhld(qs + q * Lay::kTile + h * kHalfBytes, &p.qmap, h * 64, static_cast<int>(r.g),
                            static_cast<int>((r.t0 + q) * kTileQ), static_cast<int>(r.b), &q_full.word);
      ++run;
      for (std::int64_t j = r.j_begin; j < r.j_end; ++j) {
        const int st = ring.stage();
        empty[st].wait(ring.phase() ^ 1u);
        full[st].arrive_expect_tx(Lay::kTile);
        for (int h = 0; h < kHalves; ++h)
          ck::tma_load_bhld(ks + st * Lay::kTile + h * kHalfBytes, &p.kmap, h * 64, static_cast<int>(r.hk),
                            static_cast<int>(j * kBlockK), static_cast<int>(r.b), &full[st].word);
        ring.advance();
      }
    }
    return;
  }

  // The warpgroup and warp indices warp_uniform: the wgmma descriptors and the per-run limits are built in
  // uniform registers, not per job in vector ones.
  const int ctid = tid - 128, lane = tid % 32;
  const int wg = ck::warp_uniform(ctid / 128), w = ck::warp_uniform((ctid / 32) % 4);
  const int mq = wg / 2, half = wg % 2;       // this warpgroup's Q tile in the group and its 64 rows
  const int part = half * 4 + w;              // TileLists: the warp's partial maximum
  constexpr int ksteps = kHalves * 4;
  ck::PipelineState<kStages> ring;
  float acc[64];
  // The wgmma descriptors: A (the warpgroup's 64 rows of its Q tile) fixed, B one per K slot, each k-step
  // an add (ck::desc_advance).
  const std::uint64_t base_a =
      ck::make_desc_sw128(ck::smem_addr(qs) + (mq < kQTiles ? mq : 0) * Lay::kTile + half * 64 * 128, 16, 1024);
  const std::uint64_t base_b = ck::make_desc_sw128(ck::smem_addr(ks), 16, 1024);
  auto issue = [&](int st) {
    ck::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < ksteps; ++kk) {
      const auto off = static_cast<std::uint32_t>((kk / 4) * kHalfBytes + (kk % 4) * 32);
      const std::uint64_t da = ck::desc_advance(base_a, off);
      const std::uint64_t db = ck::desc_advance(base_b, static_cast<std::uint32_t>(st * Lay::kTile) + off);
      if constexpr (kFp8)
        ck::wgmma_ss_e4m3(acc, da, db, kk > 0);
      else
        ck::wgmma_ss<ck::Bf16Tag>(acc, da, db, kk > 0);
    }
    ck::wgmma_commit();
  };

  int run = 0;
  for (std::int64_t u = u_first; u < u_end;) {
    const Run<kQTiles> r = run_of<kQTiles>(s, u, u_end);
    u = r.next;
    if (r.j_begin >= r.j_end) continue;
    q_full.wait(static_cast<std::uint32_t>(run & 1));
    ++run;
    // Only what the walk needs stays live (the kernel has 96 registers a thread): block ids fit 32 bits.
    const std::int64_t t = r.t0 + mq, i0 = t * kTileQ + half * 64 + 16 * w;  // the warp's first row
    const int jmax = mq < r.nt ? static_cast<int>(r.jmax[mq < kQTiles ? mq : 0]) : 0;
    const int j_end = static_cast<int>(r.j_end);
    // Blocks below j_full are seen whole by all 16 of the warp's rows (key_end grows with the row): no mask.
    const int j_full = i0 + 15 < s.Lq ? static_cast<int>(s.key_end(i0) / kBlockK) : 0;
    float* const out = kTiles ? p.out + part * p.part_stride + (r.bg * s.Tq + t) * s.Tk : p.out + r.bg * s.Lq * s.Tk;
    // Every warpgroup walks every block of the run (each releases every slot); it multiplies the blocks its
    // tile sees. One job at a time: issue, wait, maxima; the tensor cores take the other warpgroups' jobs
    // meanwhile.
    for (int j = static_cast<int>(r.j_begin); j < j_end; ++j) {
      const int st = ring.stage();
      full[st].wait(ring.phase());
      ring.advance();
      if (j >= jmax) {
        empty[st].arrive();
        continue;
      }
      issue(st);
      ck::wgmma_wait<0>();
      ck::fence_operands(acc);
      empty[st].arrive();  // the accumulators hold everything this thread needs from the slot
      const std::int64_t k0 = static_cast<std::int64_t>(j) * kBlockK;
      const bool full_rows = j < j_full;
      // The row maxima by balanced float trees (masked where the warp's rows do not all see the block).
      auto row_maxima = [&](float (&m)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float a[16];
          if (full_rows) {
#pragma unroll
            for (int c = 0; c < 16; ++c) a[c] = fmaxf(acc[4 * c + 2 * h], acc[4 * c + 2 * h + 1]);
          } else {
            const std::int64_t i = i0 + lane / 4 + 8 * h;
            const std::int64_t lim = i < s.Lq ? s.key_end(i) - k0 : 0;
#pragma unroll
            for (int c = 0; c < 16; ++c) {
              const int key = 8 * c + 2 * (lane % 4);
              a[c] = fmaxf(key < lim ? acc[4 * c + 2 * h] : -INFINITY, key + 1 < lim ? acc[4 * c + 2 * h + 1] : -INFINITY);
            }
          }
#pragma unroll
          for (int c = 0; c < 8; ++c) a[c] = fmaxf(a[c], a[c + 8]);
#pragma unroll
          for (int c = 0; c < 4; ++c) a[c] = fmaxf(a[c], a[c + 4]);
          m[h] = fmaxf(fmaxf(a[0], a[2]), fmaxf(a[1], a[3]));
        }
      };
      if constexpr (kTiles) {
        // Where the warp sees the whole block: the max of the 64 values' bits as signed integers by 3-input
        // VIMNMX3 (32 instructions for 64 values): the float max whenever that is +0 or more and not NaN;
        // otherwise (every value negative, or a NaN) the float trees.
        int bits = -1;
        if (full_rows) {
          int x[64];
#pragma unroll
          for (int c = 0; c < 64; ++c) x[c] = __float_as_int(acc[c]);
          int a1[22], b1[8];
#pragma unroll
          for (int c = 0; c < 21; ++c) a1[c] = __vimax3_s32(x[3 * c], x[3 * c + 1], x[3 * c + 2]);
          a1[21] = x[63];
#pragma unroll
          for (int c = 0; c < 7; ++c) b1[c] = __vimax3_s32(a1[3 * c], a1[3 * c + 1], a1[3 * c + 2]);
          b1[7] = a1[21];
          bits = __vimax3_s32(__vimax3_s32(b1[0], b1[1], b1[2]), __vimax3_s32(b1[3], b1[4], b1[5]), max(b1[6], b1[7]));
        }
        float v;
        if (bits >= 0 && bits <= 0x7f800000) {
          v = __int_as_float(bits) + 0.0f;
        } else {
          float m[2];
          row_maxima(m);
          v = fmaxf(fmaxf(m[0], m[1]), -INFINITY) + 0.0f;
        }
        const unsigned key = __reduce_max_sync(0xffffffffu, order_key(v));
        if (lane == 0) reinterpret_cast<unsigned*>(out)[j] = key;
      } else {
        float m[2];
        row_maxima(m);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float v = ck::quad_max(m[h]);
          const std::int64_t i = i0 + lane / 4 + 8 * h;
          if (lane % 4 == 0 && i < s.Lq) out[i * s.Tk + j] = v;
        }
      }
    }
    q_empty.arrive();  // every wgmma that read the group's Q tiles is complete
  }
}

// ---- 4. ranking -----------------------------------------------------------------------------------------

struct RankParams {
  const float* m;            // screened maxima: QueryLists [R, Tk] floats; TileLists kScreenParts x [R, Tk] order keys
  std::int64_t part_stride;  // R * Tk
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, width;
  std::int32_t* cnt;         // TileLists only
  std::int64_t cs0, cs1, cs2;
  Shape s;
  int top_k;
  bool reserve_local, force_block0;
};

// One list: its candidates, its reserved local blocks, where it goes.
struct ListRow {
  std::int64_t b, g, pos;   // pos: query i (QueryLists) or tile t (TileLists)
  std::int64_t n;           // candidates: blocks 0 .. n - 1
  std::int64_t r_lo, r_hi;  // reserved local blocks (empty when r_lo > r_hi)
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
  L.r_lo = 1, L.r_hi = 0;
  if constexpr (kTiles) {
    const std::int64_t i_first = L.pos * kTileQ, i_last = imin(s.Lq, i_first + kTileQ) - 1;
    L.n = (s.key_end(i_last) + kBlockK - 1) / kBlockK;
    // The aligned key grows with i: the reserved blocks are a contiguous range.
    if (p.reserve_local && s.aligned(i_last) >= 0) {
      const std::int64_t first_seen = s.causal ? imax(i_first, s.Lq - s.Lk) : i_first;
      L.r_lo = s.aligned(first_seen) / kBlockK;
      L.r_hi = s.aligned(i_last) / kBlockK;
    }
  } else {
    L.n = (s.key_end(L.pos) + kBlockK - 1) / kBlockK;
    if (p.reserve_local && s.aligned(L.pos) >= 0) L.r_lo = L.r_hi = s.aligned(L.pos) / kBlockK;
  }
  L.out = p.idx + L.b * p.is0 + L.g * p.is1 + L.pos * p.is2;
  return L;
}

// rank_kernel's shared memory: the order keys (16-byte aligned), then the selecting group's scratch.
__host__ __device__ constexpr std::size_t rank_keys_bytes(std::int64_t Tk) {
  return (static_cast<std::size_t>(Tk) * sizeof(unsigned) + 15) / 16 * 16;
}
std::size_t rank_smem(std::int64_t Tk) {
  return rank_keys_bytes(Tk) + sel::Group<kRankThreads>::kScratchWords * sizeof(unsigned);
}

// grid: R lists, one CTA each. Per candidate its order key in shared memory: a forced block's above every
// score (sel::kForcedKey: forced blocks tie and go by id, as the CPU's +inf scores), else the screened
// maximum's (QueryLists: sanitised here; TileLists: the max of the kScreenParts warps' keys, sanitised by the
// screen); then group_top_k on (key, id): exactly min(top_k, n) kept, ids ascending.
template <bool kTiles>
__global__ void __launch_bounds__(kRankThreads) rank_kernel(const __grid_constant__ RankParams p) {
  sel::pdl_wait();
  sel::pdl_launch_dependents();
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  auto* keys = reinterpret_cast<unsigned*>(smem);
  const sel::Group<kRankThreads> gr{static_cast<int>(threadIdx.x), cuda_kernels::NamedBarrier::kSync,
                                    reinterpret_cast<unsigned*>(smem + rank_keys_bytes(s.Tk))};
  const std::int64_t row = blockIdx.x;
  const ListRow L = list_row<kTiles>(p, row);
  const int n = static_cast<int>(L.n);
  const float* mrow = p.m + row * s.Tk;
  for (int j = gr.tid; j < n; j += kRankThreads) {
    unsigned key;
    if constexpr (kTiles) {  // the warps' order keys, their 8 loads in flight together
      unsigned m[kScreenParts];
#pragma unroll
      for (int q = 0; q < kScreenParts; ++q) m[q] = reinterpret_cast<const unsigned*>(mrow)[q * p.part_stride + j];
      key = m[0];
#pragma unroll
      for (int q = 1; q < kScreenParts; ++q) key = max(key, m[q]);
    } else {
      key = sel::order_key(sel::sanitize(mrow[j]));
    }
    const bool forced = (j >= L.r_lo && j <= L.r_hi) || (p.force_block0 && j == 0);
    keys[j] = forced ? sel::kForcedKey : key;
  }
  __syncthreads();
  const int c =
      sel::group_top_k(gr, [keys](int i) { return sel::rank_key_of(keys[i], i); }, n, p.top_k, L.out, p.is3, p.width);
  if constexpr (kTiles)
    if (gr.tid == 0) p.cnt[L.b * p.cs0 + L.g * p.cs1 + L.pos * p.cs2] = c;
}

// ---- host ------------------------------------------------------------------------------------------------

/// Offsets of the one scratch allocation of a call.
struct Scratch {
  std::size_t amax, slots, qc, kc, m, bytes;
};

Scratch scratch_layout(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hkv, std::int64_t Hk,
                       std::int64_t Di, IndexPrecision p, bool tiles) {
  const std::int64_t Dc = tc::padded_dim(Di), Tq = ceil_div(Lq, kTileQ), Tk = ceil_div(Lk, kBlockK);
  const std::int64_t R = B * Hkv * (tiles ? Tq : Lq);
  Scratch sc{};
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += sel::align_up(bytes);
    return at;
  };
  sc.amax = take(2 * sizeof(unsigned int));  // amax of qidx, kidx
  sc.slots = take(prep::fused_slot_bytes());  // the fused prep's per-CTA maxima
  sc.qc = take(static_cast<std::size_t>(B * Lq * Hkv * Dc * code_bytes(p)));
  sc.kc = take(static_cast<std::size_t>(B * Lk * Hk * Dc * code_bytes(p)));
  sc.m = take(static_cast<std::size_t>(R * Tk * (tiles ? kScreenParts : 1)) * sizeof(float));
  sc.bytes = off;
  return sc;
}

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
  s.Dc = tc::padded_dim(s.Di), s.Tq = ceil_div(s.Lq, kTileQ), s.Tk = ceil_div(s.Lk, kBlockK);
  s.causal = o.causal;
  const auto stream = static_cast<cudaStream_t>(o.stream);
  const IndexPrecision prec = o.precision;
  const bool fp8 = prec == IndexPrecision::fp8_e4m3;

  if (s.Di > kMaxDi)
    throw Error(op, "qidx", "index dim Di = " + std::to_string(s.Di) + " exceeds the CUDA token_max selector's limit of " +
                                std::to_string(kMaxDi));
  const std::size_t rk_smem = rank_smem(s.Tk);
  if (rk_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "kidx", "Lk = " + std::to_string(s.Lk) + " gives " + std::to_string(s.Tk) +
                                " blocks, more than the CUDA selector's shared-memory ranking holds");
  const std::int64_t R = s.B * s.Hkv * (kTiles ? s.Tq : s.Lq);
  if (R > 0x7fffffff || s.Lq > 0x7fffffff || s.Lk > 0x7fffffff)
    throw Error(op, "qidx", "the problem has more lists or rows than the CUDA token_max selector indexes");

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
  using ScreenFn = void (*)(ScreenParams);
  constexpr ScreenFn bf16_screens[] = {screen_kernel<kTiles, false, 1>, screen_kernel<kTiles, false, 2>,
                                       screen_kernel<kTiles, false, 3>, screen_kernel<kTiles, false, 4>};
  constexpr ScreenFn fp8_screens[] = {screen_kernel<kTiles, true, 1>, screen_kernel<kTiles, true, 2>};
  constexpr std::size_t screen_bytes[] = {ScreenLayout<1>::kBytes, ScreenLayout<2>::kBytes, ScreenLayout<3>::kBytes,
                                          ScreenLayout<4>::kBytes};
  const int halves = static_cast<int>(code_halves(s.Dc, prec));
  const ScreenFn screen = fp8 ? fp8_screens[halves - 1] : bf16_screens[halves - 1];
  constexpr int screen_qtiles[] = {ScreenLayout<1>::kQTiles, ScreenLayout<2>::kQTiles, ScreenLayout<3>::kQTiles,
                                   ScreenLayout<4>::kQTiles};
  const std::size_t sc_smem = screen_bytes[halves - 1];
  if (sc_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "qidx", "index dim Di = " + std::to_string(s.Di) + " needs " + std::to_string(sc_smem) +
                                " bytes of shared memory for the screening kernel; the device allows " +
                                std::to_string(max_smem));
  attr(reinterpret_cast<const void*>(screen), sc_smem);
  attr(reinterpret_cast<const void*>(rank_kernel<kTiles>), rk_smem);

  const Scratch lay = scratch_layout(s.B, s.Lq, s.Lk, s.Hkv, s.Hk, s.Di, prec, kTiles);
  sel::Scratch scratch(op, o.workspace, lay.bytes, qidx.device_index, stream);
  auto* amax = scratch.as<unsigned int>(lay.amax);
  prep::CodesParams<prep::RowLayout> pp{};
  pp.src[0] = tc::index_src(qidx), pp.src[1] = tc::index_src(kidx);
  pp.type[0] = sel::in_type(qidx.dtype), pp.type[1] = sel::in_type(kidx.dtype);
  pp.dst[0] = scratch.as<unsigned char>(lay.qc), pp.dst[1] = scratch.as<unsigned char>(lay.kc);
  for (int i = 0; i < 2; ++i) pp.lay[i] = {s.Dc * code_bytes(prec), prep::contiguous_rows(pp.src[i])};
  pp.lanes = static_cast<int>(s.Dc / 8);
  pp.rows0 = s.B * s.Lq * s.Hkv;
  pp.rows = pp.rows0 + s.B * s.Lk * s.Hk;
  pp.amax = amax;
  pp.bf16_down = true;
  // One launch where the inputs fit in a resident wave (prep::launch_fused), else the amax and then the codes.
  auto codes = [&]<Prec P>() {
    if (prep::launch_fused<P>(op, pp, amax, scratch.as<float>(lay.slots), stream)) return;
    check_cuda(cudaMemsetAsync(amax, 0, 2 * sizeof(unsigned int), stream), op, "cudaMemsetAsync");
    prep::launch_amax(op, qidx, &kidx, amax, stream);
    prep::launch_codes<P>(op, pp, true, stream);
  };
  if (prec == IndexPrecision::bf16) codes.template operator()<Prec::bf16>();
  else if (fp8) codes.template operator()<Prec::fp8>();
  else codes.template operator()<Prec::fp4>();
  const int sms = sel::current_sm_count(op);

  // The code rows as 16-bit columns (e4m3 bytes in pairs): TMA moves bits, and a box of 64 columns is the
  // 128-byte swizzle span either way.
  const std::int64_t cols = s.Dc * code_bytes(prec) / 2;
  ScreenParams sp{};
  sp.qmap = cuda_kernels::make_bhld_tensor_map(
      op, "qidx", TensorView::contiguous(scratch.as<void>(lay.qc), DType::bf16, {s.B, s.Lq, s.Hkv, cols}, Device::cuda, dev));
  sp.kmap = cuda_kernels::make_bhld_tensor_map(
      op, "kidx", TensorView::contiguous(scratch.as<void>(lay.kc), DType::bf16, {s.B, s.Lk, s.Hk, cols}, Device::cuda, dev));
  sp.out = scratch.as<float>(lay.m);
  sp.part_stride = R * s.Tk;
  sp.s = s;
  // One wave of persistent CTAs (one per SM) over contiguous ranges of (Q group, KV block) units.
  const std::int64_t units = ceil_div(s.Tq, screen_qtiles[halves - 1]) * s.B * s.Hkv * s.Tk;
  const std::int64_t ctas = imin<std::int64_t>(units, static_cast<std::int64_t>(sms));
  sp.per_cta = ceil_div(units, ctas);
  sel::launch_dependent(op, "screen launch", screen, dim3(static_cast<unsigned>(ceil_div(units, sp.per_cta))),
                        dim3(kScreenThreads), sc_smem, stream, sp);

  RankParams rp{};
  rp.m = scratch.as<float>(lay.m);
  rp.part_stride = R * s.Tk;
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
  rp.force_block0 = o.force_block0;
  sel::launch_dependent(op, "ranking launch", rank_kernel<kTiles>, dim3(static_cast<unsigned>(R)), dim3(kRankThreads),
                        rk_smem, stream, rp);
  check_cuda(cudaGetLastError(), op, "kernel launch");
}

}  // namespace

std::size_t token_max_scratch_bytes(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hkv, std::int64_t Hk,
                                    std::int64_t Di, IndexPrecision precision, bool tiles) {
  return scratch_layout(B, Lq, Lk, Hkv, Hk, Di, precision, tiles).bytes;
}

double token_max_score_error(IndexPrecision precision, std::int64_t Di, double nq, double nk, double sq, double sk) {
  const std::int64_t Dc = tc::padded_dim(Di);
  const bool fp8 = precision == IndexPrecision::fp8_e4m3;
  const double n = 4.0 * static_cast<double>(code_halves(Dc, precision));
  const double acc = fp8 ? n * 40.0 * 0x1p-13 * (1.0 + 0x1p-6) : n * 0x1p-18;  // A of the derivation's item 1
  return (acc * (1.0 + 0x1p-4) + 0x1p-20) * nq * nk + 0x1p-140 * (nq + nk) + 0x1p-128 * (sq * nk + sk * nq) +
         n * 0x1p-120 * sq * sk + 0x1p-280;
}

void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out, const TokenMaxOptions& o) {
  run_token_max<false>(qidx, kidx, out.idx, nullptr, o);
}

void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out, const TokenMaxOptions& o) {
  run_token_max<true>(qidx, kidx, out.idx, &out.cnt, o);
}

}  // namespace sparse_attn::cuda_backend
