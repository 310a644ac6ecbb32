// R1 / R4 pooled selector on the GPU (docs/design.md §5.7): float32 scores with a derived error bound
// against the CPU's float64 scores (src/selectors/pooled.cpp), no float64 and no second pass. Two
// kernels on the caller's stream, the second a programmatic dependent of the first:
//
//  1. representatives (q and k in one grid): L warps share each (representative row, slice of 8 columns)
//     column (L = 8 for R1, 2 for R4), a warp 32 columns, one per lane, a CTA 256 / L columns; warp u of
//     the L sums the tokens u, u + L, u + 2 L, ... of its lane's column (16 per thread, every 16-byte load
//     in flight at once) by a balanced tree in float32, and the L partial sums are added by a balanced
//     tree in shared memory: each token passes through log2(128 / r) additions. Scalar loads where the
//     views allow no 16-byte vectors. The mean m = sum / n (n tokens present) is stored as two bf16 planes,
//     hi = bf16(m) and lo = bf16(m - hi), rows of Dp = D rounded up to 16 columns (zero past D). The rows
//     of one job (b, group, Q tile), group * r of them, are contiguous. The kernel reads its input once:
//     it is bound by HBM bandwidth (42 MB at the tile16 shape, Lk = 16K). CTA 0 zeroes kernel 2's counters.
//  2. scores + top-k: C CTAs per job (chunks of its key rows in multiples of 16; C = 1 where the job's key
//     rows fit one staged slab, else up to 8 with the grid one wave of two CTAs per SM). A CTA stages the
//     query rows and a slab of key rows (both planes) in shared memory by cp.async and splits the slab into
//     tasks of 16 key rows x 32 query rows over its 8 warps: mma.sync m16n8k16 bf16 with float32
//     accumulation, hi.hi in one accumulator and hi.lo + lo.hi in another, score = acc1 + acc2.
//     Uncounted pairs (causal, absent representatives) are masked; the maxima over a task's query rows meet
//     per key row in shared memory (atomicMax on order-preserving keys), then over the r key rows of a
//     block: the block scores. With C = 1 they stay in shared memory and the CTA ranks; otherwise they go
//     to the scratch and the chunk that finishes last (a fence and a counter per job) ranks: forced blocks
//     set to +inf, then the top-k of select.cuh (group_top_k: ties to the lower id, ids written ascending).
//     Every reduction has a fixed order or is a maximum, so two runs give the same bits.
//
// Why the tensor cores: R4 at the tile16 shape is 268 M multiply-adds per call, 8 us at the H200's
// float32 FMA peak on the CUDA cores, against a 25 us target that the reads alone take 13-15 us of. The
// split products cost three bf16 MMAs per product, about 2.5 us spread over the SMs, and keep the bound
// near 2^-15 of the dots' absolute size instead of the 2^-8 a single bf16 product would give.
//
// Error bound (pooled_error_bound below; the GPU tests check lists against it). u = 2^-24. For one
// representative row of n <= 128 / r tokens x_l (float32 values of the inputs), column d: mu = sum x / n,
// a = sum |x| / n (so |mu| <= a), c = the CPU's mean (a float64 sum and division, rounded to float32).
//  (a) Device mean m^: each x passes through h = log2(128 / r) float32 additions (7 for R1, 5 for R4: a
//      balanced tree over its lane's tokens, then over the eight lanes; absent tokens add exact zeros), so
//      |sum^ - sum| <= gamma_h sum |x|, gamma_h = h u / (1 - h u);
//      the division adds u |sum^ / n| and at most 2^-150 below the normal range. With the CPU's
//      |c - mu| <= u a + 2^-45 a + 2^-150 (float64 steps, n <= 128, then the float32 rounding):
//      |m^ - c| <= delta a + 2^-149, delta = gamma_h (1 + u) + 2 u + 2^-45.
//  (b) Split: hi = bf16(m^), lo = bf16(m^ - hi) (the subtraction is exact), |m^ - hi - lo| <= 2^-16 |m^|,
//      |lo| <= 2^-8 (1 + 2^-8) |m^|. The three products hq hk + hq lk + lq hk miss
//      lq lk + (hq + lq) rho_k + rho_q (hk + lk) + rho_q rho_k, at most 3.02 * 2^-16 |m^q m^k| per column.
//      If the tensor cores flush bf16 subnormals, hi or lo lose at most 2^-125 more each.
//  (c) Accumulation: the bf16 products are exact in float32 (or below 2^-126 and flushed). Hopper's
//      float32 MMA accumulation aligns its terms to the largest exponent and truncates (>= 24 bits
//      kept), then normalises: per m16n8k16 step at most 2^-18 (|acc| + sum of the step's |products|)
//      plus 17 * 2^-126 (the model of tc_index.cuh, "the screening bound"). acc1 takes n1 = Dp / 16
//      steps over the hi.hi products, whose absolute sum is <= (1 + 2^-8)^2 A, A = sum_d |m^q m^k|;
//      acc2 takes 2 n1 steps over the cross products (absolute sum <= 2^-7 * 1.008 A). With n1 <= 2^10
//      (|acc| grows by at most n1 2^-18) this is <= 1.028 n1 2^-18 A; the final float32 addition adds
//      u (|acc1| + |acc2|) <= 1.02 u A, inside the slack of (b) (3.008 * 2^-16 rounded up to 3.02).
//  (d) The CPU's float64 dot is within D 2^-52 sum |cq ck| of the exact dot of its means.
// Per pair, with sums over d and A <= sum (|cq| + delta aq)(|ck| + delta ak) (+ absolute terms):
//   |s^ - S| <= delta sum (aq |ck| + |cq| ak + delta aq ak)
//             + (3.02 * 2^-16 + 1.03 n1 2^-18 + D 2^-52) sum (|cq| + delta aq)(|ck| + delta ak)
//             + 2^-120 (1 + D + sum (|cq| + |ck| + aq + ak)),
// the last term collecting every underflow (2^-149 per mean, 2^-125 per split value, flushed products
// and steps: 3 D 2^-126 + (3 Dp / 16) 17 2^-126). A block score is a maximum over pairs, so it is within
// the largest pair bound e_j of the block's exact score; the device ranks block i above j only if
// S_i >= S_j - (e_i + e_j), so every list is a top-k of the exact scores up to 2 max_j e_j. Valid while
// every mean is finite and below 2^60 in magnitude (no float32 overflow in products or sums).
// Random N(0, 1) inputs at the tile16 shape (Lk = 8K, top-16): median 2 max_j e_j 1.5e-4 (R1) and 6.0e-4
// (R4) against median top-k gaps of 1.9e-3 and 6.1e-3.
//
// Non-finite inputs: the CPU rejects nothing here and ranks NaN scores as -inf; on the device a
// representative holding a non-finite mean makes every pair it takes part in NaN (hi - hi or inf * 0),
// and NaN pairs are ignored by the maxima, so such a pair ranks as -inf (a block left without pairs
// still counts as a candidate, scored -inf). Scores beyond float32's range become +-inf or NaN.
//
// Scratch: both planes of both tensors, the block scores ([jobs][Tk] float32) and the chunk counters
// (one word per job), pooled_scratch_bytes, one allocation per call (scratch.hpp: the caller's
// options.workspace, or the library's per (device, stream)).
#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/common/mma_sync.cuh"
#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"
#include "cuda/selectors/scratch.hpp"
#include "cuda/selectors/select.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using namespace sel;
using cuda_kernels::Bf16Tag;
using cuda_kernels::cp_async16;
using cuda_kernels::ldmatrix_x4;
using cuda_kernels::mma_m16n8k16;

