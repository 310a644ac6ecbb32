// Calibration of gated's thresholds on the GPU (docs/design.md §5.5): per (head, gate tile) of one
// sample, the maxima of the gate's candidate blocks (QK only), then for each budget k the k-th
// largest of them, -inf where fewer than k exist. The same definition as the CPU Calibrator, which
// stays the oracle: scores are float32 sums over the head dimension in its order (d = 0, 1, ...), fused
// multiply-adds, scaled after the sum.
//
// One CTA per (gate tile, head): its 64 query rows stay in shared memory (float), each candidate
// block's keys are loaded transposed (float, [d][key], so a warp reads 32 consecutive keys) and every
// thread scores 8 rows x 4 keys; the block maximum is a warp then CTA reduction. Candidates of a gate
// tile are a run of blocks [sink_blocks, end) (Lq = Lk), so the CTA walks them in order and keeps
// their maxima in shared memory for the selection: the k-th largest is the value v_i with
// #{v > v_i} < k <= #{v >= v_i}, found by every thread over its share of i (n^2 / 256 comparisons; a
// gate tile has at most Tk candidates).
//
// CUDA cores, not tensor cores: calibration runs once per model and the float32 order of the CPU's
// sums is what makes the two agree; an H200 scores a 64K-token sample of 32 heads in about a second.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/smem_limit.hpp"

namespace sparse_attn::cuda_kernels {
namespace {

constexpr int kCalibThreads = 256;
constexpr int kRows = 64;   // a gate tile (kGateRows)
constexpr int kKeys = 128;  // a KV block (kBlockK)
constexpr int kMaxHeadDim = 128;

struct CalibParams {
  const void* q = nullptr;  // [1, L, Hq, D], strides in elements (D contiguous)
  const void* k = nullptr;  // [1, L, Hkv, D]
  std::int64_t q_stride[2] = {0, 0};  // L, H
  std::int64_t k_stride[2] = {0, 0};
  int L = 0, D = 0, group_size = 1, Tk = 0;
  float scale = 1.0f;
  int sink_blocks = 0;
  const int* budgets = nullptr;  // n_budgets values >= 1
  int n_budgets = 0;
  float* out = nullptr;  // [Hq, Tg, n_budgets]
};

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class Elem>
__global__ void __launch_bounds__(kCalibThreads) calibrate_kernel(const __grid_constant__ CalibParams p) {
  extern __shared__ float smem[];
  const int D = p.D, g = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y), hk = h / p.group_size;
  float* qs = smem;                   // [64][D]
  float* kt = qs + kRows * D;         // [D][128]
  float* maxima = kt + D * kKeys;     // [Tk]
  float* warp_max = maxima + p.Tk;    // [8]
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int row0 = g * kRows;
  const int rows = min(kRows, p.L - row0);

  const auto* q = static_cast<const Elem*>(p.q);
  const auto* k = static_cast<const Elem*>(p.k);
  for (int i = tid; i < kRows * D; i += kCalibThreads) {
    const int r = i / D, d = i % D;
    qs[i] = r < rows ? to_float(q[(row0 + r) * p.q_stride[0] + h * p.q_stride[1] + d]) : 0.0f;
  }
  // Candidates: blocks past the sinks whose every key is visible to the first row (Lq = Lk).
  int end = p.sink_blocks;
  while (end < p.Tk && min((end + 1) * kKeys, p.L) <= row0 + 1) ++end;
  const int n = max(0, end - p.sink_blocks);

  for (int c = 0; c < n; ++c) {
    const int j = p.sink_blocks + c, key0 = j * kKeys, keys = min(kKeys, p.L - key0);
    __syncthreads();  // the previous block's keys are no longer read
    for (int i = tid; i < kKeys * D; i += kCalibThreads) {
      const int key = i / D, d = i % D;
      kt[d * kKeys + key] = key < keys ? to_float(k[(key0 + key) * p.k_stride[0] + hk * p.k_stride[1] + d]) : 0.0f;
    }
    __syncthreads();
    // Rows warp * 8 .. + 8, keys lane + 32 i.
    float acc[8][4];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][i] = 0.0f;
    for (int d = 0; d < D; ++d) {
      float kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) kv[i] = kt[d * kKeys + lane + 32 * i];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float qv = qs[(warp * 8 + r) * D + d];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][i] = fmaf(qv, kv[i], acc[r][i]);
      }
    }
    float m = -INFINITY;
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (warp * 8 + r < rows && lane + 32 * i < keys) m = fmaxf(m, acc[r][i] * p.scale);
#pragma unroll
    for (int s = 16; s > 0; s /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    if (tid == 0) {
      float b = warp_max[0];
      for (int w = 1; w < kCalibThreads / 32; ++w) b = fmaxf(b, warp_max[w]);
      maxima[c] = b;
    }
  }
  __syncthreads();

  // The k-th largest maximum of each budget (ties: any of the equal values, which are the same).
  float* out = p.out + (static_cast<std::int64_t>(h) * gridDim.x + g) * p.n_budgets;
  for (int bi = tid; bi < p.n_budgets; bi += kCalibThreads)
    if (n < p.budgets[bi]) out[bi] = -INFINITY;
  for (int i = tid; i < n; i += kCalibThreads) {
    const float v = maxima[i];
    int gt = 0, ge = 0;
    for (int s = 0; s < n; ++s) {
      gt += maxima[s] > v;
      ge += maxima[s] >= v;
    }
    for (int bi = 0; bi < p.n_budgets; ++bi)
      if (gt < p.budgets[bi] && p.budgets[bi] <= ge) out[bi] = v;
  }
}

