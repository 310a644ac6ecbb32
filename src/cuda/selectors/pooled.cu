// R1 / R4 pooled selector on the GPU (docs/design.md §5.7): float32 scores with a derived error bound
// against the CPU's float64 scores (src/selectors/pooled.cpp), no float64 and no second pass. Two
// kernels on the caller's stream, the second a programmatic dependent of the first:
//
//  1. representatives (q and k in one grid): L warps share each (representative row, slice of 8 columns)
//     column (L = 8 for R1, 2 for R4), a warp 32 columns, one per lane, a CTA 256 / L columns; warp u of
//     the L sums the tokens u, u + L, u + 2 L, ... of its lane's column (16 per thread, every 16-byte load
//     in flight at once) by a balanced tree in float32, and the L partial sums are added by a balanced
//     tree in shared memory: each token passes through log2(128 / r) additions. Scalar loads where the
//     views allow no 16-byte vectors. The mean m = sum / n (n tokens
//     present) is stored as two bf16 planes, hi = bf16(m) and lo = bf16(m - hi), rows of Dp = D rounded up
//     to 16 columns (zero past D). The rows of one (b, group, Q tile), group * r of them, are contiguous.
//     The kernel only reads its input once: it is bound by HBM bandwidth (42 MB at the tile16 shape,
//     Lk = 16K).
//  2. scores + top-k: a cluster of C CTAs per (b, group, Q tile); CTA c scores a range of key rows (a
//     multiple of 32, whole KV blocks; C the largest with which the whole grid is resident at once)
//     against all group * r query rows: both planes staged in shared memory by cp.async (up to 64 query
//     rows and 128 key rows in one copy), mma.sync m16n8k16 bf16 with float32 accumulation, hi.hi in one
//     accumulator and hi.lo + lo.hi in another, score = acc1 + acc2. Uncounted pairs (causal, absent
//     representatives) are masked; the maxima over query rows, then over the r key rows of a block, go to
//     the block's slot in CTA 0's shared memory (distributed shared memory; one writer per block, no
//     atomics). After a cluster barrier CTA 0 sets the forced blocks to +inf and takes the top-k, ties to
//     the lower id, ids written ascending: by counting, per candidate, the candidates ranked above it
//     (up to 256 candidates), else by a radix select (four 8-bit passes over order-preserving keys).
//     Every reduction has a fixed order, so two runs give the same bits.
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
// Scratch: both planes of both tensors, pooled_scratch_bytes, one allocation per call (scratch.hpp: the
// caller's options.workspace, or the library's per (device, stream)).
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"
#include "cuda/selectors/scratch.hpp"

