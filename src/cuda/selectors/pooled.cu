// R1 / R4 pooled selector on the GPU (docs/design.md §5.7), version 3. The ids equal the CPU reference
// (src/selectors/pooled.cpp) bit for bit; see common.cuh for why float64 chains in the CPU's order
// reproduce its doubles. Two kernels on the caller's stream, the second a programmatic dependent
// launch of the first:
//
//  1. representatives (q and k in one launch): a thread owns one row of means (one head, 128 / r
//     tokens) and W of its columns, read as one aligned vector of 16, 8 or 4 bytes per token (single
//     elements for views that allow none), so it runs W independent float64 column sums, each over the
//     tokens in order (the CPU's order), with two batches of token loads in flight. The widest vector
//     that still leaves 8 warps per SM is taken (rep_layout; more bytes per thread and fewer warps put
//     fewer bytes in flight). On the H200 it reads 42 MB in 18-19 us at tile16 (R1 and R4, 16K), about
//     half the DRAM bandwidth, with 18-31 % of the issue slots busy: the time follows neither the
//     instruction count (halved by 16-byte loads without a gain) nor the warp count beyond that floor
//     (docs/notes/selectors.md, pooled v3 and v5). The float means are written
//     in a layout where the group * r query rows of one (b, group, Q tile) are contiguous, and beside
//     them a two-level int8 copy for the screen: M = rint(mean / s), s = 2^e with max|mean| < 16256 s,
//     split as M = 128 H + L with H in [-127, 127] and L in [-64, 63]; plus s and L1 = sum |M| (a
//     row's threads reduce with shuffles, through shared memory where a row spans several warps). The
//     launch also zeroes the per-tile counters of kernel 2.
//  2. scores + top-k: a CTA takes one (b, group, Q tile) and a range of whole KV blocks, stages the
//     int8 rows in shared memory and forms every representative dot M_a.M_b exactly from four int8
//     products on the tensor cores (mma m16n8k32 s8: H.H, H.L + L.H, L.L). Per block it keeps only the
//     pairs that the quantisation bound cannot rule out as the block's maximum and evaluates those in
//     float64 in the CPU's order (from the float means), so each block score is the CPU's double (a
//     pass with one chunk of query rows keeps each pair's upper bound in shared memory from the lower-
//     bound sweep for the test; several chunks form the products again). A
//     tile whose key rows fit one pass is one CTA and ranks its blocks from shared memory; otherwise the
//     last CTA of the tile (an atomic counter) ranks the exact block scores. Exact top-k, ties to the
//     lower id.
//
// Screening proof. Let a, b be the float32 mean rows of a counted pair (n = D <= 256 columns), S the
// CPU's float64 chain over them (the value to reproduce), M, N their integer copies and s_a, s_b their
// scales: a_i = s_a (M_i + α_i) with |α_i| <= 1/2 (rint of a_i / s_a, which is exact, or below 2^-126
// and then rounded to 0), |M_i| <= 16256. Then a.b - s_a s_b M.N = s_a s_b Σ (M_i β_i + α_i N_i + α_i β_i),
// so |a.b - s_a s_b M.N| <= s_a s_b (L1(M) / 2 + L1(N) / 2 + n / 4). The float64 chain has no underflow
// (float products are 0 or >= 2^-298 in magnitude) and |S - a.b| <= γ'_n Σ|a_i b_i| with
// γ'_n = n 2^-53 / (1 - n 2^-53) and Σ|a_i b_i| <= s_a s_b n 16256.5^2, which is below s_a s_b for
// n <= 4096. So |S - s_a s_b M.N| <= e = s_a s_b (L1(M) / 2 + L1(N) / 2 + n / 4 + 1).
// M.N = 16384 H_a.H_b + 128 (H_a.L_b + L_a.H_b) + L_a.L_b; each of the three integer dots is exact in
// int32 and below 2^22 in magnitude for n <= 256 (127^2 n, 2 127 64 n, 64^2 n), so each converts to
// float exactly (the bias trick below), and M.N is bracketed by two fmas rounded down (up):
// X_lo = rd(16384 HH + rd(128 HL + LL)) <= M.N <= X_hi. With ss = s_a s_b a power of two in
// [2^-120, 2^80] every product below is exact or directed, nothing overflows (|M.N| < 2^37, e < 2^23 ss)
// and nothing leaves float's normal range: lb = rd(X_lo ss - e) <= S <= ub = ru(X_hi ss + e).
// For a block, let Lb = max lb over its counted pairs. The pair p* holding the block's maximum has
// S(p*) >= S(q) >= lb(q) for every pair q, so ub(p*) >= Lb: evaluating in float64 every pair with
// ub >= Lb, plus every pair of a row without a scale (NaN or infinity in the means, max|mean| outside
// 16256 [2^-60, 2^40], or D > 256), finds p* and hence the block's exact maximum; NaN scores rank as
// -inf as on the CPU. The copy is 128x finer than version 2b's single int8 level, so on random data
// about one pair per block reaches float64 instead of most of them.
//
// Code size is time here: a scoring CTA runs most of its code once, so every instruction is fetched
// once per CTA; loops that are unrolled for no reuse (the key tiles of a pass, the staging batches)
// stay rolled and the float64 dot and the top-k are calls.
//
// Scratch (means, int8 copies, block scores, counters) is cached per (device, stream) and grown (with
// a synchronisation of that stream) only when a call needs more; a call being captured into a CUDA
// graph takes stream-ordered memory instead (the graph owns it; capture never synchronises).
#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <type_traits>

#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using namespace sel;

// ---- 1. representatives -----------------------------------------------------------------------------

// 64-thread CTAs where a row takes fewer threads (else one row per CTA): small CTAs spread a grid of
// few rows (tile16 R1 at Lk = 4K) over the SMs evenly.
constexpr int kRepThreads = 64;
constexpr int kRepMaxGroup = 256;  // threads of one row that reduce together (blockDim is at most this)
// Scale exponents that keep M.N s_a s_b and its bound inside float's normal range (proof above).
constexpr int kMinScaleExp = -60, kMaxScaleExp = 40;
constexpr float kMaxLevel = 16256.0f;  // |M| <= 127 * 128: M = 128 H + L with |H| <= 127, L in [-64, 63]
constexpr int kMaxScreenD = 256;       // the three int8 dots stay below 2^22 (exact through the bias trick)

// One input tensor's view and where its representatives go: row
// (((b * (H / G) + h / G) * T + t) * G + h % G) * r + a (G = heads per group for q, 1 for k), so the
// group * r rows of one (b, group, tile) are contiguous. mean: D floats per row; i8: per row the H
// bytes then the L bytes, i8_stride each.
struct RepTensor {
  const void* x;
  std::int64_t sb, sl, sh;  // element strides (d is contiguous)
  std::int64_t L, H, G, T;
  std::int64_t rows;        // B * H * T * r
  std::int64_t ctas;        // CTAs of the grid serving this tensor
  float* mean;
  signed char* i8;
  float* scale;             // s, or 0 where the row has no int8 bound
  float* l1;                // sum |M|
};

struct RepParams {
  RepTensor t[2];  // q, k
  std::int64_t D, r, span;
  int cols;        // threads of a row that hold columns: ceil(D / W)
  int group;       // threads per row: cols rounded up to a power of two (or cols when not quantised)
  bool quantize;   // D <= kMaxScreenD and group <= kRepMaxGroup
  std::int64_t i8_stride;
  unsigned* counters;
  std::int64_t n_counters;
};

// Loads of W columns of one token, as floats in column order: one aligned vector of kVecBytes (16, 8 or
// 4; W = kVecBytes / element size), or, with kVecBytes = 0, W = 4 / element size single elements.
template <In T, int kVecBytes>
struct RepIO {
  static constexpr int kBytes = T == In::f32 ? 4 : 2;
  static constexpr int W = (kVecBytes ? kVecBytes : 4) / kBytes;
  static constexpr int kWords = kVecBytes / 4;
  // Tokens of loads per batch; two batches are in flight per thread.
  static constexpr int kBatch = kVecBytes == 16 ? 8 : 16;
  struct Raw {
    std::conditional_t<kVecBytes == 0, float[W], unsigned[kWords ? kWords : 1]> v;
  };

  __device__ static __forceinline__ void load(const char* p, int valid, Raw& r) {
    if constexpr (kVecBytes == 16) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
      r.v[0] = u.x, r.v[1] = u.y, r.v[2] = u.z, r.v[3] = u.w;
    } else if constexpr (kVecBytes == 8) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      r.v[0] = u.x, r.v[1] = u.y;
    } else if constexpr (kVecBytes == 4) {
      r.v[0] = __ldg(reinterpret_cast<const unsigned*>(p));
    } else {
#pragma unroll
      for (int e = 0; e < W; ++e) r.v[e] = e < valid ? load_elem<T>(p, e) : 0.0f;
    }
  }
  __device__ static __forceinline__ void to_float(const Raw& r, float (&f)[W]) {
    if constexpr (kVecBytes == 0) {
#pragma unroll
      for (int e = 0; e < W; ++e) f[e] = r.v[e];
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        const unsigned w = r.v[i];
        if constexpr (T == In::f32) {
          f[i] = __uint_as_float(w);
        } else if constexpr (T == In::bf16) {  // the element at the lower address is the low half
          f[2 * i] = __uint_as_float(w << 16);
          f[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
        } else {
          f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
          f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
        }
      }
    }
  }
};

// Stores the low W bytes of v (W = 1, 2, 4 or 8) at p, which is aligned to W bytes.
template <int W>
__device__ __forceinline__ void store_bytes(signed char* p, unsigned long long v) {
  if constexpr (W == 8) *reinterpret_cast<unsigned long long*>(p) = v;
  else if constexpr (W == 4) *reinterpret_cast<unsigned*>(p) = static_cast<unsigned>(v);
  else if constexpr (W == 2) *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(v);
  else *p = static_cast<signed char>(v);
}

