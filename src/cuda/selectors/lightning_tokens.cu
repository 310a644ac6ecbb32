// DSA lightning indexer on the GPU, token form (TokenLists): I[t, s] = sum_j w[t, j] * ReLU(qI[t, j] . kI[s]),
// the exact top-k keys per query (ties to the lower key), ascending, -1 padded, written to every group. The
// [Lq, Lk] score matrix never reaches device memory. Kernels on the caller's stream:
//  1. prepare (tc_index.cuh): per-tensor amax (fp8); bf16 codes of qI and kI (exact: value = code * scale up
//     to one rounding) and upper bounds of every code row's norm, maxed per 128 keys;
//  2. screen (two kernels, same ids: wgmma where its candidate buffers hold top_k + 256 keys, mma.sync, with
//     smaller buffers, for the larger top_k that leave too little room): keys stream through two cp.async stages and meet
//     the query codes on the tensor cores so that each product tile holds keys x 64 heads of one query, and
//     the weighted ReLU sum over the heads stays in registers (16 heads per thread, then two shuffles),
//     giving the screened score I^ of each key. wgmma: two warpgroups, each with two queries' 2 x 64 head
//     rows as the B operand of m64n128k16 and 64-key slabs as A. mma.sync: a CTA holds nw queries, one per
//     warp, the query's 64 heads x Di codes in registers as the B operand of m16n8k16 (A = 16 keys x 16 d).
//     Each key whose interval [I^ - E, I^ + E] (E: the bound below) can still reach the top-k joins its
//     query's candidate buffer in shared memory; when the buffer fills, an exact selection (linear-bin
//     histograms, warp_kth_largest) finds the k-th largest I^ (v_k) and drops every key with I^ + 2E < v_k,
//     and later keys must pass the same test to enter;
//  3. at the end of the row: v_k over the buffer; IN = {I^ - 2E > v_k} goes straight to the output row,
//     OUT = {I^ + 2E < v_k} is dropped, the rest (UNDECIDED) is queued for the row;
//  4. resolve: per row, the undecided keys get the CPU's exact score (float64 dots of the dequantised values
//     in d order, fma chain over the heads in order, NaN as -inf); the best k - |IN| of them by (score desc,
//     key asc) complete the list, which is sorted and written to every group;
//  5. fallback: rows whose buffer or undecided list overflowed (massive ties, a huge bound, non-finite
//     inputs), or every row when the shape is beyond the screening kernel (HI > 64, Di > 128), take the
//     float64 streaming path: exact scores of all visible keys, a bitonic sort of a 2k buffer whenever it
//     fills. Rows that see at most k keys are written by the screen (all of them, ascending).
//
// The bound (why every key's exact score lies in [I^ - E, I^ + E]). Notation of tc_index.cuh: codes cq, ck
// (bf16, exact), scales sq, sk, n = Dp / 16 MMA k-steps, norms |cq_j| <= NQ_j and |ck| <= NK (upper bounds).
// Exact score I = sum_j w_j ReLU(D_j), D_j the CPU's float64 dot of the dequantised values. For every head,
// tc_index.cuh proves |D_j - sq sk T^_j| <= sq sk (n 2^-18 + 2^-20) NQ_j NK + deq (sq NQ_j + sk NK)
// + sq sk n 2^-121 + tiny, T^_j the tensor-core dot of the codes (items 1, 3 and 4 of its bound). ReLU is
// 1-Lipschitz and sq sk > 0, so |I - sq sk sum_j w_j ReLU(T^_j)| <= sum_j |w_j| (the same per-head terms).
// The float32 evaluation Ic = sum_j w_j ReLU(T^_j) is a tree of fma / add with at most 18 roundings on any
// term's path (16 in a thread's chain, 2 shuffles), then I^ = fl(fl(Ic sq) sk): 20 roundings, so
// |I^ - sq sk Ic| <= 21 * 2^-24 * sq sk sum_j |w_j| |T^_j| + underflow, and |T^_j| <= NQ_j NK (1 + 2^-14).
// With A = sum_j |w_j| NQ_j and W = sum_j |w_j| (both rounded upward):
//   E = sq sk [(n 2^-18 + 2^-19 + 24 * 2^-24) A NK + n 2^-121 W + 2^-145] + deq (sq A + sk NK W)
//       + 2^-140 (1 + W) + 2^-148 (1 + sk),
// evaluated in float32 rounded upward. NK is the largest key norm over the row's visible keys, so E is one
// number per row. E is +inf (the row goes to the fallback) when a norm, w or a scale is not finite, a scale is
// 0 (an fp8 tensor whose amax underflows keeps its raw values, which the codes do not represent exactly), or
// A NK > 2^100 (float32 overflow inside the MMA or the sum becomes possible).
//
// Why the ids equal the CPU's. Let T be the CPU's top-k (its strict order: score desc, key asc) and x_s the
// exact score of key s; x_s lies in [I^_s - E, I^_s + E] (computed with upward / downward rounding, so the
// float comparisons below are implied by the real ones).
//  - A key is dropped (at insertion or compaction) only when I^_s + 2E < v, with v the k-th largest I^ among
//    buffered keys: k keys have I^_i >= v, so x_i >= I^_i - E > I^_s + E >= x_s, and s is not in T. The k
//    keys with the largest I^ are never dropped, so the buffer's v_k is the row's.
//  - IN: I^_s - 2E > v_k. A key that can rank before s has x_i >= x_s, so I^_i >= x_i - E >= I^_s - 2E > v_k;
//    at most k - 1 keys have I^ > v_k and s is one of them, so fewer than k keys rank before s: s is in T.
//  - OUT: I^_s + 2E < v_k: k keys rank before s, as for a dropped key.
//  So IN is in T, T is in IN + UNDECIDED, and T minus IN is the best k - |IN| undecided keys under the exact
//  order (every member of T ranks before every non-member), which the resolve kernel picks with the CPU's
//  scores and tie rule. |IN| <= k - 1 and |IN| + |UNDECIDED| >= k, so the list always has exactly k keys.
#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/smem_limit.hpp"
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
using sel::align_up;
using sel::StreamScratch;

constexpr int kMaxWarps = 8;                   // queries per screening CTA (one per warp)
constexpr int kTileKeys = 64;                  // keys per shared stage (4 m16 chunks)
constexpr int kHeadTiles = 8;                  // n8 tiles of heads held as B fragments in registers
constexpr int kMaxHeads = 8 * kHeadTiles;      // 64: 16 * KS registers of codes per thread at Di = 128
constexpr int kMaxDi = 128;                    // KS <= 8 k-steps
constexpr int kPitchPad = 8;                   // row pitch (Dp + 8) * 2 bytes = 16 * odd: ldmatrix conflict-free
constexpr int kHistBins = 256;                 // radix digit of the k-th selection
constexpr int kUndCap = 512;                   // undecided keys per row before the row falls back
constexpr int kRowThreads = 128;               // resolve and fallback kernels: one key per thread
constexpr int kMinSlack = 64;                  // mma.sync buffer capacity >= top_k + kMinSlack (16 per chunk)
constexpr int kMinSlackWg = 256;               // wgmma: up to 128 entries per query and tile

enum Status : int { kDone = 0, kResolve = 1, kFallback = 2 };

struct Shape {
  std::int64_t B, Lq, Lk, HI, Di, Dp;
  bool causal;
  __host__ __device__ std::int64_t key_end(std::int64_t t) const {
    const std::int64_t e = t + (Lk - Lq) + 1;
    return causal ? (e < 0 ? 0 : (e > Lk ? Lk : e)) : Lk;
  }
};

struct OutRows {
  std::int32_t* idx;
  std::int64_t s0, s1, s2, s3, G, width;
  __device__ std::int32_t* row(std::int64_t b, std::int64_t g, std::int64_t t) const {
    return idx + b * s0 + g * s1 + t * s2;
  }
};

struct RowMeta {
  int status, nin, nund, pad;
};

// ---- helpers ----------------------------------------------------------------------------------------------

__device__ __forceinline__ float up2(float x, float e) { return __fadd_ru(__fadd_ru(x, e), e); }
__device__ __forceinline__ float down2(float x, float e) { return __fsub_rd(__fsub_rd(x, e), e); }

// Visits val[0, n) by one warp, four values per lane and load (val 16-byte aligned), then the tail.
template <class F>
__device__ __forceinline__ void warp_visit(const float* val, int n, int lane, F&& f) {
  const int n4 = n >> 2;
  const float4* v4 = reinterpret_cast<const float4*>(val);
  for (int i = lane; i < n4; i += 32) {
    const float4 x = v4[i];
    f(x.x), f(x.y), f(x.z), f(x.w);
  }
  for (int i = 4 * n4 + lane; i < n; i += 32) f(val[i]);
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_scan(int c, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, c, o);
    if (lane >= o) c += y;
  }
  return c;
}

