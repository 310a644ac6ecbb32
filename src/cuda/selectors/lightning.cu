// DSA lightning indexer on the GPU, block form (QueryLists): I[t, s] = sum_j w[t, j] * ReLU(qI[t, j] . kI[s])
// max-pooled over the visible keys of each KV block, then the exact top-k blocks per query, written to
// every group. Kernels on the caller's stream:
//  1. (fp8) amax of qI and kI; 2. dequantise both to dense float32 (prepare.cu, identical to the CPU);
//  3. a CTA holds kLQueries query rows (all index heads) and streams KV blocks through shared memory;
//     each thread owns one key: per head a float64 dot in d order, then acc = fma(w, ReLU(dot), acc)
//     over the heads in order, exactly the CPU's index_score; the block maximum goes to [B, Lq, Tk];
//  4. exact top-k per query for every group.
// Only block scores (1 / 128 of the [Lq, Lk] matrix) reach device memory.
#include <algorithm>
#include <cmath>

#include "cuda/common/smem_limit.hpp"
#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using namespace sel;

constexpr int kLQueries = 2;         // query rows per CTA (each with all HI index heads in shared memory)
constexpr int kLThreads = kBlockK;   // one key per thread

struct LScoreParams {
  const float* q;  // dense [B, Lq, HI, Di]
  const float* w;  // [B, Lq, HI] with strides
  std::int64_t ws0, ws1, ws2;
  const float* k;  // dense [B, Lk, Di]
  double* scores;  // [B, Lq, Tk]
  std::int64_t B, Lq, Lk, HI, Di, Tk;
  bool causal;
  __device__ std::int64_t key_end(std::int64_t i) const {
    return causal ? imax(std::int64_t{0}, imin(i + (Lk - Lq) + 1, Lk)) : Lk;
  }
};

// grid: (ceil(Lq / kLQueries), B). Shared: the KV block (odd row stride: conflict-free per key), the
// query rows [kLQueries][HI][Di], their weights as doubles, and per-warp maxima.
__global__ void __launch_bounds__(kLThreads) lightning_scores_kernel(const LScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const std::int64_t ks = p.Di + 1;
  double* wsh = reinterpret_cast<double*>(smem);                 // [kLQueries][HI]
  double* red = wsh + kLQueries * p.HI;                          // [4][kLQueries]
  float* kb = reinterpret_cast<float*>(red + 4 * kLQueries);     // [128][Di + 1]
  float* qs = kb + kBlockK * ks;                                 // [kLQueries][HI][Di]

  const std::int64_t b = blockIdx.y;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.x) * kLQueries;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const std::int64_t qrow = p.HI * p.Di;
  for (std::int64_t e = tid; e < kLQueries * qrow; e += kLThreads) {
    const std::int64_t qi = i0 + e / qrow;
    qs[e] = qi < p.Lq ? p.q[(b * p.Lq + qi) * qrow + e % qrow] : 0.0f;
  }
  for (std::int64_t e = tid; e < kLQueries * p.HI; e += kLThreads) {
    const std::int64_t qi = i0 + e / p.HI, j = e % p.HI;
    wsh[e] = qi < p.Lq ? static_cast<double>(p.w[b * p.ws0 + qi * p.ws1 + j * p.ws2]) : 0.0;
  }
  const std::int64_t last_end = p.key_end(imin(p.Lq, i0 + kLQueries) - 1);
  double* out = p.scores + b * p.Lq * p.Tk;

  for (std::int64_t jb = 0; jb < p.Tk; ++jb) {
    const std::int64_t k0 = jb * kBlockK;
    if (k0 >= last_end) {
      if (tid < kLQueries && i0 + tid < p.Lq) out[(i0 + tid) * p.Tk + jb] = -INFINITY;
      continue;
    }
    __syncthreads();  // previous readers of kb and red are done (and qs, wsh are filled)
    const std::int64_t nk = imin<std::int64_t>(kBlockK, p.Lk - k0);
    for (std::int64_t e = tid; e < nk * p.Di; e += kLThreads) {
      const std::int64_t r = e / p.Di, d = e % p.Di;
      kb[r * ks + d] = p.k[(b * p.Lk + k0 + r) * p.Di + d];
    }
    __syncthreads();
    for (int m = 0; m < kLQueries; ++m) {
      const std::int64_t i = i0 + m;
      const bool seen = tid < nk && i < p.Lq && k0 + tid < p.key_end(i);
      double v = -INFINITY;
      if (seen) {
        const float* kr = kb + tid * ks;
        double acc = 0.0;
        for (std::int64_t j = 0; j < p.HI; ++j) {
          const float* qr = qs + (m * p.HI + j) * p.Di;
          double dot = 0.0;
          for (std::int64_t d = 0; d < p.Di; ++d) dot = fma(static_cast<double>(qr[d]), static_cast<double>(kr[d]), dot);
          acc = fma(wsh[m * p.HI + j], fmax(0.0, dot), acc);
        }
        v = sanitize(acc);
      }
      for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0) red[warp * kLQueries + m] = v;
    }
    __syncthreads();
    if (tid < kLQueries && i0 + tid < p.Lq) {
      double v = -INFINITY;
      for (int w = 0; w < 4; ++w) v = fmax(v, red[w * kLQueries + tid]);
      out[(i0 + tid) * p.Tk + jb] = v;
    }
  }
}

