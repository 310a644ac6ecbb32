// Phase 2 of query_sparse: per-block attention over gathered rows (combine.cu is phase 3).
//
// Attention uses mma.sync m16n8k16 (16-bit inputs, f32 accumulators; fragment layouts in mma.cuh)
// with fragments loaded from padded shared memory by 32-bit loads. V is stored transposed in shared
// memory so that PV's B fragment (two consecutive keys of one column) is one 32-bit load, like QK's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/mma.cuh"
#include "cuda/query_sparse/partials.cuh"

namespace sparse_attn::cuda_kernels::qs {
namespace {

template <int D>
struct Smem {
  static constexpr int kStrideQK = D + kPad;       // halves per row of Q and K
  static constexpr int kStrideV = kKeys + kPad;    // halves per row of V^T (one row per column d)
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRowsPerItem * kStrideQK;
  static constexpr int kV = kK + kKeys * kStrideQK;
  static constexpr int kHalves = kV + D * kStrideV;
  static constexpr std::size_t kBytes = sizeof(std::uint16_t) * kHalves;
};

__device__ __forceinline__ std::uint32_t ld32(const std::uint16_t* p) { return *reinterpret_cast<const std::uint32_t*>(p); }

template <class T, int D, class Part>
__global__ void __launch_bounds__(kThreads) attend_kernel(const __grid_constant__ Params p) {
  using S = Smem<D>;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) std::uint16_t smem[];
  __shared__ int row_query[kRowsPerItem];
  __shared__ int row_slot[kRowsPerItem];
  __shared__ int row_head[kRowsPerItem];

  const int item = blockIdx.x;
  if (item >= p.item_offsets[p.nblk]) return;  // the grid is sized for the most items any list can give
  const int2 it = p.items[item];
  const long long x = it.x;
  const long long bg = x / p.Tk, b = bg / p.Hkv, g = bg % p.Hkv;
  const int j = static_cast<int>(x % p.Tk);
  const int e0 = p.offsets[x];
  const long long block_rows = static_cast<long long>(p.offsets[x + 1] - e0) * p.group - it.y;
  const int nrows = block_rows < kRowsPerItem ? static_cast<int>(block_rows) : kRowsPerItem;
  const int tid = threadIdx.x;

  for (int r = tid; r < kRowsPerItem; r += kThreads) {
    if (r < nrows) {
      const int flat = it.y + r;
      const int ent = p.entries[e0 + flat / p.group];
      row_query[r] = ent / p.Kq;
      row_slot[r] = ent % p.Kq;
      row_head[r] = flat % p.group;
    } else {
      row_query[r] = -1;
    }
  }
  __syncthreads();

  std::uint16_t* Qs = smem + S::kQ;
  std::uint16_t* Ks = smem + S::kK;
  std::uint16_t* Vt = smem + S::kV;
  const auto* q = static_cast<const std::uint16_t*>(p.q);
  const auto* k = static_cast<const std::uint16_t*>(p.k);
  const auto* v = static_cast<const std::uint16_t*>(p.v);
  const long long key0 = static_cast<long long>(j) * kKeys;
  for (int c = tid; c < kRowsPerItem * kChunks; c += kThreads) {
    const int r = c / kChunks, cc = c % kChunks;
    uint4 val = make_uint4(0, 0, 0, 0);
    const int qi = row_query[r];
    if (qi >= 0) {
      const long long h = g * p.group + row_head[r];
      val = *reinterpret_cast<const uint4*>(q + b * p.q_stride[0] + qi * p.q_stride[1] + h * p.q_stride[2] + cc * 8);
    }
    *reinterpret_cast<uint4*>(Qs + r * S::kStrideQK + cc * 8) = val;
  }
  for (int c = tid; c < kKeys * kChunks; c += kThreads) {
    const int kk = c / kChunks, cc = c % kChunks;
    const long long key = key0 + kk;
    uint4 kv = make_uint4(0, 0, 0, 0);
    if (key < p.Lk)
      kv = *reinterpret_cast<const uint4*>(k + b * p.k_stride[0] + key * p.k_stride[1] + g * p.k_stride[2] + cc * 8);
    *reinterpret_cast<uint4*>(Ks + kk * S::kStrideQK + cc * 8) = kv;
  }
  // V goes in transposed, one half at a time: consecutive lanes take consecutive keys of one column
  // chunk so that their 16-bit stores hit consecutive addresses (a lane per column chunk would put
  // all 32 lanes' stores in one bank).
  for (int c = tid; c < kKeys * kChunks; c += kThreads) {
    const int kk = c % kKeys, cc = c / kKeys;
    const long long key = key0 + kk;
    uint4 vv = make_uint4(0, 0, 0, 0);
    if (key < p.Lk)
      vv = *reinterpret_cast<const uint4*>(v + b * p.v_stride[0] + key * p.v_stride[1] + g * p.v_stride[2] + cc * 8);
    std::uint16_t hv[8];
    memcpy(hv, &vv, 16);
#pragma unroll
    for (int e = 0; e < 8; ++e) Vt[(cc * 8 + e) * S::kStrideV + kk] = hv[e];
  }
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  const int r_a = warp * 16 + gq, r_b = r_a + 8;
  if (warp * 16 >= nrows) return;  // no barrier follows