// Reductions over the `group` threads of one row: an aligned power-of-two segment of a warp, or (group
// > 32, then blockDim == group) the whole CTA through `red` (one slot per warp). Every thread of the
// segment (of the CTA) calls them.
__device__ __forceinline__ float row_max(float v, int group, float* red) {
  const int lane = threadIdx.x % 32;
  const int width = group < 32 ? group : 32;
  const unsigned mask = width == 32 ? 0xffffffffu : ((1u << width) - 1u) << (lane & ~(width - 1));
  for (int o = width / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
  if (group <= 32) return v;
  __syncthreads();  // `red` is free (an earlier reduction has been read by every thread)
  if (lane == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  for (int w = 0; w < group / 32; ++w) v = fmaxf(v, red[w]);
  return v;
}
__device__ __forceinline__ int row_sum(int v, int group, int* red) {
  const int lane = threadIdx.x % 32;
  const int width = group < 32 ? group : 32;
  const unsigned mask = width == 32 ? 0xffffffffu : ((1u << width) - 1u) << (lane & ~(width - 1));
  for (int o = width / 2; o > 0; o /= 2) v += __shfl_xor_sync(mask, v, o);
  if (group <= 32) return v;
  __syncthreads();
  if (lane == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0;
  for (int w = 0; w < group / 32; ++w) v += red[w];
  return v;
}

template <In T, int kVecBytes>
__global__ void __launch_bounds__(kRepMaxGroup) representatives_kernel(const __grid_constant__ RepParams p) {
  using IO = RepIO<T, kVecBytes>;
  constexpr int W = IO::W, U = IO::kBatch;
  __shared__ float red_f[kRepMaxGroup / 32];
  __shared__ int red_i[kRepMaxGroup / 32];
  // The scoring kernel may be scheduled as soon as every CTA here has started (programmatic dependent
  // launch); it waits for this grid's completion before it reads anything this grid writes.
  pdl_launch_dependents();
  if (blockIdx.x == 0)
    for (std::int64_t i = threadIdx.x; i < p.n_counters; i += blockDim.x) p.counters[i] = 0u;

  const int which = static_cast<std::int64_t>(blockIdx.x) < p.t[0].ctas ? 0 : 1;
  const RepTensor& x = p.t[which];
  // 32-bit index arithmetic (the host keeps rows * group below 2^31): the decode is a fifth of the
  // instructions of a short R4 row otherwise.
  const unsigned item = (blockIdx.x - (which ? static_cast<unsigned>(p.t[0].ctas) : 0u)) * blockDim.x + threadIdx.x;
  const unsigned group = static_cast<unsigned>(p.group);
  const std::int64_t row = item / group;
  // Whole rows per CTA when quantising (blockDim is a multiple of group, or equal to it), so this exit
  // is uniform over every row segment and every CTA that reduces through shared memory.
  if (row >= x.rows) return;
  const int c = static_cast<int>(item % group);
  const std::int64_t col = static_cast<std::int64_t>(c) * W;
  const int valid = c < p.cols ? static_cast<int>(imin<std::int64_t>(W, p.D - col)) : 0;
  unsigned rest = static_cast<unsigned>(row);
  const unsigned nr = static_cast<unsigned>(p.r), ng = static_cast<unsigned>(x.G), nt = static_cast<unsigned>(x.T);
  const unsigned hg = static_cast<unsigned>(x.H / x.G);
  const std::int64_t a = rest % nr;
  rest /= nr;
  const std::int64_t hl = rest % ng;
  rest /= ng;
  const std::int64_t t = rest % nt;
  rest /= nt;
  const std::int64_t h = static_cast<std::int64_t>(rest % hg) * ng + hl;
  const std::int64_t b = rest / hg;
  const std::int64_t l0 = t * kTileQ + a * p.span;
  const std::int64_t n = imin(x.L, l0 + p.span) - l0;  // <= 0: an absent representative

  double acc[W];
#pragma unroll
  for (int e = 0; e < W; ++e) acc[e] = 0.0;
  if (valid > 0 && n > 0) {
    const char* base = static_cast<const char*>(x.x) + (b * x.sb + h * x.sh + l0 * x.sl + col) * IO::kBytes;
    const std::int64_t step = x.sl * IO::kBytes;
    const int ni = static_cast<int>(n);
    typename IO::Raw b0[U], b1[U];
    auto load = [&](typename IO::Raw(&buf)[U], int s) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (s + u < ni) IO::load(base + (s + u) * step, valid, buf[u]);
    };
    // Token order within a column, as the CPU: the batches are added in sequence.
    auto add = [&](const typename IO::Raw(&buf)[U], int s) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (s + u < ni) {
          float f[W];
          IO::to_float(buf[u], f);
#pragma unroll
          for (int e = 0; e < W; ++e) acc[e] += static_cast<double>(f[e]);
        }
      }
    };
    load(b0, 0);
    for (int s = 0; s < ni; s += 2 * U) {
      load(b1, s + U);
      add(b0, s);
      load(b0, s + 2 * U);
      add(b1, s + U);
    }
  }
  // Absent representatives are skipped by the scores; their means are kept defined (zero).
  float m[W];
  const double count = static_cast<double>(n > 0 ? n : 1);
#pragma unroll
  for (int e = 0; e < W; ++e) m[e] = e < valid ? __double2float_rn(acc[e] / count) : 0.0f;
  float* dst = x.mean + row * p.D + col;
#pragma unroll
  for (int e = 0; e < W; ++e)
    if (e < valid) dst[e] = m[e];
  if (!p.quantize) {
    if (c == 0) x.scale[row] = 0.0f;
    return;
  }

  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    amax = fmaxf(amax, fabsf(m[e]));
    finite = finite && isfinite(m[e]);
  }
  amax = row_max(amax, p.group, red_f);
  // A non-finite mean anywhere in the row makes the row's maximum +inf (NaN is carried as +inf).
  const float bad = row_max(finite ? 0.0f : INFINITY, p.group, red_f);
  float s = 0.0f;  // no bound
  if (bad == 0.0f) {
    if (amax == 0.0f) {
      s = 1.0f;
    } else {
      int ex = 0;
      frexpf(__fdiv_ru(amax, kMaxLevel), &ex);  // amax / 16256 < 2^ex, so |mean| / 2^ex < 16256
      if (ex >= kMinScaleExp && ex <= kMaxScaleExp) s = ldexpf(1.0f, ex);
    }
  }
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;  // a power of two: exact
  unsigned long long hi = 0u, lo = 0u;
  int l1 = 0;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    const int M = s > 0.0f ? static_cast<int>(rintf(m[e] * inv)) : 0;
    const int H = (M + 64) >> 7;  // floor: L = M - 128 H in [-64, 63], |H| <= 127 for |M| <= 16256
    const int Lo = M - 128 * H;
    l1 += abs(M);
    hi |= static_cast<unsigned long long>(static_cast<unsigned>(H) & 0xffu) << (8 * e);
    lo |= static_cast<unsigned long long>(static_cast<unsigned>(Lo) & 0xffu) << (8 * e);
  }
  l1 = row_sum(l1, p.group, red_i);
  signed char* d8 = x.i8 + row * 2 * p.i8_stride + col;
  store_bytes<W>(d8, hi);
  store_bytes<W>(d8 + p.i8_stride, lo);
  if (c == 0) {
    x.scale[row] = s;
    x.l1[row] = static_cast<float>(l1);
  }
}

// ---- 2. scores and top-k ------------------------------------------------------------------------------

// Candidate pairs queued per CTA; a block whose candidates overflow the queue has all its pairs
// evaluated instead.
constexpr int kCandCap = 2048;
constexpr int kMaxRowsPerCta = 512;    // key representative rows per CTA (passes of kKN rows)
constexpr std::int64_t kNever = LLONG_MAX;  // key position that no query sees

// Tile of one pass: kQM query rows x kKN key rows, 8 warps (WarpTile says which pairs a warp forms
// with mma m16n8k32).
constexpr int kQM = 64, kKN = 128, kThreads = 256;
// int8 row stride in shared memory: a multiple of 16 bytes that is 4 words modulo 8, so the eight
// rows of a fragment load fall on distinct banks.
__host__ __device__ inline int smem_i8_stride(std::int64_t k32) { return static_cast<int>(k32) + 16; }

struct ScoreParams {
  const float* qmean;  // [jobs, P, D], row h_local * r + a
  const float* kmean;  // [B * Hkv, Tk * r, D], row j * r + c
  const signed char* q8;
  const signed char* k8;
  const float* qscale;
  const float* kscale;
  const float* ql1;
  const float* kl1;
  double* scores;      // [jobs, Tk]
  unsigned* counters;  // [jobs]
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, kmax;
  std::int32_t* cnt;
  std::int64_t cs0, cs1, cs2;
  std::int64_t Lq, Lk, Hkv, D, Tq, Tk;
  std::int64_t i8_stride;    // bytes of one level (H or L) of an int8 row in global memory
  int k32;                   // columns of the int8 tiles: D rounded up to 32
  int P, r, span, top_k;
  int rshift;                // log2 r: block of a key row without a division in the per-pair code
  int chunks, rows_per_cta;  // CTAs per (b, group, tile); key rows per CTA (a multiple of r)
  float dterm;               // D / 4 + 1 of the bound
  bool force_local, force_block0, causal;
};

struct ScoreSmem {
  std::size_t qlim, kfirst, ekey, q8, k8, qsc, ksc, ql1, kl1, lkey, cand, full, ubs, total;
};

// Shared memory of the scoring phase; the top-k phase reuses it from offset 0. q8 / k8 hold both
// levels: [2][kQM][rs] and [2][kKN][rs].
__host__ __device__ inline ScoreSmem score_smem(int k32, int nblk) {
  auto up = [](std::size_t x) { return (x + 15) / 16 * 16; };
  const std::size_t rs = static_cast<std::size_t>(smem_i8_stride(k32));
  ScoreSmem s{};
  std::size_t o = 0;
  s.qlim = o, o = up(o + kQM * sizeof(long long));
  s.kfirst = o, o = up(o + kKN * sizeof(long long));
  s.ekey = o, o = up(o + nblk * sizeof(unsigned long long));
  s.q8 = o, o = up(o + 2 * kQM * rs);
  s.k8 = o, o = up(o + 2 * kKN * rs);
  s.qsc = o, o = up(o + kQM * sizeof(float));
  s.ksc = o, o = up(o + kKN * sizeof(float));
  s.ql1 = o, o = up(o + kQM * sizeof(float));
  s.kl1 = o, o = up(o + kKN * sizeof(float));
  s.lkey = o, o = up(o + nblk * sizeof(unsigned));
  s.cand = o, o = up(o + kCandCap * sizeof(uint2));
  s.full = o, o = up(o + nblk * sizeof(unsigned));
  s.ubs = o, o = up(o + 32 * kThreads * sizeof(float));  // 32 pair slots per thread (test_stored)
  s.total = o;
  return s;
}

// After the scores: 64 ints of per-warp counts, then 256 ints of half counts (blocks of <= 512 threads).
__host__ __device__ inline std::size_t topk_smem(std::int64_t Tk) {
  return static_cast<std::size_t>(Tk) * sizeof(double) + (64 + 256) * sizeof(int);
}