struct LTopParams {
  const double* scores;  // [B, Lq, Tk]
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, width, G;
  std::int64_t Lq, Lk, Tk;
  int top_k;
  bool causal;
};

constexpr int kLRankThreads = 128;

// grid: B * Lq; the same list is written to every group.
__global__ void lightning_topk_kernel(const LTopParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  double* sc = reinterpret_cast<double*>(smem);
  int* part = reinterpret_cast<int*>(sc + p.Tk);
  unsigned char* flags = reinterpret_cast<unsigned char*>(part + blockDim.x + 1);
  const std::int64_t row = blockIdx.x, i = row % p.Lq, b = row / p.Lq;
  const std::int64_t end = p.causal ? imax(std::int64_t{0}, imin(i + (p.Lk - p.Lq) + 1, p.Lk)) : p.Lk;
  const std::int64_t n = (end + kBlockK - 1) / kBlockK;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) sc[j] = p.scores[row * p.Tk + j];
  __syncthreads();
  for (std::int64_t g = 0; g < p.G; ++g)
    top_k_ascending(sc, static_cast<int>(n), p.top_k, flags, part, p.idx + b * p.is0 + g * p.is1 + i * p.is2, p.is3,
                    p.width);
}

}  // namespace

void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const QueryLists& out,
                      const LightningOptions& o) {
  const std::string op = "lightning_select";
  const std::int64_t B = qI.shape[0], Lq = qI.shape[1], HI = qI.shape[2], Di = qI.shape[3];
  const std::int64_t Lk = kI.shape[1], Tk = ceil_div(Lk, kBlockK);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  const int max_smem = usable_device_smem(op, "qI", qI);
  check_device_memory(op, "qI", qI);
  check_device_memory(op, "w", w);
  check_device_memory(op, "kI", kI);
  check_device_memory(op, "out.idx", out.idx);
  if (B > 65535)  // the scoring grid's y extent
    throw Error(op, "qI", "batch " + std::to_string(B) + " exceeds the CUDA selector's limit of 65535");
  const std::size_t score_smem = static_cast<std::size_t>(kLQueries * HI + 4 * kLQueries) * sizeof(double) +
                                 static_cast<std::size_t>(kBlockK * (Di + 1) + kLQueries * HI * Di) * sizeof(float);
  const std::size_t rank_smem = static_cast<std::size_t>(Tk) * (sizeof(double) + 1) + (kLRankThreads + 1) * sizeof(int);
  if (score_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "qI", "HI x Di = " + std::to_string(HI) + " x " + std::to_string(Di) +
                              " index heads do not fit the CUDA lightning selector's shared memory");
  if (rank_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "kI", "Lk = " + std::to_string(Lk) + " gives " + std::to_string(Tk) +
                              " blocks, more than the CUDA selector's shared-memory ranking holds");

  const std::size_t a_bytes = align_up(2 * sizeof(unsigned int));
  const std::size_t q_bytes = align_up(static_cast<std::size_t>(B * Lq * HI * Di) * sizeof(float));
  const std::size_t k_bytes = align_up(static_cast<std::size_t>(B * Lk * Di) * sizeof(float));
  const std::size_t s_bytes = align_up(static_cast<std::size_t>(B * Lq * Tk) * sizeof(double));
  StreamScratch scratch(a_bytes + q_bytes + k_bytes + s_bytes, stream, op);
  auto* amax = scratch.as<unsigned int>(0);
  float* qd = scratch.as<float>(a_bytes);
  float* kd = scratch.as<float>(a_bytes + q_bytes);
  double* scores = scratch.as<double>(a_bytes + q_bytes + k_bytes);
  if (o.precision != IndexPrecision::bf16)
    check_cuda(cudaMemsetAsync(amax, 0, 2 * sizeof(unsigned int), stream), op, "cudaMemsetAsync");
  prepare_index_tensor(qI, o.precision, amax, qd, stream);
  prepare_index_tensor(kI, o.precision, amax + 1, kd, stream);

  LScoreParams p{};
  p.q = qd, p.w = w.ptr<float>(), p.ws0 = w.stride[0], p.ws1 = w.stride[1], p.ws2 = w.stride[2];
  p.k = kd, p.scores = scores;
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.HI = HI, p.Di = Di, p.Tk = Tk, p.causal = o.causal;
  const dim3 grid(static_cast<unsigned>(ceil_div(Lq, kLQueries)), static_cast<unsigned>(B));
  check_cuda(cuda_kernels::launch_with_smem(lightning_scores_kernel, score_smem,
                                            [&] { lightning_scores_kernel<<<grid, kLThreads, score_smem, stream>>>(p); }),
             op, "scores kernel launch");

  LTopParams t{};
  t.scores = scores;
  t.idx = out.idx.ptr<std::int32_t>();
  t.is0 = out.idx.stride[0], t.is1 = out.idx.stride[1], t.is2 = out.idx.stride[2], t.is3 = out.idx.stride[3];
  t.width = out.idx.shape[3], t.G = out.idx.shape[1];
  t.Lq = Lq, t.Lk = Lk, t.Tk = Tk, t.top_k = o.top_k, t.causal = o.causal;
  check_cuda(cuda_kernels::launch_with_smem(lightning_topk_kernel, rank_smem,
                                            [&] {
                                              lightning_topk_kernel<<<static_cast<unsigned>(B * Lq), kLRankThreads,
                                                                      rank_smem, stream>>>(t);
                                            }),
             op, "kernel launch");
}

}  // namespace sparse_attn::cuda_backend
