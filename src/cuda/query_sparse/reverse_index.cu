// Phase 1 of query_sparse: validation of the lists and the reverse index (CSR per (b, group, KV
// block)) with its work items.
#include <cuda_runtime.h>

#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"

namespace sparse_attn::cuda_kernels::qs {
namespace {

constexpr int kScanThreads = 1024;

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

__global__ void count_kernel(Params p) {
  for (long long f = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; f < p.slots;
       f += static_cast<long long>(gridDim.x) * blockDim.x) {
    int i, s;
    long long bg;
    const int j = slot_block(p, f, i, s, bg);
    if (chosen(p, i, j)) atomicAdd(p.counts + bg * p.Tk + j, 1);
  }
}

// One CTA: each thread scans a contiguous chunk sequentially, the chunk totals are scanned across
// the CTA. nblk is B * Hkv * Tk (thousands), so one CTA is enough and keeps the scan deterministic.
__global__ void __launch_bounds__(kScanThreads) scan_kernel(Params p) {
  __shared__ long long sh_entries[kScanThreads];
  __shared__ long long sh_items[kScanThreads];
  const int t = threadIdx.x;
  const long long per = (p.nblk + kScanThreads - 1) / kScanThreads;
  const long long lo = t * per, hi = lo + per < p.nblk ? lo + per : p.nblk;
  long long se = 0, si = 0;
  for (long long x = lo; x < hi; ++x) {
    const long long c = p.counts[x];
    se += c;
    si += items_of(p, c);
  }
  sh_entries[t] = se;
  sh_items[t] = si;
  __syncthreads();
  for (int off = 1; off < kScanThreads; off <<= 1) {
    const long long ve = t >= off ? sh_entries[t - off] : 0;
    const long long vi = t >= off ? sh_items[t - off] : 0;
    __syncthreads();
    sh_entries[t] += ve;
    sh_items[t] += vi;
    __syncthreads();
  }
  long long ee = sh_entries[t] - se, ei = sh_items[t] - si;
  for (long long x = lo; x < hi; ++x) {
    const long long c = p.counts[x];
    p.offsets[x] = static_cast<int>(ee);
    p.item_offsets[x] = static_cast<int>(ei);
    p.counts[x] = static_cast<int>(ee);  // the fill cursor of block x
    ee += c;
    ei += items_of(p, c);
  }
  if (t == kScanThreads - 1) {
    p.offsets[p.nblk] = static_cast<int>(sh_entries[t]);
    p.item_offsets[p.nblk] = static_cast<int>(sh_items[t]);
  }
}

__global__ void fill_kernel(Params p) {
  for (long long f = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; f < p.slots;
       f += static_cast<long long>(gridDim.x) * blockDim.x) {
    int i, s;
    long long bg;
    const int j = slot_block(p, f, i, s, bg);
    if (chosen(p, i, j)) {
      const int pos = atomicAdd(p.counts + bg * p.Tk + j, 1);
      p.entries[pos] = i * p.Kq + s;
    }
  }
}

__global__ void items_kernel(Params p) {
  for (long long x = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; x < p.nblk;
       x += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long n = items_of(p, p.offsets[x + 1] - p.offsets[x]);
    const int first = p.item_offsets[x];
    for (long long t = 0; t < n; ++t) p.items[first + t] = make_int2(static_cast<int>(x), static_cast<int>(t * kRowsPerItem));
  }
}

int grid_for(long long n, int threads) {
  const long long g = (n + threads - 1) / threads;
  return static_cast<int>(g < 1 ? 1 : (g > 65536 ? 65536 : g));
}

}  // namespace

cudaError_t launch_validate(const Params& p, cudaStream_t stream) {
  validate_kernel<<<grid_for(static_cast<long long>(p.B) * p.Hkv * p.Lq, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_reverse_index(const Params& p, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(p.counts, 0, sizeof(int) * static_cast<std::size_t>(p.nblk), stream);
  if (e != cudaSuccess) return e;
  if (p.slots > 0) {
    count_kernel<<<grid_for(p.slots, 256), 256, 0, stream>>>(p);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  scan_kernel<<<1, kScanThreads, 0, stream>>>(p);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if (p.slots > 0) {
    fill_kernel<<<grid_for(p.slots, 256), 256, 0, stream>>>(p);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  items_kernel<<<grid_for(p.nblk, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sparse_attn::cuda_kernels::qs
