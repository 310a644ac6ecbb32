// R1 / R4 pooled selector on the GPU (DESIGN §5.7). Two kernels on the caller's stream:
//  1. representatives: one thread per (row group, d) sums its `span` tokens in float64 in token
//     order and divides by the count, as the CPU does, so the float means are identical;
//  2. one CTA per (b, group, Q tile): a warp per candidate block takes the maximum of the float64
//     representative dot products (one thread per dot, d in order: see common.cuh for why this equals
//     the CPU's double bit for bit), then the exact top-k writes the ascending list and its count.
// The means live in stream-ordered scratch (common.cuh).
#include <algorithm>
#include <cmath>

#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using namespace sel;

struct RepParams {
  const void* x;
  std::int64_t sb, sl, sh;  // strides of x in elements (d is contiguous)
  std::int64_t L, H, D, T, r, span;
  float* mean;          // [B, H, T, r, D]
  std::int32_t* count;  // [B, H, T, r]
};

// grid: B * H * T * r blocks (one representative each); threads stride over d.
template <In T>
__global__ void representatives_kernel(const RepParams p) {
  const std::int64_t slot = blockIdx.x;  // ((b * H + h) * T + t) * r + a
  const std::int64_t a = slot % p.r;
  const std::int64_t t = (slot / p.r) % p.T;
  const std::int64_t h = (slot / (p.r * p.T)) % p.H;
  const std::int64_t b = slot / (p.r * p.T * p.H);
  const std::int64_t l0 = t * kTileQ + a * p.span;
  const std::int64_t l1 = imin(p.L, l0 + p.span);
  const std::int64_t n = l1 > l0 ? l1 - l0 : 0;
  if (threadIdx.x == 0) p.count[slot] = static_cast<std::int32_t>(n);
  for (std::int64_t d = threadIdx.x; d < p.D; d += blockDim.x) {
    double acc = 0.0;
    const std::int64_t base = b * p.sb + h * p.sh + d;
    // Unrolled so the loads of several tokens are in flight; the additions stay in token order.
#pragma unroll 8
    for (std::int64_t l = l0; l < l1; ++l) acc += static_cast<double>(load_elem<T>(p.x, base + l * p.sl));
    // An absent representative (n = 0) is skipped by its count; its mean is only kept defined.
    p.mean[slot * p.D + d] = n > 0 ? static_cast<float>(acc / static_cast<double>(n)) : 0.0f;
  }
}

struct ScoreParams {
  const float* qmean;  // [B, Hq, Tq, r, D]
  const std::int32_t* qcount;
  const float* kmean;  // [B, Hkv, Tk, r, D]
  const std::int32_t* kcount;
  std::int32_t* idx;
  std::int64_t is0, is1, is2, is3, kmax;
  std::int32_t* cnt;
  std::int64_t cs0, cs1, cs2;
  std::int64_t Lq, Lk, Hq, Hkv, D, Tq, Tk, r, span;
  int top_k;
  bool force_local, force_block0, causal;
};

// Two float64 dots, each over d in order (the CPU's order), interleaved so their dependent FMA chains
// overlap. With D % 4 == 0 the rows are read as float4 (the means are 16-byte aligned rows).
__device__ __forceinline__ void dot2_f64(const float* a0, const float* b0, const float* a1, const float* b1,
                                         std::int64_t n, double& s0, double& s1) {
  s0 = 0.0, s1 = 0.0;
  if ((n & 3) == 0) {
    const auto* a04 = reinterpret_cast<const float4*>(a0);
    const auto* b04 = reinterpret_cast<const float4*>(b0);
    const auto* a14 = reinterpret_cast<const float4*>(a1);
    const auto* b14 = reinterpret_cast<const float4*>(b1);
    for (std::int64_t d = 0; d < n / 4; ++d) {
      const float4 x0 = __ldg(a04 + d), y0 = __ldg(b04 + d), x1 = __ldg(a14 + d), y1 = __ldg(b14 + d);
      s0 = fma(static_cast<double>(x0.x), static_cast<double>(y0.x), s0);
      s1 = fma(static_cast<double>(x1.x), static_cast<double>(y1.x), s1);
      s0 = fma(static_cast<double>(x0.y), static_cast<double>(y0.y), s0);
      s1 = fma(static_cast<double>(x1.y), static_cast<double>(y1.y), s1);
      s0 = fma(static_cast<double>(x0.z), static_cast<double>(y0.z), s0);
      s1 = fma(static_cast<double>(x1.z), static_cast<double>(y1.z), s1);
      s0 = fma(static_cast<double>(x0.w), static_cast<double>(y0.w), s0);
      s1 = fma(static_cast<double>(x1.w), static_cast<double>(y1.w), s1);
    }
  } else {
    for (std::int64_t d = 0; d < n; ++d) {
      s0 = fma(static_cast<double>(__ldg(a0 + d)), static_cast<double>(__ldg(b0 + d)), s0);
      s1 = fma(static_cast<double>(__ldg(a1 + d)), static_cast<double>(__ldg(b1 + d)), s1);
    }
  }
}