  // Last visible key of each row, relative to the block (-1: none, a padding row).
  auto rel_limit = [&](int r) -> long long {
    const int qi = row_query[r];
    if (qi < 0) return -1;
    long long lim = p.Lk - 1;
    if (p.causal && qi + p.offset < lim) lim = qi + p.offset;
    return lim - key0;
  };
  const long long lim_a = rel_limit(r_a), lim_b = rel_limit(r_b);

  float s[kKeys / 8][4];
#pragma unroll
  for (int nt = 0; nt < kKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const std::uint16_t* qa = Qs + r_a * S::kStrideQK + ks * 16 + tq * 2;
    const std::uint16_t* qb = Qs + r_b * S::kStrideQK + ks * 16 + tq * 2;
    const std::uint32_t a[4] = {ld32(qa), ld32(qb), ld32(qa + 8), ld32(qb + 8)};
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
      const std::uint16_t* kb = Ks + (nt * 8 + gq) * S::kStrideQK + ks * 16 + tq * 2;
      T::mma(s[nt], a, ld32(kb), ld32(kb + 8));
    }
  }

  float m_a = -INFINITY, m_b = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = nt * 8 + tq * 2 + e;
      if (col > lim_a) s[nt][e] = -INFINITY;
      if (col > lim_b) s[nt][2 + e] = -INFINITY;
      m_a = fmaxf(m_a, s[nt][e]);
      m_b = fmaxf(m_b, s[nt][2 + e]);
    }
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    m_a = fmaxf(m_a, __shfl_xor_sync(0xffffffffu, m_a, o));
    m_b = fmaxf(m_b, __shfl_xor_sync(0xffffffffu, m_b, o));
  }
  // A row with no visible key (only padding rows) keeps p = 0 instead of exp(-inf + inf) = NaN.
  const float base_a = m_a == -INFINITY ? 0.0f : m_a * p.scale_log2;
  const float base_b = m_b == -INFINITY ? 0.0f : m_b * p.scale_log2;
  float l_a = 0.0f, l_b = 0.0f;
#pragma unroll
  for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      // The row sum (and so the LSE) uses the float32 probabilities; PV sees them rounded to the
      // 16-bit type, as in FlashAttention.
      s[nt][e] = exp2f(fmaf(s[nt][e], p.scale_log2, -base_a));
      s[nt][2 + e] = exp2f(fmaf(s[nt][2 + e], p.scale_log2, -base_b));
      l_a += s[nt][e];
      l_b += s[nt][2 + e];
    }
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, o);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, o);
  }

  float acc[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    const std::uint32_t a[4] = {T::pack(s[2 * kk][0], s[2 * kk][1]), T::pack(s[2 * kk][2], s[2 * kk][3]),
                                T::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                T::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const std::uint16_t* vb = Vt + (dn * 8 + gq) * S::kStrideV + kk * 16 + tq * 2;
      T::mma(acc[dn], a, ld32(vb), ld32(vb + 8));
    }
  }

  const int rows[2] = {r_a, r_b};
  const float l[2] = {l_a, l_b};
  const float m[2] = {m_a, m_b};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rows[h];
    const int qi = row_query[r];
    if (qi < 0) continue;
    const long long base =
        ((bg * p.Lq + qi) * p.Kq + row_slot[r]) * p.group + row_head[r];
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      Part::store2(p.part, base * D + dn * 8 + tq * 2, acc[dn][2 * h] * inv, acc[dn][2 * h + 1] * inv);
    if (tq == 0) p.lse_part[base] = l[h] > 0.0f ? m[h] * p.scale + logf(l[h]) : -INFINITY;
  }
}

template <class T, int D, class Part>
cudaError_t attend(const Params& p, long long max_items, cudaStream_t stream) {
  auto* kernel = attend_kernel<T, D, Part>;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Smem<D>::kBytes));
  if (e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(max_items), kThreads, Smem<D>::kBytes, stream>>>(p);
  return cudaGetLastError();
}

template <class T, int D, class Part>
struct AttendOp {
  static cudaError_t run(const Params& p, long long max_items, cudaStream_t s) { return attend<T, D, Part>(p, max_items, s); }
};
}  // namespace

cudaError_t launch_attend(const Params& p, bool bf16, int D, bool bf16_partials, long long max_items,
                          cudaStream_t stream) {
  if (max_items <= 0) return cudaSuccess;
  return dispatch<AttendOp>(bf16, D, bf16_partials, p, max_items, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
