// entmax on the GPU (docs/design.md §5.6): per-row thresholds by passes over recomputed scores, the
// block bits of the support, then the output pass (the Q-centric kernel with the entmax transform,
// attention/entmax_transform.cuh) over the set bits.
//
// Scores are never stored. Every pass recomputes S = Q K^T on the tensor cores (mma.sync m16n8k16,
// float32 accumulation) for a CTA of 128 query rows (8 warps x 16 rows: one Q tile) of one (b, head), walking the
// keys it sees in steps of 64 (cp.async, double buffered):
//   1. row max: z_max of z = scale * q.k over the visible keys, and the rows with a NaN or +inf score;
//   2. bracketing passes, in shifted units u = (alpha - 1)(z - z_max) + 1 where tau* lies in [0, 1)
//      (the max alone has weight 1 at tau = 0): the bracket [lo, hi] of each row still searching is cut
//      into kSections equal intervals and only the scores with u > lo are looked at.
//      alpha = 2 and 1.5 (r = 1, 2): per interval the count and the sums of d and d^2, d = u - (the
//      interval's left edge) in [0, width) (the scores above hi in one more bin, d = u - hi), from
//      which f(e) = sum [u - e]_+^r is exact at every edge (no cancellation: every term is >= 0). The
//      root's interval becomes the new bracket; where no score lies inside it, f is a polynomial there
//      and tau is solved in closed form (one pass, two at most, on random scores). Other alphas: f
//      itself (2^(r log2(u - e))) at each interior edge; the bracket shrinks kSections-fold per pass
//      to kGeneralTolerance, and tau is its midpoint.
//      A row finishes with z_tau = z_max + (tau - 1) / (alpha - 1) in float32: its weights are
//      ((alpha - 1)(z - z_tau))^r for z > z_tau, normalised by their sum in the output pass. The
//      threshold is thus exact to the float32 resolution of z_tau (a few 1e-7 of |z|); at large alpha
//      the weight of a support score within that distance of z_tau is not resolved (the CPU holds the
//      threshold relative to the support's smallest score instead: entmax/threshold_solver.hpp).
//   3. support: the (query, key) pairs with z > z_tau are counted, and the bit of (128-row tile,
//      128-key block) is set where some row has z > z_tau - margin, margin = 2^-10 max(1, |z_max|):
//      the output pass recomputes the scores with wgmma, whose float32 sums are in another order
//      (at most about D 2^-24 sum |scale q_d k_d|, 1e-4 for unit-scale q and k at D = 128), so no
//      block holding a score that the output pass weighs is ever skipped.
// Passes 2 and 3 skip a CTA whose rows need nothing (all finished, or none live), so the passes the
// host launches past convergence cost a launch each.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "core/check.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/elem_tag.cuh"
#include "cuda/common/mma_sync.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/smem_limit.hpp"
#include "cuda/common/workspace_cache.hpp"
#include "cuda/convert/backend.hpp"
#include "cuda/attention/entmax_params.hpp"
#include "cuda/entmax/backend.hpp"
#include "cuda/entmax/bracket.hpp"