// 16 warps: one candidate block per warp at a time (a Tk = 128 list takes 8 rounds).
constexpr int kScoreThreads = 512;

// grid: B * Hkv * Tq; dynamic shared memory: Tk doubles, Tk flags, blockDim + 1 ints.
__global__ void __launch_bounds__(kScoreThreads) pooled_score_topk_kernel(const ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  double* scores = reinterpret_cast<double*>(smem);
  int* part = reinterpret_cast<int*>(scores + p.Tk);
  unsigned char* flags = reinterpret_cast<unsigned char*>(part + blockDim.x + 1);

  const std::int64_t job = blockIdx.x;
  const std::int64_t t = job % p.Tq;
  const std::int64_t g = (job / p.Tq) % p.Hkv;
  const std::int64_t b = job / (p.Tq * p.Hkv);
  const std::int64_t group = p.Hq / p.Hkv;
  const std::int64_t offset = p.Lk - p.Lq;
  const std::int64_t i_first = t * kTileQ;
  const std::int64_t i_last = imin(p.Lq, i_first + kTileQ) - 1;
  const std::int64_t n_cand =
      p.causal ? imax(std::int64_t{0}, imin(p.Tk, (i_last + offset + 1 + kBlockK - 1) / kBlockK)) : p.Tk;
  // Forced blocks (same rules as the CPU): block 0 and the local block(s), for tiles with candidates.
  std::int64_t local_lo = -1, local_hi = -2;
  if (p.force_local) {
    if (p.causal) {
      local_lo = imax(i_first + offset, std::int64_t{0}) / kBlockK;
      local_hi = (i_last + offset) / kBlockK;
    } else {
      local_lo = local_hi = imin(i_first * p.Lk / p.Lq / kBlockK, p.Tk - 1);
    }
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const std::int64_t pairs = p.r * p.r * group;
  for (std::int64_t j = warp; j < n_cand; j += warps) {
    const bool forced = (p.force_block0 && j == 0) || (j >= local_lo && j <= local_hi);
    double best = -INFINITY;
    if (!forced) {
      // Lane `lane` scores pairs lane, lane + 32, ...; two at a time. A pair that does not count (absent
      // representative, or causally invisible) is replaced by the other one of its step or dropped.
      const float* qrow[2];
      const float* krow[2];
      int held = 0;
      for (std::int64_t e = lane; e < pairs; e += 32) {
        const std::int64_t h = e % group, c = (e / group) % p.r, a = e / (group * p.r);
        const std::int64_t qa0 = ((b * p.Hq + g * group) * p.Tq + t) * p.r + a;
        const std::int32_t qn = p.qcount[qa0];
        if (qn == 0) continue;
        const std::int64_t kc = ((b * p.Hkv + g) * p.Tk + j) * p.r + c;
        if (p.kcount[kc] == 0) continue;
        const std::int64_t q_last = i_first + a * p.span + qn - 1;
        if (p.causal && j * kBlockK + c * p.span > q_last + offset) continue;
        const std::int64_t qa = ((b * p.Hq + g * group + h) * p.Tq + t) * p.r + a;
        qrow[held] = p.qmean + qa * p.D;
        krow[held] = p.kmean + kc * p.D;
        if (++held == 2) {
          double s0, s1;
          dot2_f64(qrow[0], krow[0], qrow[1], krow[1], p.D, s0, s1);
          best = fmax(best, fmax(sanitize(s0), sanitize(s1)));
          held = 0;
        }
      }
      if (held == 1) {
        double s0, s1;
        dot2_f64(qrow[0], krow[0], qrow[0], krow[0], p.D, s0, s1);
        best = fmax(best, sanitize(s0));
      }
      for (int o = 16; o > 0; o >>= 1) best = fmax(best, __shfl_xor_sync(0xffffffffu, best, o));
    }
    if (lane == 0) scores[j] = forced ? INFINITY : best;
  }
  __syncthreads();
  std::int32_t* row = p.idx + b * p.is0 + g * p.is1 + t * p.is2;
  const int c = top_k_ascending(scores, static_cast<int>(n_cand), p.top_k, flags, part, row, p.is3, p.kmax);
  if (threadIdx.x == 0) p.cnt[b * p.cs0 + g * p.cs1 + t * p.cs2] = c;
}

template <In T>
void launch_reps(const TensorView& x, std::int64_t r, float* mean, std::int32_t* count, cudaStream_t stream) {
  RepParams p{};
  p.x = x.data;
  p.sb = x.stride[0], p.sl = x.stride[1], p.sh = x.stride[2];
  p.L = x.shape[1], p.H = x.shape[2], p.D = x.shape[3];
  p.T = ceil_div(p.L, kTileQ), p.r = r, p.span = kTileQ / r;
  p.mean = mean, p.count = count;
  const std::int64_t blocks = x.shape[0] * p.H * p.T * r;
  const int threads = static_cast<int>(std::min<std::int64_t>(128, ((p.D + 31) / 32) * 32));
  representatives_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p);
}