// Candidates of [lo, hi) that rank before candidate j (score sj), counted until k: eight comparisons
// per exit test, so their shared-memory loads overlap.
__device__ __forceinline__ int ranked_before(const double* scores, int lo, int hi, int k, double sj, int j) {
  int before = 0;
  for (int o0 = lo; o0 < hi && before < k; o0 += 8) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int o = o0 + u;
      if (o < hi) before += ranks_before(scores[o], o, sj, j) ? 1 : 0;
    }
  }
  return before;
}

// Exact top-k of the tile, block-wide: scores[0, n) in shared memory (sanitised), candidate id = index.
// Writes the best min(k, n) ids ascending to row[s * stride] for s < width, pads with -1, returns the
// count. A candidate is kept iff fewer than k candidates rank before it (the CPU's order is total, so
// the set is the CPU's); kept ids are placed by warp ballots, so ascending order costs two barriers per
// blockDim candidates instead of common.cuh's serial scan over the threads.
// warp_kept: 64 + 256 ints (topk_smem). When 2 n <= blockDim, two threads count for each candidate at
// the same time (thread j over [0, n/2), thread n + j over [n/2, n)): the count is a dependent chain of
// about n instructions per thread, which a CTA with one warp per scheduler runs at ten cycles each.
__device__ __noinline__ int tile_top_k(const double* scores, int n, int k, int* warp_kept, std::int32_t* row, std::int64_t stride,
                          std::int64_t width) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  int* half_count = warp_kept + 64;
  const bool split = k < n && 2 * n <= static_cast<int>(blockDim.x);  // the same in every thread
  const int h = n / 2;
  int first_half = 0;  // split, thread j < n: candidates of [0, n/2) before j (counted until k)
  if (split) {
    if (tid < n) first_half = ranked_before(scores, 0, h, k, scores[tid], tid);
    else if (tid < 2 * n) half_count[tid - n] = ranked_before(scores, h, n, k, scores[tid - n], tid - n);
    __syncthreads();
  }
  int written = 0;  // the same in every thread
  for (int base = 0; base < n; base += blockDim.x) {
    const int j = base + tid;
    bool keep = false;
    if (j < n) {
      if (k >= n) {
        keep = true;
      } else {
        // split: one chunk (n <= blockDim / 2), so j is this thread's candidate
        keep = split ? first_half + half_count[j] < k : ranked_before(scores, 0, n, k, scores[j], j) < k;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_kept[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, total = 0;
    for (int w = 0; w < warps; ++w) {
      const int c = warp_kept[w];
      offset += w < warp ? c : 0;
      total += c;
    }
    if (keep) row[static_cast<std::int64_t>(written + offset + __popc(ballot & ((1u << lane) - 1u))) * stride] = j;
    written += total;
    __syncthreads();  // warp_kept is reused by the next chunk
  }
  for (std::int64_t s = written + tid; s < width; s += blockDim.x) row[s * stride] = -1;
  return written;
}

// Order-preserving integer keys of floats / doubles, for atomicMax in shared memory.
__device__ __forceinline__ unsigned key32(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unkey32(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ unsigned long long key64(double d) {
  const auto u = static_cast<unsigned long long>(__double_as_longlong(d));
  return (u >> 63) ? ~u : (u | (1ull << 63));
}
__device__ __forceinline__ double unkey64(unsigned long long k) {
  return __longlong_as_double(static_cast<long long>((k >> 63) ? (k & ~(1ull << 63)) : ~k));
}

__device__ __forceinline__ void mma_s8(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The CPU's dot_f64: one float64 chain over d in order (products of floats are exact in float64,
// so the fma rounds as the CPU's multiply and add).
__device__ __forceinline__ double exact_dot(const float* a, const float* b, std::int64_t n) {
  double s = 0.0;
  if ((n & 31) == 0) {
    // 32 columns per step, their 16 loads issued before the chain uses them: one round trip per step
    // (the chain waited for about 130 cycles per column with 4 columns per round trip, round 5).
    const auto* a4 = reinterpret_cast<const float4*>(a);
    const auto* b4 = reinterpret_cast<const float4*>(b);
    for (std::int64_t c = 0; c < n / 4; c += 8) {
      float4 x[8], y[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        x[u] = __ldg(a4 + c + u);
        y[u] = __ldg(b4 + c + u);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        s = fma(static_cast<double>(x[u].x), static_cast<double>(y[u].x), s);
        s = fma(static_cast<double>(x[u].y), static_cast<double>(y[u].y), s);
        s = fma(static_cast<double>(x[u].z), static_cast<double>(y[u].z), s);
        s = fma(static_cast<double>(x[u].w), static_cast<double>(y[u].w), s);
      }
    }
  } else if ((n & 3) == 0) {
    const auto* a4 = reinterpret_cast<const float4*>(a);
    const auto* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll 4
    for (std::int64_t d = 0; d < n / 4; ++d) {
      const float4 x = __ldg(a4 + d), y = __ldg(b4 + d);
      s = fma(static_cast<double>(x.x), static_cast<double>(y.x), s);
      s = fma(static_cast<double>(x.y), static_cast<double>(y.y), s);
      s = fma(static_cast<double>(x.z), static_cast<double>(y.z), s);
      s = fma(static_cast<double>(x.w), static_cast<double>(y.w), s);
    }
  } else {
    for (std::int64_t d = 0; d < n; ++d) s = fma(static_cast<double>(__ldg(a + d)), static_cast<double>(__ldg(b + d)), s);
  }
  return s;
}

struct CtaView {
  const float* qrows;   // this job's first query row (float means)
  const float* krows;   // this (b, group)'s first key row
  unsigned long long* ekey;
  std::int64_t blk0;    // first block of the CTA
};

// The tile a scoring CTA works on: (b, group, Q tile) job, its candidate blocks under causal
// visibility, the blocks forced into the list (as the CPU forces them) and the CTA's key rows.
struct TileJob {
  std::int64_t job, t, bg, i_first, n_cand, local_lo, local_hi, row_begin, row_end;

  __device__ __forceinline__ bool forced(const ScoreParams& p, std::int64_t j) const {
    return (p.force_block0 && j == 0) || (j >= local_lo && j <= local_hi);
  }
};

__device__ __forceinline__ TileJob tile_job(const ScoreParams& p) {
  TileJob tj;
  tj.job = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x % p.chunks;
  tj.t = tj.job % p.Tq, tj.bg = tj.job / p.Tq;
  const std::int64_t offset = p.Lk - p.Lq;
  tj.i_first = tj.t * kTileQ;
  const std::int64_t i_last = imin(p.Lq, tj.i_first + kTileQ) - 1;
  tj.n_cand = p.causal ? imax(std::int64_t{0}, imin(p.Tk, (i_last + offset + 1 + kBlockK - 1) / kBlockK)) : p.Tk;
  // Forced blocks: block 0 and the local block(s); they only matter for j < n_cand.
  tj.local_lo = -1, tj.local_hi = -2;
  if (p.force_local) {
    if (p.causal) {
      tj.local_lo = imax(tj.i_first + offset, std::int64_t{0}) / kBlockK;
      tj.local_hi = (i_last + offset) / kBlockK;
    } else {
      tj.local_lo = tj.local_hi = imin(tj.i_first * p.Lk / p.Lq / kBlockK, p.Tk - 1);
    }
  }
  tj.row_begin = static_cast<std::int64_t>(chunk) * p.rows_per_cta;
  tj.row_end = imin(tj.row_begin + p.rows_per_cta, tj.n_cand * p.r);
  return tj;
}

// The CTA's rows of means and its shared block maxima (ekey, one per block of the CTA).
__device__ __forceinline__ CtaView cta_view(const ScoreParams& p, const TileJob& tj, unsigned long long* ekey) {
  CtaView v;
  v.qrows = p.qmean + tj.job * p.P * p.D;
  v.krows = p.kmean + tj.bg * p.Tk * p.r * p.D;
  v.ekey = ekey;
  v.blk0 = tj.row_begin / p.r;
  return v;
}

// Visibility of the pairs, shared by every scoring kernel: a pair counts iff key_first(its key row) <=
// query_limit(its query row). query_limit: the last key position that query row `row` of the tile
// starting at query i_first sees (causal), kNever - 1 without causality, -1 for an absent representative.
__device__ __forceinline__ long long query_limit(const ScoreParams& p, std::int64_t i_first, int row) {
  const std::int64_t first = i_first + static_cast<std::int64_t>(row % p.r) * p.span;
  const std::int64_t qn = imin(p.Lq, first + p.span) - first;
  if (qn <= 0) return -1;
  return p.causal ? first + qn - 1 + (p.Lk - p.Lq) : kNever - 1;
}
// key_first: the first key position of key row `row` (>= 0), or kNever (above every limit) for an absent
// representative or a block forced into the list (scored +inf, not by its pairs).
__device__ __forceinline__ long long key_first(const ScoreParams& p, std::int64_t row, std::int64_t local_lo,
                                               std::int64_t local_hi) {
  const std::int64_t j = row >> p.rshift, first = j * kBlockK + (row - (j << p.rshift)) * p.span;
  const bool forced = (p.force_block0 && j == 0) || (j >= local_lo && j <= local_hi);
  return !forced && imin(p.Lk, first + p.span) > first ? first : kNever;
}

// The CTA's block scores (forced +inf, else the exact maximum; -inf where no pair counts), then the
// exact top-k of the tile. With `local` (a CTA that holds all of its tile's blocks) they are ranked
// from that shared-memory array; otherwise they go through global memory and the last of the tile's
// CTAs ranks them. `is_last` is a __shared__ int of the kernel.
__device__ __forceinline__ void rank_tile(const ScoreParams& p, const TileJob& tj, const CtaView& v,
                                          unsigned char* smem, double* local, int& is_last) {
  const int tid = threadIdx.x, nthreads = static_cast<int>(blockDim.x);
  const int n = static_cast<int>(tj.n_cand);
  double* sc = local;
  if (local != nullptr) {
    for (std::int64_t j = tid; j < tj.n_cand; j += nthreads) sc[j] = tj.forced(p, j) ? INFINITY : unkey64(v.ekey[j]);
  } else {
    double* scores = p.scores + tj.job * p.Tk;
    for (std::int64_t j = v.blk0 + tid; j * p.r < tj.row_end; j += nthreads)
      scores[j] = tj.forced(p, j) ? INFINITY : unkey64(v.ekey[j - v.blk0]);
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(p.counters + tj.job, 1u) == static_cast<unsigned>(p.chunks - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();  // the other CTAs' scores are visible (they fenced before counting)
    sc = reinterpret_cast<double*>(smem);
    for (int j = tid; j < n; j += nthreads) sc[j] = __ldcg(scores + j);
  }
  int* warp_kept = reinterpret_cast<int*>(sc + p.Tk);
  __syncthreads();
  const std::int64_t b = tj.bg / p.Hkv, g = tj.bg % p.Hkv;
  std::int32_t* row = p.idx + b * p.is0 + g * p.is1 + tj.t * p.is2;
  const int c = tile_top_k(sc, n, p.top_k, warp_kept, row, p.is3, p.kmax);
  if (tid == 0) p.cnt[b * p.cs0 + g * p.cs1 + tj.t * p.cs2] = c;
}

__device__ __noinline__ void evaluate_pair(const ScoreParams& p, const CtaView& v, unsigned qrow, unsigned krow) {
  const float* a = v.qrows + static_cast<std::int64_t>(qrow) * p.D;
  const float* b = v.krows + static_cast<std::int64_t>(krow) * p.D;
  // Every line of both rows requested at once: the chain below then waits for one round trip to L2,
  // not one per unrolled step.
  for (std::int64_t d = 0; d < p.D; d += 32) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(a + d));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(b + d));
  }
  const double s = exact_dot(a, b, p.D);
  atomicMax(v.ekey + ((krow >> p.rshift) - v.blk0), key64(sanitize(s)));
}

// Float64 evaluation of the pairs the screen could not decide: the queued ones, and, for blocks whose
// pairs overflowed the queue (near-ties in bulk), every counted pair of those blocks at once.
template <int kThreads>
__device__ __forceinline__ void evaluate_queued(const ScoreParams& p, const TileJob& tj, const CtaView& v,
                                                const uint2* cand, const unsigned* full, int n_queued, int cap,
                                                std::int64_t k0, int krows) {
  const int tid = threadIdx.x;
  const int queued = imin(n_queued, cap);
  for (int i = tid; i < queued; i += kThreads) evaluate_pair(p, v, cand[i].x, cand[i].y);
  if (n_queued <= cap) return;
  const std::int64_t r = p.r, pairs = p.P * r, j0 = k0 / r;
  for (std::int64_t e = tid; e < (krows / r) * pairs; e += kThreads) {
    const std::int64_t j = j0 + e / pairs;
    if (!full[j - v.blk0]) continue;
    const std::int64_t qrow = (e % pairs) / r, krow = j * r + e % r;
    // (a full block is never forced: a forced block's pairs are never queued)
    if (key_first(p, krow, tj.local_lo, tj.local_hi) > query_limit(p, tj.i_first, static_cast<int>(qrow))) continue;
    evaluate_pair(p, v, static_cast<unsigned>(qrow), static_cast<unsigned>(krow));
  }
}



// An integer below 2^22 in magnitude as a float, exactly, without a conversion instruction: the float
// with bits 1.5 * 2^23 + v is 12582912 + v (its unit in the last place is 1), and the subtraction is exact.
__device__ __forceinline__ float small_int_to_float(int v) {
  return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// Stages both int8 levels, the scales and L1 of query rows [q0, q0 + qrows) of the job and key rows
// [k0, k0 + krows) of the (b, group), and fills the pairs' visibility data: qlim = the last key
// position a query row's group sees (-1 when absent), kfirst = a key row's first position (kNever when
// it is absent, forced or past the CTA's range). Starts and ends with a barrier.
__device__ __forceinline__ void stage_rows(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L,
                                           std::int64_t job, std::int64_t bg, int q0, int qrows, std::int64_t k0,
                                           int krows, std::int64_t i_first, std::int64_t local_lo,
                                           std::int64_t local_hi) {
  auto* qlim = reinterpret_cast<long long*>(smem + L.qlim);
  auto* kfirst = reinterpret_cast<long long*>(smem + L.kfirst);
  unsigned char* q8 = smem + L.q8;
  unsigned char* k8 = smem + L.k8;
  float* qsc = reinterpret_cast<float*>(smem + L.qsc);
  float* ksc = reinterpret_cast<float*>(smem + L.ksc);
  float* ql1 = reinterpret_cast<float*>(smem + L.ql1);
  float* kl1 = reinterpret_cast<float*>(smem + L.kl1);
  const int tid = threadIdx.x;
  const int rs = smem_i8_stride(p.k32);

  __syncthreads();  // the previous pass is done with every staged array
  const std::int64_t qbase = job * p.P + q0, kbase = bg * p.Tk * p.r + k0;
  // int8 rows (both levels), 16 bytes at a time, a batch of loads in flight per thread (the first batch
  // also overlaps the row data below); columns past D are zero.
  const int vecs = p.k32 / 16, total = (qrows + krows) * 2 * vecs;
  constexpr int kBatch = 12;  // tile16: every vector of a pass in one batch (R1 9, R4 12 per thread)
  uint4 val[kBatch];
  auto load_batch = [&](int base) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = base + u * kThreads;
      val[u] = make_uint4(0u, 0u, 0u, 0u);
      if (e < total) {
        const int row = e / (2 * vecs), lv = (e / vecs) % 2, v16 = e % vecs;
        const bool is_q = row < qrows;
        const std::int64_t grow = is_q ? qbase + row : kbase + (row - qrows);
        if (v16 * 16 < p.i8_stride)
          val[u] = __ldg(reinterpret_cast<const uint4*>((is_q ? p.q8 : p.k8) + (2 * grow + lv) * p.i8_stride) + v16);
      }
    }
  };
  auto store_batch = [&](int base) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = base + u * kThreads;
      if (e < total) {
        const int row = e / (2 * vecs), lv = (e / vecs) % 2, v16 = e % vecs;
        const int past = v16 * 16 + 16 - static_cast<int>(p.D);  // bytes of this vector beyond column D - 1
        if (past > 0) {
          unsigned w[4] = {val[u].x, val[u].y, val[u].z, val[u].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int keep = imax(0, imin(4, 4 - (past - 4 * (3 - i))));  // bytes of word i below column D
            w[i] = keep >= 4 ? w[i] : keep <= 0 ? 0u : (w[i] & ((1u << (8 * keep)) - 1u));
          }
          val[u] = make_uint4(w[0], w[1], w[2], w[3]);
        }
        unsigned char* dst = row < qrows ? q8 + (lv * kQM + row) * rs : k8 + (lv * kKN + row - qrows) * rs;
        reinterpret_cast<uint4*>(dst)[v16] = val[u];
      }
    }
  };
  // One copy of the unrolled batch code (a loop, the row data in its first trip): the kernel's code is
  // fetched once per CTA, so its size is time (see the header).
  for (int base = tid; base < total || base == tid; base += kBatch * kThreads) {
    load_batch(base);
    if (base == tid) {  // the row data, while the first batch is in flight
      for (int i = tid; i < kQM + kKN; i += kThreads) {
        if (i < kQM) {
          qlim[i] = i < qrows ? query_limit(p, i_first, q0 + i) : -1;
          if (i < qrows) {
            qsc[i] = p.qscale[qbase + i];
            ql1[i] = p.ql1[qbase + i];
          }
        } else {
          const int k = i - kQM;
          kfirst[k] = k < krows ? key_first(p, k0 + k, local_lo, local_hi) : kNever;
          if (k < krows) {
            ksc[k] = p.kscale[kbase + k];
            kl1[k] = p.kl1[kbase + k];
          }
        }
      }
    }
    store_batch(base);
  }
  __syncthreads();
}

