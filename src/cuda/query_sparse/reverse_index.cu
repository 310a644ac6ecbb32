// Phase 1 of query_sparse: validation of the lists and the reverse index (CSR per (b, group, bin))
// with its work items. A bin is a KV block, or (Params::bands > 1) a KV block within a band of
// queries, bin = band * Tk + block, so that the work items, written in bin order, walk a (b, group)
// band by band; or with merged slots a piece (below).
//
// The reverse index is a counting sort of each (b, group)'s slots by bin, in three launches:
//   zero:  the bin counters and the count kernel's arrival counter (offsets[nblk]).
//   count: one CTA per chunk of one (b, group)'s slots builds the chunk's histogram over the bins
//          in shared memory, then adds each non-zero bin to its global counter with one
//          atomic; the last CTA to arrive scans the counters into entry and item offsets and turns
//          the counters into fill cursors.
//   fill:  every CTA recounts its chunk, reserves one range per non-zero bin with one global atomic,
//          sorts its entries by bin in shared memory and writes each bin's run out contiguously;
//          the CTAs together also write the work items.
// Per-slot global atomics (the seed's count and fill) put the whole selection's contention on
// B * Hkv * bins L2 addresses; the shared histograms leave about one global atomic per bin and CTA.
// When the staging does not fit, entries are stored straight from the shared cursors, and with more
// than kHistBins bins per (b, group) (no shared histogram) the kernels fall back to per-slot global
// atomics. Entry order inside a bin's list depends on which CTA reserves first; the attend and combine
// phases do not depend on it (backend.hpp).
//
// With merged slots (Params::win > 1) a fourth launch comes first: `merge` writes each query's
// pieces (its visible blocks grouped by window) as bins into the merged lists, and the counting sort
// above runs over those lists and bins (index_view) instead of the blocks.
#include <cuda_runtime.h>

#include "cuda/common/smem_limit.hpp"
#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"