template <class Elem>
cudaError_t launch_calibrate(const CalibParams& p, dim3 grid, std::size_t smem, cudaStream_t stream) {
  auto* kernel = &calibrate_kernel<Elem>;
  return launch_with_smem(kernel, smem, [&] { kernel<<<grid, kCalibThreads, smem, stream>>>(p); });
}

}  // namespace
}  // namespace sparse_attn::cuda_kernels

namespace sparse_attn::cuda_backend {

std::vector<float> calibration_sample(const TensorView& q, const TensorView& k, float scale, std::int64_t sink_blocks,
                                      const std::vector<std::int64_t>& budgets, const std::string& op) {
  using cuda_kernels::check_cuda;
  const std::int64_t L = q.shape[1], Hq = q.shape[2], D = q.shape[3], Hkv = k.shape[2];
  detail::require(q.dtype == DType::bf16 || q.dtype == DType::f16, op, "q",
                  [&] { return "on a CUDA device needs bf16 or f16, got " + q.describe(); });
  detail::require(k.dtype == q.dtype, op, "k", [&] { return "dtype differs from q's: " + k.describe(); });
  detail::require(D <= cuda_kernels::kMaxHeadDim, op, "q",
                  [&] { return "head dim up to 128 on a CUDA device, got " + q.describe(); });
  const std::int64_t Tk = ceil_div(L, kBlockK), Tg = ceil_div(L, kGateRows);
  const std::size_t smem =
      sizeof(float) * static_cast<std::size_t>(cuda_kernels::kRows * D + D * cuda_kernels::kKeys + Tk + 8);
  int device = 0, limit = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), op, "device query");
  detail::require(smem <= static_cast<std::size_t>(limit), op, "q", [&] {
    return "sample too long for the GPU calibration (" + std::to_string(Tk) + " KV blocks need " +
           std::to_string(smem) + " bytes of shared memory, the device has " + std::to_string(limit) + ")";
  });
  detail::require(Hq <= 65535 && L <= 0x7fffffff, op, "q",
                  [&] { return "too many heads or queries for the GPU calibration's grid: " + q.describe(); });

  cuda_kernels::DeviceGuard guard(q.device_index, op);
  const std::size_t n_out = static_cast<std::size_t>(Hq * Tg) * budgets.size();
  std::vector<int> budgets32(budgets.begin(), budgets.end());
  for (std::size_t i = 0; i < budgets.size(); ++i)
    budgets32[i] = static_cast<int>(std::min<std::int64_t>(budgets[i], 0x7fffffff));
  int* d_budgets = nullptr;
  float* d_out = nullptr;
  check_cuda(cudaMalloc(&d_budgets, budgets32.size() * sizeof(int)), op, "cudaMalloc");
  std::vector<float> host(n_out);
  try {
    check_cuda(cudaMalloc(&d_out, n_out * sizeof(float)), op, "cudaMalloc");
    // NaN where no value is written: only a NaN block maximum leaves a budget without its k-th value.
    check_cuda(cudaMemset(d_out, 0xff, n_out * sizeof(float)), op, "cudaMemset");
    check_cuda(cudaMemcpy(d_budgets, budgets32.data(), budgets32.size() * sizeof(int), cudaMemcpyHostToDevice), op,
               "budgets");
    // The samples may have been written on any stream: wait for all of them (calibration is not on a
    // latency path, and the result comes back to the host anyway).
    check_cuda(cudaDeviceSynchronize(), op, "device synchronisation");
    cuda_kernels::CalibParams p;
    p.q = q.data;
    p.k = k.data;
    p.q_stride[0] = q.stride[1];
    p.q_stride[1] = q.stride[2];
    p.k_stride[0] = k.stride[1];
    p.k_stride[1] = k.stride[2];
    p.L = static_cast<int>(L);
    p.D = static_cast<int>(D);
    p.group_size = static_cast<int>(Hq / Hkv);
    p.Tk = static_cast<int>(Tk);
    p.scale = scale;
    p.sink_blocks = static_cast<int>(std::min<std::int64_t>(sink_blocks, 0x7fffffff));
    p.budgets = d_budgets;
    p.n_budgets = static_cast<int>(budgets.size());
    p.out = d_out;
    const dim3 grid(static_cast<unsigned>(Tg), static_cast<unsigned>(Hq));
    check_cuda(q.dtype == DType::bf16 ? cuda_kernels::launch_calibrate<__nv_bfloat16>(p, grid, smem, nullptr)
                                      : cuda_kernels::launch_calibrate<__half>(p, grid, smem, nullptr),
               op, "kernel launch");
    check_cuda(cudaMemcpy(host.data(), d_out, n_out * sizeof(float), cudaMemcpyDeviceToHost), op, "thresholds");
  } catch (...) {
    cudaFree(d_budgets);
    cudaFree(d_out);
    throw;
  }
  cudaFree(d_budgets);
  cudaFree(d_out);
  return host;
}

}  // namespace sparse_attn::cuda_backend