// How the 8 warps split a pass of qrows x kKN pairs: wm warps along the query rows (16 rows each, as
// few as cover qrows, so R1 tiles of 16 query rows keep every warp busy) and 8 / wm along the key
// rows, each warp taking nt = 2 wm column tiles of 8 key rows.
struct WarpTile {
  int mt, nh, nt;
  __device__ __forceinline__ explicit WarpTile(int qrows) {
    const int wm = qrows <= 16 ? 1 : qrows <= 32 ? 2 : 4, warp = static_cast<int>(threadIdx.x) / 32;
    mt = warp % wm, nh = warp / wm, nt = 2 * wm;
  }
  __device__ __forceinline__ int query_row(int gid, int mi) const { return mt * 16 + gid + 8 * mi; }
  __device__ __forceinline__ int key_row(int n, int tq, int j) const { return nh * 8 * nt + n * 8 + 2 * tq + j; }
};

// The thread's pairs of one staged pass: query rows qr(mi) = 16 mt + gid + 8 mi, key rows
// kr(n, j) = 8 nt nh + 8 n + 2 tq + j, pair bit 4 n + 2 mi + j (the mma accumulator layout).
// Forms M.N from the four int8 products of every counted pair, two column tiles at a time (six
// independent accumulator chains). Without kTest it raises each block's lower bound in lkey (one
// atomic per key row and warp, after a shuffle maximum over the eight query lanes) and returns 0; with
// kTest (every lower bound in) it returns the bits of the pairs whose upper bound reaches their block's
// lower bound (every counted pair of a row without a scale). Without kTest and with `ubs`, it also
// stores each counted pair's upper bound (+inf without a scale) in the thread's column of ubs (slot
// 4 n + 2 mi + j, kThreads floats per slot) and returns the bits of its counted pairs, so that a
// single-chunk pass tests them without forming the products again (test_stored); 32 bounds per
// thread in registers spill.
template <bool kTest>
__device__ __forceinline__ unsigned screen_pass(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L, int qrows,
                                                std::int64_t k0, int krows, std::int64_t blk0, float* ubs = nullptr) {
  const unsigned char* q8 = smem + L.q8;
  const unsigned char* k8 = smem + L.k8;
  const float* qsc = reinterpret_cast<const float*>(smem + L.qsc);
  const float* ksc = reinterpret_cast<const float*>(smem + L.ksc);
  const float* ql1 = reinterpret_cast<const float*>(smem + L.ql1);
  const float* kl1 = reinterpret_cast<const float*>(smem + L.kl1);
  const auto* qlim = reinterpret_cast<const long long*>(smem + L.qlim);
  const auto* kfirst = reinterpret_cast<const long long*>(smem + L.kfirst);
  auto* lkey = reinterpret_cast<unsigned*>(smem + L.lkey);
  const int lane = threadIdx.x % 32, gid = lane / 4, tq = lane % 4;
  const WarpTile wt(qrows);
  const int rs = smem_i8_stride(p.k32);

  float qs[2], qa[2];
  long long ql[2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    const int qr = wt.query_row(gid, mi);
    const bool in = qr < qrows;
    qs[mi] = in ? qsc[qr] : 0.0f;
    qa[mi] = in ? ql1[qr] : 0.0f;
    ql[mi] = in ? qlim[qr] : -1;
  }
  const bool active = wt.mt * 16 < qrows;  // warp-uniform: mma needs the whole warp
  const unsigned char* qh = q8 + wt.query_row(gid, 0) * rs + tq * 4;
  const unsigned char* qlo = qh + kQM * rs;
  const unsigned char* kh = k8 + (wt.key_row(0, 0, 0) + gid) * rs + tq * 4;
  const unsigned char* klo = kh + kKN * rs;
  unsigned bits = 0u;
#pragma unroll 1
  for (int np = 0; np < 4; ++np) {
    if (2 * np >= wt.nt) break;  // warp-uniform
    int hh[2][4] = {}, hl[2][4] = {}, ll[2][4] = {};
    const bool tile_in = active && wt.key_row(2 * np, 0, 0) < krows;  // warp-uniform
    if (tile_in) {
#pragma unroll 4
      for (int ks = 0; ks < p.k32 / 32; ++ks) {
        const int o = ks * 32;
        const unsigned ah[4] = {*reinterpret_cast<const unsigned*>(qh + o), *reinterpret_cast<const unsigned*>(qh + 8 * rs + o),
                                *reinterpret_cast<const unsigned*>(qh + o + 16),
                                *reinterpret_cast<const unsigned*>(qh + 8 * rs + o + 16)};
        const unsigned al[4] = {*reinterpret_cast<const unsigned*>(qlo + o),
                                *reinterpret_cast<const unsigned*>(qlo + 8 * rs + o),
                                *reinterpret_cast<const unsigned*>(qlo + o + 16),
                                *reinterpret_cast<const unsigned*>(qlo + 8 * rs + o + 16)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned char* bh = kh + (2 * np + h) * 8 * rs + o;
          const unsigned char* bl = klo + (2 * np + h) * 8 * rs + o;
          const unsigned bh0 = *reinterpret_cast<const unsigned*>(bh), bh1 = *reinterpret_cast<const unsigned*>(bh + 16);
          const unsigned bl0 = *reinterpret_cast<const unsigned*>(bl), bl1 = *reinterpret_cast<const unsigned*>(bl + 16);
          mma_s8(hh[h], ah, bh0, bh1);
          mma_s8(hl[h], ah, bl0, bl1);
          mma_s8(hl[h], al, bh0, bh1);
          mma_s8(ll[h], al, bl0, bl1);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 2 * np + h;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int kr = wt.key_row(n, tq, j);
        const bool kin = tile_in && kr < krows;
        const long long kf = kin ? kfirst[kr] : kNever;
        const float ks = kin ? ksc[kr] : 0.0f, ka = kin ? kl1[kr] : 0.0f;
        const int blk = static_cast<int>(((k0 + kr) >> p.rshift) - blk0);
        float lb_block = 0.0f;
        if constexpr (kTest) lb_block = kin ? unkey32(lkey[blk]) : 0.0f;
        float best = -INFINITY;
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          if (kf == kNever || kf > ql[mi]) continue;  // not a counted pair
          const bool bounded = qs[mi] > 0.0f && ks > 0.0f;
          const float ss = qs[mi] * ks;  // powers of two in range: exact
          const float e = __fmul_ru(ss, __fadd_ru(__fmul_ru(0.5f, __fadd_ru(qa[mi], ka)), p.dterm));
          const int i = 2 * mi + j;
          const float fhh = small_int_to_float(hh[h][i]), fhl = small_int_to_float(hl[h][i]),
                      fll = small_int_to_float(ll[h][i]);
          if constexpr (kTest) {
            const float ub = __fadd_ru(__fmul_ru(__fmaf_ru(16384.0f, fhh, __fmaf_ru(128.0f, fhl, fll)), ss), e);
            if (!bounded || ub >= lb_block) bits |= 1u << (n * 4 + i);
          } else {
            if (bounded) best = fmaxf(best, __fsub_rd(__fmul_rd(__fmaf_rd(16384.0f, fhh, __fmaf_rd(128.0f, fhl, fll)), ss), e));
            if (ubs != nullptr) {
              bits |= 1u << (n * 4 + i);
              ubs[(n * 4 + i) * kThreads + threadIdx.x] =
                  bounded ? __fadd_ru(__fmul_ru(__fmaf_ru(16384.0f, fhh, __fmaf_ru(128.0f, fhl, fll)), ss), e) : INFINITY;
            }
          }
        }
        if constexpr (!kTest) {
          best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, 4));
          best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, 8));
          best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, 16));
          if (gid == 0 && best > -INFINITY) atomicMax(lkey + blk, key32(best));
        }
      }
    }
  }
  return bits;
}