namespace sparse_attn::cuda_kernels::qs {
namespace {

constexpr int kIndexThreads = 256;
// Slots each thread loads before it counts them: 16 independent 4-byte loads in flight per thread
// hide the DRAM latency of the idx stream.
constexpr int kSlotsPerThread = 16;
constexpr int kRoundSlots = kIndexThreads * kSlotsPerThread;
// Eight CTAs of 256 threads fill an SM: query-long's 1024 count CTAs then run in one wave, so each
// CTA's latency chain (loads, histogram, atomics, fence, arrival) is paid once. The 32 registers
// this leaves make the last CTA's scan spill a few words; no other CTA runs that code.
constexpr int kIndexCtasPerSm = 8;
// 48 KB of int bins (with an opt-in past 48 KB less the kernel's static shared memory), i.e. rows of
// up to 1.5 M keys.
constexpr int kHistBins = 12 * 1024;
constexpr int kScanPer = 8;  // counters per thread and scan tile
// The staged fill's shared memory: 34 KB for query-long's 256 bins and 4096-slot chunks (six CTAs
// per SM); up to 96 KB (Tk around 2000) before it falls back to storing entries from the cursors.
constexpr std::size_t kStagedSmem = 96 * 1024;

// One thread per row; the minimum of (entry position << 1 | code) is the first offending slot in
// row-major order.
__global__ void validate_kernel(Params p) {
  const long long rows = static_cast<long long>(p.B) * p.Hkv * p.Lq;
  for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = r % p.Lq, bg = r / p.Lq;
    const std::int32_t* row =
        p.idx + (bg / p.Hkv) * p.idx_stride[0] + (bg % p.Hkv) * p.idx_stride[1] + i * p.idx_stride[2];
    for (int s = 0; s < p.Kq; ++s) {
      const int j = row[s * p.idx_stride[3]];
      const unsigned long long pos = static_cast<unsigned long long>(r * p.Kq + s) << 1;
      if (j < -1 || j >= p.Tk) {
        atomicMin(p.bad, pos | kBadRange);
        break;
      }
      bool dup = false;
      for (int s2 = 0; s2 < s && j != -1 && !dup; ++s2) dup = row[s2 * p.idx_stride[3]] == j;
      if (dup) {
        atomicMin(p.bad, pos | kBadDuplicate);
        break;
      }
    }
  }
}

// One thread per slot: the slot's piece bin if it is the first chosen slot of its window, else -1.
// Each thread reads its query's whole row (Kq loads, from L1 after the first thread of the row), so
// the cost grows with Kq^2 per query; merge_window.hpp keeps Kq small enough.
__global__ void merge_kernel(const __grid_constant__ Params p) {
  const long long slots = p.slots;
  for (long long f = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; f < slots;
       f += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int s = static_cast<int>(f % p.Kq);
    const long long r = f / p.Kq;
    const int i = static_cast<int>(r % p.Lq);
    const long long bg = r / p.Lq;
    const std::int32_t* row =
        p.idx + (bg / p.Hkv) * p.idx_stride[0] + (bg % p.Hkv) * p.idx_stride[1] + i * p.idx_stride[2];
    const int j = row[static_cast<long long>(s) * p.idx_stride[3]];
    int out = -1;
    if (chosen(p, i, j)) {
      const int w = j / p.win, lo = w * p.win;
      unsigned mask = 0;
      bool first = true;
      for (int t = 0; t < p.Kq; ++t) {
        const int jt = row[static_cast<long long>(t) * p.idx_stride[3]];
        if (jt < lo || jt >= lo + p.win || !chosen(p, i, jt)) continue;
        mask |= 1u << (jt - lo);
        first = first && t >= s;
      }
      if (first) out = (w << p.win) | static_cast<int>(mask);
    }
    p.merged[f] = out;
  }
}

// The CTA's share of the slots: chunk `chunk` of row group bg, slots [lo, hi) of the bg's Lq * Kq
// (query-major, as `entries` encodes them: query * Kq + slot). Lq * Kq fits in an int (checked on
// the host), so the per-slot division is 32-bit.
struct Chunk {
  long long bg = 0;
  int lo = 0, hi = 0;
  const std::int32_t* idx = nullptr;  // the bg's [Lq, Kq] lists
};

__device__ __forceinline__ Chunk chunk_of(const Params& p, int chunk, int ctas_per_bg) {
  Chunk c;
  c.bg = blockIdx.x / ctas_per_bg;
  if (c.bg >= static_cast<long long>(p.B) * p.Hkv) return c;  // the one CTA of a problem without rows
  const long long per_bg = static_cast<long long>(p.Lq) * p.Kq;
  const long long lo = static_cast<long long>(blockIdx.x % ctas_per_bg) * chunk;
  c.lo = static_cast<int>(lo < per_bg ? lo : per_bg);
  c.hi = static_cast<int>(lo + chunk < per_bg ? lo + chunk : per_bg);
  c.idx = p.idx + (c.bg / p.Hkv) * p.idx_stride[0] + (c.bg % p.Hkv) * p.idx_stride[1];
  return c;
}

// f(query, slot, bin) for every chosen slot of the chunk (the bin: its block, in its query band).
// Each round loads kSlotsPerThread slots per thread (consecutive threads, consecutive slots:
// coalesced for contiguous lists) before handing any to f, so the loads are in flight together.
template <class F>
__device__ __forceinline__ void for_each_chosen(const Params& p, const Chunk& c, F&& f) {
  const unsigned kq = static_cast<unsigned>(p.Kq);
  for (long long base = c.lo; base < c.hi; base += kRoundSlots) {
    // Only the block ids stay live between the loads and their use (the query and slot are
    // recomputed), which keeps the kernels near 32 registers and eight CTAs per SM.
    int blk[kSlotsPerThread];
#pragma unroll
    for (int u = 0; u < kSlotsPerThread; ++u) {
      const long long fl = base + u * kIndexThreads + threadIdx.x;
      blk[u] = -1;
      if (fl < c.hi) {
        const unsigned f32 = static_cast<unsigned>(fl), qi = f32 / kq;
        blk[u] = c.idx[qi * p.idx_stride[2] + (f32 - qi * kq) * p.idx_stride[3]];
      }
    }
#pragma unroll
    for (int u = 0; u < kSlotsPerThread; ++u) {
      if (blk[u] < 0) continue;
      const unsigned f32 = static_cast<unsigned>(base + u * kIndexThreads + threadIdx.x), qi = f32 / kq;
      if (!chosen(p, static_cast<int>(qi), blk[u])) continue;
      const int bin =
          p.bands > 1 ? blk[u] + static_cast<int>(qi / static_cast<unsigned>(p.band_queries)) * p.Tk : blk[u];
      f(static_cast<int>(qi), static_cast<int>(f32 - qi * kq), bin);
    }
  }
}

// Exclusive prefix sums over the CTA's threads, in thread order, of two values at once; `tot_*`
// receive the CTA's totals. Every thread of the CTA must call it (it holds two barriers).
__device__ __forceinline__ void cta_exclusive_scan(int& a, int& b, int& tot_a, int& tot_b) {
  __shared__ int warp_a[kIndexThreads / 32], warp_b[kIndexThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int ia = a, ib = b;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int va = __shfl_up_sync(0xffffffffu, ia, off), vb = __shfl_up_sync(0xffffffffu, ib, off);
    if (lane >= off) ia += va, ib += vb;
  }
  if (lane == 31) warp_a[warp] = ia, warp_b[warp] = ib;
  __syncthreads();
  int ba = 0, bb = 0;
  tot_a = 0, tot_b = 0;
  for (int w = 0; w < kIndexThreads / 32; ++w) {
    if (w < warp) ba += warp_a[w], bb += warp_b[w];
    tot_a += warp_a[w], tot_b += warp_b[w];
  }
  __syncthreads();  // the warp totals are rewritten by the next call
  a = ba + ia - a;
  b = bb + ib - b;
}

// Exclusive scan of the counters into entry offsets, item offsets and fill cursors, by one CTA of
// kIndexThreads in tiles of kIndexThreads * kScanPer counters. nblk is B * Hkv * Tk, small next to
// the slots the other CTAs counted, and one CTA keeps the scan free of inter-CTA traffic. Counters
// are read through L2 (__ldcg): other CTAs' atomics put them there. Each thread reads its counters
// twice (sum, then write-out) rather than holding them, which keeps the count kernel within its
// 32 registers.
__device__ void scan_counts(const Params& p) {
  int carry_e = 0, carry_i = 0;
  for (long long t0 = 0; t0 < p.nblk; t0 += kIndexThreads * kScanPer) {
    const long long x0 = t0 + static_cast<long long>(threadIdx.x) * kScanPer;
    const int n = static_cast<int>(p.nblk - x0 < kScanPer ? (p.nblk - x0 > 0 ? p.nblk - x0 : 0) : kScanPer);
    int e = 0, it = 0;
    for (int u = 0; u < n; ++u) {
      const int c = __ldcg(p.counts + x0 + u);
      e += c;
      it += static_cast<int>(items_of(p, c));
    }
    int tot_e, tot_i;
    cta_exclusive_scan(e, it, tot_e, tot_i);
    e += carry_e;
    it += carry_i;
    for (int u = 0; u < n; ++u) {
      const int c = __ldcg(p.counts + x0 + u);
      p.offsets[x0 + u] = e;
      p.item_offsets[x0 + u] = it;
      p.counts[x0 + u] = e;  // the fill cursor of block x0 + u
      e += c;
      it += static_cast<int>(items_of(p, c));
    }
    carry_e += tot_e;
    carry_i += tot_i;
  }
  if (threadIdx.x == 0) {
    p.offsets[p.nblk] = carry_e;
    p.item_offsets[p.nblk] = carry_i;
  }
}

__global__ void zero_kernel(Params p) {
  for (long long x = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; x <= p.nblk;
       x += static_cast<long long>(gridDim.x) * blockDim.x) {
    if (x < p.nblk) p.counts[x] = 0;
    else p.offsets[p.nblk] = 0;  // arrivals of the count kernel's CTAs
  }
  if (blockIdx.x == 0 && threadIdx.x < 2 && p.queue != nullptr) p.queue[threadIdx.x] = 0;
}

template <bool kShared>
__global__ void __launch_bounds__(kIndexThreads, kIndexCtasPerSm) count_kernel(const __grid_constant__ Params p, int chunk,
                                                              int ctas_per_bg) {
  extern __shared__ int hist[];
  __shared__ bool last;
  const Chunk c = chunk_of(p, chunk, ctas_per_bg);
  if (c.idx != nullptr) {
    int* counts = p.counts + c.bg * p.bins;
    if constexpr (kShared) {
      for (int x = threadIdx.x; x < p.bins; x += kIndexThreads) hist[x] = 0;
      __syncthreads();
      for_each_chosen(p, c, [&](int, int, int j) { atomicAdd(hist + j, 1); });
      __syncthreads();
      for (int x = threadIdx.x; x < p.bins; x += kIndexThreads)
        if (hist[x] != 0) atomicAdd(counts + x, hist[x]);
    } else {
      for_each_chosen(p, c, [&](int, int, int j) { atomicAdd(counts + j, 1); });
    }
  }
  // Last-CTA-done: every thread's atomics are ordered before the arrival, and the last CTA's reads
  // after it.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.offsets + p.nblk, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  scan_counts(p);
}

// Every block's work items, one warp per block (a popular block's items are spread over its lanes).
__device__ __forceinline__ void write_items(const Params& p) {
  const long long warps = static_cast<long long>(gridDim.x) * (kIndexThreads / 32);
  const int lane = threadIdx.x % 32;
  for (long long x = blockIdx.x * static_cast<long long>(kIndexThreads / 32) + threadIdx.x / 32; x < p.nblk;
       x += warps) {
    const long long n = items_of(p, p.offsets[x + 1] - p.offsets[x]);
    int2* out = p.items + p.item_offsets[x];
    for (long long t = lane; t < n; t += 32) out[t] = make_int2(static_cast<int>(x), static_cast<int>(t * kRowsPerItem));
  }
}

// How the fill places entries (chosen on the host from Tk and the chunk).
enum class FillMode {
  staged,          // shared cursors, entries staged in shared memory and written out bin by bin
  shared_cursors,  // shared cursors, each entry stored where its cursor points
  global_atomics,  // one global atomic per slot (histogram too large for shared memory)
};

// Shared memory of the staged fill: per bin its local cursor and its global base minus its local
// offset; per chunk slot the entry and its global position.
std::size_t staged_bytes(int Tk, int chunk) {
  return sizeof(int) * (2 * static_cast<std::size_t>(Tk) + 2 * static_cast<std::size_t>(chunk));
}

template <FillMode kMode>
__global__ void __launch_bounds__(kIndexThreads) fill_kernel(const __grid_constant__ Params p, int chunk,
                                                             int ctas_per_bg) {
  extern __shared__ int smem[];
  const Chunk c = chunk_of(p, chunk, ctas_per_bg);
  if (c.idx != nullptr) {
    int* counts = p.counts + c.bg * p.bins;
    if constexpr (kMode == FillMode::staged) {
      // Entries of one bin land in consecutive staging slots, so the write-out stores runs of
      // consecutive entries (a bin's share of the chunk) instead of one 4-byte store per L2 sector.
      int* cursor = smem;
      int* base = smem + p.bins;
      int* val = smem + 2 * p.bins;
      int* pos = val + chunk;
      for (int x = threadIdx.x; x < p.bins; x += kIndexThreads) cursor[x] = 0;
      __syncthreads();
      for_each_chosen(p, c, [&](int, int, int j) { atomicAdd(cursor + j, 1); });
      __syncthreads();
      // Local offsets: thread t scans bins [t * per, (t + 1) * per); the counts wait in base.
      const int per = (p.bins + kIndexThreads - 1) / kIndexThreads;
      const int x0 = threadIdx.x * per, x1 = min(x0 + per, p.bins);
      int off = 0, unused = 0, total = 0, unused_total = 0;
      for (int x = x0; x < x1; ++x) off += cursor[x];
      cta_exclusive_scan(off, unused, total, unused_total);
      for (int x = x0; x < x1; ++x) {
        base[x] = cursor[x];
        cursor[x] = off;
        off += base[x];
      }
      __syncthreads();
      // One reservation per non-zero bin, bins spread over the threads so the atomics overlap.
      for (int x = threadIdx.x; x < p.bins; x += kIndexThreads) {
        const int n = base[x];
        base[x] = n != 0 ? atomicAdd(counts + x, n) - cursor[x] : 0;
      }
      __syncthreads();
      for_each_chosen(p, c, [&](int i, int s, int j) {
        const int r = atomicAdd(cursor + j, 1);
        val[r] = i * p.Kq + s;
        pos[r] = base[j] + r;
      });
      __syncthreads();
      for (int e = threadIdx.x; e < total; e += kIndexThreads) p.entries[pos[e]] = val[e];
    } else if constexpr (kMode == FillMode::shared_cursors) {
      int* cursor = smem;
      for (int x = threadIdx.x; x < p.bins; x += kIndexThreads) cursor[x] = 0;
      __syncthreads();
      for_each_chosen(p, c, [&](int, int, int j) { atomicAdd(cursor + j, 1); });
      __syncthreads();
      for (int x = threadIdx.x; x < p.bins; x += kIndexThreads)
        if (cursor[x] != 0) cursor[x] = atomicAdd(counts + x, cursor[x]);
      __syncthreads();
      for_each_chosen(p, c, [&](int i, int s, int j) { p.entries[atomicAdd(cursor + j, 1)] = i * p.Kq + s; });
    } else {
      for_each_chosen(p, c, [&](int i, int s, int j) { p.entries[atomicAdd(counts + j, 1)] = i * p.Kq + s; });
    }
  }
  write_items(p);
}

int grid_for(long long n, int threads) {
  const long long g = (n + threads - 1) / threads;
  return static_cast<int>(g < 1 ? 1 : (g > 65536 ? 65536 : g));
}

template <FillMode kMode>
cudaError_t launch_fill(const Params& p, int chunk, int ctas_per_bg, unsigned grid, cudaStream_t stream) {
  std::size_t smem = 0;
  if constexpr (kMode == FillMode::staged) smem = staged_bytes(p.bins, chunk);
  if constexpr (kMode == FillMode::shared_cursors) smem = sizeof(int) * static_cast<std::size_t>(p.bins);
  return launch_with_smem(fill_kernel<kMode>, smem,
                          [&] { fill_kernel<kMode><<<grid, kIndexThreads, smem, stream>>>(p, chunk, ctas_per_bg); });
}

}  // namespace