namespace sparse_attn::cuda_backend {

namespace {

using namespace sel;
namespace cg = cooperative_groups;

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
constexpr int kQRows = 32;           // query rows per pass of the mma loop
constexpr int kMTiles = kQRows / 16;  // m-tiles per warp (the accumulators of 64 rows spill)
constexpr int kQStage = 64;          // query rows staged at once: R4's group * r at Hq / Hkv = 16, one copy
constexpr int kKRows = 128;          // key rows per slab: 16 per warp (2 n-tiles)
constexpr int kCtaRowsUnit = 32;     // a CTA's key rows come in multiples of this (whole blocks for r <= 32)
constexpr int kDChunk = 128;         // columns staged at once
// bf16 per staged row: 272 bytes, an odd number of 16-byte units, so the 8 rows of an ldmatrix fall on
// distinct banks.
constexpr int kSmemRow = kDChunk + 8;
constexpr int kMaxCluster = 8;       // portable cluster size

std::int64_t padded_d(std::int64_t D) { return ceil_div(D, kKStep) * kKStep; }

// Byte offsets of the four planes in the scratch: q hi, q lo, k hi, k lo ([rows][Dp] bf16 each).
struct Planes {
  std::size_t at[4];
  std::size_t total;
};

Planes plane_layout(std::int64_t rows_q, std::int64_t rows_k, std::int64_t Dp) {
  Planes p{};
  std::size_t o = 0;
  for (int i = 0; i < 4; ++i) {
    p.at[i] = o;
    o += align_up(static_cast<std::size_t>((i < 2 ? rows_q : rows_k) * Dp) * 2);
  }
  p.total = o;
  return p;
}

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

// A CTA takes kRepThreads / kLanes consecutive columns of one tensor, 32 per group of kLanes warps (one
// per lane); warp u of a group sums the tokens u, u + kLanes, ... of its lane's column (kRepPerLane of
// them, every load in flight at once where the batch allows) by a balanced tree, and the kLanes warps'
// partial sums meet in shared memory, added by a balanced tree too: each token passes through
// log2(128 / r) float32 additions (rep_sum_depth). The loads of a warp cover whole 16-byte column slices
// of 32 columns (two representative rows of D = 128: 512 bytes per token).
template <In T, bool kVec, int kLanes>
__global__ void __launch_bounds__(kRepThreads, 2) representatives_kernel(const __grid_constant__ RepParams p) {
  using IO = SliceIO<T, kVec>;
  constexpr int kPerLane = kRepPerLane, kColumns = kRepThreads / kLanes;
  constexpr int kB = IO::kBatch < kPerLane ? IO::kBatch : kPerLane;
  static_assert(kPerLane % kB == 0 && kPerLane / kB <= 2 && (kB & (kB - 1)) == 0 && (kLanes & (kLanes - 1)) == 0,
                "balanced trees over a lane's tokens and over the lanes");
  __shared__ float part[kLanes][kColumns][kSliceCols];
  __shared__ RepColumn cols[kColumns];
  // The scoring grid may be scheduled once every CTA of this grid has started (then no CTA of this grid
  // still needs an SM's room); it waits in pdl_wait for this grid's completion and memory before reading.
  pdl_launch_dependents();
  const int warp = threadIdx.x / 32, u = warp % kLanes, col = warp / kLanes * 32 + threadIdx.x % 32;
  const int which = static_cast<int>(blockIdx.x) < p.t[0].ctas ? 0 : 1;  // CTA-uniform
  const RepTensor& x = p.t[which];
  const int cid0 = (static_cast<int>(blockIdx.x) - (which == 0 ? 0 : p.t[0].ctas)) * kColumns;
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
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, kmax;
  std::int32_t* cnt;
  std::int64_t cs0, cs1, cs2;
  std::int64_t Lq, Lk, Hkv, Dp;
  int Tq, Tk;
  int rows_per_cta;  // key rows per CTA of a cluster: a multiple of kCtaRowsUnit
  int P, r, span, top_k, cluster;
  bool force_local, force_block0, causal;
};

// Dynamic shared memory: the block scores of the tile (CTA 0's are the ones ranked), the top-k's scratch,
// then the staged planes (q: [2][qcap][kSmemRow], k: [2][kKRows][kSmemRow] bf16), qcap = group * r rounded
// up to an m-tile, at most kQStage.
struct ScoreSmem {
  std::size_t scores, hist, warp_sums, pick, q, k, total;
  int qcap;
};

__host__ __device__ inline ScoreSmem score_smem(std::int64_t Tk, int P) {
  auto up = [](std::size_t x) { return (x + 15) / 16 * 16; };
  ScoreSmem s{};
  std::size_t o = 0;
  s.scores = o, o = up(o + static_cast<std::size_t>(Tk) * sizeof(float));
  s.hist = o, o = up(o + 256 * sizeof(int));
  s.warp_sums = o, o = up(o + 32 * sizeof(int));
  s.pick = o, o = up(o + 2 * sizeof(int));
  s.qcap = P < kQStage ? (P + 15) / 16 * 16 : kQStage;
  s.q = o, o = up(o + static_cast<std::size_t>(2 * s.qcap * kSmemRow * 2));
  s.k = o, o = up(o + 2 * kKRows * kSmemRow * 2);
  s.total = o;
  return s;
}

constexpr long long kNever = LLONG_MAX;  // key position no query sees

// The last key position that query row `row` of the tile starting at query i_first sees: -1 for an absent
// representative, kNever - 1 without causality.
__device__ __forceinline__ long long query_limit(const ScoreParams& p, std::int64_t i_first, int row) {
  if (row >= p.P) return -1;
  const std::int64_t first = i_first + static_cast<std::int64_t>(row % p.r) * p.span;
  const std::int64_t qn = imin(p.Lq, first + p.span) - first;
  if (qn <= 0) return -1;
  return p.causal ? first + qn - 1 + (p.Lk - p.Lq) : kNever - 1;
}

// The first key position of key row `row` (block row / r, group row % r), kNever past `row_end` or for an
// absent representative. A pair counts iff key_first <= query_limit: for causal tiles, iff the query
// group's last query sees the key group's first key (the CPU's rule).
__device__ __forceinline__ long long key_first(const ScoreParams& p, int row, int row_end) {
  if (row >= row_end) return kNever;
  const int j = row / p.r;
  const std::int64_t first = static_cast<std::int64_t>(j) * kBlockK + (row - j * p.r) * p.span;
  return first < p.Lk ? first : kNever;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const std::uint16_t* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies rows [0, rows) of both planes (row stride Dp, columns [d0, d0 + width)) into `dst`
// ([2][cap][kSmemRow]); rows [rows, fill) are zero. Thread t copies the 16-byte unit t % 16 of every
// sixteenth row (a warp two whole rows), no division in the loop.
__device__ __forceinline__ void stage_planes(std::uint16_t* dst, int cap, const std::uint16_t* hi,
                                             const std::uint16_t* lo, std::int64_t Dp, std::int64_t d0, int width,
                                             int rows, int fill) {
  constexpr int kUnits = kDChunk / 8;  // 16-byte units of a staged row
  const int v = threadIdx.x % kUnits;
  if (v >= width / 8) return;
  for (int line = threadIdx.x / kUnits; line < 2 * fill; line += kScoreThreads / kUnits) {
    const int plane = line < fill ? 0 : 1, row = line - plane * fill;
    const bool in = row < rows;
    const std::uint16_t* src = (plane == 0 ? hi : lo) + (in ? row * Dp + d0 + 8 * v : 0);
    cp_async16(dst + (plane * cap + row) * kSmemRow + 8 * v, src, in);
  }
}

// Scores key rows [k0, k0 + krows) of the CTA against every query row and writes each whole block's
// maximum over its counted pairs to `lead` (CTA 0's score array; -inf where no pair counts). Warp w
// takes key rows k0 + 16 w .. + 16 (two n-tiles of 8) and every query row, kQRows at a time. The query
// rows are staged L.qcap at a time (one copy for all of R4's rows), the key slab once for all of them
// (one chunk of D each; with several chunks both are staged per chunk).
__device__ __forceinline__ void score_slab(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L,
                                           const std::uint16_t* qhi, const std::uint16_t* qlo,
                                           const std::uint16_t* khi, const std::uint16_t* klo, std::int64_t i_first,
                                           int k0, int krows, int row_end, bool stage_q_once, bool& q_staged,
                                           float* lead) {
  auto* qs = reinterpret_cast<std::uint16_t*>(smem + L.q);
  auto* ks = reinterpret_cast<std::uint16_t*>(smem + L.k);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gid = lane / 4, tq = lane % 4;
  const int wk = warp * 16;
  const bool active = wk < krows;  // warp-uniform
  const int dchunks = static_cast<int>(ceil_div(p.Dp, kDChunk));

  long long kf[2][2];  // first key position of the thread's key rows: n-tile, column parity
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) kf[nt][c] = key_first(p, k0 + wk + nt * 8 + 2 * tq + c, row_end);
  float best[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) best[nt][0] = best[nt][1] = -INFINITY;

  for (int q0 = 0; q0 < p.P; q0 += kQRows) {
    const int qrows = imin(kQRows, p.P - q0), mtiles = (qrows + 15) / 16;
    const int qoff = q0 % L.qcap;  // staged row of query row q0
    float acc1[kMTiles][2][4], acc2[kMTiles][2][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc1[mt][nt][i] = acc2[mt][nt][i] = 0.0f;
    for (int dc = 0; dc < dchunks; ++dc) {
      const std::int64_t d0 = static_cast<std::int64_t>(dc) * kDChunk;
      const int width = static_cast<int>(imin<std::int64_t>(kDChunk, p.Dp - d0));
      // The staged planes stay in place while nothing else needs the space: the key slab across query
      // passes, the query rows across passes and, where all fit, across slabs (one chunk of D of each).
      const bool stage_k = dchunks > 1 || q0 == 0;
      const bool stage_q = dchunks > 1 || (qoff == 0 && !(stage_q_once && q_staged));
      if (stage_k || stage_q) {
        __syncthreads();  // every warp is done with the planes it replaces
        if (stage_q) {
          const int n = dchunks > 1 ? qrows : imin(L.qcap, p.P - q0);
          stage_planes(qs + qoff * kSmemRow, L.qcap, qhi + q0 * p.Dp, qlo + q0 * p.Dp, p.Dp, d0, width, n,
                       (n + 15) / 16 * 16);
          q_staged = true;
        }
        if (stage_k)  // the rows of the warps with key rows (wk < krows)
          stage_planes(ks, kKRows, khi + k0 * p.Dp, klo + k0 * p.Dp, p.Dp, d0, width, krows, (krows + 15) / 16 * 16);
        cp_async_wait_all();
        __syncthreads();
      }
      if (active) {
        for (int kk = 0; kk < width / 16; ++kk) {
          // B fragments of both n-tiles: matrices (n-tile 0, k 0-7), (0, 8-15), (1, 0-7), (1, 8-15).
          const int brow = wk + lane % 8 + 8 * (lane / 16), bcol = kk * 16 + 8 * ((lane / 8) % 2);
          unsigned bh[4], bl[4];
          ldsm_x4(bh, ks + brow * kSmemRow + bcol);
          ldsm_x4(bl, ks + (kKRows + brow) * kSmemRow + bcol);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            if (mt >= mtiles) break;  // warp-uniform
            const int arow = qoff + mt * 16 + lane % 16, acol = kk * 16 + 8 * (lane / 16);
            unsigned ah[4], al[4];
            ldsm_x4(ah, qs + arow * kSmemRow + acol);
            ldsm_x4(al, qs + (L.qcap + arow) * kSmemRow + acol);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              mma_bf16(acc1[mt][nt], ah, bh[2 * nt], bh[2 * nt + 1]);
              mma_bf16(acc2[mt][nt], ah, bl[2 * nt], bl[2 * nt + 1]);
              mma_bf16(acc2[mt][nt], al, bh[2 * nt], bh[2 * nt + 1]);
            }
          }
        }
      }
    }
    // Accumulator element i of (mt, nt): query row q0 + 16 mt + gid + 8 (i / 2), key column 2 tq + i % 2.
    // fmaxf ignores a NaN operand, so NaN pairs rank as -inf.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (mt >= mtiles) break;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const long long ql = query_limit(p, i_first, q0 + mt * 16 + gid + 8 * half);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (kf[nt][c] <= ql)
              best[nt][c] = fmaxf(best[nt][c], __fadd_rn(acc1[mt][nt][2 * half + c], acc2[mt][nt][2 * half + c]));
      }
    }
  }
  // Maxima over the query rows (the 8 lanes of a column), then over the r key rows of a block.
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int o = 4; o < 32; o *= 2) best[nt][c] = fmaxf(best[nt][c], __shfl_xor_sync(0xffffffffu, best[nt][c], o));
    const int row = k0 + wk + nt * 8 + 2 * tq;  // the thread's first key row of this n-tile
    if (p.r == 1) {
      if (gid == 0) {
        if (row < row_end) lead[row] = best[nt][0];
        if (row + 1 < row_end) lead[row + 1] = best[nt][1];
      }
    } else {  // r = 4: key rows 4 j' .. 4 j' + 3 of one block sit in lanes tq and tq ^ 1
      float v = fmaxf(best[nt][0], best[nt][1]);
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
      if (gid == 0 && tq % 2 == 0 && row < row_end) lead[row / 4] = v;
    }
  }
}