// ---- shapes shared by the host and the kernels ----------------------------------------------------------

constexpr std::int64_t kKStep = 16;  // columns of one mma k-step; rows of the planes hold Dp = D rounded up
constexpr int kSliceCols = 8;        // columns of a representative row per thread of kernel 1 (16 output bytes)
constexpr int kRepThreads = 256;
constexpr int kRepPerLane = 16;      // tokens per thread of kernel 1: 256 bytes of 16-byte loads in flight
// Warps of kernel 1 sharing a column (tokens interleaved over them): 8 for R1, 2 for R4. A CTA takes
// kRepThreads / rep_lanes(r) columns: 32 (R1), 128 (R4).
constexpr int rep_lanes(int r) { return static_cast<int>(kTileQ) / r / kRepPerLane; }
constexpr int rep_columns(int r) { return kRepThreads / rep_lanes(r); }

// Float32 additions each token passes through on its way into a representative's sum (kernel 1): a
// balanced binary tree over the 128 / r tokens of the span.
constexpr int rep_sum_depth(int r) {
  int depth = 0;
  while ((1 << depth) < kTileQ / r) ++depth;
  return depth;
}
static_assert((1 << rep_sum_depth(1)) == kTileQ && (1 << rep_sum_depth(4)) == kTileQ / 4 &&
              rep_lanes(1) * kRepPerLane == kTileQ && rep_lanes(4) * kRepPerLane == kTileQ / 4);

constexpr int kScoreThreads = 256;   // 8 warps

std::int64_t padded_d(std::int64_t D) { return ceil_div(D, kKStep) * kKStep; }

// ---- 1. representatives -----------------------------------------------------------------------------------

// One input tensor: its view and where its representatives go. Row (((b * (H / G) + h / G) * T + t) * G +
// h % G) * r + a (G = heads per group for q, 1 for k). The host checks that the shape fields and
// rows * slices fit in an int.
struct RepTensor {
  const void* x;
  std::int64_t sb, sl, sh;  // element strides (d is contiguous)
  int L, H, G, T;
  int rows;                 // B * H * T * r
  int ctas;                 // CTAs of kernel 1 over this tensor's columns
  std::uint16_t* hi;
  std::uint16_t* lo;
};

struct RepParams {
  RepTensor t[2];  // q, k: CTAs [0, t[0].ctas) take q's columns, the next t[1].ctas k's
  std::int64_t Dp;
  int D, r, span;
  int slices;  // Dp / kSliceCols
};

// The 8 columns of one token of a slice: two 16-byte vectors (f32) or one (bf16, f16) with kVec, else
// single elements (the columns below D only).
template <In T, bool kVec>
struct SliceIO {
  static constexpr int kBytes = T == In::f32 ? 4 : 2;
  static constexpr int kVecs = kSliceCols * kBytes / 16;
  // Tokens of loads in flight per thread: 256 bytes of 16-byte vectors, 8 tokens of single elements.
  static constexpr int kBatch = kVec ? 16 / kVecs : 8;
  struct Raw {
    std::conditional_t<kVec, uint4[kVecs], float[kSliceCols]> v;
  };

  // Zeros where the token is absent (adding them is exact).
  __device__ static __forceinline__ void load(const char* p, int valid, bool present, Raw& r) {
    if constexpr (kVec) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
        r.v[i] = present ? __ldg(reinterpret_cast<const uint4*>(p) + i) : make_uint4(0u, 0u, 0u, 0u);
    } else {
#pragma unroll
      for (int e = 0; e < kSliceCols; ++e) r.v[e] = present && e < valid ? load_elem<T>(p, e) : 0.0f;
    }
  }
  // x[e] = column e of the token (exact conversions).
  __device__ static __forceinline__ void unpack(const Raw& r, float (&x)[kSliceCols]) {
    if constexpr (!kVec) {
#pragma unroll
      for (int e = 0; e < kSliceCols; ++e) x[e] = r.v[e];
    } else {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const unsigned w[4] = {r.v[i].x, r.v[i].y, r.v[i].z, r.v[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if constexpr (T == In::f32) {
            x[4 * i + j] = __uint_as_float(w[j]);
          } else if constexpr (T == In::bf16) {  // the element at the lower address is the low half
            x[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
            x[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
          } else {
            x[8 * i + 2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] & 0xffffu)));
            x[8 * i + 2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] >> 16)));
          }
        }
      }
    }
  }
};

