// The selection step shared by the CUDA selectors: the rank order as one 64-bit key, a group of threads
// that selects together (a CTA or a warpgroup set with its named barrier), the k-th largest key by a radix
// select, and the top-k of a list of candidates written as ascending ids. pooled.cu (R1 / R4), token_max.cu
// and lightning.cu rank with these, so every selector breaks ties the same way: a higher score first, then
// the lower id; NaN as -inf and -0 as +0, as the CPU's comparisons (detail::sanitize) do.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/sync.cuh"
#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend::sel {

using u64 = unsigned long long;

constexpr int kHist = 256;  // radix digit of the selection: 8 bits a pass

/// NaN -> -inf, -0 -> +0: the CPU compares -0 and +0 equal, so they must tie on the id.
__device__ __forceinline__ float sanitize(float s) { return isnan(s) ? -INFINITY : (s == 0.0f ? 0.0f : s); }

/// The rank order as one unsigned key: a larger key ranks first (higher score, then lower id). The score's
/// order key in the high word (order_key), the id's complement in the low one: distinct ids give distinct
/// keys. The caller sanitises the score.
__device__ __forceinline__ u64 rank_key_of(std::uint32_t score_key, std::int64_t id) {
  return (static_cast<u64>(score_key) << 32) | (0xffffffffu - static_cast<unsigned>(id));
}
__device__ __forceinline__ u64 rank_key(float s, std::int64_t id) { return rank_key_of(order_key(s), id); }
/// The score key of a forced candidate (a sink, a reserved local block): above every sanitised score's order key,
/// +inf's included; forced candidates tie among themselves and go by id.
constexpr std::uint32_t kForcedKey = 0xffffffffu;
__device__ __forceinline__ int key_id(u64 k) { return static_cast<int>(0xffffffffu - static_cast<unsigned>(k)); }

/// Candidate i's key: a[i] of an array of keys, or key_at(key, i) of a function of the id.
template <class Keys>
__device__ __forceinline__ u64 key_at(const Keys& keys, int i) {
  if constexpr (std::is_pointer_v<Keys>) return keys[i];
  else return keys(i);
}

/// kThreads threads (whole warps, `tid` 0 .. kThreads - 1) that select together, meeting at `bar` (the whole
/// CTA when it is NamedBarrier::kSync and kThreads is the block size), with kScratchWords words of shared
/// memory at `hist`: the radix histogram (kHist), the chosen digit [3], a found key (8-byte aligned), per-warp
/// counts [2][kWarps] and per-warp extremes [2][kWarps] (u64).
template <int kThreadsT>
struct Group {
  static constexpr int kThreads = kThreadsT;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kScratchWords = kHist + 8 + 6 * kWarps;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "a group is whole warps, at most 32");
  int tid;
  cuda_kernels::NamedBarrier bar;
  unsigned* hist;  // kScratchWords words, 8-byte aligned
  __device__ void sync() const { cuda_kernels::named_barrier_sync(bar, kThreads); }
  __device__ unsigned* digit() const { return hist + kHist; }                                  // [3]
  __device__ u64* found() const { return reinterpret_cast<u64*>(hist + kHist + 4); }           // 8-byte aligned
  __device__ int* warp_counts() const { return reinterpret_cast<int*>(hist + kHist + 8); }     // [2][kWarps]
  __device__ u64* warp_extremes() const { return reinterpret_cast<u64*>(hist + kHist + 8 + 2 * kWarps); }  // [2][kWarps]
};