// Order-preserving key of a float (larger float, larger key; -0 < +0).
__device__ __forceinline__ unsigned order_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive scan of v over the CTA in thread order; `total` gets the sum (every thread). Every thread calls it.
__device__ __forceinline__ int cta_exclusive_scan(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < kScoreThreads / 32; ++w) {
    const int c = warp_sums[w];
    before += w < warp ? c : 0;
    total += c;
  }
  __syncthreads();  // warp_sums is free again
  return before + incl - v;
}

// Top-k of scores[0, n) (candidate id = index), higher score first, ties to the lower id: writes the
// min(k, n) ids ascending to row[s * stride], pads to `width` with -1 and returns the count. Up to one
// candidate per thread (n <= kScoreThreads: R1 and R4 up to Lk = 32K), thread j counts the candidates
// ranked above j and keeps j if fewer than k are: one pass over the scores, one scan. Otherwise a radix
// select finds the key T of the k-th largest score (four passes of 8 bits); the ids with a larger key
// and the lowest `take` ids with key T are kept. Each thread owns a contiguous range of ids, so two
// scans in thread order place the ties and the output in id order.
__device__ int top_k_blocks(const float* scores, int n, int k, int* hist, int* warp_sums, int* pick,
                            std::int32_t* row, std::int64_t stride, std::int64_t width) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const bool all = k >= n;  // CTA-uniform
  if (!all && n <= kScoreThreads) {
    bool keep = false;
    if (tid < n) {
      const unsigned mine = order_key(scores[tid]);
      int above = 0;
#pragma unroll 4
      for (int i = 0; i < n; ++i) {
        const unsigned other = order_key(scores[i]);
        above += other > mine || (other == mine && i < tid) ? 1 : 0;
      }
      keep = above < k;
    }
    int total = 0;
    const int pos = cta_exclusive_scan(keep ? 1 : 0, warp_sums, total);
    if (keep) row[static_cast<std::int64_t>(pos) * stride] = tid;
    for (std::int64_t s = total + tid; s < width; s += kScoreThreads) row[s * stride] = -1;
    return total;
  }
  unsigned thr = 0u;
  int take = 0;
  if (!all) {
    unsigned prefix = 0u, mask = 0u;
    int remaining = k;  // of the candidates matching prefix under mask, this many are still to be taken
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kScoreThreads) hist[i] = 0;
      __syncthreads();
      for (int j = tid; j < n; j += kScoreThreads) {
        const unsigned key = order_key(scores[j]);
        if ((key & mask) == prefix) atomicAdd(hist + ((key >> shift) & 255u), 1);
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l holds the digits 255 - 8 l - i, i < 8 (lane 0 the highest).
        int c[8], s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) s += c[i] = hist[255 - 8 * lane - i];
        int incl = s;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
          const int t = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += t;
        }
        int above = incl - s;  // candidates with a higher digit than this lane's
        if (above < remaining && remaining <= incl) {  // exactly one lane
          for (int i = 0; i < 8; ++i) {
            if (above + c[i] >= remaining) {
              pick[0] = 255 - 8 * lane - i;
              pick[1] = remaining - above;
              break;
            }
            above += c[i];
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<unsigned>(pick[0]) << shift;
      mask |= 255u << shift;
      remaining = pick[1];
      // (pick is rewritten only after the next pass's first barrier)
    }
    thr = prefix;
    take = remaining;
  }
  const int chunk = (n + kScoreThreads - 1) / kScoreThreads;
  const int lo = imin(n, tid * chunk), hi = imin(n, lo + chunk);
  int ties = 0, total = 0;
  if (!all)
    for (int j = lo; j < hi; ++j) ties += order_key(scores[j]) == thr ? 1 : 0;
  const int ties_before = all ? 0 : cta_exclusive_scan(ties, warp_sums, total);
  auto keep = [&](int j, int& tie) {
    if (all) return true;
    const unsigned key = order_key(scores[j]);
    return key > thr || (key == thr && tie++ < take);
  };
  int kept = 0, tie = ties_before;
  for (int j = lo; j < hi; ++j) kept += keep(j, tie) ? 1 : 0;
  int pos = cta_exclusive_scan(kept, warp_sums, total);
  tie = ties_before;
  for (int j = lo; j < hi; ++j)
    if (keep(j, tie)) row[static_cast<std::int64_t>(pos++) * stride] = j;
  for (std::int64_t s = total + tid; s < width; s += kScoreThreads) row[s * stride] = -1;
  return total;
}