// The test of screen_pass<true> from the bounds that screen_pass<false> stored (every lower bound in):
// the bits of the counted pairs whose upper bound reaches their block's lower bound.
__device__ __forceinline__ unsigned test_stored(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L, int qrows,
                                                std::int64_t k0, std::int64_t blk0, unsigned counted, const float* ubs) {
  const auto* lkey = reinterpret_cast<const unsigned*>(smem + L.lkey);
  const int tq = static_cast<int>(threadIdx.x) % 4;
  const WarpTile wt(qrows);
  unsigned bits = 0u;
  while (counted != 0u) {
    const int b = __ffs(counted) - 1;
    counted &= counted - 1u;
    const int kr = wt.key_row(b / 4, tq, b % 2);
    const float lb_block = unkey32(lkey[((k0 + kr) >> p.rshift) - blk0]);
    if (ubs[b * kThreads + threadIdx.x] >= lb_block) bits |= 1u << b;
  }
  return bits;
}

// Queues the pairs of `bits` (screen_pass<true>): one atomic per warp (a warp-wide scan of the
// per-thread counts places the pairs). A block whose pairs do not fit the queue is flagged in `full`
// and has every pair evaluated later.
__device__ __forceinline__ void enqueue_pass(const ScoreParams& p, unsigned char* smem, const ScoreSmem& L, int q0,
                                             int qrows, std::int64_t k0, std::int64_t blk0, unsigned bits,
                                             int& n_queued) {
  auto* cand = reinterpret_cast<uint2*>(smem + L.cand);
  auto* full = reinterpret_cast<unsigned*>(smem + L.full);
  const int lane = threadIdx.x % 32, gid = lane / 4, tq = lane % 4;
  const WarpTile wt(qrows);
  const int mine = __popc(bits);
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  int base = 0;
  if (lane == 31 && incl > 0) base = atomicAdd(&n_queued, incl);
  base = __shfl_sync(0xffffffffu, base, 31);
  int slot = base + incl - mine;
  while (bits != 0u) {
    const int b = __ffs(bits) - 1;
    bits &= bits - 1u;
    const int kr = wt.key_row(b / 4, tq, b % 2);
    const int qr = wt.query_row(gid, (b % 4) / 2);
    if (slot < kCandCap) cand[slot] = make_uint2(static_cast<unsigned>(q0 + qr), static_cast<unsigned>(k0 + kr));
    else atomicOr(full + (((k0 + kr) >> p.rshift) - blk0), 1u);
    ++slot;
  }
}

__global__ void __launch_bounds__(kThreads, 2) pooled_score_kernel(const __grid_constant__ ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int n_queued;
  __shared__ int is_last;
  const int nblk = p.rows_per_cta / p.r;
  const ScoreSmem L = score_smem(p.k32, nblk);
  auto* lkey = reinterpret_cast<unsigned*>(smem + L.lkey);
  auto* cand = reinterpret_cast<uint2*>(smem + L.cand);
  auto* full = reinterpret_cast<unsigned*>(smem + L.full);
  auto* ubs = reinterpret_cast<float*>(smem + L.ubs);
  const int tid = threadIdx.x;

  const TileJob tj = tile_job(p);
  const CtaView v = cta_view(p, tj, reinterpret_cast<unsigned long long*>(smem + L.ekey));

  for (int i = tid; i < nblk; i += kThreads) {
    lkey[i] = key32(-INFINITY);
    v.ekey[i] = key64(-INFINITY);
    full[i] = 0u;
  }
  if (tid == 0) n_queued = 0;
  // The representatives and counters come from the previous grid (a no-op without a programmatic launch).
  pdl_wait();
  // (stage_rows starts with a barrier)

  const int qchunks = (p.P + kQM - 1) / kQM;
  for (std::int64_t k0 = tj.row_begin; k0 < tj.row_end; k0 += kKN) {
    const int krows = static_cast<int>(imin<std::int64_t>(kKN, tj.row_end - k0));
    // With one query chunk the lower bounds and the test use the same registers; with several, a
    // first pass collects the lower bounds of every chunk and a second one recomputes and tests.
    for (int pass = qchunks == 1 ? 1 : 0; pass < 2; ++pass) {
      for (int qc = 0; qc < qchunks; ++qc) {
        const int q0 = qc * kQM, qrows = imin(kQM, p.P - q0);
        stage_rows(p, smem, L, tj.job, tj.bg, q0, qrows, k0, krows, tj.i_first, tj.local_lo, tj.local_hi);
        if (qchunks == 1) {
          // One chunk: the lower bounds and the stored upper bounds in one pass over the products.
          const unsigned counted = screen_pass<false>(p, smem, L, qrows, k0, krows, v.blk0, ubs);
          __syncthreads();  // every lower bound of the pass is in
          const unsigned bits = test_stored(p, smem, L, qrows, k0, v.blk0, counted, ubs);
          enqueue_pass(p, smem, L, q0, qrows, k0, v.blk0, bits, n_queued);
        } else if (pass == 0) {
          screen_pass<false>(p, smem, L, qrows, k0, krows, v.blk0);
        } else {
          const unsigned bits = screen_pass<true>(p, smem, L, qrows, k0, krows, v.blk0);
          enqueue_pass(p, smem, L, q0, qrows, k0, v.blk0, bits, n_queued);
        }
      }
      if (pass == 0) __syncthreads();
    }
    __syncthreads();
    evaluate_queued<kThreads>(p, tj, v, cand, full, n_queued, kCandCap, k0, krows);
    __syncthreads();
    if (tid == 0) n_queued = 0;
  }
  __syncthreads();

  // A CTA that holds all of its tile's blocks ranks them from shared memory, behind the scoring region.
  rank_tile(p, tj, v, smem, p.chunks == 1 ? reinterpret_cast<double*>(smem + L.total) : nullptr, is_last);
}

// ---- host ---------------------------------------------------------------------------------------------

// Whether every token's D elements of x can be read as whole aligned vectors of `bytes`.
bool vectorizable(const TensorView& x, int bytes) {
  const auto es = static_cast<std::int64_t>(dtype_size(x.dtype));
  return reinterpret_cast<std::uintptr_t>(x.data) % static_cast<std::uintptr_t>(bytes) == 0 &&
         (x.stride[0] * es) % bytes == 0 && (x.stride[1] * es) % bytes == 0 && (x.stride[2] * es) % bytes == 0 &&
         (x.shape[3] * es) % bytes == 0;
}

