// MSA-style token-max selector on the GPU (DESIGN §5.7). Kernels on the caller's stream:
//  1. (fp8, fp4) amax of each index tensor: the per-tensor scales, as the CPU's load_quantized (prepare.cu);
//  2. dequantise qidx and kidx to dense float32 copies through the precision (common.cuh ports the
//     CPU round trips operation by operation, so the values are identical);
//  3. per-query block scores: a CTA holds kQueries query rows and streams KV blocks through shared
//     memory; each thread owns one key and accumulates float64 dots in d order (common.cuh: equal to
//     the CPU's dots_f64 bit for bit), the block maximum over visible keys goes to a score matrix
//     [B, Hkv, Lq, Tk] (-inf where a query sees no key of the block);
//  4. exact top-k per query (QueryLists) or, for TileLists, the maximum over the tile's queries and the
//     union of their local blocks, then top-k per tile.
// Every intermediate lives in stream-ordered scratch (common.cuh).
//
// Speed: float64 dots keep the ids equal to the CPU reference; they run at the float64 CUDA-core
// rate, far from a tensor-core path. A faster exact path needs a score whose float32 (or fp8 MMA)
// evaluation is provably order-independent, which the CPU's dequantised float32 values (fl(e * scale))
// do not give in general.
#include <algorithm>
#include <cmath>

#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using namespace sel;

constexpr int kQueries = 16;       // query rows per scoring CTA
constexpr int kScoreThreads = 256;  // 128 keys x 2 halves of the query rows
constexpr int kRowsPerThread = kQueries / 2;
static_assert(kScoreThreads == 2 * kBlockK);

struct ScoreParams {
  const float* q;  // dense [B, Lq, Hkv, Di]
  const float* k;  // dense [B, Lk, Hk, Di]
  double* scores;  // [B, Hkv, Lq, Tk]
  std::int64_t B, Lq, Lk, Hkv, Hk, Di, Tk;
  bool causal;
  __device__ std::int64_t key_end(std::int64_t i) const {
    return causal ? imax(std::int64_t{0}, imin(i + (Lk - Lq) + 1, Lk)) : Lk;
  }
};

// grid: (ceil(Lq / kQueries), B * Hkv). Shared: the KV block (128 rows of Di + 1 floats: the odd
// stride puts the 32 keys of a warp in 32 banks), the query rows, and the per-warp maxima.
__global__ void __launch_bounds__(kScoreThreads) token_scores_kernel(const ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const std::int64_t ks = p.Di + 1;
  float* kb = reinterpret_cast<float*>(smem);
  float* qs = kb + kBlockK * ks;
  double* red = reinterpret_cast<double*>(qs + kQueries * p.Di + (kQueries * p.Di) % 2);  // [2][4][kRowsPerThread]

  const std::int64_t bg = blockIdx.y, b = bg / p.Hkv, g = bg % p.Hkv, hk = p.Hk == 1 ? 0 : g;
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.x) * kQueries;
  const int tid = threadIdx.x, key = tid % kBlockK, half = tid / kBlockK;
  const int warp_in_half = key / 32, lane = tid % 32;

  for (std::int64_t e = tid; e < kQueries * p.Di; e += kScoreThreads) {
    const std::int64_t qi = i0 + e / p.Di;
    qs[e] = qi < p.Lq ? p.q[((b * p.Lq + qi) * p.Hkv + g) * p.Di + e % p.Di] : 0.0f;
  }
  const std::int64_t i_hi = imin(p.Lq, i0 + kQueries) - 1;
  const std::int64_t last_end = p.key_end(i_hi);  // the chunk's largest visible range
  double* out = p.scores + ((b * p.Hkv + g) * p.Lq) * p.Tk;

  for (std::int64_t j = 0; j < p.Tk; ++j) {
    const std::int64_t k0 = j * kBlockK;
    if (k0 >= last_end) {
      // No query of the chunk sees this block.
      for (std::int64_t e = tid; e < kQueries; e += kScoreThreads)
        if (i0 + e < p.Lq) out[(i0 + e) * p.Tk + j] = -INFINITY;
      continue;
    }
    __syncthreads();  // the previous block's readers are done with kb (and qs is filled)
    const std::int64_t nk = imin<std::int64_t>(kBlockK, p.Lk - k0);
    for (std::int64_t e = tid; e < nk * p.Di; e += kScoreThreads) {
      const std::int64_t r = e / p.Di, d = e % p.Di;
      kb[r * ks + d] = p.k[((b * p.Lk + k0 + r) * p.Hk + hk) * p.Di + d];
    }
    __syncthreads();
    double acc[kRowsPerThread];
    for (int m = 0; m < kRowsPerThread; ++m) acc[m] = 0.0;
    if (key < nk) {
      const float* kr = kb + key * ks;
      for (std::int64_t d = 0; d < p.Di; ++d) {
        const double kv = kr[d];
        for (int m = 0; m < kRowsPerThread; ++m)
          acc[m] = fma(static_cast<double>(qs[(half + 2 * m) * p.Di + d]), kv, acc[m]);
      }
    }
    for (int m = 0; m < kRowsPerThread; ++m) {
      const std::int64_t i = i0 + half + 2 * m;
      const bool seen = key < nk && i < p.Lq && k0 + key < p.key_end(i);
      double v = seen ? sanitize(acc[m]) : -INFINITY;
      for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0) red[(half * 4 + warp_in_half) * kRowsPerThread + m] = v;
    }
    __syncthreads();
    if (tid < kQueries) {
      const int h = tid % 2, m = tid / 2;
      const std::int64_t i = i0 + h + 2 * m;
      if (i < p.Lq) {
        double v = -INFINITY;
        for (int w = 0; w < 4; ++w) v = fmax(v, red[(h * 4 + w) * kRowsPerThread + m]);
        out[i * p.Tk + j] = v;
      }
    }
  }
}