// A cluster of p.cluster CTAs per (b, group, Q tile); CTA c scores key rows [c rows_per_cta, ...) of the
// tile's candidates and CTA 0 ranks.
__global__ void __launch_bounds__(kScoreThreads, 2) score_kernel(const __grid_constant__ ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ScoreSmem L = score_smem(p.Tk, p.P);
  auto* scores = reinterpret_cast<float*>(smem + L.scores);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int job = static_cast<int>(blockIdx.x) / p.cluster;  // the host checks jobs * cluster <= INT_MAX
  const int bg = job / p.Tq, t = job - bg * p.Tq;
  const std::int64_t offset = p.Lk - p.Lq, i_first = t * kTileQ, i_last = imin(p.Lq, i_first + kTileQ) - 1;
  // Causal: block j is a candidate iff the tile's last query sees its first key.
  const std::int64_t n_cand =
      p.causal ? imax<std::int64_t>(0, imin<std::int64_t>(p.Tk, ceil_div(i_last + offset + 1, kBlockK))) : p.Tk;
  // Key rows of this CTA (Tk * r <= INT_MAX / 2, checked on the host).
  const int row_begin = rank * p.rows_per_cta;
  const int row_end = imin(row_begin + p.rows_per_cta, static_cast<int>(n_cand) * p.r);
  // Every CTA of the cluster runs before any of them writes into CTA 0's shared memory.
  cluster.sync();
  pdl_wait();  // the representatives are complete

  float* lead = cluster.map_shared_rank(scores, 0);
  const std::uint16_t* qhi = p.qhi + static_cast<std::int64_t>(job) * p.P * p.Dp;
  const std::uint16_t* qlo = p.qlo + static_cast<std::int64_t>(job) * p.P * p.Dp;
  const std::uint16_t* khi = p.khi + static_cast<std::int64_t>(bg) * p.Tk * p.r * p.Dp;
  const std::uint16_t* klo = p.klo + static_cast<std::int64_t>(bg) * p.Tk * p.r * p.Dp;
  const bool stage_q_once = p.P <= L.qcap && p.Dp <= kDChunk;
  bool q_staged = false;
  for (int k0 = row_begin; k0 < row_end; k0 += kKRows)
    score_slab(p, smem, L, qhi, qlo, khi, klo, i_first, k0, imin(kKRows, row_end - k0), row_end, stage_q_once,
               q_staged, lead);
  cluster.sync();  // every block score is in CTA 0
  if (rank != 0) return;

  // Forced blocks rank above every scored one, as on the CPU (only among the candidates).
  if (n_cand > 0) {
    if (p.force_block0 && threadIdx.x == 0) scores[0] = INFINITY;
    if (p.force_local) {
      std::int64_t lo, hi;
      if (p.causal) {
        lo = imax<std::int64_t>(i_first + offset, 0) / kBlockK;
        hi = (i_last + offset) / kBlockK;
      } else {
        lo = hi = imin<std::int64_t>(i_first * p.Lk / p.Lq / kBlockK, p.Tk - 1);
      }
      for (std::int64_t j = lo + threadIdx.x; j <= hi && j < n_cand; j += kScoreThreads) scores[j] = INFINITY;
    }
  }
  __syncthreads();
  const int hkv = static_cast<int>(p.Hkv), b = bg / hkv, g = bg - b * hkv;
  std::int32_t* out = p.idx + b * p.is0 + g * p.is1 + t * p.is2;
  const int c = top_k_blocks(scores, static_cast<int>(n_cand), p.top_k, reinterpret_cast<int*>(smem + L.hist),
                             reinterpret_cast<int*>(smem + L.warp_sums), reinterpret_cast<int*>(smem + L.pick), out,
                             p.is3, p.kmax);
  if (threadIdx.x == 0) p.cnt[b * p.cs0 + g * p.cs1 + t * p.cs2] = c;
}