namespace sparse_attn::cuda_kernels::entmax {

// Query rows per CTA: a whole Q tile. Each K step (16 KB at D = 128) feeds 128 rows, 128 flops per
// byte, what an SM's mma.sync rate needs from L2; 64 rows starved the tensor cores.
constexpr int kRows = 128;
constexpr int kWarps = kRows / 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kKeys = 64;        // keys per step (divides the output pass's 128-key block)
constexpr int kPad = 8;          // halves of padding per shared row: ldmatrix rows on distinct banks
constexpr float kBitMargin = 1.0f / 1024.0f;
constexpr int kBlockKeys = 128;  // the output pass's KV block
constexpr int kTileRows = 128;   // and Q tile
static_assert(kBlockKeys % kKeys == 0 && kTileRows % kRows == 0, "a step and a CTA lie inside one block and tile");

enum class Pass { kRowMax, kSearch, kSupport };

struct ScanParams {
  const void* q = nullptr;
  const void* k = nullptr;
  long long q_stride[3] = {};  // b, l, h (elements; d contiguous)
  long long k_stride[3] = {};
  int Lq = 0, Lk = 0, Hq = 0, group = 1, Tq = 0, words = 0;
  bool causal = false;
  float scale = 1.0f;
  double am1 = 0.5, r = 2.0;
  int power = 2;                    // 1: r = 1, 2: r = 2, 0: other
  bool last_pass = false;           // the last bracketing pass: every row finishes
  EntmaxRow* rows = nullptr;        // [B, Hq, Lq]
  std::uint32_t* bits = nullptr;    // [B, Hq, Tq, words], zeroed before the support pass
  unsigned long long* support = nullptr;
};

template <int D>
struct Smem {
  static constexpr int kRow = D + kPad;
  std::uint16_t q[kRows * kRow];
  std::uint16_t k[2][kKeys * kRow];
};

// Per row of a bracketing pass: kSections intervals plus the scores above hi.
struct Bins {
  int cnt[kRows][kSections + 1];
  float s1[kRows][kSections + 1];  // fast paths: sum d; other alphas: f at interior edge j (j >= 1)
  float s2[kRows][kSections + 1];
  // A collecting row: its scores inside the bracket as u - lo (those >= hi go to bin kSections).
  float coll[kRows][kCollect];
  int ncoll[kRows];
};

__device__ __forceinline__ int key_end(const ScanParams& p, int row) {
  return p.causal ? min(max(row + p.Lk - p.Lq + 1, 0), p.Lk) : p.Lk;
}

template <class Tag, int D, Pass kPass>
__global__ void __launch_bounds__(kThreads) scan_kernel(const __grid_constant__ ScanParams p) {
  using S = Smem<D>;
  constexpr int kRow = S::kRow, kPieces = D / 8, kKSteps = D / 16;
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  S& sm = *reinterpret_cast<S*>(smem_raw);
  Bins& bins = *reinterpret_cast<Bins*>(smem_raw + sizeof(S));
  std::uint32_t* words = reinterpret_cast<std::uint32_t*>(smem_raw + sizeof(S));  // support pass
  __shared__ int any_s;
  __shared__ unsigned long long support_s;

  const int row0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int kvh = h / p.group;
  const long long row_base = (static_cast<long long>(b) * p.Hq + h) * p.Lq;
  const int last_row = min(row0 + kRows, p.Lq) - 1;
  const int cta_key_end = key_end(p, last_row);

  // This thread's two rows: g and g + 8 of its warp's 16.
  int row[2], kend[2];
  float zcut[2];  // scores above this are looked at (+inf: none)
  float zmax[2] = {-INFINITY, -INFINITY};
  bool bad[2] = {false, false};
  float zbit[2];
  double lo[2], w[2], hi[2];
  bool collect[2] = {false, false};
  for (int i = 0; i < 2; ++i) {
    row[i] = row0 + 16 * warp + g + 8 * i;
    kend[i] = row[i] < p.Lq ? key_end(p, row[i]) : 0;
    zcut[i] = INFINITY;
    zbit[i] = INFINITY;
    lo[i] = hi[i] = w[i] = 0.0;
    if (kPass != Pass::kRowMax && row[i] < p.Lq) {
      const EntmaxRow st = p.rows[row_base + row[i]];
      zmax[i] = st.z_max;
      if (kPass == Pass::kSearch && st.status == EntmaxRow::kSearching) {
        zcut[i] = st.z_lo;
        lo[i] = st.lo;
        hi[i] = st.hi;
        w[i] = (st.hi - st.lo) / kSections;
        collect[i] = collects(st, p.power);
      }
      if (kPass == Pass::kSupport && st.status == EntmaxRow::kLive) {
        zcut[i] = st.z_tau;
        zbit[i] = st.z_tau - kBitMargin * fmaxf(1.0f, fabsf(st.z_max));
      }
    }
  }
  if (threadIdx.x == 0) {
    any_s = 0;
    support_s = 0;
  }
  __syncthreads();
  if (kPass != Pass::kRowMax) {
    if (zbit[0] < INFINITY || zbit[1] < INFINITY || zcut[0] < INFINITY || zcut[1] < INFINITY) any_s = 1;
    __syncthreads();
    if (!any_s) return;
  }
  if (kPass == Pass::kSearch) {
    for (int e = threadIdx.x; e < kRows * (kSections + 1); e += kThreads) {
      (&bins.cnt[0][0])[e] = 0;
      (&bins.s1[0][0])[e] = 0.0f;
      (&bins.s2[0][0])[e] = 0.0f;
    }
    for (int e = threadIdx.x; e < kRows; e += kThreads) bins.ncoll[e] = 0;
  }
  if (kPass == Pass::kSupport)
    for (int e = threadIdx.x; e < p.words; e += kThreads) words[e] = 0u;

  const auto* qbase = static_cast<const std::uint16_t*>(p.q) + b * p.q_stride[0] + h * p.q_stride[2];
  const auto* kbase = static_cast<const std::uint16_t*>(p.k) + b * p.k_stride[0] + kvh * p.k_stride[2];
  for (int e = threadIdx.x; e < kRows * kPieces; e += kThreads) {
    const int r = e / kPieces, c = e % kPieces;
    const bool ok = row0 + r < p.Lq;
    cp_async16(&sm.q[r * kRow + c * 8], qbase + (ok ? static_cast<long long>(row0 + r) * p.q_stride[1] : 0) + c * 8, ok);
  }
  cp_async_commit();
  const int steps = (max(cta_key_end, 0) + kKeys - 1) / kKeys;
  const auto load_k = [&](int step, int stage) {
    for (int e = threadIdx.x; e < kKeys * kPieces; e += kThreads) {
      const int r = e / kPieces, c = e % kPieces, key = step * kKeys + r;
      const bool ok = key < p.Lk;
      cp_async16(&sm.k[stage][r * kRow + c * 8], kbase + (ok ? static_cast<long long>(key) * p.k_stride[1] : 0) + c * 8,
                 ok);
    }
    cp_async_commit();
  };
  if (steps > 0) {
    load_k(0, 0);
    cp_async_wait<1>();  // Q (K's first step may still be in flight)
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
  std::uint32_t qa[kKSteps][4];
  {
    const int r = warp * 16 + lane % 16, c = (lane / 16) * 8;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(qa[ks], &sm.q[r * kRow + ks * 16 + c]);
  }
  unsigned long long support = 0;

  for (int step = 0; step < steps; ++step) {
    const int stage = step % 2;
    if (step + 1 < steps) {
      load_k(step + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    float s[kKeys / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kp = 0; kp < kKSteps / 2; ++kp) {
        std::uint32_t kb[4];
        ldmatrix_x4(kb, &sm.k[stage][(nt * 8 + lane % 8) * kRow + kp * 32 + (lane / 8) * 8]);
        mma_m16n8k16<Tag>(s[nt], qa[2 * kp], kb[0], kb[1]);
        mma_m16n8k16<Tag>(s[nt], qa[2 * kp + 1], kb[2], kb[3]);
      }
    }
    const int key0 = step * kKeys;
    bool hit = false;  // support pass: a score of this step passes the bit test
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = j / 2, key = key0 + nt * 8 + 2 * t4 + (j % 2);
        if (key >= kend[i]) continue;
        const float z = s[nt][j] * p.scale;
        if (kPass == Pass::kRowMax) {
          zmax[i] = fmaxf(zmax[i], z);
          bad[i] |= !(z < INFINITY);
        } else if (kPass == Pass::kSearch) {
          if (!(z > zcut[i])) continue;
          const double u = p.am1 * (static_cast<double>(z) - static_cast<double>(zmax[i])) + 1.0;
          const int r = 16 * warp + g + 8 * i;
          if (collect[i] && u < hi[i]) {
            const int slot = atomicAdd(&bins.ncoll[r], 1);
            if (slot < kCollect) bins.coll[r][slot] = static_cast<float>(fmax(u - lo[i], 0.0));
          } else if (p.power != 0) {
            double d;
            const int k = bin_of(u, lo[i], hi[i], d);  // a collecting row's scores >= hi: bin kSections
            atomicAdd(&bins.cnt[r][k], 1);
            atomicAdd(&bins.s1[r][k], static_cast<float>(d));
            atomicAdd(&bins.s2[r][k], static_cast<float>(d * d));
          } else {
            const float rf = static_cast<float>(p.r);
            for (int e = 1; e < kSections; ++e) {
              const double x = u - (lo[i] + e * w[i]);
              if (!(x > 0.0)) break;
              atomicAdd(&bins.s1[r][e], fast_exp2(rf * __log2f(static_cast<float>(x))));
            }
          }
        } else {
          if (z > zcut[i]) ++support;
          hit |= z > zbit[i];
        }
      }
    if constexpr (kPass == Pass::kSupport) {
      // A step of 64 keys lies inside one 128-key block: one bit per warp and step.
      const int blk = key0 / kBlockKeys;
      if (__any_sync(0xffffffffu, hit) && lane == 0) atomicOr(&words[blk / 32], 1u << (blk % 32));
    }
    __syncthreads();  // every warp is done with `stage` before the next step refills it
  }

  if constexpr (kPass == Pass::kRowMax) {
    for (int i = 0; i < 2; ++i) {
      zmax[i] = quad_max(zmax[i]);
      int f = bad[i] ? 1 : 0;
      f |= __shfl_xor_sync(0xffffffffu, f, 1);
      f |= __shfl_xor_sync(0xffffffffu, f, 2);
      bad[i] = f != 0;
    }
    if (t4 == 0)
      for (int i = 0; i < 2; ++i) {
        if (row[i] >= p.Lq) continue;
        EntmaxRow st;
        st.z_max = zmax[i];
        st.lo = 0.0;
        st.hi = 1.0;
        st.z_tau = INFINITY;
        if (bad[i]) st.status = EntmaxRow::kPoisoned;
        else if (kend[i] == 0 || zmax[i] == -INFINITY) st.status = EntmaxRow::kNoKey;
        else st.status = EntmaxRow::kSearching;
        st.z_lo = z_of_lo(st, p.am1);
        p.rows[row_base + row[i]] = st;
      }
  } else if constexpr (kPass == Pass::kSearch) {
    __syncthreads();
    if (threadIdx.x < kRows && row0 + static_cast<int>(threadIdx.x) < p.Lq) {
      const int r = threadIdx.x;
      EntmaxRow& st = p.rows[row_base + row0 + r];
      if (st.status == EntmaxRow::kSearching) {
        if (!collects(st, p.power)) {
          close_row(st, bins.cnt[r], bins.s1[r], bins.s2[r], p.power, p.am1, p.last_pass);
        } else if (bins.ncoll[r] <= kCollect) {
          close_collected(st, bins.cnt[r][kSections], bins.s1[r][kSections], bins.s2[r][kSections], bins.coll[r],
                          bins.ncoll[r], p.power, p.am1);
        } else if (p.last_pass) {  // more than the count said (rounding at the bracket's ends): midpoint
          finish_row(st, 0.5 * (st.lo + st.hi), p.am1);
        } else {
          st.inside = -1;  // bin the bracket on the next pass
        }
      }
    }
  } else {  // support: the CTA's counts and bits
    for (int o = 16; o > 0; o >>= 1) support += __shfl_xor_sync(0xffffffffu, support, o);
    if (lane == 0 && support != 0) atomicAdd(&support_s, support);
    __syncthreads();
    if (threadIdx.x == 0 && support_s != 0) atomicAdd(p.support, support_s);
    std::uint32_t* out = p.bits + ((static_cast<long long>(b) * p.Hq + h) * p.Tq + row0 / kTileRows) * p.words;
    for (int e = threadIdx.x; e < p.words; e += kThreads)
      if (words[e] != 0u) atomicOr(out + e, words[e]);
  }
}

// Sum of the set bits of `n` words into *count.
__global__ void popcount_kernel(const std::uint32_t* bits, long long n, unsigned long long* count) {
  unsigned long long c = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    c += __popc(bits[i]);
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % 32 == 0 && c != 0) atomicAdd(count, c);
}

// The contiguous [B, Hq, Tq, words] bits into the caller's block_bits (any strides).
struct CopyBitsParams {
  const std::uint32_t* src = nullptr;
  std::uint32_t* dst = nullptr;
  long long stride[4] = {};
  long long shape[4] = {};
};
__global__ void copy_bits_kernel(const __grid_constant__ CopyBitsParams p) {
  const long long n = p.shape[0] * p.shape[1] * p.shape[2] * p.shape[3];
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long rest = i, off = 0;
    for (int d = 3; d >= 0; --d) {
      off += (rest % p.shape[d]) * p.stride[d];
      rest /= p.shape[d];
    }
    p.dst[off] = p.src[i];
  }
}

