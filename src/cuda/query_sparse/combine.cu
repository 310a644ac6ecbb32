// Phase 3 of query_sparse: the LSE-weighted combine of each (query, head)'s partial outputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/mma.cuh"
#include "cuda/query_sparse/partials.cuh"

namespace sparse_attn::cuda_kernels::qs {
namespace {

// One warp per (b, group, query, head); lane owns D / 32 consecutive columns. Every lane walks the
// slots in the same order and computes the same weights, so the result does not depend on timing.
template <class T, int D, class Part>
__global__ void __launch_bounds__(256) combine_kernel(const __grid_constant__ Params p) {
  constexpr int kPer = D / 32;
  const long long w = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const long long total = static_cast<long long>(p.B) * p.Hkv * p.Lq * p.group;
  if (w >= total) return;
  const int hh = static_cast<int>(w % p.group);
  const long long r = w / p.group;
  const int qi = static_cast<int>(r % p.Lq);
  const long long bg = r / p.Lq, b = bg / p.Hkv, g = bg % p.Hkv;
  const std::int32_t* row = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + qi * p.idx_stride[2];
  const long long slot0 = (bg * p.Lq + qi) * p.Kq;

  float m = -INFINITY;
  for (int s = 0; s < p.Kq; ++s)
    if (chosen(p, qi, row[s * p.idx_stride[3]])) m = fmaxf(m, p.lse_part[(slot0 + s) * p.group + hh]);
  float acc[kPer] = {};
  float lse = -INFINITY;
  if (m != -INFINITY) {
    float sum = 0.0f;
    for (int s = 0; s < p.Kq; ++s)
      if (chosen(p, qi, row[s * p.idx_stride[3]])) sum += expf(p.lse_part[(slot0 + s) * p.group + hh] - m);
    lse = m + logf(sum);
    for (int s = 0; s < p.Kq; ++s) {
      if (!chosen(p, qi, row[s * p.idx_stride[3]])) continue;
      const long long e = (slot0 + s) * p.group + hh;
      const float wgt = expf(p.lse_part[e] - lse);
#pragma unroll
      for (int c = 0; c < kPer; ++c) acc[c] = fmaf(wgt, Part::load(p.part, e * D + lane * kPer + c), acc[c]);
    }
  }
  const long long h = g * p.group + hh;
  char* o = static_cast<char*>(p.out) +
            sizeof(std::uint16_t) * (b * p.out_stride[0] + qi * p.out_stride[1] + h * p.out_stride[2] + lane * kPer);
#pragma unroll
  for (int c = 0; c < kPer; ++c) T::store(o + sizeof(std::uint16_t) * c, acc[c]);
  if (lane == 0 && p.lse != nullptr) p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + qi * p.lse_stride[2]] = lse;
}

template <class T, int D, class Part>
cudaError_t combine(const Params& p, cudaStream_t stream) {
  const long long warps = static_cast<long long>(p.B) * p.Hkv * p.Lq * p.group;
  const long long blocks = (warps + 7) / 8;
  combine_kernel<T, D, Part><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <class T, int D, class Part>
struct CombineOp {
  static cudaError_t run(const Params& p, cudaStream_t s) { return combine<T, D, Part>(p, s); }
};

}  // namespace

cudaError_t launch_combine(const Params& p, bool bf16, int D, bool bf16_partials, cudaStream_t stream) {
  if (static_cast<long long>(p.B) * p.Hkv * p.Lq * p.group == 0) return cudaSuccess;
  return dispatch<CombineOp>(bf16, D, bf16_partials, p, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