// ---- host ----------------------------------------------------------------------------------------------------

// Whether every token's D elements of x can be read as aligned 16-byte vectors of 8 columns.
bool vectorizable(const TensorView& x) {
  const auto es = static_cast<std::int64_t>(dtype_size(x.dtype));
  return reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0 && (x.stride[0] * es) % 16 == 0 &&
         (x.stride[1] * es) % 16 == 0 && (x.stride[2] * es) % 16 == 0 && x.shape[3] % kSliceCols == 0;
}

template <In T, bool kVec>
void launch_reps(const RepParams& p, unsigned blocks, cudaStream_t stream) {
  if (p.r == 1) representatives_kernel<T, kVec, rep_lanes(1)><<<blocks, kRepThreads, 0, stream>>>(p);
  else representatives_kernel<T, kVec, rep_lanes(4)><<<blocks, kRepThreads, 0, stream>>>(p);
}

template <In T>
void launch_reps(bool vec, const RepParams& p, unsigned blocks, cudaStream_t stream) {
  if (vec) launch_reps<T, true>(p, blocks, stream);
  else launch_reps<T, false>(p, blocks, stream);
}

// Facts of a device that do not change while the process runs, queried once per device.
struct DeviceFacts {
  int max_smem = 0;  // opt-in dynamic shared memory per block (the scoring kernel's limit is raised to it)
  int sms = 0;
};