// k-th largest of val[0, n) (1 <= k <= n, values not NaN, val 16-byte aligned), by one warp. The values in
// play (initially all) lie in [lo, hi]; a histogram of 256 linear bins over that range (bin(x) = min(255,
// (x - lo) * 256 / (hi - lo)) in double: monotone in x, so every bin is an interval of values and the bins are
// ordered) locates the bin holding the k-th largest and its rank inside the bin; the bin's own min and max
// become the next range. Each round removes at least the top bin's or the bottom bin's values (lo and hi fall
// in bins 0 and 255), and random data leaves ~n / 256 values after one round; at most 32 left are ranked
// directly by the lanes. No atomics contend: the bins spread the values. `hist` is 256 words of scratch.
__device__ float warp_kth_largest(const float* val, int n, int k, unsigned* hist, int lane) {
  float lo = INFINITY, hi = -INFINITY;
  warp_visit(val, n, lane, [&](float x) { lo = fminf(lo, x), hi = fmaxf(hi, x); });
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  int cnt = n, kk = k;
  for (;;) {
    if (!(lo < hi)) return hi;  // every value in play is equal
    if (cnt <= 32) {
      // Gather the values in play into the histogram scratch (any order), then rank them.
      float* g = reinterpret_cast<float*>(hist);
      int at = 0;
      const int n4 = n >> 2;
      const float4* v4 = reinterpret_cast<const float4*>(val);
      for (int base = 0; base < n4 + 1; base += 32) {  // the last lane-slot past n4 takes the tail
        const int i = base + lane;
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int m = 0;
        if (i < n4) {
          const float4 y = v4[i];
          x[0] = y.x, x[1] = y.y, x[2] = y.z, x[3] = y.w;
          m = 4;
        } else if (i == n4) {
          m = n - 4 * n4;
          for (int j = 0; j < m; ++j) x[j] = val[4 * n4 + j];
        }
        bool in[4];
        int c = 0;
        for (int j = 0; j < 4; ++j) c += (in[j] = j < m && x[j] >= lo && x[j] <= hi) ? 1 : 0;
        const int inc = warp_inclusive_scan(c, lane);
        int pos = at + inc - c;
        for (int j = 0; j < 4; ++j)
          if (in[j]) g[pos++] = x[j];
        at += __shfl_sync(0xffffffffu, inc, 31);
      }
      __syncwarp();
      const float y = lane < cnt ? g[lane] : -INFINITY;
      int gt = 0, ge = 0;
      for (int j = 0; j < cnt; ++j) {
        const float z = g[j];
        gt += z > y, ge += z >= y;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, lane < cnt && gt < kk && kk <= ge);
      const float v = __shfl_sync(0xffffffffu, y, __ffs(hit) - 1);
      __syncwarp();
      return v;
    }
    const double base = lo, scale = 256.0 / (static_cast<double>(hi) - base);
    auto bin = [&](float x) { return imin(255, static_cast<int>((static_cast<double>(x) - base) * scale)); };
    for (int i = lane; i < kHistBins; i += 32) hist[i] = 0;
    __syncwarp();
    warp_visit(val, n, lane, [&](float x) {
      if (x >= lo && x <= hi) atomicAdd(&hist[bin(x)], 1u);
    });
    __syncwarp();
    // Lane l owns bins [8 l, 8 l + 8); suffix sums over lanes locate the bin holding the kk-th largest.
    unsigned c[8], local = 0;
    for (int i = 0; i < 8; ++i) local += (c[i] = hist[8 * lane + i]);
    unsigned suffix = local;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned y = __shfl_down_sync(0xffffffffu, suffix, o);
      if (lane + o < 32) suffix += y;
    }
    const unsigned above = suffix - local;
    const bool mine = above < static_cast<unsigned>(kk) && static_cast<unsigned>(kk) <= suffix;
    int dig = 0, rest = 0, inbin = 0;
    if (mine) {
      unsigned acc = above;
      for (int i = 7; i >= 0; --i) {
        if (acc + c[i] >= static_cast<unsigned>(kk)) {
          dig = 8 * lane + i;
          rest = kk - static_cast<int>(acc);
          inbin = static_cast<int>(c[i]);
          break;
        }
        acc += c[i];
      }
    }
    const int src = __ffs(__ballot_sync(0xffffffffu, mine)) - 1;
    dig = __shfl_sync(0xffffffffu, dig, src);
    kk = __shfl_sync(0xffffffffu, rest, src);
    cnt = __shfl_sync(0xffffffffu, inbin, src);
    float nlo = INFINITY, nhi = -INFINITY;
    warp_visit(val, n, lane, [&](float x) {
      if (x >= lo && x <= hi && bin(x) == dig) nlo = fminf(nlo, x), nhi = fmaxf(nhi, x);
    });
    for (int o = 16; o > 0; o >>= 1) {
      nlo = fminf(nlo, __shfl_xor_sync(0xffffffffu, nlo, o));
      nhi = fmaxf(nhi, __shfl_xor_sync(0xffffffffu, nhi, o));
    }
    lo = nlo, hi = nhi;
    __syncwarp();
  }
}

// Keeps the buffered keys that can still be in the top-k (I^ + 2E >= v_k) and returns v_k, the new entry
// threshold. In place, four entries per lane: a chunk's reads all happen before its writes, which land below
// the chunk's end. The buffer's order is irrelevant (the selection depends only on the set).
__device__ float warp_compact(float* val, int* id, int& count, int k, float E, unsigned* hist, int lane) {
  const float v = warp_kth_largest(val, count, k, hist, lane);
  const int n = count, n4 = n >> 2;
  float4* v4 = reinterpret_cast<float4*>(val);
  int4* i4 = reinterpret_cast<int4*>(id);
  int out = 0;
  for (int base = 0; base < n4 + 1; base += 32) {
    const int i = base + lane;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int d[4] = {0, 0, 0, 0}, m = 0;
    if (i < n4) {
      const float4 y = v4[i];
      const int4 z = i4[i];
      x[0] = y.x, x[1] = y.y, x[2] = y.z, x[3] = y.w;
      d[0] = z.x, d[1] = z.y, d[2] = z.z, d[3] = z.w;
      m = 4;
    } else if (i == n4) {
      m = n - 4 * n4;
      for (int j = 0; j < m; ++j) x[j] = val[4 * n4 + j], d[j] = id[4 * n4 + j];
    }
    bool keep[4];
    int c = 0;
    for (int j = 0; j < 4; ++j) c += (keep[j] = j < m && up2(x[j], E) >= v) ? 1 : 0;
    const int inc = warp_inclusive_scan(c, lane);
    __syncwarp();
    int pos = out + inc - c;
    for (int j = 0; j < 4; ++j)
      if (keep[j]) val[pos] = x[j], id[pos] = d[j], ++pos;
    out += __shfl_sync(0xffffffffu, inc, 31);
    __syncwarp();
  }
  count = out;
  return v;
}

// Block-wide bitonic sort of n (a power of two) (score, id) pairs into the CPU's rank order (score desc, id
// asc): pad with (-inf, INT_MAX), which ranks after every real entry.
__device__ void bitonic_rank_sort(double* key, int* id, int n) {
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int lo = 2 * stride * (i / stride) + (i % stride), hi = lo + stride;
        const bool up = (lo & size) == 0;
        const bool hi_first = sel::ranks_before(key[hi], id[hi], key[lo], id[lo]);
        if (up == hi_first) {
          const double tk = key[lo];
          key[lo] = key[hi], key[hi] = tk;
          const int ti = id[lo];
          id[lo] = id[hi], id[hi] = ti;
        }
      }
      __syncthreads();
    }
}

// Block-wide bitonic sort of n (a power of two) ints, ascending.
__device__ void bitonic_sort_ints(int* v, int n) {
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int lo = 2 * stride * (i / stride) + (i % stride), hi = lo + stride;
        const bool up = (lo & size) == 0;
        if (up == (v[hi] < v[lo])) {
          const int t = v[lo];
          v[lo] = v[hi], v[hi] = t;
        }
      }
      __syncthreads();
    }
}