// s = the sum of tokens raw[0, N) by a balanced binary tree: every token passes through log2(N) additions.
template <class IO, int N>
__device__ __forceinline__ void tree_sum(const typename IO::Raw* raw, float (&s)[kSliceCols]) {
  if constexpr (N == 1) {
    IO::unpack(raw[0], s);
  } else {
    float a[kSliceCols], b[kSliceCols];
    tree_sum<IO, N / 2>(raw, a);
    tree_sum<IO, N / 2>(raw + N / 2, b);
#pragma unroll
    for (int e = 0; e < kSliceCols; ++e) s[e] = __fadd_rn(a[e], b[e]);
  }
}

// Where column `cid` of a tensor (a (representative row, slice) pair) reads and writes.
struct RepColumn {
  std::int64_t in;   // element offset of its first token's slice in the input
  std::int64_t out;  // element offset in the planes
  int n;             // tokens present (<= 0: an absent representative)
  int valid;         // columns of the slice below D; 0 for a column past the tensor's rows
};

__device__ __forceinline__ RepColumn rep_column(const RepParams& p, const RepTensor& x, int cid) {
  RepColumn c{};
  if (cid >= x.rows * p.slices) return c;
  const int row = cid / p.slices, col = (cid - row * p.slices) * kSliceCols;
  int q = row / p.r;
  const int a = row - q * p.r;
  int rest = q / x.G;
  const int hl = q - rest * x.G;
  q = rest / x.T;
  const int t = rest - q * x.T;
  const int hgroups = x.H / x.G;
  const int b = q / hgroups, h = (q - b * hgroups) * x.G + hl;
  const int l0 = static_cast<int>(t * kTileQ) + a * p.span;
  c.in = b * x.sb + h * x.sh + l0 * x.sl + col;
  c.out = static_cast<std::int64_t>(row) * p.Dp + col;
  c.n = imin(x.L, l0 + p.span) - l0;
  c.valid = imax(0, imin(kSliceCols, p.D - col));
  return c;
}