template <In T, int kVecBytes>
void launch_reps(const RepParams& p, std::int64_t blocks, int threads, cudaStream_t stream) {
  representatives_kernel<T, kVecBytes><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p);
}

struct RepBuffers {
  float* mean[2];
  signed char* i8[2];
  float* scale[2];
  float* l1[2];
};

// Load width (vec bytes, 0 = single elements), columns per thread (W), threads per row and per CTA of the
// representatives kernel for these inputs.
struct RepLayout {
  int vec, W, cols, group, threads;
  bool quantize;
  std::int64_t i8_stride;
};

// The widest load is taken only while it leaves this many warps per SM: every thread keeps two batches of
// loads in flight, so wider loads with fewer warps put fewer bytes in flight per SM. H200, tile16 at 16K
// (ncu, one launch; bf16, D = 128): R1 (1280 rows) 22.1 / 18.2 / 18.8 us with 16 / 8 / 4-byte loads (grid of 4.8,
// 9.7 and 19.4 warps per SM), R4 (5120 rows) 18.8 / 19.6 / 19.8 us (19.4, 39 and 78 warps per SM).
constexpr std::int64_t kRepMinWarpsPerSm = 8;

// quantize_wanted: whether the scoring kernel reads the int8 copies (the float64 kernel does not).
// rows: representative rows of q and k together. forced: SelectorTuning::pooled_rep_bytes (0: choose).
RepLayout rep_layout(const TensorView& q, const TensorView& k, std::int64_t rows, bool quantize_wanted, int sms,
                     int forced) {
  const std::int64_t D = q.shape[3];
  const int es = static_cast<int>(dtype_size(q.dtype));
  auto with = [&](int vec) {
    RepLayout l{};
    l.vec = vec;
    l.W = (vec ? vec : 4) / es;
    l.cols = static_cast<int>(ceil_div(D, static_cast<std::int64_t>(l.W)));
    l.group = 1;
    while (l.group < l.cols && l.group < 2 * kRepMaxGroup) l.group *= 2;
    l.quantize = quantize_wanted && D <= kMaxScreenD && l.group <= kRepMaxGroup;
    if (!l.quantize) l.group = l.cols;  // no reductions: any row width, one thread per W columns
    l.threads = l.quantize ? std::max(kRepThreads, l.group) : kRepThreads;
    l.i8_stride = static_cast<std::int64_t>(ceil_div(static_cast<std::int64_t>(l.group) * l.W, std::int64_t{16}) * 16);
    return l;
  };
  // The widest vector the views allow that keeps kRepMinWarpsPerSm, else the narrowest they allow; a
  // forced width takes the widest the views allow up to it (single elements for 1).
  RepLayout pick = with(0);
  for (int bytes : {4, 8, 16}) {
    if ((forced != 0 && bytes > forced) || bytes < es || !vectorizable(q, bytes) || !vectorizable(k, bytes)) continue;
    const RepLayout l = with(bytes);
    if (forced != 0 || pick.vec == 0 || rows * l.group >= kRepMinWarpsPerSm * 32 * sms) pick = l;
  }
  return pick;
}

template <In T>
void launch_reps_for(int vec, const RepParams& p, std::int64_t blocks, int threads, cudaStream_t stream) {
  switch (vec) {
    case 16: return launch_reps<T, 16>(p, blocks, threads, stream);
    case 8: return launch_reps<T, 8>(p, blocks, threads, stream);
    case 4: return launch_reps<T, 4>(p, blocks, threads, stream);
    default: return launch_reps<T, 0>(p, blocks, threads, stream);
  }
}

void representatives(const TensorView& q, const TensorView& k, std::int64_t r, std::int64_t group, const RepLayout& lay,
                     const RepBuffers& buf, unsigned* counters, std::int64_t n_counters, cudaStream_t stream) {
  const In type = in_type(q.dtype);
  RepParams p{};
  p.D = q.shape[3], p.r = r, p.span = kTileQ / r;
  p.cols = lay.cols, p.group = lay.group, p.quantize = lay.quantize, p.i8_stride = lay.i8_stride;
  p.counters = counters, p.n_counters = n_counters;
  const TensorView* xs[2] = {&q, &k};
  std::int64_t blocks = 0;
  for (int i = 0; i < 2; ++i) {
    const TensorView& x = *xs[i];
    RepTensor& d = p.t[i];
    d.x = x.data;
    d.sb = x.stride[0], d.sl = x.stride[1], d.sh = x.stride[2];
    d.L = x.shape[1], d.H = x.shape[2], d.G = i == 0 ? group : 1, d.T = ceil_div(d.L, kTileQ);
    d.rows = x.shape[0] * d.H * d.T * r;
    d.ctas = ceil_div(d.rows * p.group, static_cast<std::int64_t>(lay.threads));
    if (d.rows * p.group + lay.threads > INT_MAX)
      throw Error("pooled_select", i == 0 ? "q" : "k",
                  "tensor " + x.describe() + " has more representative rows than the CUDA selector indexes");
    d.mean = buf.mean[i], d.i8 = buf.i8[i], d.scale = buf.scale[i], d.l1 = buf.l1[i];
    blocks += d.ctas;
  }
  const int th = lay.threads;
  switch (type) {
    case In::f32: return launch_reps_for<In::f32>(lay.vec, p, blocks, th, stream);
    case In::f16: return launch_reps_for<In::f16>(lay.vec, p, blocks, th, stream);
    case In::bf16: return launch_reps_for<In::bf16>(lay.vec, p, blocks, th, stream);
  }
}

// Per-device facts of a kernel that do not change between calls, queried once: at tile16 sizes the
// queries cost more host time than the kernels take on the GPU.
struct KernelFacts {
  std::size_t smem_limit = 0;          // dynamic shared memory the kernel is allowed (attribute set)
  std::map<std::size_t, int> resident;  // resident CTAs per SM by dynamic shared-memory bytes
};

// Raises the kernel's dynamic shared-memory limit to `bytes` where needed and returns its resident
// CTAs per SM at `bytes`.
int prepare_kernel(const std::string& op, const void* fn, int device, int threads, std::size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, KernelFacts> facts;
  const std::lock_guard<std::mutex> lock(mu);
  KernelFacts& f = facts[{fn, device}];
  if (bytes > f.smem_limit) {
    check_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
               "cudaFuncSetAttribute");
    f.smem_limit = bytes;
  }
  auto it = f.resident.find(bytes);
  if (it == f.resident.end()) {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, bytes), op,
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    it = f.resident.emplace(bytes, std::max(n, 1)).first;
  }
  return it->second;
}

int multiprocessors(const std::string& op, int device) {
  static std::mutex mu;
  static std::map<int, int> count;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = count.find(device);
  if (it == count.end()) {
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op, "cudaDeviceGetAttribute");
    it = count.emplace(device, sms).first;
  }
  return it->second;
}

// Key rows per CTA: enough CTAs per tile to fill the resident slots of the GPU once, whole blocks,
// a multiple of 16 rows, at most kMaxRowsPerCta.
int rows_per_cta(std::int64_t jobs, std::int64_t rows_total, std::int64_t r, std::int64_t slots) {
  const std::int64_t want = imax<std::int64_t>(1, slots / imax<std::int64_t>(jobs, 1));
  std::int64_t rows = ceil_div(rows_total, want);
  rows = ceil_div(rows, 16) * 16;
  rows = imin<std::int64_t>(imax<std::int64_t>(rows, 16), kMaxRowsPerCta);
  return static_cast<int>(ceil_div(rows, r) * r);
}


// Checks a scoring grid of `jobs` tiles x p.chunks CTAs with `smem` bytes of shared memory each and
// launches it as a programmatic dependent of the representatives: its launch and prologue overlap
// their tail.
void launch_scoring(const std::string& op, void (*kernel)(ScoreParams), const ScoreParams& p, std::int64_t jobs,
                    int threads, std::size_t smem, int max_smem, int device, cudaStream_t stream) {
  if (smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "k", "Lk = " + std::to_string(p.Lk) + " gives " + std::to_string(p.Tk) +
                             " blocks, more than the CUDA selector's per-tile shared-memory ranking holds");
  const std::int64_t grid = jobs * p.chunks;
  if (grid > INT_MAX)
    throw Error(op, "q", "B * Hkv * Tq = " + std::to_string(jobs) + " tiles exceed the CUDA selector's grid");
  prepare_kernel(op, reinterpret_cast<const void*>(kernel), device, threads, smem);
  launch_dependent(op, "scoring launch", kernel, dim3(static_cast<unsigned>(grid)), dim3(static_cast<unsigned>(threads)),
                   smem, stream, p);
}