template <class Tag, int D, Pass kPass>
cudaError_t launch_scan(const ScanParams& p, dim3 grid, cudaStream_t stream) {
  const std::size_t smem =
      sizeof(Smem<D>) + (kPass == Pass::kSearch ? sizeof(Bins) : kPass == Pass::kSupport ? 4 * static_cast<std::size_t>(p.words) : 0);
  auto* kernel = &scan_kernel<Tag, D, kPass>;
  return launch_with_smem(kernel, smem, [&] { kernel<<<grid, kThreads, smem, stream>>>(p); });
}

template <class Tag, int D>
cudaError_t launch_passes(ScanParams p, dim3 grid, cudaStream_t stream) {
  cudaError_t e = launch_scan<Tag, D, Pass::kRowMax>(p, grid, stream);
  for (int i = 0; i < kMaxPasses && e == cudaSuccess; ++i) {
    p.last_pass = i == kMaxPasses - 1;
    e = launch_scan<Tag, D, Pass::kSearch>(p, grid, stream);
  }
  if (e == cudaSuccess) e = launch_scan<Tag, D, Pass::kSupport>(p, grid, stream);
  return e;
}

}  // namespace sparse_attn::cuda_kernels::entmax

namespace sparse_attn::cuda_backend {
namespace {

constexpr const char* kOp = "entmax";

// Per (device, stream): the row states, the bits, the tile lists of the output pass and two counters.
// entmax holds its lock across both phases.
WorkspaceCache g_entmax_workspaces;

std::size_t round256(std::size_t n) { return (n + 255) / 256 * 256; }

void require_cp_async(const TensorView& t, const char* name) {
  const auto addr = reinterpret_cast<std::uintptr_t>(t.data);
  detail::require(addr % 16 == 0 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0, kOp, name,
                  [&] { return "needs a 16-byte aligned base and strides in multiples of 8 elements, got " + t.describe(); });
}

}  // namespace

std::mutex& entmax_workspace_mutex() { return g_entmax_workspaces.mutex(); }

EntmaxPlan entmax_thresholds(const detail::AttentionCall& a, const EntmaxOptions& options) {
  using namespace cuda_kernels::entmax;
  using cuda_kernels::check_cuda;
  const ProblemShape& s = a.p;
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  detail::require(s.Lq <= kIntMax && s.Lk <= kIntMax && ceil_div(s.Lq, kRows) <= kIntMax && s.Hq <= 65535 && s.B <= 65535,
                  kOp, "q", [&] { return "problem too large for the CUDA entmax's grid: " + s.describe(); });
  require_cp_async(a.q, "q");
  require_cp_async(a.k, "k");
  cuda_kernels::DeviceGuard guard(a.device, kOp);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  const std::int64_t Tq = s.Tq(), Tk = s.Tk(), words = ceil_div(Tk, 32);
  const std::int64_t nrows = s.B * s.Hq * s.Lq, nbits = s.B * s.Hq * Tq * words;

  const std::size_t rows_bytes = round256(static_cast<std::size_t>(nrows) * sizeof(cuda_kernels::EntmaxRow));
  const std::size_t bits_bytes = round256(static_cast<std::size_t>(nbits) * 4);
  const std::size_t idx_bytes = round256(static_cast<std::size_t>(s.B * s.Hq * Tq * Tk) * 4);
  const std::size_t cnt_bytes = round256(static_cast<std::size_t>(s.B * s.Hq * Tq) * 4);
  const std::size_t need = rows_bytes + bits_bytes + idx_bytes + cnt_bytes + 256;
  char* ws = static_cast<char*>(g_entmax_workspaces.get(kOp, a.device, a.stream, need));
  auto* rows = reinterpret_cast<cuda_kernels::EntmaxRow*>(ws);
  auto* bits = reinterpret_cast<std::uint32_t*>(ws + rows_bytes);
  char* idx = ws + rows_bytes + bits_bytes;
  char* cnt = idx + idx_bytes;
  auto* counters = reinterpret_cast<unsigned long long*>(cnt + cnt_bytes);  // support, active tiles
  check_cuda(cudaMemsetAsync(bits, 0, bits_bytes, stream), kOp, "bits");
  check_cuda(cudaMemsetAsync(counters, 0, 2 * sizeof(unsigned long long), stream), kOp, "counters");

  const double alpha = options.alpha;
  ScanParams p;
  p.q = a.q.data;
  p.k = a.k.data;
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = a.q.stride[i];
    p.k_stride[i] = a.k.stride[i];
  }
  p.Lq = static_cast<int>(s.Lq);
  p.Lk = static_cast<int>(s.Lk);
  p.Hq = static_cast<int>(s.Hq);
  p.group = static_cast<int>(s.group_size());
  p.Tq = static_cast<int>(Tq);
  p.words = static_cast<int>(words);
  p.causal = s.causal;
  p.scale = a.scale;
  p.am1 = alpha - 1.0;
  p.r = 1.0 / (alpha - 1.0);
  p.power = alpha == 2.0 ? 1 : (alpha == 1.5 ? 2 : 0);
  p.rows = rows;
  p.bits = bits;
  p.support = counters;
  const dim3 grid(static_cast<unsigned>(ceil_div(s.Lq, kRows)), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B));
  const bool bf16 = a.q.dtype == DType::bf16;
  using cuda_kernels::Bf16Tag;
  using cuda_kernels::F16Tag;
  check_cuda(s.D == 128 ? (bf16 ? launch_passes<Bf16Tag, 128>(p, grid, stream) : launch_passes<F16Tag, 128>(p, grid, stream))
                        : (bf16 ? launch_passes<Bf16Tag, 64>(p, grid, stream) : launch_passes<F16Tag, 64>(p, grid, stream)),
             kOp, "threshold passes");
  const unsigned small_grid = static_cast<unsigned>(std::clamp<std::int64_t>(ceil_div(nbits, 256), 1, 1024));
  popcount_kernel<<<small_grid, 256, 0, stream>>>(
      bits, nbits, counters + 1);
  check_cuda(cudaGetLastError(), kOp, "popcount");
  if (options.block_bits) {
    CopyBitsParams c;
    c.src = bits;
    c.dst = static_cast<std::uint32_t*>(options.block_bits->data);
    for (int i = 0; i < 4; ++i) {
      c.stride[i] = options.block_bits->stride[i];
      c.shape[i] = options.block_bits->shape[i];
    }
    copy_bits_kernel<<<small_grid, 256, 0, stream>>>(c);
    check_cuda(cudaGetLastError(), kOp, "block_bits copy");
  }

  // The output pass over the set bits, as TileLists (one list per query head).
  const TileLists tiles{TensorView::contiguous(idx, DType::i32, {s.B, s.Hq, Tq, Tk}, Device::cuda, a.device),
                        TensorView::contiguous(cnt, DType::i32, {s.B, s.Hq, Tq}, Device::cuda, a.device)};
  ConvertOptions convert;
  convert.trusted = true;  // set by the support pass: in range by construction
  convert.stream = a.stream;
  block_bits_to_tile_lists(BlockBits{TensorView::contiguous(bits, DType::u32, {s.B, s.Hq, Tq, words}, Device::cuda, a.device)},
                           tiles, s, convert, kOp, "block_bits");
  EntmaxPlan plan{detail::TileCall{tiles, s.Hq, Tk}, {}, counters};
  plan.transform.rows = rows;
  plan.transform.am1 = static_cast<float>(alpha - 1.0);
  plan.transform.r = static_cast<float>(1.0 / (alpha - 1.0));
  plan.transform.scale = a.scale;
  plan.transform.power = p.power;
  return plan;
}