// Kernel 1's work for one CTA: columns [cta * kColumns, ...) of tensor `which` (0: q, 1: k). A CTA takes
// kRepThreads / kLanes consecutive columns of one tensor, 32 per group of kLanes warps (one per lane);
// warp u of a group sums the tokens u, u + kLanes, ... of its lane's column (kRepPerLane of them, every
// load in flight at once where the batch allows) by a balanced tree, and the kLanes warps' partial sums
// meet in shared memory, added by a balanced tree too: each token passes through log2(128 / r) float32
// additions (rep_sum_depth). The loads of a warp cover whole 16-byte column slices of 32 columns (two
// representative rows of D = 128: 512 bytes per token).
template <In T, bool kVec, int kLanes>
__device__ __forceinline__ void representatives(const RepParams& p, int which, int cta,
                                                float (&part)[kLanes][kRepThreads / kLanes][kSliceCols],
                                                RepColumn (&cols)[kRepThreads / kLanes]) {
  using IO = SliceIO<T, kVec>;
  constexpr int kPerLane = kRepPerLane, kColumns = kRepThreads / kLanes;
  constexpr int kB = IO::kBatch < kPerLane ? IO::kBatch : kPerLane;
  static_assert(kPerLane % kB == 0 && kPerLane / kB <= 2 && (kB & (kB - 1)) == 0 && (kLanes & (kLanes - 1)) == 0,
                "balanced trees over a lane's tokens and over the lanes");
  const int warp = threadIdx.x / 32, u = warp % kLanes, col = warp / kLanes * 32 + threadIdx.x % 32;
  const RepTensor& x = p.t[which];
  const int cid0 = cta * kColumns;
  const RepColumn c = rep_column(p, x, cid0 + col);
  if (u == 0) cols[col] = c;

  float s[kSliceCols];
#pragma unroll
  for (int e = 0; e < kSliceCols; ++e) s[e] = 0.0f;
  if (c.n > 0 && c.valid > 0) {
    const char* base = static_cast<const char*>(x.x) + (c.in + u * x.sl) * IO::kBytes;
    const std::int64_t step = x.sl * IO::kBytes * kLanes;  // to the lane's next token
#pragma unroll
    for (int i0 = 0; i0 < kPerLane; i0 += kB) {
      typename IO::Raw raw[kB];
#pragma unroll
      for (int i = 0; i < kB; ++i) {
        const int tok = u + (i0 + i) * kLanes;
        IO::load(base + (i0 + i) * step, c.valid, tok < c.n, raw[i]);
      }
      float b[kSliceCols];
      tree_sum<IO, kB>(raw, b);
#pragma unroll
      for (int e = 0; e < kSliceCols; ++e) s[e] = i0 == 0 ? b[e] : __fadd_rn(s[e], b[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < kSliceCols; ++e) part[u][col][e] = s[e];
  __syncthreads();

  // Per (column j, element e): the kLanes partials added pairwise, the mean, the two planes.
  for (int it = threadIdx.x; it < kColumns * kSliceCols; it += kRepThreads) {
    const int j = it / kSliceCols, e = it % kSliceCols;
    float v[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) v[i] = part[i][j][e];
#pragma unroll
    for (int o = 1; o < kLanes; o *= 2)
#pragma unroll
      for (int i = 0; i < kLanes; i += 2 * o) v[i] = __fadd_rn(v[i], v[i + o]);
    const RepColumn cj = cols[j];
    if (cid0 + j < x.rows * p.slices) {
      // Zero for an absent representative (its pairs are never counted) and past D (adds nothing).
      const float m = cj.n > 0 && e < cj.valid ? __fdiv_rn(v[0], static_cast<float>(cj.n)) : 0.0f;
      const __nv_bfloat16 hi = __float2bfloat16_rn(m);
      const __nv_bfloat16 lo = __float2bfloat16_rn(__fsub_rn(m, __bfloat162float(hi)));
      x.hi[cj.out + e] = __bfloat16_as_ushort(hi);
      x.lo[cj.out + e] = __bfloat16_as_ushort(lo);
    }
  }
}

// ---- 2. scores and top-k ------------------------------------------------------------------------------------

struct ScoreParams {
  const std::uint16_t* qhi;  // [jobs * P][Dp]
  const std::uint16_t* qlo;
  const std::uint16_t* khi;  // [B * Hkv * Tk * r][Dp]
  const std::uint16_t* klo;
  float* bmax;               // [jobs][Tk]: block scores, written by the job's chunks
  unsigned* done;            // [jobs]: chunks scored (zeroed by kernel 1)
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, kmax;
  std::int32_t* cnt;
  std::int64_t cs0, cs1, cs2;
  int Lq, Lk, Hkv, Dp;
  int Tq, Tk;
  int P, r, span, top_k;
  int chunks;          // CTAs scoring one job's key rows
  int rows_per_chunk;  // key rows per chunk: a multiple of kKUnit
  int qcap, kcap;      // query and key rows staged at once: multiples of 16
  bool force_local, force_block0, causal;
};

// Dynamic shared memory of the scoring part: the job's block scores (ranked by the job's last chunk),
// the top-k's scratch, per staged key row its running maximum (an order key) and per staged query row
// its last visible key position, then the staged planes: q [2][qcap][Dp + 8], k [2][kcap][Dp + 8] bf16
// (rows of an odd number of 16-byte units: conflict-free ldmatrix).
struct ScoreSmem {
  std::size_t scores, group, kmax, qlim, q, k, total;
};

__host__ __device__ inline ScoreSmem score_smem(int Tk, int Dp, int qcap, int kcap) {
  auto up = [](std::size_t x) { return (x + 15) / 16 * 16; };
  const std::size_t row = static_cast<std::size_t>(Dp + 8) * 2;
  ScoreSmem s{};
  std::size_t o = 0;
  s.scores = o, o = up(o + static_cast<std::size_t>(Tk) * sizeof(float));
  s.group = o, o = up(o + Group<kScoreThreads>::kScratchWords * sizeof(unsigned));
  s.kmax = o, o = up(o + static_cast<std::size_t>(kcap) * sizeof(unsigned));
  s.qlim = o, o = up(o + static_cast<std::size_t>(qcap) * sizeof(int));
  s.q = o, o = up(o + 2 * static_cast<std::size_t>(qcap) * row);
  s.k = o, o = up(o + 2 * static_cast<std::size_t>(kcap) * row);
  s.total = o;
  return s;
}

constexpr int kNever = INT_MAX;  // key position no query sees (positions fit an int: checked on the host)
constexpr int kKUnit = 16;       // key rows of one warp task (two n-tiles of 8); chunks and slabs are multiples

// The last key position that query row `row` of the tile starting at query i_first sees: -1 for an absent
// representative, kNever - 1 without causality.
__device__ __forceinline__ int query_limit(const ScoreParams& p, int i_first, int row) {
  if (row >= p.P) return -1;
  const int first = i_first + (row % p.r) * p.span;
  const int qn = imin(p.Lq, first + p.span) - first;
  if (qn <= 0) return -1;
  return p.causal ? first + qn - 1 + (p.Lk - p.Lq) : kNever - 1;
}

// The first key position of key row `row` of a job (block row / r, group row % r), kNever at or past
// `row_end` or for an absent representative. A pair counts iff key_first <= query_limit: for causal
// tiles, iff the query group's last query sees the key group's first key (the CPU's rule).
__device__ __forceinline__ int key_first(const ScoreParams& p, int row, int row_end) {
  if (row >= row_end) return kNever;
  const int j = row / p.r;
  const int first = j * static_cast<int>(kBlockK) + (row - j * p.r) * p.span;
  return first < p.Lk ? first : kNever;
}

// Copies rows [0, rows) of both planes (row stride Dp elements) into `dst` ([2][cap][Dp + 8]); rows
// [rows, fill) are zero. Thread t copies the 16-byte unit t % U (U = Dp / 8 per row) of every
// (256 / U)-th line, no division in the loop.
__device__ __forceinline__ void stage_planes(std::uint16_t* dst, int cap, const std::uint16_t* hi,
                                             const std::uint16_t* lo, int Dp, int rows, int fill) {
  const int U = Dp / 8, per = kScoreThreads / U;
  const int v = threadIdx.x % U, first = threadIdx.x / U;
  if (first >= per) return;
  for (int line = first; line < 2 * fill; line += per) {
    const int plane = line < fill ? 0 : 1, row = line - plane * fill;
    const bool in = row < rows;
    const std::uint16_t* src = (plane == 0 ? hi : lo) + (in ? row * Dp + 8 * v : 0);
    cp_async16(dst + (plane * cap + row) * (Dp + 8) + 8 * v, src, in);
  }
}

// The query tile and candidate blocks of a job (b, group, Q tile).
struct JobTile {
  int bg, t, i_first, i_last, n_cand;
};
__device__ __forceinline__ JobTile job_tile(const ScoreParams& p, int job) {
  JobTile j{};
  j.bg = job / p.Tq, j.t = job - j.bg * p.Tq;
  j.i_first = j.t * static_cast<int>(kTileQ), j.i_last = imin(p.Lq, j.i_first + static_cast<int>(kTileQ)) - 1;
  // Causal: block j is a candidate iff the tile's last query sees its first key (the division only of a
  // non-negative position: C's division truncates toward zero).
  const int last_key = j.i_last + p.Lk - p.Lq;
  j.n_cand = !p.causal ? p.Tk : last_key < 0 ? 0 : imin(p.Tk, last_key / static_cast<int>(kBlockK) + 1);
  return j;
}

// Scores chunk `chunk` of job `job`: its key rows [chunk * rows_per_chunk, ...) below the job's candidate
// rows, kcap at a time (a slab), against every query row, qcap at a time, and writes each whole block's
// maximum over its counted pairs to p.bmax, or with one chunk per job to the shared scores (-inf where no
// pair counts). Work of a staged (slab, query
// rows) pair: tasks of 16 key rows x 32 query rows, task t to warp t % 8; the maxima over a task's query
// rows meet per key row in shared memory (atomicMax on order keys), then over the r key rows of a block.
__device__ void score_chunk(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L, int job, int chunk) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gid = lane / 4, tq = lane % 4;
  const JobTile jt = job_tile(p, job);
  const int bg = jt.bg, i_first = jt.i_first;
  const int row_end = jt.n_cand * p.r, k_begin = chunk * p.rows_per_chunk;
  const int k_end = imin(row_end, k_begin + p.rows_per_chunk);
  auto* qs = reinterpret_cast<std::uint16_t*>(smem + L.q);
  auto* ks = reinterpret_cast<std::uint16_t*>(smem + L.k);
  auto* kmax = reinterpret_cast<unsigned*>(smem + L.kmax);
  auto* qlim = reinterpret_cast<int*>(smem + L.qlim);
  auto* scores = reinterpret_cast<float*>(smem + L.scores);
  const int RS = p.Dp + 8, ksteps = p.Dp / 16;
  const std::int64_t qrow0 = static_cast<std::int64_t>(job) * p.P, krow0 = static_cast<std::int64_t>(bg) * p.Tk * p.r;
  const bool q_once = p.P <= p.qcap;  // the query rows stay staged across slabs
  for (int k0 = k_begin; k0 < k_end; k0 += p.kcap) {
    const int krows = imin(p.kcap, k_end - k0), groups = (krows + kKUnit - 1) / kKUnit;
    for (int q0 = 0; q0 < p.P; q0 += p.qcap) {
      const int qrows = imin(p.qcap, p.P - q0), passes = (qrows + 31) / 32;
      __syncthreads();  // every warp is done with the planes and maxima this staging replaces
      if (!q_once || k0 == k_begin) {
        stage_planes(qs, p.qcap, p.qhi + (qrow0 + q0) * p.Dp, p.qlo + (qrow0 + q0) * p.Dp, p.Dp, qrows,
                     (qrows + 15) / 16 * 16);
        for (int i = threadIdx.x; i < p.qcap; i += kScoreThreads) qlim[i] = query_limit(p, i_first, q0 + i);
      }
      if (q0 == 0) {
        stage_planes(ks, p.kcap, p.khi + (krow0 + k0) * p.Dp, p.klo + (krow0 + k0) * p.Dp, p.Dp, krows,
                     groups * kKUnit);
        for (int i = threadIdx.x; i < p.kcap; i += kScoreThreads) kmax[i] = order_key(-INFINITY);
      }
      cuda_kernels::cp_async_commit();
      cuda_kernels::cp_async_wait<0>();
      __syncthreads();
      for (int task = warp; task < groups * passes; task += kScoreThreads / 32) {
        const int g = task % groups, qr0 = (task / groups) * 32, kr0 = g * kKUnit;
        const int mtiles = imin(2, (qrows - qr0 + 15) / 16);  // warp-uniform
        float acc1[2][2][4], acc2[2][2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc1[mt][nt][i] = acc2[mt][nt][i] = 0.0f;
        const std::uint16_t* brow = ks + (kr0 + lane % 8 + 8 * (lane / 16)) * RS + 8 * ((lane / 8) % 2);
        const std::uint16_t* arow = qs + (qr0 + lane % 16) * RS + 8 * (lane / 16);
        for (int kk = 0; kk < ksteps; ++kk) {
          // B fragments of both n-tiles: matrices (n-tile 0, k 0-7), (0, 8-15), (1, 0-7), (1, 8-15).
          std::uint32_t bh[4], bl[4];
          ldmatrix_x4(bh, brow + kk * 16);
          ldmatrix_x4(bl, brow + p.kcap * RS + kk * 16);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            if (mt >= mtiles) break;  // warp-uniform
            std::uint32_t ah[4], al[4];
            ldmatrix_x4(ah, arow + mt * 16 * RS + kk * 16);
            ldmatrix_x4(al, arow + (p.qcap + mt * 16) * RS + kk * 16);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              mma_m16n8k16<Bf16Tag>(acc1[mt][nt], ah, bh[2 * nt], bh[2 * nt + 1]);
              mma_m16n8k16<Bf16Tag>(acc2[mt][nt], ah, bl[2 * nt], bl[2 * nt + 1]);
              mma_m16n8k16<Bf16Tag>(acc2[mt][nt], al, bh[2 * nt], bh[2 * nt + 1]);
            }
          }
        }
        // Accumulator element i of (mt, nt): query row qr0 + 16 mt + gid + 8 (i / 2), key row kr0 + 8 nt +
        // 2 tq + i % 2. fmaxf ignores a NaN operand, so NaN pairs rank as -inf.
        int kf[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) kf[nt][c] = key_first(p, k0 + kr0 + nt * 8 + 2 * tq + c, k_end);
        float best[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          if (mt >= mtiles) break;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int ql = qlim[qr0 + mt * 16 + gid + 8 * half];  // -1 past the staged rows' P
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
              for (int c = 0; c < 2; ++c)
                if (kf[nt][c] <= ql)
                  best[nt][c] = fmaxf(best[nt][c], __fadd_rn(acc1[mt][nt][2 * half + c], acc2[mt][nt][2 * half + c]));
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
#pragma unroll
            for (int o = 4; o < 32; o *= 2) best[nt][c] = fmaxf(best[nt][c], __shfl_xor_sync(0xffffffffu, best[nt][c], o));
            if (gid == 0) atomicMax(kmax + kr0 + nt * 8 + 2 * tq + c, order_key(best[nt][c]));
          }
      }
    }
    __syncthreads();  // every task's maxima are in kmax
    // Block maxima over the r key rows of each block of the slab (slabs hold whole blocks).
    for (int b = threadIdx.x; b * p.r < krows; b += kScoreThreads) {
      unsigned m = kmax[b * p.r];
      for (int i = 1; i < p.r; ++i) m = max(m, kmax[b * p.r + i]);
      if (p.chunks == 1) scores[k0 / p.r + b] = order_value(m);  // ranked by this CTA
      else p.bmax[static_cast<std::int64_t>(job) * p.Tk + (k0 / p.r) + b] = order_value(m);
    }
  }
}

// The job's list from its block scores (every chunk's are stored and visible): forced blocks rank above
// every scored one, as on the CPU (only among the candidates), then the top-k.
__device__ void rank_job(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L, int job) {
  const JobTile jt = job_tile(p, job);
  auto* scores = reinterpret_cast<float*>(smem + L.scores);
  const float* bm = p.bmax + static_cast<std::int64_t>(job) * p.Tk;
  if (p.chunks > 1)  // else the scores are this CTA's, in shared memory
    for (int j = threadIdx.x; j < jt.n_cand; j += kScoreThreads) scores[j] = __ldcg(bm + j);
  __syncthreads();
  if (jt.n_cand > 0) {
    if (p.force_block0 && threadIdx.x == 0) scores[0] = INFINITY;
    if (p.force_local) {
      int lo, hi;
      if (p.causal) {
        lo = imax(jt.i_first + p.Lk - p.Lq, 0) / static_cast<int>(kBlockK);
        hi = (jt.i_last + p.Lk - p.Lq) / static_cast<int>(kBlockK);
      } else {
        lo = hi = static_cast<int>(
            imin<std::int64_t>(static_cast<std::int64_t>(jt.i_first) * p.Lk / p.Lq / kBlockK, p.Tk - 1));
      }
      for (int j = lo + static_cast<int>(threadIdx.x); j <= hi && j < jt.n_cand; j += kScoreThreads)
        scores[j] = INFINITY;
    }
  }
  __syncthreads();
  const int b = jt.bg / p.Hkv, g = jt.bg - b * p.Hkv;
  std::int32_t* out = p.idx + b * p.is0 + g * p.is1 + jt.t * p.is2;
  // The scores' order keys in place (each thread its own entries), then the top-k on (key, id).
  auto* keys = reinterpret_cast<unsigned*>(scores);
  for (int j = threadIdx.x; j < jt.n_cand; j += kScoreThreads) keys[j] = order_key(sanitize(scores[j]));
  __syncthreads();
  const Group<kScoreThreads> gr{static_cast<int>(threadIdx.x), cuda_kernels::NamedBarrier::kSync,
                                 reinterpret_cast<unsigned*>(smem + L.group)};
  const int c = group_top_k(gr, [keys](int j) { return rank_key_of(keys[j], j); }, jt.n_cand, p.top_k, out, p.is3,
                            p.kmax);
  if (threadIdx.x == 0) p.cnt[b * p.cs0 + g * p.cs1 + jt.t * p.cs2] = c;
}

// Kernel 1: the representatives of q (CTAs [0, t[0].ctas)) and k (the rest). CTA 0 also zeroes the
// scoring kernel's counters (read only after this grid completes). Each CTA triggers the dependent launch
// at its start, so the scoring grid launches once the last CTA of this grid is running (its pdl_wait still
// waits for completion).
template <In T, bool kVec, int kLanes>
__global__ void __launch_bounds__(kRepThreads, 2)
    representatives_kernel(const __grid_constant__ RepParams p, unsigned* done, int jobs) {
  constexpr int kColumns = kRepThreads / kLanes;
  __shared__ float part[kLanes][kColumns][kSliceCols];
  __shared__ RepColumn cols[kColumns];
  pdl_launch_dependents();
  const int which = static_cast<int>(blockIdx.x) < p.t[0].ctas ? 0 : 1;  // CTA-uniform
  const int cta = static_cast<int>(blockIdx.x) - (which == 0 ? 0 : p.t[0].ctas);
  if (blockIdx.x == 0)
    for (int j = threadIdx.x; j < jobs; j += kRepThreads) done[j] = 0u;
  representatives<T, kVec, kLanes>(p, which, cta, part, cols);
}

// Kernel 2: CTA (job, chunk) scores the chunk's key rows of the job; the chunk that finishes last ranks the
// job (release by a fence and a counter, acquire by a fence after it).
__global__ void __launch_bounds__(kScoreThreads, 2) score_kernel(const __grid_constant__ ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ unsigned last;
  const ScoreSmem L = score_smem(p.Tk, p.Dp, p.qcap, p.kcap);
  const int job = static_cast<int>(blockIdx.x) / p.chunks, chunk = static_cast<int>(blockIdx.x) - job * p.chunks;
  pdl_wait();  // the representatives are complete
  score_chunk(p, smem, L, job, chunk);
  __syncthreads();  // every block score of the chunk is stored
  if (p.chunks == 1) {
    rank_job(p, smem, L, job);
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(p.done + job, 1u) == static_cast<unsigned>(p.chunks - 1) ? 1u : 0u;
    __threadfence();
  }
  __syncthreads();
  if (last != 0u) rank_job(p, smem, L, job);
}

// ---- host ----------------------------------------------------------------------------------------------------

// Whether every token's D elements of x can be read as aligned 16-byte vectors of 8 columns.
bool vectorizable(const TensorView& x) {
  const auto es = static_cast<std::int64_t>(dtype_size(x.dtype));
  return reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0 && (x.stride[0] * es) % 16 == 0 &&
         (x.stride[1] * es) % 16 == 0 && (x.stride[2] * es) % 16 == 0 && x.shape[3] % kSliceCols == 0;
}

template <In T, bool kVec>
void launch_reps(const RepParams& p, unsigned* done, int jobs, unsigned blocks, cudaStream_t stream) {
  if (p.r == 1) representatives_kernel<T, kVec, rep_lanes(1)><<<blocks, kRepThreads, 0, stream>>>(p, done, jobs);
  else representatives_kernel<T, kVec, rep_lanes(4)><<<blocks, kRepThreads, 0, stream>>>(p, done, jobs);
}

template <In T>
void launch_reps(bool vec, const RepParams& p, unsigned* done, int jobs, unsigned blocks, cudaStream_t stream) {
  if (vec) launch_reps<T, true>(p, done, jobs, blocks, stream);
  else launch_reps<T, false>(p, done, jobs, blocks, stream);
}

// Per device, queried once: the dynamic shared memory a scoring CTA may use (the device's opt-in maximum
// per block less the kernel's static shared memory; the kernel's limit is raised to it) and the SM count.
struct DeviceFacts {
  int max_smem = 0;
  int sms = 0;
};

DeviceFacts device_facts(const std::string& op, const TensorView& t) {
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != t.device_index)
    throw Error(op, "q", "tensor " + t.describe() + " is not on the current CUDA device " + std::to_string(dev));
  static std::mutex mu;
  static std::map<int, DeviceFacts> known;
  if (e == cudaSuccess) {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(dev);
    if (it != known.end()) return it->second;
  }
  DeviceFacts f;
  const int opt_in = usable_device_smem(op, "q", t);
  check_cuda(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, t.device_index), op,
             "cudaDeviceGetAttribute");
  cudaFuncAttributes attr{};
  check_cuda(cudaFuncGetAttributes(&attr, score_kernel), op, "cudaFuncGetAttributes");
  f.max_smem = opt_in - static_cast<int>(attr.sharedSizeBytes);
  check_cuda(cudaFuncSetAttribute(score_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, f.max_smem), op,
             "cudaFuncSetAttribute");
  const std::lock_guard<std::mutex> lock(mu);
  known[t.device_index] = f;
  return f;
}