// ---- version 4: every counted pair in float64, no screen ---------------------------------------------
//
// Where a group has few query rows (P = group * r <= 64) the float64 dots of every pair cost less than
// any screen around them: tile16 R1 at Lk = 16K is 16.8 M fused multiply-adds, about a microsecond of
// the H200's float64 rate, while the int8 screen's phases (staging, two sweeps, queueing, ranking) ran
// at about ten cycles per instruction each (docs/notes/selectors.md, pooled v3). A CTA stages the
// job's query rows and one or two slabs of 64 key rows in shared memory as doubles (each value
// converted once);
// a thread forms 4 query rows x 2 key rows of dots, 8 independent chains each over the columns in
// order (the CPU's dot_f64: products of floats are exact in float64, so each fma rounds as the CPU's
// add), reading the query rows as broadcasts (a warp shares them) and its key rows conflict-free. A
// thread's maximum over its counted pairs goes to the block's shared maximum (an order-preserving
// integer atomicMax: max is exact in any order), and the ranking is the int8 kernel's.
namespace exact_f64 {

constexpr int kTM = 4;         // query rows per thread
constexpr int kTN = 2;         // key rows per thread: lane and lane + 32 of the warp's 64-row slab
constexpr int kSlab = 32 * kTN;  // key rows of a warp; a CTA holds one or two slabs
constexpr int kMaxRows = 64;   // P: at most 16 warps, one per group of kTM query rows
// Query rows and the CTA's key rows as doubles: (P + key rows) * (D + 4) <= kMaxStaged (200 KB).
constexpr std::int64_t kMaxStaged = 25600;

// Row strides in doubles: the query rows even (16-byte reads of two columns); the key rows an odd number
// of 16-byte units, so that the 16-byte reads of eight consecutive rows fall on distinct banks.
__host__ __device__ inline int q_stride(std::int64_t D) { return static_cast<int>((D + 1) / 2 * 2); }
__host__ __device__ inline int k_stride(std::int64_t D) {
  const int s = q_stride(D);
  return (s / 2) % 2 == 1 ? s : s + 2;
}

// Whether a (group * r, D) problem runs here; the rest take a screen.
inline bool applies(std::int64_t P, std::int64_t D) { return P <= kMaxRows && (P + kSlab) * (D + 4) <= kMaxStaged; }

// The automatic choice takes this kernel up to kAutoMaxFma float64 fmas per call and the int8 screen
// above. H200, tile16 (docs/notes/selectors.md, pooled v4), warm per call, this kernel / the int8 screen:
// R1 at 4K, 16K, 32K (4.2 M, 16.8 M, 33.6 M fmas) 27.8 / 33.0, 30.7 / 45.3, 40.9 / 57.8 us; R4 at 4K
// (67 M) 33.2 / 50.8 us; R4 at 16K and 32K (268 M, 537 M) 83.5 / 58.7 and 149.3 / 95.1 us.
constexpr std::int64_t kAutoMaxFma = std::int64_t{128} << 20;
inline bool preferred(double fmas) { return fmas <= static_cast<double>(kAutoMaxFma); }

struct Smem {
  std::size_t q, k, qlim, ekey, total;
};
__host__ __device__ inline Smem smem_layout(std::int64_t P, std::int64_t D, std::int64_t krows, std::int64_t nblk) {
  auto up = [](std::size_t x) { return (x + 15) / 16 * 16; };
  Smem s{};
  std::size_t o = 0;
  s.q = o, o = up(o + static_cast<std::size_t>(P * q_stride(D)) * sizeof(double));
  s.k = o, o = up(o + static_cast<std::size_t>(krows * k_stride(D)) * sizeof(double));
  s.qlim = o, o = up(o + static_cast<std::size_t>(P) * sizeof(long long));
  s.ekey = o, o = up(o + static_cast<std::size_t>(nblk) * sizeof(unsigned long long));
  s.total = o;
  return s;
}

// acc[n][i] = the CPU's dot_f64 of query row qs + qoff[i] with key row ks + koff[n] (both in shared
// memory, doubles). Columns outside, rows inside: consecutive fmas belong to the kTM x kTN independent chains
// (a chain's next fma waits for the previous one's result), and every row is computed, so no predicate
// keeps the compiler from interleaving them (the caller points rows past the group at valid rows and
// ignores their sums).
__device__ __forceinline__ void dot_tile(const double* qs, const int (&qoff)[kTM], const double* ks,
                                         const int (&koff)[kTN], int D, double (&acc)[kTN][kTM]) {
#pragma unroll
  for (int n = 0; n < kTN; ++n)
#pragma unroll
    for (int i = 0; i < kTM; ++i) acc[n][i] = 0.0;
  const int even = D & ~1;
#pragma unroll 2
  for (int c = 0; c < even; c += 2) {
    double2 x[kTM], y[kTN];
#pragma unroll
    for (int i = 0; i < kTM; ++i) x[i] = *reinterpret_cast<const double2*>(qs + qoff[i] + c);
#pragma unroll
    for (int n = 0; n < kTN; ++n) y[n] = *reinterpret_cast<const double2*>(ks + koff[n] + c);
#pragma unroll
    for (int n = 0; n < kTN; ++n)
#pragma unroll
      for (int i = 0; i < kTM; ++i) acc[n][i] = fma(x[i].x, y[n].x, acc[n][i]);
#pragma unroll
    for (int n = 0; n < kTN; ++n)
#pragma unroll
      for (int i = 0; i < kTM; ++i) acc[n][i] = fma(x[i].y, y[n].y, acc[n][i]);
  }
  if (D & 1) {
#pragma unroll
    for (int n = 0; n < kTN; ++n)
#pragma unroll
      for (int i = 0; i < kTM; ++i) acc[n][i] = fma(qs[qoff[i] + even], ks[koff[n] + even], acc[n][i]);
  }
}

// Copies rows a[0, na) and b[0, nb) (D floats each, contiguous) into shared memory as doubles with row
// strides sa and sb (even). With 16-byte rows a warp copies whole rows (lanes over the columns, no index
// divisions) and every lane has 16 loads of 16 bytes in flight, so the copy waits for about one L2 round
// trip per 16 rows per warp instead of one per element.
__device__ __forceinline__ void stage_as_doubles(const float* a, int na, int D, double* da, int sa, const float* b,
                                                 int nb, double* db, int sb) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32, nw = nt / 32;
  const int n = na + nb;
  if ((D & 3) == 0 && ((reinterpret_cast<std::uintptr_t>(a) | reinterpret_cast<std::uintptr_t>(b)) & 15) == 0) {
    constexpr int kU = 16;
    const int d4 = D / 4;
    for (int c4 = lane; c4 < d4; c4 += 32) {
      for (int r0 = warp; r0 < n; r0 += kU * nw) {
        float4 v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int r = r0 + u * nw;
          if (r < n) v[u] = __ldg(reinterpret_cast<const float4*>(r < na ? a + r * D : b + (r - na) * D) + c4);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int r = r0 + u * nw;
          if (r >= n) continue;
          double* dst = (r < na ? da + r * sa : db + (r - na) * sb) + 4 * c4;
          reinterpret_cast<double2*>(dst)[0] = make_double2(v[u].x, v[u].y);
          reinterpret_cast<double2*>(dst)[1] = make_double2(v[u].z, v[u].w);
        }
      }
    }
  } else {
    for (int e = tid; e < n * D; e += nt) {
      const bool in_a = e < na * D;
      const int j = in_a ? e : e - na * D, row = j / D, col = j - row * D;
      (in_a ? da + row * sa : db + row * sb)[col] = static_cast<double>(__ldg((in_a ? a : b) + j));
    }
  }
}

// One CTA: one (b, group, Q tile) job and rows_per_cta key rows, one or two slabs of kSlab; warp w
// takes query rows [4 g, 4 g + 4) (g = w mod the query groups) against the rows of slab w / groups
// (lane and lane + 32 of it).
__global__ void __launch_bounds__(32 * kMaxRows / kTM) exact_score_kernel(const __grid_constant__ ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;
  const int D = static_cast<int>(p.D), qs_stride = q_stride(D), ks_stride = k_stride(D);
  const int nblk = p.rows_per_cta / p.r;
  const Smem L = smem_layout(p.P, p.D, p.rows_per_cta, nblk);
  auto* qs = reinterpret_cast<double*>(smem + L.q);
  auto* ks = reinterpret_cast<double*>(smem + L.k);
  auto* qlim = reinterpret_cast<long long*>(smem + L.qlim);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  const TileJob tj = tile_job(p);
  const CtaView v = cta_view(p, tj, reinterpret_cast<unsigned long long*>(smem + L.ekey));

  for (int i = tid; i < nblk; i += blockDim.x) v.ekey[i] = key64(-INFINITY);
  for (int row = tid; row < p.P; row += blockDim.x) qlim[row] = query_limit(p, tj.i_first, row);
  // The means and counters come from the representatives grid (a no-op without a programmatic launch).
  pdl_wait();
  // Staged once, converted once: the query rows of the job and the CTA's key rows (zero past row_end).
  // Key rows of the CTA: none where causality ends the tile's candidates before them.
  const int slab_rows = static_cast<int>(imax(std::int64_t{0}, tj.row_end - tj.row_begin));  // <= rows_per_cta
  if (slab_rows > 0) {  // uniform over the CTA
    const float* kbase = v.krows + tj.row_begin * p.D;
    for (int e = slab_rows * D + tid; e < p.rows_per_cta * D; e += blockDim.x) ks[(e / D) * ks_stride + e % D] = 0.0;
    stage_as_doubles(v.qrows, p.P, D, qs, qs_stride, kbase, slab_rows, ks, ks_stride);
  }
  __syncthreads();

  const int qgroups = (p.P + kTM - 1) / kTM, slab = warp / qgroups;
  const int q0 = (warp - slab * qgroups) * kTM, rows = imin(kTM, p.P - q0);
  int qoff[kTM], koff[kTN];
#pragma unroll
  for (int i = 0; i < kTM; ++i) qoff[i] = imin(q0 + i, p.P - 1) * qs_stride;
#pragma unroll
  for (int n = 0; n < kTN; ++n) koff[n] = (slab * kSlab + lane + 32 * n) * ks_stride;
  double acc[kTN][kTM];
  if (slab_rows > 0) dot_tile(qs, qoff, ks, koff, D, acc);
#pragma unroll
  for (int n = 0; n < kTN; ++n) {
    const std::int64_t krow = tj.row_begin + slab * kSlab + lane + 32 * n;
    if (krow >= tj.row_end) continue;
    const long long kfirst = key_first(p, krow, tj.local_lo, tj.local_hi);
    if (kfirst == kNever) continue;
    const std::int64_t j = krow >> p.rshift;
    double best = -INFINITY;
#pragma unroll
    for (int i = 0; i < kTM; ++i)
      if (i < rows && kfirst <= qlim[q0 + i]) best = fmax(best, sanitize(acc[n][i]));
    if (best > -INFINITY) atomicMax(v.ekey + (j - v.blk0), key64(best));
  }
  __syncthreads();
  // A CTA that holds all of its tile's blocks ranks them from shared memory, behind the scoring region.
  rank_tile(p, tj, v, smem, p.chunks == 1 ? reinterpret_cast<double*>(smem + L.total) : nullptr, is_last);
}

void launch_scores(const std::string& op, ScoreParams p, std::int64_t jobs, int max_smem, int device,
                   cudaStream_t stream) {
  const int qgroups = static_cast<int>(ceil_div(static_cast<std::int64_t>(p.P), static_cast<std::int64_t>(kTM)));
  // Two slabs per CTA where the warps and the shared memory allow and a tile has more than one slab:
  // fewer CTAs rank through global memory (tile16 R1 at 16K: 64 CTAs of 256 threads, each ranking its
  // tile from shared memory); R4 with 16 query heads keeps one slab (512 threads).
  const int slabs = qgroups <= 8 && p.Tk * p.r > kSlab && (p.P + 2 * kSlab) * (p.D + 4) <= kMaxStaged ? 2 : 1;
  const int threads = 32 * qgroups * slabs;
  p.rows_per_cta = kSlab * slabs;
  p.chunks = static_cast<int>(ceil_div(p.Tk * p.r, static_cast<std::int64_t>(p.rows_per_cta)));
  const Smem L = smem_layout(p.P, p.D, p.rows_per_cta, p.rows_per_cta / p.r);
  const std::size_t smem = p.chunks == 1 ? L.total + topk_smem(p.Tk) : std::max(L.total, topk_smem(p.Tk));
  launch_scoring(op, exact_score_kernel, p, jobs, threads, smem, max_smem, device, stream);
}

}  // namespace exact_f64