__host__ __device__ inline int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// The CPU's dequantised value of one element of an index tensor, from the raw input (as load_quantized).
__device__ __forceinline__ float raw_value(const IndexSrc& src, In t, int prec, float ts, std::int64_t off) {
  float x = load_elem_rt(src.x, off, t), v, c;
  if (prec == static_cast<int>(Prec::bf16)) quantize_codes<Prec::bf16>(&x, 1, ts, &v, &c);
  else quantize_codes<Prec::fp8>(&x, 1, ts, &v, &c);
  return v;
}

// The CPU's index_score: per head a float64 dot in d order (fma = the CPU's exact product plus add), then
// acc = fma(w_j, max(0, dot_j), acc) over the heads in order; NaN ranks as -inf.
__device__ __forceinline__ double exact_score(const float* qv, const double* wv, const float* kv, int HI, int Di) {
  double acc = 0.0;
  for (int j = 0; j < HI; ++j) {
    const float* qr = qv + j * Di;
    double dot = 0.0;
    for (int d = 0; d < Di; ++d) dot = fma(static_cast<double>(qr[d]), static_cast<double>(kv[d]), dot);
    acc = fma(wv[j], fmax(0.0, dot), acc);
  }
  return sel::sanitize(acc);
}

// Writes ids[0, n) (ascending) and -1 up to the row width, to every group.
__device__ void write_row(const OutRows& o, std::int64_t b, std::int64_t t, const int* ids, int n) {
  for (std::int64_t g = 0; g < o.G; ++g) {
    std::int32_t* r = o.row(b, g, t);
    for (std::int64_t s = threadIdx.x; s < o.width; s += blockDim.x) r[s * o.s3] = s < n ? ids[s] : -1;
  }
}

// ---- 2.-3. screening -------------------------------------------------------------------------------------

struct ScreenParams {
  const __nv_bfloat16* qc;  // [B * Lq * HI, Dp]
  const float* qn;          // [B * Lq * HI] code norm bounds
  const __nv_bfloat16* kc;  // [B * Lk, Dp]
  const unsigned* kgmax;    // [B, ceil(Lk / 128)] largest key code norm per 128 keys (float bits)
  const float* w;
  std::int64_t ws0, ws1, ws2;
  const unsigned* amax;     // [2]: qI, kI
  int prec;
  Shape s;
  OutRows out;
  RowMeta* meta;            // [B * Lq]
  std::int32_t* und;        // [B * Lq, kUndCap]
  int top_k, cap;
  float deq;                // 2^-146 sqrt(Di) (tc_index.cuh)
  unsigned long long* stats;
};

std::size_t screen_smem(int KS, int nw, int cap) {
  const std::size_t pitch = static_cast<std::size_t>(16 * KS + kPitchPad);
  return 2 * kTileKeys * pitch * 2 + static_cast<std::size_t>(nw) * kHistBins * 4 +
         static_cast<std::size_t>(nw) * static_cast<std::size_t>(cap) * 8;
}

// E for one row (see the header), computed identically by every lane.
__device__ float row_bound(const ScreenParams& p, std::int64_t b, std::int64_t t, std::int64_t row, std::int64_t end,
                           float sq, float sk, int KS, int lane) {
  const Shape& s = p.s;
  float A = 0.0f, W = 0.0f, NK = 0.0f;
  bool finite = true;
  for (std::int64_t h = lane; h < s.HI; h += 32) {
    const float wj = p.w[b * p.ws0 + t * p.ws1 + h * p.ws2];
    finite = finite && isfinite(wj);
    const float aw = fabsf(wj);
    W = __fadd_ru(W, aw);
    A = __fadd_ru(A, __fmul_ru(aw, p.qn[row * s.HI + h]));
  }
  const std::int64_t groups = (end + kBlockK - 1) / kBlockK, Tg = (s.Lk + kBlockK - 1) / kBlockK;
  for (std::int64_t gi = lane; gi < groups; gi += 32) NK = fmaxf(NK, __uint_as_float(p.kgmax[b * Tg + gi]));
  for (int o = 16; o > 0; o >>= 1) {
    A = __fadd_ru(A, __shfl_xor_sync(0xffffffffu, A, o));
    W = __fadd_ru(W, __shfl_xor_sync(0xffffffffu, W, o));
    NK = fmaxf(NK, __shfl_xor_sync(0xffffffffu, NK, o));
  }
  finite = __all_sync(0xffffffffu, finite);
  const float ANK = __fmul_ru(A, NK);
  if (!finite || !isfinite(W) || !(ANK <= 0x1p100f) || !(sq > 0.0f) || !(sk > 0.0f) || !isfinite(sq) ||
      !isfinite(sk))
    return INFINITY;
  const float rel = static_cast<float>(KS) * 0x1p-18f + 0x1p-19f + 24.0f * 0x1p-24f;  // exact
  const float sqsk = __fmul_ru(sq, sk);
  float inner = __fmul_ru(rel, ANK);
  inner = __fadd_ru(inner, __fmul_ru(W, static_cast<float>(KS) * 0x1p-121f));
  inner = __fadd_ru(inner, 0x1p-145f);
  float e = __fmul_ru(sqsk, inner);
  e = __fadd_ru(e, __fmul_ru(p.deq, __fadd_ru(__fmul_ru(sq, A), __fmul_ru(__fmul_ru(sk, NK), W))));
  e = __fadd_ru(e, __fmul_ru(0x1p-140f, __fadd_ru(1.0f, W)));
  e = __fadd_ru(e, __fmul_ru(0x1p-148f, __fadd_ru(1.0f, sk)));
  return isfinite(e) ? e : INFINITY;
}