EntmaxStats entmax(const detail::AttentionCall& a, const EntmaxOptions& options, const detail::AttentionTuning& tuning) {
  using cuda_kernels::check_cuda;
  const ProblemShape& s = a.p;
  cuda_kernels::DeviceGuard guard(a.device, kOp);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  std::lock_guard<std::mutex> lock(entmax_workspace_mutex());
  const EntmaxPlan plan = entmax_thresholds(a, options);
  entmax_output(a, plan.tiles, plan.transform, tuning);
  unsigned long long host[2] = {0, 0};
  check_cuda(cudaMemcpyAsync(host, plan.counters, sizeof(host), cudaMemcpyDeviceToHost, stream), kOp, "statistics");
  check_cuda(cudaStreamSynchronize(stream), kOp, "statistics");
  EntmaxStats stats;
  stats.support = static_cast<std::int64_t>(host[0]);
  stats.active_tiles = static_cast<std::int64_t>(host[1]);
  for (std::int64_t t = 0; t < s.Tq(); ++t) {
    const std::int64_t last = std::min(s.Lq, (t + 1) * cuda_kernels::entmax::kTileRows) - 1;
    stats.visible_tiles +=
        s.B * s.Hq * ceil_div(s.key_end(last), static_cast<std::int64_t>(cuda_kernels::entmax::kBlockKeys));
  }
  return stats;
}

}  // namespace sparse_attn::cuda_backend