void launch_scores(const std::string& op, ScoreParams p, std::int64_t jobs, int max_smem, int sms, int device,
                   cudaStream_t stream) {
  const std::int64_t rows_total = p.Tk * p.r;
  // The slot count assumes the largest scoring footprint; it only steers the split.
  const void* fn = reinterpret_cast<const void*>(pooled_score_kernel);
  const std::size_t guess = std::max(score_smem(p.k32, kMaxRowsPerCta / p.r).total, topk_smem(p.Tk));
  const int per_sm = guess <= static_cast<std::size_t>(max_smem) ? prepare_kernel(op, fn, device, kThreads, guess) : 1;
  // A tile whose key rows fit one pass keeps them in one CTA: its ranking then needs no global round trip.
  p.rows_per_cta = rows_total <= kKN ? static_cast<int>(ceil_div(rows_total, std::int64_t{16}) * 16)
                                     : rows_per_cta(jobs, rows_total, p.r, static_cast<std::int64_t>(sms) * per_sm);
  p.chunks = static_cast<int>(ceil_div(rows_total, p.rows_per_cta));
  const std::size_t scoring = score_smem(p.k32, p.rows_per_cta / p.r).total;
  const std::size_t smem = p.chunks == 1 ? scoring + topk_smem(p.Tk) : std::max(scoring, topk_smem(p.Tk));
  launch_scoring(op, pooled_score_kernel, p, jobs, kThreads, smem, max_smem, device, stream);
}


// Facts of a device that do not change while the process runs, queried once per device.
struct DeviceFacts {
  int max_smem = 0;  // opt-in dynamic shared memory per block
  int sms = 0;
};

// The tensor's device must be the current device and usable (as usable_device_smem in common.cuh, whose
// three runtime queries per call are answered from a per-device cache after the first success).
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
  f.sms = multiprocessors(op, t.device_index);
  const std::lock_guard<std::mutex> lock(mu);
  known[t.device_index] = f;
  return f;
}

// Scratch of the selector, kept per (device, stream) between calls: calls on one stream run in stream
// order, so the next call may reuse the memory; calls on different streams get different memory.
struct CachedScratch {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

// Device memory of at least `bytes` for a call on `stream`: the cached scratch, grown (after the
// stream's earlier calls have finished with it) when too small. A call being captured into a graph
// gets stream-ordered memory instead (`owned`, freed on the stream after the call): the graph then
// owns its memory, so a later growth of the cache cannot free memory a graph still uses, and capture
// never synchronises.
void* scratch_for(const std::string& op, int device, cudaStream_t stream, std::size_t bytes,
                  std::unique_ptr<StreamScratch>& owned) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), op, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    owned = std::make_unique<StreamScratch>(bytes, stream, op);
    return owned->as<void>();
  }
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<int, cudaStream_t>, CachedScratch>();  // never freed: no
                                                                                     // cudaFree after the runtime's teardown
  const std::lock_guard<std::mutex> lock(mu);
  CachedScratch& c = (*cache)[{device, stream}];
  if (c.bytes >= bytes) return c.ptr;
  check_cuda(cudaStreamSynchronize(stream), op, "scratch growth");  // earlier calls may still use it
  if (c.ptr != nullptr) check_cuda(cudaFree(c.ptr), op, "scratch growth");
  c = CachedScratch{};
  const std::size_t grown = align_up(bytes, std::size_t{1} << 20);
  check_cuda(cudaMalloc(&c.ptr, grown), op, "cudaMalloc of " + std::to_string(grown) + " bytes of selector scratch");
  c.bytes = grown;
  return c.ptr;
}

}  // namespace

}  // namespace sparse_attn::cuda_backend

namespace sparse_attn::detail {

bool pooled_exact_applies(std::int64_t rows, std::int64_t D) { return cuda_backend::exact_f64::applies(rows, D); }

}  // namespace sparse_attn::detail

namespace sparse_attn::cuda_backend {

void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& o,
                   const detail::SelectorTuning& tuning) {
  using detail::PooledScoring;
  const std::string op = "pooled_select";
  const std::int64_t B = q.shape[0], Lq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const std::int64_t Lk = k.shape[1], Hkv = k.shape[2];
  const std::int64_t Tq = ceil_div(Lq, kTileQ), Tk = ceil_div(Lk, kBlockK), r = o.representatives;
  const std::int64_t group = Hq / Hkv, P = group * r, jobs = B * Hkv * Tq;
  const auto stream = static_cast<cudaStream_t>(o.stream);

  const int forced_rep = tuning.pooled_rep_bytes;
  if (forced_rep != 0 && forced_rep != 16 && forced_rep != 8 && forced_rep != 4 && forced_rep != 1)
    throw Error(op, "tuning.pooled_rep_bytes", "is " + std::to_string(forced_rep) + "; expected 0, 16, 8, 4 or 1");
  PooledScoring scoring = tuning.pooled_scoring;
  if (scoring == PooledScoring::automatic) {
    // float64 fmas of the call, in double: the product of the extents may not fit an int64
    const double fmas = static_cast<double>(jobs) * static_cast<double>(P * D) * static_cast<double>(Tk * r);
    scoring = exact_f64::applies(P, D) && exact_f64::preferred(fmas) ? PooledScoring::exact_f64
                                                                      : PooledScoring::int8_tensor_cores;
  } else if (scoring == PooledScoring::exact_f64 && !exact_f64::applies(P, D)) {
    throw Error(op, "q", "the float64 scoring kernel takes group * r <= " + std::to_string(exact_f64::kMaxRows) +
                             " query rows and (group * r + " + std::to_string(exact_f64::kSlab) + ") * (D + 4) <= " +
                             std::to_string(exact_f64::kMaxStaged) + ", got group * r = " + std::to_string(P) +
                             " with D = " + std::to_string(D));
  }
  const bool exact = scoring == PooledScoring::exact_f64;
  const DeviceFacts dev = device_facts(op, q);
  check_device_memory(op, "q", q);
  check_device_memory(op, "k", k);
  check_device_memory(op, "out.idx", out.idx);
  check_device_memory(op, "out.cnt", out.cnt);
  if (P > INT_MAX / 2 || Tk * r > INT_MAX / 2)
    throw Error(op, "q", "group * r = " + std::to_string(P) + " or Tk * r = " + std::to_string(Tk * r) +
                             " exceed the CUDA selector's row indices");

  const std::int64_t rows[2] = {B * Hq * Tq * r, B * Hkv * Tk * r};
  const RepLayout lay = rep_layout(q, k, rows[0] + rows[1], !exact, multiprocessors(op, q.device_index), forced_rep);
  std::size_t offsets[9]{}, total = 0;
  auto carve = [&](std::size_t bytes) {
    const std::size_t at = total;
    total += align_up(bytes);
    return at;
  };
  for (int i = 0; i < 2; ++i) {
    offsets[4 * i + 0] = carve(static_cast<std::size_t>(rows[i] * D) * sizeof(float));
    offsets[4 * i + 1] = carve(static_cast<std::size_t>(rows[i] * 2 * lay.i8_stride));
    offsets[4 * i + 2] = carve(static_cast<std::size_t>(rows[i]) * sizeof(float));
    offsets[4 * i + 3] = carve(static_cast<std::size_t>(rows[i]) * sizeof(float));
  }
  const std::size_t at_scores = carve(static_cast<std::size_t>(jobs * Tk) * sizeof(double));
  const std::size_t at_counters = carve(static_cast<std::size_t>(jobs) * sizeof(unsigned));
  std::unique_ptr<StreamScratch> owned;
  auto* base = static_cast<char*>(scratch_for(op, q.device_index, stream, total, owned));
  RepBuffers buf{};
  for (int i = 0; i < 2; ++i) {
    buf.mean[i] = reinterpret_cast<float*>(base + offsets[4 * i + 0]);
    buf.i8[i] = reinterpret_cast<signed char*>(base + offsets[4 * i + 1]);
    buf.scale[i] = reinterpret_cast<float*>(base + offsets[4 * i + 2]);
    buf.l1[i] = reinterpret_cast<float*>(base + offsets[4 * i + 3]);
  }
  auto* scores = reinterpret_cast<double*>(base + at_scores);
  auto* counters = reinterpret_cast<unsigned*>(base + at_counters);
  representatives(q, k, r, group, lay, buf, counters, jobs, stream);
  check_cuda(cudaGetLastError(), op, "representatives launch");

  ScoreParams p{};
  p.qmean = buf.mean[0], p.kmean = buf.mean[1];
  p.q8 = buf.i8[0], p.k8 = buf.i8[1];
  p.qscale = buf.scale[0], p.kscale = buf.scale[1];
  p.ql1 = buf.l1[0], p.kl1 = buf.l1[1];
  p.scores = scores, p.counters = counters;
  p.idx = out.idx.ptr<std::int32_t>();
  p.is0 = out.idx.stride[0], p.is1 = out.idx.stride[1], p.is2 = out.idx.stride[2], p.is3 = out.idx.stride[3];
  p.kmax = out.idx.shape[3];
  p.cnt = out.cnt.ptr<std::int32_t>();
  p.cs0 = out.cnt.stride[0], p.cs1 = out.cnt.stride[1], p.cs2 = out.cnt.stride[2];
  p.Lq = Lq, p.Lk = Lk, p.Hkv = Hkv, p.D = D, p.Tq = Tq, p.Tk = Tk;
  // Rows that are not quantised have scale 0 (every pair exact); their tiles are then never read.
  p.i8_stride = lay.i8_stride;
  p.k32 = lay.quantize ? static_cast<int>(ceil_div(D, std::int64_t{32}) * 32) : 32;
  p.P = static_cast<int>(P), p.r = static_cast<int>(r), p.span = static_cast<int>(kTileQ / r), p.top_k = o.top_k;
  p.rshift = r == 4 ? 2 : 0;  // the front end allows r = 1 or 4
  p.dterm = static_cast<float>(D) / 4.0f + 1.0f;
  p.force_local = o.force_local, p.force_block0 = o.force_block0, p.causal = o.causal;
  const int max_smem = dev.max_smem, sms = dev.sms;
  if (exact) exact_f64::launch_scores(op, p, jobs, max_smem, q.device_index, stream);
  else launch_scores(op, p, jobs, max_smem, sms, q.device_index, stream);
}

}  // namespace sparse_attn::cuda_backend