// grid: (ceil(Lq / nw), B), nw warps. Warp w owns query t0 + w; CTAs run the latest (longest causal) queries
// first. Shared: two key stages [64][Dp + 8] bf16, per warp a 256-bin histogram and the candidate buffer
// (cap screened scores, cap key ids).
template <int KS>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) screen_kernel(const ScreenParams p) {
  constexpr int Dp = 16 * KS, pitch = Dp + kPitchPad, chunks = Dp / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  const int nw = static_cast<int>(blockDim.x / 32);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  auto* kst = reinterpret_cast<__nv_bfloat16*>(smem);
  unsigned* hist = reinterpret_cast<unsigned*>(kst + 2 * kTileKeys * pitch) + warp * kHistBins;
  float* bval = reinterpret_cast<float*>(reinterpret_cast<unsigned*>(kst + 2 * kTileKeys * pitch) + nw * kHistBins) +
                static_cast<std::size_t>(warp) * p.cap;
  int* bid = reinterpret_cast<int*>(reinterpret_cast<float*>(reinterpret_cast<unsigned*>(kst + 2 * kTileKeys * pitch) +
                                                             nw * kHistBins) +
                                    static_cast<std::size_t>(nw) * p.cap) +
             static_cast<std::size_t>(warp) * p.cap;

  const std::int64_t b = blockIdx.y;
  const std::int64_t t0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * nw, t = t0 + warp;
  const std::int64_t cta_end = s.key_end(imin(s.Lq, t0 + nw) - 1);
  const std::int64_t end = t < s.Lq ? s.key_end(t) : 0;
  const std::int64_t row = b * s.Lq + t;
  const int k = p.top_k;

  // mode 0: nothing to screen (no query, or a query seeing at most k keys: all of them, written here);
  // 1: screening; 2: handed to the float64 fallback.
  int mode = 0;
  if (t < s.Lq) {
    if (end <= k) {
      for (std::int64_t gr = 0; gr < p.out.G; ++gr) {
        std::int32_t* r = p.out.row(b, gr, t);
        for (std::int64_t j = lane; j < p.out.width; j += 32) r[j * p.out.s3] = j < end ? static_cast<std::int32_t>(j) : -1;
      }
      if (lane == 0) p.meta[row] = RowMeta{kDone, 0, 0, 0};
    } else {
      mode = 1;
    }
  }

  const float sq = tensor_scale(p.prec, p.amax), sk = tensor_scale(p.prec, p.amax + 1);
  float E = 0.0f;
  if (mode == 1) {
    E = row_bound(p, b, t, row, end, sq, sk, KS, lane);
    if (!isfinite(E)) mode = 2;
  }

  // The query's codes as B fragments (head 8 nt + g, d = 16 ks + 2 q4 (+ 8)) and its weights per C column.
  std::uint32_t bq[kHeadTiles][KS][2];
  float wr[kHeadTiles][2];
#pragma unroll
  for (int nt = 0; nt < kHeadTiles; ++nt) {
    const std::int64_t hb = 8 * nt + g;
    const bool hv = mode == 1 && hb < s.HI;
    const __nv_bfloat16* qrow = p.qc + (row * s.HI + (hv ? hb : 0)) * Dp;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      bq[nt][ks][0] = hv ? *reinterpret_cast<const std::uint32_t*>(qrow + 16 * ks + 2 * q4) : 0u;
      bq[nt][ks][1] = hv ? *reinterpret_cast<const std::uint32_t*>(qrow + 16 * ks + 2 * q4 + 8) : 0u;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const std::int64_t h = 8 * nt + 2 * q4 + e;
      wr[nt][e] = mode == 1 && h < s.HI ? p.w[b * p.ws0 + t * p.ws1 + h * p.ws2] : 0.0f;
    }
  }

  int count = 0;
  float thr = -INFINITY;  // entry test: I^ + 2E >= thr (the last compaction's v_k)
  const std::int64_t ntiles = (cta_end + kTileKeys - 1) / kTileKeys;
  auto load_tile = [&](std::int64_t j, int stage) {
    __nv_bfloat16* dst = kst + stage * kTileKeys * pitch;
    for (int e = tid; e < kTileKeys * chunks; e += blockDim.x) {
      const int r = e / chunks, c = e % chunks;
      const std::int64_t key = j * kTileKeys + r;
      const bool valid = key < s.Lk;
      cp_async16(dst + r * pitch + c * 8, p.kc + (b * s.Lk + (valid ? key : 0)) * Dp + c * 8, valid);
    }
  };
  if (ntiles > 0) {
    load_tile(0, 0);
    cp_async_commit();
  }
  for (std::int64_t j = 0; j < ntiles; ++j) {
    const int stage = static_cast<int>(j & 1);
    if (j + 1 < ntiles) {
      load_tile(j + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (mode == 1) {
      const __nv_bfloat16* kb = kst + stage * kTileKeys * pitch;
      for (int c = 0; c < kTileKeys / 16; ++c) {
        const std::int64_t kbase = j * kTileKeys + c * 16;
        if (kbase >= end) break;
        if (count + 16 > p.cap) {
          thr = warp_compact(bval, bid, count, k, E, hist, lane);
          if (p.stats && lane == 0) atomicAdd(p.stats + 3, 1ull);
          if (count + 16 > p.cap) {
            mode = 2;
            break;
          }
        }
        float acc[kHeadTiles][4];
#pragma unroll
        for (int nt = 0; nt < kHeadTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          std::uint32_t a[4];
          ldmatrix_x4(a, kb + (c * 16 + lane % 16) * pitch + ks * 16 + (lane / 16) * 8);
#pragma unroll
          for (int nt = 0; nt < kHeadTiles; ++nt) mma_m16n8k16<Bf16Tag>(acc[nt], a, bq[nt][ks][0], bq[nt][ks][1]);
        }
        // acc[nt][e]: key g + 8 (e / 2), head 8 nt + 2 q4 + e % 2.
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kHeadTiles; ++nt) {
          s0 = fmaf(wr[nt][0], fmaxf(acc[nt][0], 0.0f), s0);
          s0 = fmaf(wr[nt][1], fmaxf(acc[nt][1], 0.0f), s0);
          s1 = fmaf(wr[nt][0], fmaxf(acc[nt][2], 0.0f), s1);
          s1 = fmaf(wr[nt][1], fmaxf(acc[nt][3], 0.0f), s1);
        }
        s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        const float v0 = __fmul_rn(__fmul_rn(s0, sq), sk), v1 = __fmul_rn(__fmul_rn(s1, sq), sk);
        const bool c0 = q4 == 0 && kbase + g < end && up2(v0, E) >= thr;
        const bool c1 = q4 == 0 && kbase + g + 8 < end && up2(v1, E) >= thr;
        const unsigned m0 = __ballot_sync(0xffffffffu, c0), m1 = __ballot_sync(0xffffffffu, c1);
        const unsigned lt = (1u << lane) - 1u;
        if (c0) {
          const int pos = count + __popc(m0 & lt);
          bval[pos] = v0;
          bid[pos] = static_cast<int>(kbase + g);
        }
        if (c1) {
          const int pos = count + __popc(m0) + __popc(m1 & lt);
          bval[pos] = v1;
          bid[pos] = static_cast<int>(kbase + g + 8);
        }
        count += __popc(m0) + __popc(m1);
        __syncwarp();
      }
    }
    __syncthreads();  // the stage is rewritten by the next iteration's load
  }

  if (mode == 2) {
    if (lane == 0) {
      p.meta[row] = RowMeta{kFallback, 0, 0, 0};
      if (p.stats) atomicAdd(p.stats + 2, 1ull);
    }
    return;
  }
  if (mode != 1) return;

  // Classification against the row's v_k; IN keys go to group 0 of the output row, unsorted.
  const float v = warp_kth_largest(bval, count, k, hist, lane);
  std::int32_t* orow = p.out.row(b, 0, t);
  std::int32_t* urow = p.und + row * kUndCap;
  int nin = 0, nund = 0;
  for (int base = 0; base < count; base += 32) {
    const int i = base + lane;
    bool in = false, und = false;
    int key = 0;
    if (i < count) {
      const float x = bval[i];
      key = bid[i];
      in = down2(x, E) > v;
      und = !in && !(up2(x, E) < v);
    }
    const unsigned mi = __ballot_sync(0xffffffffu, in), mu = __ballot_sync(0xffffffffu, und);
    const unsigned lt = (1u << lane) - 1u;
    if (in) orow[static_cast<std::int64_t>(nin + __popc(mi & lt)) * p.out.s3] = key;
    if (und) {
      const int pos = nund + __popc(mu & lt);
      if (pos < kUndCap) urow[pos] = key;
    }
    nin += __popc(mi);
    nund += __popc(mu);
  }
  if (lane == 0) {
    const bool over = nund > kUndCap;
    p.meta[row] = RowMeta{over ? kFallback : kResolve, nin, nund, 0};
    if (p.stats) {
      atomicAdd(p.stats + 0, 1ull);
      if (over) atomicAdd(p.stats + 2, 1ull);
      else if (nin + nund > k) atomicAdd(p.stats + 1, static_cast<unsigned long long>(nund));
    }
  }
}

// The same screen on wgmma: two warpgroups, each owning two queries whose 2 x 64 head code rows form the B
// operand (128 rows, K-major, 128B-swizzled, as token_max's key tiles); keys stream as A in 128-key tiles
// (two m64 slabs). m64n128k16 leaves in thread (w, g, q4) of a warpgroup d[4 c + e] = key 16 w + g + 8 (e / 2)
// of the slab, column 8 c + 2 q4 + e % 2 = query c / 8, head 8 (c % 8) + 2 q4 + e % 2: the mma.sync epilogue,
// c < 8 for the first query and c >= 8 for the second. A query's keys come from the four warps of its
// warpgroup, so its buffer count is a shared counter (one atomic per warp and chunk); compaction runs at tile
// boundaries (at most 128 entries per query and tile), one warp per query.
constexpr int kWgQueries = 4;                       // per CTA: two per warpgroup
constexpr int kWgHalf = kBlockK * 128;             // one 64-column half of a 128-row bf16 tile (16 KB)

std::size_t screen_wg_smem(int halves, int cap) {
  return 1024 + static_cast<std::size_t>(4 * halves * kWgHalf) + kWgQueries * kHistBins * 4 + 64 +
         static_cast<std::size_t>(kWgQueries) * static_cast<std::size_t>(cap) * 8;
}