struct TopParams {
  const double* scores;  // [B, Hkv, Lq, Tk]
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, width;
  std::int32_t* cnt;  // TileLists only
  std::int64_t cs0, cs1, cs2;
  std::int64_t Lq, Lk, Hkv, Tq, Tk;
  int top_k;
  bool causal, reserve_local;
  __device__ std::int64_t key_end(std::int64_t i) const {
    return causal ? imax(std::int64_t{0}, imin(i + (Lk - Lq) + 1, Lk)) : Lk;
  }
  // The query's aligned key, or -1 when it sees none (causal).
  __device__ std::int64_t aligned(std::int64_t i) const {
    if (causal) return i + (Lk - Lq) >= 0 ? i + (Lk - Lq) : -1;
    return imax(std::int64_t{0}, imin(i + (Lk - Lq), Lk - 1));
  }
};

// Shared layout of the ranking kernels: Tk doubles, blockDim + 1 ints, Tk flags.
std::size_t rank_smem(std::int64_t Tk, int threads) {
  return static_cast<std::size_t>(Tk) * (sizeof(double) + 1) + (static_cast<std::size_t>(threads) + 1) * sizeof(int);
}

// grid: B * Hkv * Lq, one query row each.
__global__ void query_topk_kernel(const TopParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  double* sc = reinterpret_cast<double*>(smem);
  int* part = reinterpret_cast<int*>(sc + p.Tk);
  unsigned char* flags = reinterpret_cast<unsigned char*>(part + blockDim.x + 1);
  const std::int64_t row = blockIdx.x;
  const std::int64_t i = row % p.Lq, g = (row / p.Lq) % p.Hkv, b = row / (p.Lq * p.Hkv);
  const std::int64_t n = (p.key_end(i) + kBlockK - 1) / kBlockK;
  const std::int64_t local = p.reserve_local && p.aligned(i) >= 0 ? p.aligned(i) / kBlockK : -1;
  const double* s = p.scores + row * p.Tk;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) sc[j] = j == local ? INFINITY : s[j];
  __syncthreads();
  top_k_ascending(sc, static_cast<int>(n), p.top_k, flags, part, p.idx + b * p.is0 + g * p.is1 + i * p.is2, p.is3,
                  p.width);
}