/// The k-th largest of the (distinct) keys of candidates 0 .. n - 1 (1 <= k <= n), by the whole group: radix
/// select, 8 bits a pass from the highest bit in which the largest and the smallest key differ (the bits
/// above are every key's: the sign and exponent of scores of a few binades), ending as soon as the prefix
/// holds one key. Each warp adds to the shared histogram once per distinct digit among its lanes
/// (__match_any_sync), so that keys crowding one digit do not serialise on one shared-memory word.
/// `key_at(key, i)` is read several times: an array element or a few instructions.
template <class G, class Keys>
__device__ u64 group_kth_key(const G& gr, const Keys& key, int n, int k) {
  const int lane = gr.tid % 32, w = gr.tid / 32, wbase = gr.tid - lane;
  u64 hi = 0ull, lo = ~0ull;
  for (int i = gr.tid; i < n; i += G::kThreads) {
    const u64 a = key_at(key, i);
    hi = a > hi ? a : hi, lo = a < lo ? a : lo;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const u64 h = __shfl_xor_sync(0xffffffffu, hi, o), l = __shfl_xor_sync(0xffffffffu, lo, o);
    hi = h > hi ? h : hi, lo = l < lo ? l : lo;
  }
  if (lane == 0) gr.warp_extremes()[w] = hi, gr.warp_extremes()[G::kWarps + w] = lo;
  gr.sync();
  for (int u = 0; u < G::kWarps; ++u) {
    const u64 h = gr.warp_extremes()[u], l = gr.warp_extremes()[G::kWarps + u];
    hi = h > hi ? h : hi, lo = l < lo ? l : lo;
  }
  if (hi == lo) return hi;  // n = 1
  const int top = 64 - __clzll(static_cast<long long>(hi ^ lo));  // bits [top, 64) are every key's
  u64 mask = top == 64 ? 0ull : ~0ull << top, prefix = hi & mask;
  int kk = k;
  for (int bits_left = top; bits_left > 0;) {
    const int width = bits_left < 8 ? bits_left : 8, shift = bits_left - width;
    bits_left = shift;
    for (int i = gr.tid; i < kHist; i += G::kThreads) gr.hist[i] = 0u;
    gr.sync();
    for (int base = wbase; base < n; base += G::kThreads) {  // whole warps, so the match covers its lanes
      const int i = base + lane;
      const u64 v = i < n ? key_at(key, i) : 0ull;
      const bool in = i < n && (v & mask) == prefix;
      const unsigned active = __ballot_sync(0xffffffffu, in);
      if (in) {
        const unsigned dig = static_cast<unsigned>(v >> shift) & ((1u << width) - 1u);
        const unsigned peers = __match_any_sync(active, dig);
        if (lane == __ffs(peers) - 1) atomicAdd(&gr.hist[dig], static_cast<unsigned>(__popc(peers)));
      }
    }
    gr.sync();
    if (gr.tid < 32) {
      // Lane l owns digits [8 l, 8 l + 8); suffix sums over lanes find the digit holding the kk-th largest.
      unsigned c[8], local = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) local += (c[i] = gr.hist[8 * lane + i]);
      unsigned suffix = local;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned y = __shfl_down_sync(0xffffffffu, suffix, o);
        if (lane + o < 32) suffix += y;
      }
      const unsigned above = suffix - local;
      if (above < static_cast<unsigned>(kk) && static_cast<unsigned>(kk) <= suffix) {
        unsigned acc = above;
        for (int i = 7; i >= 0; --i) {
          if (acc + c[i] >= static_cast<unsigned>(kk)) {
            gr.digit()[0] = 8 * lane + i, gr.digit()[1] = kk - acc, gr.digit()[2] = c[i];
            break;
          }
          acc += c[i];
        }
      }
    }
    gr.sync();
    prefix |= static_cast<u64>(gr.digit()[0]) << shift;
    mask |= ((1ull << width) - 1ull) << shift;
    kk = static_cast<int>(gr.digit()[1]);
    if (gr.digit()[2] == 1u) break;  // uniform: every thread read the same words
  }
  if (mask == ~0ull) return prefix;
  // One key carries the prefix; its holder publishes it.
  for (int i = gr.tid; i < n; i += G::kThreads) {
    const u64 a = key_at(key, i);
    if ((a & mask) == prefix) *gr.found() = a;
  }
  gr.sync();
  return *gr.found();
}

/// Exclusive scan of v over the group in thread order; `total` gets the sum (every thread). Every thread of the
/// group calls it; the per-warp counts are free again when it returns.
template <class G>
__device__ __forceinline__ int group_exclusive_scan(const G& gr, int v, int& total) {
  const int lane = gr.tid % 32, warp = gr.tid / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  if (lane == 31) gr.warp_counts()[warp] = incl;
  gr.sync();
  int before = 0;
  total = 0;
  for (int u = 0; u < G::kWarps; ++u) {
    const int c = gr.warp_counts()[u];
    before += u < warp ? c : 0;
    total += c;
  }
  gr.sync();
  return before + incl - v;
}

/// Top-k of the candidates 0 .. n - 1 by their distinct rank keys (key_at; rank_key / rank_key_of of id j): the
/// min(k, n) kept ids ascending to row[s * stride], -1 after them up to `width`; returns the count (every
/// thread). Up to one candidate per thread, candidate c's count of the keys above its own is split over
/// `shares` adjacent lanes (the largest power of two, at most 32, with shares x n <= the group's threads) and
/// added by shuffles, and c is kept if fewer than k are: one pass, one scan. More candidates: the k-th largest
/// key by group_kth_key, then each thread keeps the keys at or above it in its contiguous run of ids. The
/// kept set is a function of the keys alone, the same bits in any run.
template <class G, class Keys>
__device__ int group_top_k(const G& gr, const Keys& key, int n, int k, std::int32_t* row, std::int64_t stride,
                           std::int64_t width) {
  int total = 0;
  if (k > 0 && k < n && n <= G::kThreads) {
    int log_shares = 0;
    while (log_shares < 5 && (n << (log_shares + 1)) <= G::kThreads) ++log_shares;
    const int shares = 1 << log_shares, c = gr.tid >> log_shares, share = gr.tid & (shares - 1);
    int above = 0;
    if (c < n) {
      const u64 mine = key_at(key, c);
      const int lo = share * n >> log_shares, hi = (share + 1) * n >> log_shares;
#pragma unroll 8
      for (int i = lo; i < hi; ++i) above += key_at(key, i) > mine ? 1 : 0;
    }
    for (int o = 1; o < shares; o <<= 1) above += __shfl_xor_sync(0xffffffffu, above, o);
    const bool keep = c < n && share == 0 && above < k;
    const int pos = group_exclusive_scan(gr, keep ? 1 : 0, total);
    if (keep) row[static_cast<std::int64_t>(pos) * stride] = c;
  } else if (k > 0 && n > 0) {
    const u64 thr = k < n ? group_kth_key(gr, key, n, k) : 0ull;  // k >= n: every key is >= 0
    const int chunk = (n + G::kThreads - 1) / G::kThreads;
    const int lo = imin(n, gr.tid * chunk), hi = imin(n, lo + chunk);
    int kept = 0;
    for (int j = lo; j < hi; ++j) kept += key_at(key, j) >= thr ? 1 : 0;
    int pos = group_exclusive_scan(gr, kept, total);
    for (int j = lo; j < hi; ++j)
      if (key_at(key, j) >= thr) row[static_cast<std::int64_t>(pos++) * stride] = j;
  }
  for (std::int64_t s = total + gr.tid; s < width; s += G::kThreads) row[s * stride] = -1;
  return total;
}

}  // namespace sparse_attn::cuda_backend::sel