template <int kHalves>
__global__ void __launch_bounds__(256, 1) screen_wgmma_kernel(const ScreenParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int tile_bytes = kHalves * kWgHalf, chunks = kHalves * 8, ksteps = kHalves * 4;
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* qt = smem;                       // [2 warpgroups] tiles
  unsigned char* kst = smem + 2 * tile_bytes;     // [2 stages] tiles
  unsigned* hist_all = reinterpret_cast<unsigned*>(smem + 4 * tile_bytes);  // [4][256]
  int* qcnt = reinterpret_cast<int*>(hist_all + kWgQueries * kHistBins);   // [4]
  int* qmode = qcnt + kWgQueries;                                          // [4]
  float* qthr = reinterpret_cast<float*>(qmode + kWgQueries);              // [4]
  float* qE = qthr + kWgQueries;                                           // [4]
  float* bval_all = qE + kWgQueries;                                       // [4][cap]
  int* bid_all = reinterpret_cast<int*>(bval_all + kWgQueries * p.cap);    // [4][cap]

  const Shape& s = p.s;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = tid / 128, w4 = warp % 4;
  const int g = lane / 4, q4 = lane % 4;
  const std::int64_t b = blockIdx.y;
  const std::int64_t t0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * kWgQueries;
  const int k = p.top_k;
  const int valid_chunks = static_cast<int>(s.Dp) / 8;
  const float sq = tensor_scale(p.prec, p.amax), sk = tensor_scale(p.prec, p.amax + 1);

  // Per query: short rows are written by warps 4..7, bounds by warps 0..3.
  if (warp < kWgQueries) {
    const std::int64_t t = t0 + warp;
    int mode = 0;
    float E = 0.0f;
    if (t < s.Lq && s.key_end(t) > k) {
      E = row_bound(p, b, t, b * s.Lq + t, s.key_end(t), sq, sk, ksteps, lane);
      mode = isfinite(E) ? 1 : 2;
    }
    if (lane == 0) qmode[warp] = mode, qE[warp] = E, qthr[warp] = -INFINITY, qcnt[warp] = 0;
  } else {
    const std::int64_t t = t0 + warp - kWgQueries;
    if (t < s.Lq) {
      const std::int64_t end = s.key_end(t);
      if (end <= k) {
        for (std::int64_t gr = 0; gr < p.out.G; ++gr) {
          std::int32_t* r = p.out.row(b, gr, t);
          for (std::int64_t j = lane; j < p.out.width; j += 32) r[j * p.out.s3] = j < end ? static_cast<std::int32_t>(j) : -1;
        }
        if (lane == 0) p.meta[b * s.Lq + t] = RowMeta{kDone, 0, 0, 0};
      }
    }
  }
  // The warpgroup's two query tiles: row r = query r / 64, head r % 64 (zero beyond HI or Lq).
  {
    unsigned char* dst = qt + wg * tile_bytes;
    for (int e = tid % 128; e < kBlockK * chunks; e += 128) {
      const int r = e / chunks, c = e % chunks;
      const std::int64_t t = t0 + 2 * wg + r / 64, h = r % 64;
      const bool valid = t < s.Lq && h < s.HI && c < valid_chunks;
      unsigned char* d = dst + (c / 8) * kWgHalf + r * 128 + (((c % 8) ^ (r % 8)) * 16);
      cp_async16(d, p.qc + (valid ? ((b * s.Lq + t) * s.HI + h) * s.Dp + c * 8 : 0), valid);
    }
  }
  float wr[2][kHeadTiles][2];
#pragma unroll
  for (int qi = 0; qi < 2; ++qi)
#pragma unroll
    for (int c = 0; c < kHeadTiles; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const std::int64_t t = t0 + 2 * wg + qi, h = 8 * c + 2 * q4 + e;
        wr[qi][c][e] = t < s.Lq && h < s.HI ? p.w[b * p.ws0 + t * p.ws1 + h * p.ws2] : 0.0f;
      }
  auto load_keys = [&](std::int64_t j, int stage) {
    unsigned char* dst = kst + stage * tile_bytes;
    for (int e = tid; e < kBlockK * chunks; e += 256) {
      const int r = e / chunks, c = e % chunks;
      const std::int64_t key = j * kBlockK + r;
      const bool valid = key < s.Lk && c < valid_chunks;
      unsigned char* d = dst + (c / 8) * kWgHalf + r * 128 + (((c % 8) ^ (r % 8)) * 16);
      cp_async16(d, p.kc + (valid ? (b * s.Lk + key) * s.Dp + c * 8 : 0), valid);
    }
  };
  const std::int64_t cta_end = s.key_end(imin(s.Lq, t0 + kWgQueries) - 1);
  const std::int64_t ntiles = (cta_end + kBlockK - 1) / kBlockK;
  if (ntiles > 0) load_keys(0, 0);
  cp_async_commit();
  __syncthreads();  // qmode, qE, ... visible

  std::int64_t wend[2];
  for (int qi = 0; qi < 2; ++qi) {
    const std::int64_t t = t0 + 2 * wg + qi;
    wend[qi] = t < s.Lq ? s.key_end(t) : 0;
  }
  const std::int64_t wg_end = imax(wend[0], wend[1]);

  for (std::int64_t j = 0; j < ntiles; ++j) {
    const int stage = static_cast<int>(j & 1);
    if (j + 1 < ntiles) {
      load_keys(j + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    // Compaction before the tile: a query may gain up to 128 entries in it.
    if (warp < kWgQueries && qmode[warp] == 1 && qcnt[warp] + kBlockK > p.cap) {
      int count = qcnt[warp];
      const float v = warp_compact(bval_all + warp * p.cap, bid_all + warp * p.cap, count, k, qE[warp],
                                   hist_all + warp * kHistBins, lane);
      if (lane == 0) {
        if (p.stats) atomicAdd(p.stats + 3, 1ull);
        qcnt[warp] = count;
        qthr[warp] = v;
        if (count + kBlockK > p.cap) qmode[warp] = 2;
      }
    }
    __syncthreads();
    const int m0 = qmode[2 * wg], m1 = qmode[2 * wg + 1];
    // Slab 1's MMAs run while slab 0's epilogue does: two accumulator sets.
    auto epilogue = [&](float (&d)[64], std::int64_t kbase) {
      const std::int64_t key0 = kbase + 16 * w4 + g, key1 = key0 + 8;
#pragma unroll
      for (int qi = 0; qi < 2; ++qi) {
        const int slot = 2 * wg + qi;
        if ((qi == 0 ? m0 : m1) != 1) continue;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int c = 0; c < kHeadTiles; ++c) {
          s0 = fmaf(wr[qi][c][0], fmaxf(d[4 * (8 * qi + c) + 0], 0.0f), s0);
          s0 = fmaf(wr[qi][c][1], fmaxf(d[4 * (8 * qi + c) + 1], 0.0f), s0);
          s1 = fmaf(wr[qi][c][0], fmaxf(d[4 * (8 * qi + c) + 2], 0.0f), s1);
          s1 = fmaf(wr[qi][c][1], fmaxf(d[4 * (8 * qi + c) + 3], 0.0f), s1);
        }
        s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        const float v0 = __fmul_rn(__fmul_rn(s0, sq), sk), v1 = __fmul_rn(__fmul_rn(s1, sq), sk);
        const float E = qE[slot], thr = qthr[slot];
        const bool c0 = q4 == 0 && key0 < wend[qi] && up2(v0, E) >= thr;
        const bool c1 = q4 == 0 && key1 < wend[qi] && up2(v1, E) >= thr;
        const unsigned b0 = __ballot_sync(0xffffffffu, c0), b1 = __ballot_sync(0xffffffffu, c1);
        const int n = __popc(b0) + __popc(b1);
        if (n == 0) continue;
        int base = 0;
        if (lane == 0) base = atomicAdd(qcnt + slot, n);
        base = __shfl_sync(0xffffffffu, base, 0);
        const unsigned lt = (1u << lane) - 1u;
        float* bv = bval_all + slot * p.cap;
        int* bi = bid_all + slot * p.cap;
        if (c0) {
          const int pos = base + __popc(b0 & lt);
          bv[pos] = v0;
          bi[pos] = static_cast<int>(key0);
        }
        if (c1) {
          const int pos = base + __popc(b0) + __popc(b1 & lt);
          bv[pos] = v1;
          bi[pos] = static_cast<int>(key1);
        }
      }
    };
    const std::int64_t kb0 = j * kBlockK;
    // Both slabs always run (past the causal edge the keys are masked), so the MMAs stay unconditional.
    if ((m0 == 1 || m1 == 1) && kb0 < wg_end) {
      float d0[64], d1[64];
      const std::uint32_t a_base = smem_addr(kst + stage * tile_bytes), b_base = smem_addr(qt + wg * tile_bytes);
      cuda_kernels::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < ksteps; ++kk) {
        const std::uint32_t off = (kk / 4) * kWgHalf + (kk % 4) * 32;
        cuda_kernels::wgmma_ss<cuda_kernels::Bf16Tag>(d0, cuda_kernels::make_desc_sw128(a_base + off, 16, 1024),
                                                       cuda_kernels::make_desc_sw128(b_base + off, 16, 1024), kk > 0);
      }
      cuda_kernels::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < ksteps; ++kk) {
        const std::uint32_t off = (kk / 4) * kWgHalf + (kk % 4) * 32;
        cuda_kernels::wgmma_ss<cuda_kernels::Bf16Tag>(d1, cuda_kernels::make_desc_sw128(a_base + 64 * 128 + off, 16, 1024),
                                                       cuda_kernels::make_desc_sw128(b_base + off, 16, 1024), kk > 0);
      }
      cuda_kernels::wgmma_commit();
      cuda_kernels::wgmma_wait<1>();
      cuda_kernels::fence_operands(d0);
      epilogue(d0, kb0);
      cuda_kernels::wgmma_wait<0>();
      cuda_kernels::fence_operands(d1);
      epilogue(d1, kb0 + 64);
    }
    __syncthreads();  // the stage, the counters and the buffers are read or rewritten next
  }

  if (warp >= kWgQueries) return;
  const std::int64_t t = t0 + warp, row = b * s.Lq + t;
  const int mode = qmode[warp];
  if (mode == 2) {
    if (lane == 0) {
      p.meta[row] = RowMeta{kFallback, 0, 0, 0};
      if (p.stats) atomicAdd(p.stats + 2, 1ull);
    }
    return;
  }
  if (mode != 1) return;
  const int count = qcnt[warp];
  const float E = qE[warp];
  const float* bval = bval_all + warp * p.cap;
  const int* bid = bid_all + warp * p.cap;
  const float v = warp_kth_largest(bval, count, k, hist_all + warp * kHistBins, lane);
  std::int32_t* orow = p.out.row(b, 0, t);
  std::int32_t* urow = p.und + row * kUndCap;
  int nin = 0, nund = 0;
  for (int base = 0; base < count; base += 32) {
    const int i = base + lane;
    bool in = false, und = false;
    int key = 0;
    if (i < count) {
      const float x = bval[i];
      key = bid[i];
      in = down2(x, E) > v;
      und = !in && !(up2(x, E) < v);
    }
    const unsigned mi = __ballot_sync(0xffffffffu, in), mu = __ballot_sync(0xffffffffu, und);
    const unsigned lt = (1u << lane) - 1u;
    if (in) orow[static_cast<std::int64_t>(nin + __popc(mi & lt)) * p.out.s3] = key;
    if (und) {
      const int pos = nund + __popc(mu & lt);
      if (pos < kUndCap) urow[pos] = key;
    }
    nin += __popc(mi);
    nund += __popc(mu);
  }
  if (lane == 0) {
    const bool over = nund > kUndCap;
    p.meta[row] = RowMeta{over ? kFallback : kResolve, nin, nund, 0};
    if (p.stats) {
      atomicAdd(p.stats + 0, 1ull);
      if (over) atomicAdd(p.stats + 2, 1ull);
      else if (nin + nund > k) atomicAdd(p.stats + 1, static_cast<unsigned long long>(nund));
    }
  }
}