// grid: B * Hkv * Tq, one Q tile each.
__global__ void tile_topk_kernel(const TopParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  double* sc = reinterpret_cast<double*>(smem);
  int* part = reinterpret_cast<int*>(sc + p.Tk);
  unsigned char* flags = reinterpret_cast<unsigned char*>(part + blockDim.x + 1);
  const std::int64_t job = blockIdx.x;
  const std::int64_t t = job % p.Tq, g = (job / p.Tq) % p.Hkv, b = job / (p.Tq * p.Hkv);
  const std::int64_t i_first = t * kTileQ, i_last = imin(p.Lq, i_first + kTileQ) - 1;
  const std::int64_t n = (p.key_end(i_last) + kBlockK - 1) / kBlockK;
  // The reserved blocks of a tile: the local blocks of its queries, a contiguous range because the
  // aligned key grows with i.
  std::int64_t r_lo = 1, r_hi = 0;
  if (p.reserve_local) {
    std::int64_t first_seen = -1;
    for (std::int64_t i = i_first; i <= i_last && first_seen < 0; ++i)
      if (p.aligned(i) >= 0) first_seen = i;
    if (first_seen >= 0) {
      r_lo = p.aligned(first_seen) / kBlockK;
      r_hi = p.aligned(i_last) / kBlockK;
    }
  }
  const double* s = p.scores + ((b * p.Hkv + g) * p.Lq) * p.Tk;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    double v = -INFINITY;
    for (std::int64_t i = i_first; i <= i_last; ++i) v = fmax(v, s[i * p.Tk + j]);
    sc[j] = j >= r_lo && j <= r_hi ? INFINITY : v;
  }
  __syncthreads();
  const int c = top_k_ascending(sc, static_cast<int>(n), p.top_k, flags, part,
                                p.idx + b * p.is0 + g * p.is1 + t * p.is2, p.is3, p.width);
  if (threadIdx.x == 0) p.cnt[b * p.cs0 + g * p.cs1 + t * p.cs2] = c;
}

constexpr int kRankThreads = 128;

// Runs kernels 1-3 and then `rank` (kernel 4) while the scratch is alive.
template <class Rank>
void run_token_max(const std::string& op, const TensorView& qidx, const TensorView& kidx, const TokenMaxOptions& o,
                   std::size_t rank_smem_bytes, const void* rank_kernel, Rank&& rank) {
  const std::int64_t B = qidx.shape[0], Lq = qidx.shape[1], Hkv = qidx.shape[2], Di = qidx.shape[3];
  const std::int64_t Lk = kidx.shape[1], Hk = kidx.shape[2], Tk = ceil_div(Lk, kBlockK);
  const auto stream = static_cast<cudaStream_t>(o.stream);

  const std::size_t score_smem =
      (static_cast<std::size_t>(kBlockK * (Di + 1) + kQueries * Di + 1)) * sizeof(float) + 8 * kRowsPerThread * sizeof(double);
  const int max_smem = usable_device_smem(op, "qidx", qidx);
  check_device_memory(op, "qidx", qidx);
  check_device_memory(op, "kidx", kidx);
  if (B * Hkv > 65535)  // the scoring grid's y extent
    throw Error(op, "qidx", "B x Hkv = " + std::to_string(B * Hkv) + " exceeds the CUDA selector's limit of 65535");
  if (score_smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "qidx", "index dim Di = " + std::to_string(Di) + " is too large for the CUDA token_max selector");
  if (rank_smem_bytes > static_cast<std::size_t>(max_smem))
    throw Error(op, "kidx", "Lk = " + std::to_string(Lk) + " gives " + std::to_string(Tk) +
                                " blocks, more than the CUDA selector's shared-memory ranking holds");
  check_cuda(cudaFuncSetAttribute(token_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(score_smem)), op, "cudaFuncSetAttribute");
  check_cuda(cudaFuncSetAttribute(rank_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(rank_smem_bytes)), op, "cudaFuncSetAttribute");

  const std::size_t a_bytes = align_up(2 * sizeof(unsigned int));
  const std::size_t q_bytes = align_up(static_cast<std::size_t>(B * Lq * Hkv * Di) * sizeof(float));
  const std::size_t k_bytes = align_up(static_cast<std::size_t>(B * Lk * Hk * Di) * sizeof(float));
  const std::size_t s_bytes = align_up(static_cast<std::size_t>(B * Hkv * Lq * Tk) * sizeof(double));
  StreamScratch scratch(a_bytes + q_bytes + k_bytes + s_bytes, stream, op);
  auto* amax = scratch.as<unsigned int>(0);
  float* qd = scratch.as<float>(a_bytes);
  float* kd = scratch.as<float>(a_bytes + q_bytes);
  double* scores = scratch.as<double>(a_bytes + q_bytes + k_bytes);
  if (o.precision != IndexPrecision::bf16)
    check_cuda(cudaMemsetAsync(amax, 0, 2 * sizeof(unsigned int), stream), op, "cudaMemsetAsync");
  prepare_index_tensor(qidx, o.precision, amax, qd, stream);
  prepare_index_tensor(kidx, o.precision, amax + 1, kd, stream);

  ScoreParams p{qd, kd, scores, B, Lq, Lk, Hkv, Hk, Di, Tk, o.causal};
  const dim3 grid(static_cast<unsigned>(ceil_div(Lq, kQueries)), static_cast<unsigned>(B * Hkv));
  token_scores_kernel<<<grid, kScoreThreads, score_smem, stream>>>(p);
  rank(scores);
  check_cuda(cudaGetLastError(), op, "kernel launch");
}