// Byte offsets in the scratch: the four planes q hi, q lo, k hi, k lo ([rows][Dp] bf16 each), the block
// scores ([jobs][Tk] float32), the chunk counters ([jobs]).
struct Layout {
  std::size_t plane[4];
  std::size_t bmax, counters, total;
};

Layout scratch_layout(const ProblemShape& s, std::int64_t r) {
  const std::int64_t Dp = padded_d(s.D), jobs = s.B * s.Hkv * s.Tq();
  const std::int64_t rows[2] = {s.B * s.Hq * s.Tq() * r, s.B * s.Hkv * s.Tk() * r};
  Layout l{};
  std::size_t o = 0;
  for (int i = 0; i < 4; ++i) {
    l.plane[i] = o;
    o += align_up(static_cast<std::size_t>(rows[i / 2] * Dp) * 2);
  }
  l.bmax = o, o += align_up(static_cast<std::size_t>(jobs * s.Tk()) * sizeof(float));
  l.counters = o, o += align_up(static_cast<std::size_t>(jobs) * sizeof(unsigned));
  l.total = o;
  return l;
}

// Rows staged at once for a row length of Dp: up to 64 query and 128 key rows at D = 128, fewer for
// longer rows (at most about 105 KB of shared memory: two CTAs per SM), at least one 16-row tile each.
std::int64_t staged_rows(std::int64_t most, std::int64_t Dp) {
  return std::max<std::int64_t>(16, std::min<std::int64_t>(most, most * 128 / Dp / 16 * 16));
}

}  // namespace