// ---- 4. resolve --------------------------------------------------------------------------------------------

struct RowParams {
  const __nv_bfloat16* qc;  // codes (resolve)
  const __nv_bfloat16* kc;
  IndexSrc qsrc, ksrc;      // raw inputs (fallback)
  In qt, kt;
  const float* w;
  std::int64_t ws0, ws1, ws2;
  const unsigned* amax;
  int prec;
  Shape s;
  OutRows out;
  const RowMeta* meta;
  const std::int32_t* und;
  int top_k;
  bool all;  // fallback: every row (the screen did not run)
  unsigned long long* stats;
};

// The query's dequantised values [HI][Di] and weights into shared memory.
__device__ void load_query(const RowParams& p, std::int64_t b, std::int64_t t, bool from_codes, float sq, float* qv,
                           int pitch, double* wv) {
  const Shape& s = p.s;
  const std::int64_t row = b * s.Lq + t;
  for (std::int64_t e = threadIdx.x; e < s.HI * s.Di; e += blockDim.x) {
    const std::int64_t j = e / s.Di, d = e % s.Di;
    if (from_codes) {
      const float c = __bfloat162float(p.qc[(row * s.HI + j) * s.Dp + d]);
      qv[j * pitch + d] = p.prec == static_cast<int>(Prec::bf16) ? c : __fmul_rn(c, sq);
    } else {
      qv[j * pitch + d] = raw_value(p.qsrc, p.qt, p.prec, sq, p.qsrc.offset(row * s.HI + j) + d);
    }
  }
  for (std::int64_t j = threadIdx.x; j < s.HI; j += blockDim.x)
    wv[j] = static_cast<double>(p.w[b * p.ws0 + t * p.ws1 + j * p.ws2]);
}

// Shared layout of the row kernels: qv [HI * Di] floats, wv [HI] doubles, kb [128][Di + 1] floats, then the
// kernel's own arrays.
__host__ __device__ inline std::size_t row_common_bytes(std::int64_t HI, std::int64_t Di) {
  return static_cast<std::size_t>(HI * Di) * 4 + static_cast<std::size_t>(HI) * 8 +
         static_cast<std::size_t>(kRowThreads * (Di + 1)) * 4;
}
__host__ __device__ inline std::size_t align8(std::size_t x) { return (x + 7) / 8 * 8; }

constexpr int kResolveThreads = 256;
constexpr int kResolveKeys = 16;  // undecided keys per batch: 16 keys x 64 heads = 4 float64 dots per thread
constexpr int kResolveGroups = kResolveThreads / kMaxHeads;     // 4: thread = (head t % 64, key group t / 64)
constexpr int kResolveItems = kResolveKeys / kResolveGroups;    // 4 keys per thread, one shared head

std::size_t resolve_smem(std::int64_t HI, std::int64_t Di, std::int64_t Lk) {
  return static_cast<std::size_t>(HI + kResolveKeys * HI + kUndCap + HI * (Di + 1) + kResolveKeys * (Di + 1)) * 8 +
         static_cast<std::size_t>(kUndCap) * 4 + static_cast<std::size_t>(ceil_div(Lk, 32)) * 4 + 32 * 4;
}

// Exclusive prefix sum over the block of one int per thread; `total` gets the sum. `tot` is 32 ints of shared
// scratch.
__device__ int block_exclusive_scan(int v, int* tot, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  int inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) tot[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int x = lane < nwarps ? tot[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    tot[lane] = x;
  }
  __syncthreads();
  const int off = warp > 0 ? tot[warp - 1] : 0;
  total = tot[nwarps - 1];
  __syncthreads();
  return off + inc - v;
}