cudaError_t launch_validate(const Params& p, cudaStream_t stream) {
  validate_kernel<<<grid_for(static_cast<long long>(p.B) * p.Hkv * p.Lq, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_reverse_index(const Params& full, cudaStream_t stream) {
  if (full.win > 1) {
    merge_kernel<<<grid_for(full.slots, 256), 256, 0, stream>>>(full);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const Params p = index_view(full);
  zero_kernel<<<grid_for(p.nblk + 1, 256), 256, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  // A chunk of at least 2 * Tk slots keeps the per-CTA histogram work (zero, read, one atomic per
  // non-zero bin) under the chunk's own.
  const long long per_bg = static_cast<long long>(p.Lq) * p.Kq;
  const long long rounds = (2LL * p.bins + kRoundSlots - 1) / kRoundSlots;
  const long long chunk = kRoundSlots * (rounds < 1 ? 1 : rounds);
  long long ctas_per_bg = (per_bg + chunk - 1) / chunk;
  if (ctas_per_bg < 1) ctas_per_bg = 1;
  long long grid = static_cast<long long>(p.B) * p.Hkv * ctas_per_bg;
  if (grid < 1) grid = 1;
  if (grid > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const int ck = static_cast<int>(chunk), cpb = static_cast<int>(ctas_per_bg);
  const auto g = static_cast<unsigned>(grid);
  const bool shared = p.bins <= kHistBins;
  if (shared) {
    const std::size_t hist = sizeof(int) * static_cast<std::size_t>(p.bins);
    e = launch_with_smem(count_kernel<true>, hist, [&] { count_kernel<true><<<g, kIndexThreads, hist, stream>>>(p, ck, cpb); });
  } else {
    count_kernel<false><<<g, kIndexThreads, 0, stream>>>(p, ck, cpb);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return e;
  if (shared && staged_bytes(p.bins, ck) <= kStagedSmem) return launch_fill<FillMode::staged>(p, ck, cpb, g, stream);
  if (shared) return launch_fill<FillMode::shared_cursors>(p, ck, cpb, g, stream);
  return launch_fill<FillMode::global_atomics>(p, ck, cpb, g, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