std::size_t pooled_scratch_bytes(const ProblemShape& s, const PooledOptions& o) {
  return scratch_layout(s, o.representatives).total;
}

PooledErrorBound pooled_error_bound(std::int64_t D, int representatives) {
  const double u = 0x1p-24;
  const double h = static_cast<double>(rep_sum_depth(representatives));  // float32 additions per token
  const double gamma = h * u / (1.0 - h * u);
  const double n1 = static_cast<double>(padded_d(D) / kKStep);  // k-steps of the hi.hi accumulator
  PooledErrorBound e;
  e.mean_rel = gamma * (1.0 + u) + 2.0 * u + 0x1p-45;
  e.dot_rel = 3.02 * 0x1p-16 + 1.03 * n1 * 0x1p-18 + static_cast<double>(D) * 0x1p-52;
  e.abs_rel = 0x1p-120;
  return e;
}

void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& o) {
  const std::string op = "pooled_select";
  const ProblemShape s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], o.causal};
  const std::int64_t Tq = s.Tq(), Tk = s.Tk(), r = o.representatives, Dp = padded_d(s.D);
  const std::int64_t group = s.Hq / s.Hkv, P = group * r, jobs = s.B * s.Hkv * Tq;
  const auto stream = static_cast<cudaStream_t>(o.stream);

  const DeviceFacts dev = device_facts(op, q);
  check_device_memory(op, "q", q);
  check_device_memory(op, "k", k);
  check_device_memory(op, "out.idx", out.idx);
  check_device_memory(op, "out.cnt", out.cnt);
  const std::int64_t rows[2] = {s.B * s.Hq * Tq * r, s.B * s.Hkv * Tk * r};
  const std::int64_t slices = Dp / kSliceCols;
  // Columns (rows x slices), token and key positions, job rows and the scoring grid are indexed in int.
  const std::int64_t int_room = INT_MAX - kTileQ - kRepThreads;
  if (slices > int_room || rows[0] * slices > int_room || rows[1] * slices > int_room ||
      std::max(s.Lq, s.Lk) > int_room || Tk * r > int_room || jobs * P > int_room || jobs * 8 > int_room)
    throw Error(op, "q", "tensor " + q.describe() + " has more representative rows than the CUDA selector indexes");

  // Chunks: one CTA per job where its key rows fit one staged slab (no block scores through global memory,
  // no counter: measured 11.2 us for four chunks of R1 at tile16, Lk = 16K, where one slab is the whole
  // job); else the key rows split over C CTAs in multiples of 16 rows (whole blocks for r = 1 and 4), C up
  // to 8 and so that the grid is one wave of two CTAs per SM.
  const std::int64_t key_rows = Tk * r;
  const std::int64_t kcap_most = staged_rows(128, Dp), qcap = std::min(staged_rows(64, Dp), ceil_div(P, 16) * 16);
  const std::int64_t chunks =
      key_rows <= kcap_most
          ? 1
          : std::max<std::int64_t>(1, std::min<std::int64_t>({8, 2 * dev.sms / jobs,
                                                                ceil_div(key_rows, static_cast<std::int64_t>(kKUnit))}));
  const std::int64_t rows_per_chunk = ceil_div(ceil_div(key_rows, chunks), kKUnit) * kKUnit;
  const std::int64_t kcap = std::min(kcap_most, rows_per_chunk);
  const ScoreSmem L = score_smem(static_cast<int>(Tk), static_cast<int>(Dp), static_cast<int>(qcap), static_cast<int>(kcap));
  if (L.total > static_cast<std::size_t>(dev.max_smem))
    throw Error(op, "k", "Lk = " + std::to_string(s.Lk) + " (" + std::to_string(Tk) + " blocks) with D = " +
                             std::to_string(s.D) + " needs " + std::to_string(L.total) +
                             " bytes of shared memory per CTA, more than the device's " + std::to_string(dev.max_smem));

  const Layout lay = scratch_layout(s, r);
  const sel::Scratch scratch(op, o.workspace, lay.total, q.device_index, stream);
  auto* base = scratch.as<char>();
  auto plane = [&](int i) { return reinterpret_cast<std::uint16_t*>(base + lay.plane[i]); };
  auto* done = reinterpret_cast<unsigned*>(base + lay.counters);

  RepParams rp{};
  rp.Dp = Dp, rp.D = static_cast<int>(s.D), rp.r = static_cast<int>(r), rp.span = static_cast<int>(kTileQ / r);
  rp.slices = static_cast<int>(slices);
  const TensorView* xs[2] = {&q, &k};
  for (int i = 0; i < 2; ++i) {
    const TensorView& x = *xs[i];
    RepTensor& d = rp.t[i];
    d.x = x.data;
    d.sb = x.stride[0], d.sl = x.stride[1], d.sh = x.stride[2];
    d.L = static_cast<int>(x.shape[1]), d.H = static_cast<int>(x.shape[2]);
    d.G = static_cast<int>(i == 0 ? group : 1), d.T = static_cast<int>(ceil_div(x.shape[1], kTileQ));
    d.rows = static_cast<int>(rows[i]);
    d.ctas = static_cast<int>(ceil_div(rows[i] * slices, static_cast<std::int64_t>(rep_columns(rp.r))));
    d.hi = plane(2 * i), d.lo = plane(2 * i + 1);
  }
  const bool vec = vectorizable(q) && vectorizable(k);
  const auto blocks = static_cast<unsigned>(rp.t[0].ctas + rp.t[1].ctas);
  const int njobs = static_cast<int>(jobs);
  switch (in_type(q.dtype)) {
    case In::f32: launch_reps<In::f32>(vec, rp, done, njobs, blocks, stream); break;
    case In::f16: launch_reps<In::f16>(vec, rp, done, njobs, blocks, stream); break;
    case In::bf16: launch_reps<In::bf16>(vec, rp, done, njobs, blocks, stream); break;
  }
  check_cuda(cudaGetLastError(), op, "representatives launch");

  ScoreParams p{};
  p.qhi = plane(0), p.qlo = plane(1), p.khi = plane(2), p.klo = plane(3);
  p.bmax = reinterpret_cast<float*>(base + lay.bmax);
  p.done = done;
  p.idx = out.idx.ptr<std::int32_t>();
  p.is0 = out.idx.stride[0], p.is1 = out.idx.stride[1], p.is2 = out.idx.stride[2], p.is3 = out.idx.stride[3];
  p.kmax = out.idx.shape[3];
  p.cnt = out.cnt.ptr<std::int32_t>();
  p.cs0 = out.cnt.stride[0], p.cs1 = out.cnt.stride[1], p.cs2 = out.cnt.stride[2];
  p.Lq = static_cast<int>(s.Lq), p.Lk = static_cast<int>(s.Lk), p.Hkv = static_cast<int>(s.Hkv);
  p.Dp = static_cast<int>(Dp), p.Tq = static_cast<int>(Tq), p.Tk = static_cast<int>(Tk);
  p.P = static_cast<int>(P), p.r = static_cast<int>(r), p.span = static_cast<int>(kTileQ / r), p.top_k = o.top_k;
  p.chunks = static_cast<int>(chunks), p.rows_per_chunk = static_cast<int>(rows_per_chunk);
  p.qcap = static_cast<int>(qcap), p.kcap = static_cast<int>(kcap);
  p.force_local = o.force_local, p.force_block0 = o.force_block0, p.causal = o.causal;
  // A programmatic dependent of the representatives: its launch overlaps their tail.
  launch_dependent(op, "scoring launch", score_kernel, dim3(static_cast<unsigned>(jobs * chunks)),
                   dim3(kScoreThreads), L.total, stream, p);
}

}  // namespace sparse_attn::cuda_backend