// grid: B * Lq rows; rows with status kResolve. The undecided keys are scored exactly in batches of 16: the
// 16 x HI float64 dots spread over the threads (four interleaved per thread, each in d order), then one thread
// per key runs the fma chain over the heads; a bitonic sort ranks them and the best k - nin join the IN keys.
// The k ids are marked in a bitmap of the row's keys and written in ascending order by a block scan.
__global__ void __launch_bounds__(kResolveThreads) resolve_kernel(const RowParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  const std::int64_t row = blockIdx.x, b = row / s.Lq, t = row % s.Lq;
  const RowMeta m = p.meta[row];
  if (m.status != kResolve) return;
  const int HI = static_cast<int>(s.HI), Di = static_cast<int>(s.Di), k = p.top_k, tid = threadIdx.x;
  double* wv = reinterpret_cast<double*>(smem);
  double* dots = wv + HI;                    // [kResolveKeys][HI]
  double* usc = dots + kResolveKeys * HI;    // [kUndCap]
  // The values as doubles (exact), rows padded to Di + 1: the lanes of a warp read different heads at one d
  // (the key rows they read are the same: broadcast).
  const int pitch = Di + 1;
  double* qv = usc + kUndCap;                // [HI][Di + 1]
  double* kv = qv + HI * pitch;              // [kResolveKeys][Di + 1]
  int* uid = reinterpret_cast<int*>(kv + kResolveKeys * pitch);
  unsigned* bits = reinterpret_cast<unsigned*>(uid + kUndCap);
  const std::int64_t end = s.key_end(t);
  const int words = static_cast<int>((end + 31) / 32);
  int* tot = reinterpret_cast<int*>(bits + ceil_div(s.Lk, 32));
  const int need = k - m.nin;
  const std::int32_t* urow = p.und + row * kUndCap;
  if (need < m.nund) {
    const float sq = tensor_scale(p.prec, p.amax), sk = tensor_scale(p.prec, p.amax + 1);
    const bool bf = p.prec == static_cast<int>(Prec::bf16);
    const __nv_bfloat16* qrow = p.qc + row * s.HI * s.Dp;
    for (int e = tid; e < HI * Di; e += kResolveThreads) {
      const int j = e / Di, d = e % Di;
      const float c = __bfloat162float(qrow[j * s.Dp + d]);
      qv[j * pitch + d] = static_cast<double>(bf ? c : __fmul_rn(c, sq));
    }
    for (int j = tid; j < HI; j += kResolveThreads) wv[j] = static_cast<double>(p.w[b * p.ws0 + t * p.ws1 + j * p.ws2]);
    const int hj = tid % kMaxHeads, grp = tid / kMaxHeads;
    for (int u0 = 0; u0 < m.nund; u0 += kResolveKeys) {
      const int nb = imin(kResolveKeys, m.nund - u0);
      __syncthreads();  // qv, wv ready; the previous batch's readers of kv and dots are done
      for (int e = tid; e < nb * Di; e += kResolveThreads) {
        const int r = e / Di, d = e % Di;
        const float c = __bfloat162float(p.kc[(b * s.Lk + urow[u0 + r]) * s.Dp + d]);
        kv[r * pitch + d] = static_cast<double>(bf ? c : __fmul_rn(c, sk));
      }
      __syncthreads();
      if (hj < HI) {
        // Keys grp, grp + 4, grp + 8, grp + 12 of the batch against head hj, four chains in d order.
        const double* qr = qv + hj * pitch;
        double acc[kResolveItems];
#pragma unroll
        for (int i = 0; i < kResolveItems; ++i) acc[i] = 0.0;
        for (int d = 0; d < Di; ++d) {
          const double x = qr[d];
#pragma unroll
          for (int i = 0; i < kResolveItems; ++i)
            acc[i] = fma(x, kv[(grp + kResolveGroups * i) * pitch + d], acc[i]);
        }
#pragma unroll
        for (int i = 0; i < kResolveItems; ++i) {
          const int r = grp + kResolveGroups * i;
          if (r < nb) dots[r * HI + hj] = acc[i];
        }
      }
      __syncthreads();
      if (tid < nb) {
        double a = 0.0;
        for (int j = 0; j < HI; ++j) a = fma(wv[j], fmax(0.0, dots[tid * HI + j]), a);
        usc[u0 + tid] = sel::sanitize(a);
        uid[u0 + tid] = urow[u0 + tid];
      }
    }
    const int nu = next_pow2(m.nund);
    for (int i = m.nund + tid; i < nu; i += kResolveThreads) usc[i] = -INFINITY, uid[i] = 0x7fffffff;
    __syncthreads();
    bitonic_rank_sort(usc, uid, nu);
  } else {
    for (int i = tid; i < m.nund; i += kResolveThreads) uid[i] = urow[i];
  }
  // The list: IN (group 0 of the output row, written by the screen) and the best `need` undecided keys.
  for (int i = tid; i < words; i += kResolveThreads) bits[i] = 0u;
  __syncthreads();
  const std::int32_t* orow = p.out.row(b, 0, t);
  for (int i = tid; i < k; i += kResolveThreads) {
    const int id = i < m.nin ? orow[static_cast<std::int64_t>(i) * p.out.s3] : uid[i - m.nin];
    atomicOr(bits + id / 32, 1u << (id % 32));
  }
  __syncthreads();
  const int chunk = (words + kResolveThreads - 1) / kResolveThreads;
  const int lo = imin(words, tid * chunk), hi = imin(words, lo + chunk);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += __popc(bits[i]);
  int total = 0;
  int pos = block_exclusive_scan(mine, tot, total);
  for (int i = lo; i < hi; ++i)
    for (unsigned x = bits[i]; x != 0u; x &= x - 1u, ++pos) {
      const int id = 32 * i + __ffs(x) - 1;
      for (std::int64_t g = 0; g < p.out.G; ++g) p.out.row(b, g, t)[static_cast<std::int64_t>(pos) * p.out.s3] = id;
    }
  for (std::int64_t g = 0; g < p.out.G; ++g)
    for (std::int64_t sl = k + tid; sl < p.out.width; sl += kResolveThreads) p.out.row(b, g, t)[sl * p.out.s3] = -1;
}

// ---- 5. float64 streaming fallback -----------------------------------------------------------------------

std::size_t fallback_smem(std::int64_t HI, std::int64_t Di, int top_k) {
  return align8(row_common_bytes(HI, Di)) + static_cast<std::size_t>(next_pow2(top_k + kRowThreads)) * 12;
}

// grid: B * Lq rows; rows with status kFallback (or all). Exact scores of the visible keys, 128 at a time,
// appended to a buffer of N = next_pow2(k + 128) entries; when the next batch would not fit, a bitonic sort in
// rank order keeps the first k. At the end the best min(k, n) ids are sorted and written.
__global__ void __launch_bounds__(kRowThreads) fallback_kernel(const RowParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Shape& s = p.s;
  const std::int64_t row = blockIdx.x, b = row / s.Lq, t = row % s.Lq;
  if (!p.all && p.meta[row].status != kFallback) return;
  if (p.all && p.stats && threadIdx.x == 0) atomicAdd(p.stats + 2, 1ull);
  const int HI = static_cast<int>(s.HI), Di = static_cast<int>(s.Di), k = p.top_k, tid = threadIdx.x;
  float* qv = reinterpret_cast<float*>(smem);
  double* wv = reinterpret_cast<double*>(qv + HI * Di);
  float* kb = reinterpret_cast<float*>(wv + HI);
  const int N = next_pow2(k + kRowThreads);
  double* bsc = reinterpret_cast<double*>(smem + align8(row_common_bytes(HI, Di)));
  int* bid = reinterpret_cast<int*>(bsc + N);
  const float sq = tensor_scale(p.prec, p.amax), sk = tensor_scale(p.prec, p.amax + 1);
  load_query(p, b, t, false, sq, qv, Di, wv);
  const std::int64_t end = s.key_end(t);
  int n = 0;
  for (std::int64_t k0 = 0; k0 < end; k0 += kRowThreads) {
    const int nb = static_cast<int>(imin<std::int64_t>(kRowThreads, end - k0));
    __syncthreads();  // qv, wv ready; kb and the buffer are free
    if (n + nb > N) {
      for (int i = n + tid; i < N; i += kRowThreads) bsc[i] = -INFINITY, bid[i] = 0x7fffffff;
      __syncthreads();
      bitonic_rank_sort(bsc, bid, N);
      n = k;
    }
    for (int e = tid; e < nb * Di; e += kRowThreads) {
      const int r = e / Di, d = e % Di;
      kb[r * (Di + 1) + d] = raw_value(p.ksrc, p.kt, p.prec, sk, p.ksrc.offset(b * s.Lk + k0 + r) + d);
    }
    __syncthreads();
    if (tid < nb) {
      bsc[n + tid] = exact_score(qv, wv, kb + tid * (Di + 1), HI, Di);
      bid[n + tid] = static_cast<int>(k0 + tid);
    }
    n += nb;
  }
  __syncthreads();
  if (n > k) {
    for (int i = n + tid; i < N; i += kRowThreads) bsc[i] = -INFINITY, bid[i] = 0x7fffffff;
    __syncthreads();
    bitonic_rank_sort(bsc, bid, N);
    n = k;
  }
  // The kept ids, ascending: sort the first next_pow2(n) slots (padding sorts last).
  const int P = next_pow2(imax(n, 1));
  for (int i = n + tid; i < P; i += kRowThreads) bid[i] = 0x7fffffff;
  __syncthreads();
  bitonic_sort_ints(bid, P);
  write_row(p.out, b, t, bid, n);
}

}  // namespace