// The tensor's device must be the current device and usable (as usable_device_smem in common.cuh, whose
// runtime queries per call are answered from a per-device cache after the first success).
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
  f.max_smem = usable_device_smem(op, "q", t);
  check_cuda(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, t.device_index), op,
             "cudaDeviceGetAttribute");
  check_cuda(cudaFuncSetAttribute(score_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, f.max_smem), op,
             "cudaFuncSetAttribute");
  const std::lock_guard<std::mutex> lock(mu);
  known[t.device_index] = f;
  return f;
}

// Launch configuration of the scoring kernel: `grid` CTAs in clusters of C, `smem` bytes of dynamic shared
// memory each; with `programmatic`, a programmatic dependent of the previous launch on `stream`. The
// attributes live in `attrs`.
cudaLaunchConfig_t score_config(unsigned grid, int C, std::size_t smem, cudaStream_t stream, bool programmatic,
                                cudaLaunchAttribute (&attrs)[2]) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kScoreThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attrs[0] = cudaLaunchAttribute{};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = static_cast<unsigned>(C);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1] = cudaLaunchAttribute{};
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = programmatic ? 2 : 1;
  return cfg;
}

// How many clusters of `C` scoring CTAs with `smem` bytes of dynamic shared memory the device holds at
// once (the runtime's count, which knows the cluster placement), queried once per (device, C, smem).
int resident_clusters(const std::string& op, int device, int C, std::size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, std::size_t>, int> known;
  const auto key = std::make_tuple(device, C, smem);
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = score_config(static_cast<unsigned>(C), C, smem, nullptr, false, attrs);
  int n = 0;
  check_cuda(cudaOccupancyMaxActiveClusters(&n, score_kernel, &cfg), op, "cudaOccupancyMaxActiveClusters");
  const std::lock_guard<std::mutex> lock(mu);
  known[key] = n;
  return n;
}


}  // namespace