void reps(const TensorView& x, std::int64_t r, float* mean, std::int32_t* count, cudaStream_t stream) {
  switch (in_type(x.dtype)) {
    case In::f32: return launch_reps<In::f32>(x, r, mean, count, stream);
    case In::f16: return launch_reps<In::f16>(x, r, mean, count, stream);
    case In::bf16: return launch_reps<In::bf16>(x, r, mean, count, stream);
  }
}


}  // namespace

void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& o) {
  const std::string op = "pooled_select";
  const std::int64_t B = q.shape[0], Lq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const std::int64_t Lk = k.shape[1], Hkv = k.shape[2];
  const std::int64_t Tq = ceil_div(Lq, kTileQ), Tk = ceil_div(Lk, kBlockK), r = o.representatives;
  const auto stream = static_cast<cudaStream_t>(o.stream);

  const std::size_t smem = static_cast<std::size_t>(Tk) * (sizeof(double) + 1) + (kScoreThreads + 1) * sizeof(int);
  const int max_smem = usable_device_smem(op, "q", q);
  check_device_memory(op, "q", q);
  check_device_memory(op, "k", k);
  check_device_memory(op, "out.idx", out.idx);
  check_device_memory(op, "out.cnt", out.cnt);
  if (smem > static_cast<std::size_t>(max_smem))
    throw Error(op, "k", "Lk = " + std::to_string(Lk) + " gives " + std::to_string(Tk) +
                             " blocks, more than the CUDA selector's per-tile shared-memory ranking holds");
  check_cuda(cudaFuncSetAttribute(pooled_score_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)), op, "cudaFuncSetAttribute");

  const std::size_t qm = align_up(static_cast<std::size_t>(B * Hq * Tq * r * D) * sizeof(float));
  const std::size_t qc = align_up(static_cast<std::size_t>(B * Hq * Tq * r) * sizeof(std::int32_t));
  const std::size_t km = align_up(static_cast<std::size_t>(B * Hkv * Tk * r * D) * sizeof(float));
  const std::size_t kc = align_up(static_cast<std::size_t>(B * Hkv * Tk * r) * sizeof(std::int32_t));
  StreamScratch scratch(qm + qc + km + kc, stream, op);
  float* qmean = scratch.as<float>(0);
  auto* qcount = scratch.as<std::int32_t>(qm);
  float* kmean = scratch.as<float>(qm + qc);
  auto* kcount = scratch.as<std::int32_t>(qm + qc + km);
  reps(q, r, qmean, qcount, stream);
  reps(k, r, kmean, kcount, stream);

  ScoreParams p{};
  p.qmean = qmean, p.qcount = qcount, p.kmean = kmean, p.kcount = kcount;
  p.idx = out.idx.ptr<std::int32_t>();
  p.is0 = out.idx.stride[0], p.is1 = out.idx.stride[1], p.is2 = out.idx.stride[2], p.is3 = out.idx.stride[3];
  p.kmax = out.idx.shape[3];
  p.cnt = out.cnt.ptr<std::int32_t>();
  p.cs0 = out.cnt.stride[0], p.cs1 = out.cnt.stride[1], p.cs2 = out.cnt.stride[2];
  p.Lq = Lq, p.Lk = Lk, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.Tq = Tq, p.Tk = Tk, p.r = r, p.span = kTileQ / r;
  p.top_k = o.top_k;
  p.force_local = o.force_local, p.force_block0 = o.force_block0, p.causal = o.causal;
  pooled_score_topk_kernel<<<static_cast<unsigned>(B * Hkv * Tq), kScoreThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), op, "kernel launch");
}

}  // namespace sparse_attn::cuda_backend