void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const TokenLists& out,
                      const LightningOptions& o, const detail::SelectorTuning& tuning) {
  const std::string op = "lightning_select";
  const std::int64_t B = qI.shape[0], Lq = qI.shape[1], HI = qI.shape[2], Di = qI.shape[3], Lk = kI.shape[1];
  const auto stream = static_cast<cudaStream_t>(o.stream);
  const int max_smem = sel::usable_device_smem(op, "qI", qI);
  sel::check_device_memory(op, "qI", qI);
  sel::check_device_memory(op, "w", w);
  sel::check_device_memory(op, "kI", kI);
  sel::check_device_memory(op, "out.idx", out.idx);
  if (B > 65535)  // the screening grid's y extent
    throw Error(op, "qI", "batch " + std::to_string(B) + " exceeds the CUDA lightning selector's limit of 65535");
  if (B * Lq > 0x7fffffffLL || Lk > 0x7fffffffLL)
    throw Error(op, "qI", "B * Lq = " + std::to_string(B * Lq) + " rows exceed the CUDA lightning selector's grid");
  const int k = o.top_k;
  const int prec = o.precision == IndexPrecision::bf16 ? static_cast<int>(Prec::bf16) : static_cast<int>(Prec::fp8);

  // Screening kernel geometry: KS k-steps (Dp = 16 KS), and the most queries per CTA whose candidate buffers
  // hold at least top_k + kMinSlack keys.
  const int KS = Di <= 32 ? 2 : Di <= 64 ? 4 : 8;
  const int halves = KS <= 4 ? 1 : 2;
  int nw = 0, cap = 0;
  bool wgmma = false;
  const int cap_limit = tuning.lightning_capacity;
  const bool shape_ok = HI <= kMaxHeads && Di <= kMaxDi && !tuning.lightning_fallback_only;
  if (shape_ok && tuning.lightning_screen == detail::LightningScreen::automatic) {
    const std::size_t fixed = screen_wg_smem(halves, 0);
    if (fixed < static_cast<std::size_t>(max_smem)) {
      const int c = static_cast<int>((static_cast<std::size_t>(max_smem) - fixed) / (kWgQueries * 8)) / 32 * 32;
      if (c >= k + kMinSlackWg) {
        wgmma = true, nw = 8, cap = c;
        // Buffers stay multiples of 32 entries: the compaction reads them as float4 / int4.
        if (cap_limit > 0) cap = std::min(cap, (std::max(cap_limit, k + kMinSlackWg) + 31) / 32 * 32);
      }
    }
  }
  if (shape_ok && !wgmma) {
    for (int cand = kMaxWarps; cand >= 1; cand /= 2) {
      const std::size_t fixed = screen_smem(KS, cand, 0);
      if (fixed >= static_cast<std::size_t>(max_smem)) continue;
      int c = static_cast<int>((static_cast<std::size_t>(max_smem) - fixed) / (static_cast<std::size_t>(cand) * 8));
      c = c / 32 * 32;
      if (c >= k + kMinSlack) {
        nw = cand, cap = c;
        break;
      }
    }
    if (nw > 0 && cap_limit > 0) cap = std::min(cap, (std::max(cap_limit, k + kMinSlack) + 31) / 32 * 32);
  }
  const bool screen = nw > 0;
  const std::size_t rsmem = resolve_smem(HI, Di, Lk), fsmem = fallback_smem(HI, Di, k);
  if (fsmem > static_cast<std::size_t>(max_smem))
    throw Error(op, "options.top_k",
                "top_k = " + std::to_string(k) + " with HI x Di = " + std::to_string(HI) + " x " + std::to_string(Di) +
                    " index heads exceeds the CUDA lightning selector's shared memory");
  if (screen && rsmem > static_cast<std::size_t>(max_smem))
    throw Error(op, "kI", "Lk = " + std::to_string(Lk) + " keys exceed the CUDA lightning selector's shared-memory key bitmap");

  const std::int64_t Dp = 16 * KS, Tq128 = ceil_div(Lq, kBlockK), Tk128 = ceil_div(Lk, kBlockK);
  const std::size_t a_bytes = align_up(2 * sizeof(unsigned));
  const std::size_t meta_bytes = align_up(static_cast<std::size_t>(B * Lq) * sizeof(RowMeta));
  std::size_t qc_bytes = 0, qn_bytes = 0, qg_bytes = 0, kc_bytes = 0, kn_bytes = 0, kg_bytes = 0, u_bytes = 0;
  if (screen) {
    qc_bytes = align_up(static_cast<std::size_t>(B * Lq * HI * Dp) * 2);
    qn_bytes = align_up(static_cast<std::size_t>(B * Lq * HI) * 4);
    qg_bytes = align_up(static_cast<std::size_t>(B * HI * Tq128) * 4);
    kc_bytes = align_up(static_cast<std::size_t>(B * Lk * Dp) * 2);
    kn_bytes = align_up(static_cast<std::size_t>(B * Lk) * 4);
    kg_bytes = align_up(static_cast<std::size_t>(B * Tk128) * 4);
    u_bytes = align_up(static_cast<std::size_t>(B * Lq) * kUndCap * 4);
  }
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += bytes;
    return at;
  };
  const std::size_t o_amax = take(a_bytes), o_meta = take(meta_bytes), o_qg = take(qg_bytes), o_kg = take(kg_bytes),
                    o_qc = take(qc_bytes), o_qn = take(qn_bytes), o_kc = take(kc_bytes), o_kn = take(kn_bytes),
                    o_u = take(u_bytes);
  StreamScratch scratch(off, stream, op);
  auto* amax = scratch.as<unsigned>(o_amax);
  auto* meta = scratch.as<RowMeta>(o_meta);
  // amax words and the group maxima (atomicMax on float bits) start at zero.
  check_cuda(cudaMemsetAsync(amax, 0, o_qc - o_amax, stream), op, "cudaMemsetAsync");

  OutRows orows{out.idx.ptr<std::int32_t>(), out.idx.stride[0], out.idx.stride[1], out.idx.stride[2],
                out.idx.stride[3], out.idx.shape[1], out.idx.shape[3]};
  Shape shp{B, Lq, Lk, HI, Di, Dp, o.causal};

  if (screen) {
    launch_prepare_pair(qI, kI, o.precision, amax,
                        PrepOut{scratch.as<__nv_bfloat16>(o_qc), scratch.as<float>(o_qn), scratch.as<unsigned>(o_qg), Dp},
                        PrepOut{scratch.as<__nv_bfloat16>(o_kc), scratch.as<float>(o_kn), scratch.as<unsigned>(o_kg), Dp},
                        stream, op);
    ScreenParams sp{};
    sp.qc = scratch.as<__nv_bfloat16>(o_qc), sp.qn = scratch.as<float>(o_qn);
    sp.kc = scratch.as<__nv_bfloat16>(o_kc), sp.kgmax = scratch.as<unsigned>(o_kg);
    sp.w = w.ptr<float>(), sp.ws0 = w.stride[0], sp.ws1 = w.stride[1], sp.ws2 = w.stride[2];
    sp.amax = amax, sp.prec = prec, sp.s = shp, sp.out = orows, sp.meta = meta, sp.und = scratch.as<std::int32_t>(o_u);
    sp.top_k = k, sp.cap = cap, sp.stats = tuning.lightning_counters;
    sp.deq = bound_consts(Di, Dp).deq;
    const std::size_t smem = wgmma ? screen_wg_smem(halves, cap) : screen_smem(KS, nw, cap);
    const int per_cta = wgmma ? kWgQueries : nw;
    const dim3 grid(static_cast<unsigned>(ceil_div(Lq, per_cta)), static_cast<unsigned>(B));
    auto go = [&](auto kernel) {
      check_cuda(cuda_kernels::launch_with_smem(kernel, smem, [&] { kernel<<<grid, nw * 32, smem, stream>>>(sp); }),
                 op, "screen kernel launch");
    };
    if (wgmma) {
      if (halves == 1) go(screen_wgmma_kernel<1>);
      else go(screen_wgmma_kernel<2>);
    } else if (KS == 2) {
      go(screen_kernel<2>);
    } else if (KS == 4) {
      go(screen_kernel<4>);
    } else {
      go(screen_kernel<8>);
    }
  } else if (o.precision != IndexPrecision::bf16) {
    launch_amax_pair(qI, &kI, amax, stream);
  }

  RowParams rp{};
  rp.qc = screen ? scratch.as<__nv_bfloat16>(o_qc) : nullptr;
  rp.kc = screen ? scratch.as<__nv_bfloat16>(o_kc) : nullptr;
  rp.qsrc = index_src(qI), rp.ksrc = index_src(kI);
  rp.qt = sel::in_type(qI.dtype), rp.kt = sel::in_type(kI.dtype);
  rp.w = w.ptr<float>(), rp.ws0 = w.stride[0], rp.ws1 = w.stride[1], rp.ws2 = w.stride[2];
  rp.amax = amax, rp.prec = prec, rp.s = shp, rp.out = orows, rp.meta = meta;
  rp.und = screen ? scratch.as<std::int32_t>(o_u) : nullptr;
  rp.top_k = k, rp.all = !screen, rp.stats = tuning.lightning_counters;
  const auto rows = static_cast<unsigned>(B * Lq);
  if (screen)
    check_cuda(cuda_kernels::launch_with_smem(resolve_kernel, rsmem,
                                              [&] { resolve_kernel<<<rows, kResolveThreads, rsmem, stream>>>(rp); }),
               op, "resolve kernel launch");
  check_cuda(cuda_kernels::launch_with_smem(fallback_kernel, fsmem,
                                            [&] { fallback_kernel<<<rows, kRowThreads, fsmem, stream>>>(rp); }),
             op, "kernel launch");
}

}  // namespace sparse_attn::cuda_backend