TopParams top_params(const TensorView& qidx, const TensorView& kidx, const TensorView& idx, const TokenMaxOptions& o) {
  TopParams t{};
  t.idx = idx.ptr<std::int32_t>();
  t.is0 = idx.stride[0], t.is1 = idx.stride[1], t.is2 = idx.stride[2], t.is3 = idx.stride[3];
  t.width = idx.shape[3];
  t.Lq = qidx.shape[1], t.Lk = kidx.shape[1], t.Hkv = qidx.shape[2];
  t.Tq = ceil_div(t.Lq, kTileQ), t.Tk = ceil_div(t.Lk, kBlockK);
  t.top_k = o.top_k;
  t.causal = o.causal, t.reserve_local = o.reserve_local;
  return t;
}

}  // namespace

void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out,
                      const TokenMaxOptions& o) {
  usable_device_smem("token_max_select", "qidx", qidx);
  check_device_memory("token_max_select", "out.idx", out.idx);
  TopParams t = top_params(qidx, kidx, out.idx, o);
  const std::size_t smem = rank_smem(t.Tk, kRankThreads);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  const std::int64_t rows = qidx.shape[0] * t.Hkv * t.Lq;
  run_token_max("token_max_select", qidx, kidx, o, smem, reinterpret_cast<const void*>(query_topk_kernel),
                [&](const double* scores) {
                  t.scores = scores;
                  query_topk_kernel<<<static_cast<unsigned>(rows), kRankThreads, smem, stream>>>(t);
                });
}

void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out,
                      const TokenMaxOptions& o) {
  usable_device_smem("token_max_select", "qidx", qidx);
  check_device_memory("token_max_select", "out.idx", out.idx);
  check_device_memory("token_max_select", "out.cnt", out.cnt);
  TopParams t = top_params(qidx, kidx, out.idx, o);
  t.cnt = out.cnt.ptr<std::int32_t>();
  t.cs0 = out.cnt.stride[0], t.cs1 = out.cnt.stride[1], t.cs2 = out.cnt.stride[2];
  const std::size_t smem = rank_smem(t.Tk, kRankThreads);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  const std::int64_t tiles = qidx.shape[0] * t.Hkv * t.Tq;
  run_token_max("token_max_select", qidx, kidx, o, smem, reinterpret_cast<const void*>(tile_topk_kernel),
                [&](const double* scores) {
                  t.scores = scores;
                  tile_topk_kernel<<<static_cast<unsigned>(tiles), kRankThreads, smem, stream>>>(t);
                });
}

}  // namespace sparse_attn::cuda_backend