std::size_t pooled_scratch_bytes(const ProblemShape& s, const PooledOptions& o) {
  const std::int64_t r = o.representatives;
  return plane_layout(s.B * s.Hq * s.Tq() * r, s.B * s.Hkv * s.Tk() * r, padded_d(s.D)).total;
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
  if (P > INT_MAX / 2 || Tk * r > INT_MAX / 2)
    throw Error(op, "q", "group * r = " + std::to_string(P) + " or Tk * r = " + std::to_string(Tk * r) +
                             " exceed the CUDA selector's row indices");
  const ScoreSmem L = score_smem(Tk, static_cast<int>(P));
  if (L.total > static_cast<std::size_t>(dev.max_smem))
    throw Error(op, "k", "Lk = " + std::to_string(s.Lk) + " gives " + std::to_string(Tk) +
                             " blocks, more than the CUDA selector's per-tile shared-memory ranking holds");
  const std::int64_t rows[2] = {s.B * s.Hq * Tq * r, s.B * s.Hkv * Tk * r};
  const std::int64_t slices = Dp / kSliceCols;
  // Kernel 1 indexes columns (rows x slices) and tokens in int.
  const std::int64_t int_room = INT_MAX - kTileQ - kRepThreads;
  if (slices > int_room || rows[0] * slices > int_room || rows[1] * slices > int_room ||
      std::max(s.Lq, s.Lk) > int_room || jobs * kMaxCluster > INT_MAX)
    throw Error(op, "q", "tensor " + q.describe() + " has more representative rows than the CUDA selector indexes");

  const Planes planes = plane_layout(rows[0], rows[1], Dp);
  const sel::Scratch scratch(op, o.workspace, pooled_scratch_bytes(s, o), q.device_index, stream);
  auto* base = scratch.as<char>();
  auto plane = [&](int i) { return reinterpret_cast<std::uint16_t*>(base + planes.at[i]); };

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
  switch (in_type(q.dtype)) {
    case In::f32: launch_reps<In::f32>(vec, rp, blocks, stream); break;
    case In::f16: launch_reps<In::f16>(vec, rp, blocks, stream); break;
    case In::bf16: launch_reps<In::bf16>(vec, rp, blocks, stream); break;
  }
  check_cuda(cudaGetLastError(), op, "representatives launch");

  ScoreParams p{};
  p.qhi = plane(0), p.qlo = plane(1), p.khi = plane(2), p.klo = plane(3);
  p.idx = out.idx.ptr<std::int32_t>();
  p.is0 = out.idx.stride[0], p.is1 = out.idx.stride[1], p.is2 = out.idx.stride[2], p.is3 = out.idx.stride[3];
  p.kmax = out.idx.shape[3];
  p.cnt = out.cnt.ptr<std::int32_t>();
  p.cs0 = out.cnt.stride[0], p.cs1 = out.cnt.stride[1], p.cs2 = out.cnt.stride[2];
  p.Lq = s.Lq, p.Lk = s.Lk, p.Hkv = s.Hkv, p.Tq = static_cast<int>(Tq), p.Tk = static_cast<int>(Tk), p.Dp = Dp;
  p.P = static_cast<int>(P), p.r = static_cast<int>(r), p.span = static_cast<int>(kTileQ / r), p.top_k = o.top_k;
  p.force_local = o.force_local, p.force_block0 = o.force_block0, p.causal = o.causal;
  // Cluster size: a tile's Tk * r key rows split over C CTAs in multiples of kCtaRowsUnit rows, C the
  // largest (up to about two CTAs per SM over the grid) with which every cluster of the grid is resident
  // at once: a cluster that waits for a second wave doubles the kernel's time.
  const std::int64_t key_rows = Tk * r, units = ceil_div(key_rows, static_cast<std::int64_t>(kCtaRowsUnit));
  std::int64_t C = 1, rows_per_cta = units * kCtaRowsUnit;
  for (std::int64_t c = std::min<std::int64_t>({kMaxCluster, units, ceil_div(2 * dev.sms, jobs)}); c > 1; --c) {
    const std::int64_t per = ceil_div(units, c) * kCtaRowsUnit;
    if (ceil_div(key_rows, per) == c && jobs <= resident_clusters(op, q.device_index, static_cast<int>(c), L.total)) {
      C = c;
      rows_per_cta = per;
      break;
    }
  }
  p.rows_per_cta = static_cast<int>(rows_per_cta);
  p.cluster = static_cast<int>(C);

  // A programmatic dependent of the representatives: launch and cluster start overlap their tail.
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg =
      score_config(static_cast<unsigned>(jobs * C), p.cluster, L.total, stream, true, attrs);
  check_cuda(cudaLaunchKernelEx(&cfg, score_kernel, p), op, "scoring launch");
}

}  // namespace sparse_attn::cuda_backend
