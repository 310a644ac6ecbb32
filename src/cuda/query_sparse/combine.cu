// Phase 3 of query_sparse: the LSE-weighted combine of each (query, head)'s partial outputs.
//
// The phase streams every chosen partial row once, so its floor is those bytes at DRAM bandwidth
// (query-long: 4.3 GB of bf16 partials, about 1.1 ms on the H200). One warp owns one (b, group,
// query) and a tile of the group's heads: the partial rows of those heads for one slot are
// contiguous ([B, Hkv, Lq, Kq, group, D]; a bf16 row's columns in the attention kernel's fragment
// order, bf16_part_position), so each lane moves 16 bytes per load (streaming hint: the
// partials are read once), the idx row is read once per warp (a ballot gives the chosen slots), and
// the tile's lse_part values feed one pass that gives every head's LSE. The tile is as wide as
// kMaxChunks 16-byte loads per lane allow (4 heads of f32 or 8 of bf16 partials at D = 128); a
// wider group takes several warps; a tile narrower than 32 chunks (MHA, or two heads at D = 64)
// splits its slots over groups of lanes instead of leaving lanes idle. Several slots' loads are
// issued before any is accumulated. Every lane adds its slots in slot order and every cross-lane
// reduction runs in a fixed shuffle order, so the result does not depend on timing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/partials.cuh"

namespace sparse_attn::cuda_kernels::qs {
namespace {

// Four warps per CTA: with 96-121 registers per thread, 128-thread CTAs leave fewer registers of an
// SM unused than 256-thread ones (20 resident warps instead of 16 at 96 registers).
constexpr int kCombineThreads = 128;
constexpr unsigned kFull = 0xffffffffu;
// 16-byte loads per lane per slot: bounds the accumulators (4 x 8 bf16 columns = 32 floats per lane)
// and keeps registers low enough for 16-20 resident warps per SM.
constexpr int kMaxChunks = 4;
// 16-byte loads a lane issues before it accumulates any: 128 bytes per lane, 4 KB per warp in
// flight, enough with a few warps per SM to cover the DRAM latency.
constexpr int kLoadsInFlight = 8;

// Slots whose loads a lane issues together: kLoadsInFlight / C, at most 4 (eight slots of one chunk
// made ptxas spill).
constexpr int slots_per_round(int C) { return C >= kLoadsInFlight ? 1 : (kLoadsInFlight / C < 4 ? kLoadsInFlight / C : 4); }

// Word i of a 16-byte chunk (i known at compile time after unrolling: no local array).
__device__ __forceinline__ unsigned word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// 16 bytes of partials: 4 f32 or 8 bf16 values.
template <class Part>
struct PartChunk;

// Packed words x[0..3] of the lanes of a quad: afterwards lane q holds word q of every lane of its quad
// in lane order (x[j] = the old x[q] of lane j). Two xor-shuffle rounds; every lane must take part.
__device__ __forceinline__ void quad_transpose(std::uint32_t (&x)[4], int lane) {
  const bool odd = lane & 1, hi = lane & 2;
  std::uint32_t r0 = __shfl_xor_sync(kFull, odd ? x[0] : x[1], 1);
  std::uint32_t r1 = __shfl_xor_sync(kFull, odd ? x[2] : x[3], 1);
  const std::uint32_t u[4] = {odd ? r0 : x[0], odd ? x[1] : r0, odd ? r1 : x[2], odd ? x[3] : r1};
  r0 = __shfl_xor_sync(kFull, hi ? u[0] : u[2], 2);
  r1 = __shfl_xor_sync(kFull, hi ? u[1] : u[3], 2);
  x[0] = hi ? r0 : u[0];
  x[1] = hi ? r1 : u[1];
  x[2] = hi ? u[2] : r0;
  x[3] = hi ? u[3] : r1;
}

template <>
struct PartChunk<PartF32> {
  static constexpr int kElems = 4;
  static constexpr int kBytes = 4;
  __device__ static float get(const uint4& v, int k) { return __uint_as_float(word(v, k)); }
};

template <>
struct PartChunk<PartBf16> {
  static constexpr int kElems = 8;
  static constexpr int kBytes = 2;
  // A bf16 is the high half of the f32 with the same bits.
  __device__ static float get(const uint4& v, int k) {
    const unsigned w = word(v, k / 2);
    return __uint_as_float(k % 2 == 0 ? w << 16 : w & 0xffff0000u);
  }
};

struct CombineShape {
  int heads = 1;      // heads per warp (the tile)
  int head_bits = 0;  // log2 of the power of two >= heads: lanes hh, hh + 2^bits, ... share head hh
  int tiles = 1;      // ceil(group / heads)
  bool vec_out = false;  // out's base and strides allow one store per chunk
  int slot_groups = 1;   // lanes split over the slots when a tile's row has fewer than 32 chunks (C = 1)
};

// The set bits of `mask` whose rank (from bit 0) is grp, grp + n, grp + 2n, ...
__device__ __forceinline__ unsigned every_nth_bit(unsigned mask, int grp, int n) {
  unsigned out = 0;
  for (int r = 0; mask != 0; mask &= mask - 1, ++r)
    if (r % n == grp) out |= mask & (0u - mask);
  return out;
}

template <class T, int D, class Part, int C>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const __grid_constant__ Params p,
                                                                  const CombineShape cs) {
  using PC = PartChunk<Part>;
  constexpr int kV = PC::kElems;
  constexpr int kUnroll = slots_per_round(C);
  const long long w = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= static_cast<long long>(p.B) * p.Hkv * p.Lq * cs.tiles) return;  // whole warps leave together
  const int tile = static_cast<int>(w % cs.tiles);
  const long long r = w / cs.tiles;
  const int qi = static_cast<int>(r % p.Lq);
  const long long bg = r / p.Lq, b = bg / p.Hkv, g = bg % p.Hkv;
  const int h0 = tile * cs.heads;
  const int nh = min(cs.heads, p.group - h0);
  const std::int32_t* row = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + qi * p.idx_stride[2];
  const long long slot0 = (bg * p.Lq + qi) * p.Kq;
  const float* lp = p.lse_part + slot0 * p.group + h0;  // (slot s, head hh) at lp[s * group + hh]

  // Chosen slots of [sb, sb + 32) as a warp-uniform bit mask; the first batch is kept.
  auto batch_mask = [&](int sb) -> unsigned {
    const int s = sb + lane;
    const int j = s < p.Kq ? row[static_cast<long long>(s) * p.idx_stride[3]] : -1;
    return __ballot_sync(kFull, chosen(p, qi, j));
  };

  // LSE of each head in one pass: lane (my_h, my_k) folds slots my_k, my_k + kstep, ... of each batch
  // into a running (max, sum), loading four at a time whether chosen or not (the mask drops the
  // others), so that the first loads overlap the idx row's. Lanes of one head then merge by xor
  // shuffles over the offsets >= 2^head_bits; the merge is symmetric, so both lanes of a pair agree.
  const int hp = 1 << cs.head_bits;
  const int my_h = lane & (hp - 1), my_k = lane >> cs.head_bits, kstep = 32 >> cs.head_bits;
  const bool head_ok = my_h < nh;
  auto load4 = [&](int sb, int k0, float (&a)[4]) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int k = k0 + t * kstep, s = sb + k;
      a[t] = head_ok && k < 32 && s < p.Kq ? lp[static_cast<long long>(s) * p.group + my_h] : -INFINITY;
    }
  };
  // A NaN partial LSE (a NaN or +inf score in that slot's block, docs/design.md §2) is passed over by fmaxf
  // but makes sum NaN for good, and with it the head's LSE, every weight and the output. While the
  // max is -inf (only empty or NaN partials so far) the terms are taken against 0 instead: empty ones
  // add exp(-inf) = 0, NaN ones NaN.
  float m = -INFINITY, sum = 0.0f;
  auto fold4 = [&](const float (&a)[4], unsigned mask, int k0) {
    float x[4], mx = m;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int k = k0 + t * kstep;
      x[t] = k < 32 && ((mask >> k) & 1u) ? a[t] : -INFINITY;
      mx = fmaxf(mx, x[t]);
    }
    const float base = mx == -INFINITY ? 0.0f : mx;
    float acc_sum = sum * expf(m - base);
#pragma unroll
    for (int t = 0; t < 4; ++t) acc_sum += expf(x[t] - base);
    m = mx;
    sum = acc_sum;
  };
  float a4[4];
  load4(0, my_k, a4);
  const unsigned mask0 = batch_mask(0);
  for (int sb = 0; sb < p.Kq; sb += 32) {
    const unsigned mask = sb == 0 ? mask0 : batch_mask(sb);
    for (int k0 = my_k; k0 < 32; k0 += 4 * kstep) {
      if (sb != 0 || k0 != my_k) load4(sb, k0, a4);
      fold4(a4, mask, k0);
    }
  }
  for (int off = 16; off >= hp; off >>= 1) {
    const float mo = __shfl_xor_sync(kFull, m, off), so = __shfl_xor_sync(kFull, sum, off);
    const float mx = fmaxf(m, mo), base = mx == -INFINITY ? 0.0f : mx;  // as in fold4
    sum = sum * expf(m - base) + so * expf(mo - base);
    m = mx;
  }
  const float lse_h = m + logf(sum);  // no chosen partial: -inf + log 0 = -inf; a NaN one: NaN

  // Rows narrower than the warp (C = 1, fewer than 32 chunks) split the slots over slot groups of
  // `ls` lanes: group grp takes the chosen slots of rank grp, grp + sg, ... of each batch, and the
  // groups' sums meet in a fixed xor tree at the end.
  const int sg = C == 1 ? cs.slot_groups : 1;
  const int ls = 32 / sg, grp = lane / ls, lane_in = lane % ls;

  // Lane's chunks: element e of the tile's contiguous heads x D of one slot, head e / D.
  int hh[C], col[C];
  bool ok[C];
  float lse_c[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int e = (lane_in + ls * c) * kV;
    ok[c] = e < nh * D;
    hh[c] = e / D;
    col[c] = e % D;
    lse_c[c] = __shfl_sync(kFull, lse_h, hh[c] & 31);
    // A head with no finite partial LSE has no chosen slot with weight: +inf makes every weight 0.
    if (lse_c[c] == -INFINITY) lse_c[c] = INFINITY;
  }

  float acc[C][kV];
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int k = 0; k < kV; ++k) acc[c][k] = 0.0f;
  // Per-chunk addresses of slot 0; slot s adds s rows of the group.
  const std::size_t slot_bytes = static_cast<std::size_t>(PC::kBytes) * p.group * D;
  const char* src[C];
  const float* wsrc[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    src[c] = static_cast<const char*>(p.part) +
             PC::kBytes * ((slot0 * p.group + h0 + hh[c]) * static_cast<long long>(D) + col[c]);
    wsrc[c] = lp + hh[c];
  }
  for (int sb = 0; sb < p.Kq; sb += 32) {
    unsigned mask = sb == 0 ? mask0 : batch_mask(sb);
    if (sg > 1) mask = every_nth_bit(mask, grp, sg);
    while (mask != 0) {
      int ss[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        ss[u] = -1;
        if (mask != 0) {
          ss[u] = sb + __ffs(mask) - 1;
          mask &= mask - 1;
        }
      }
      uint4 x[kUnroll][C];
      float wgt[kUnroll][C];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int c = 0; c < C; ++c) {
          x[u][c] = make_uint4(0, 0, 0, 0);
          wgt[u][c] = 0.0f;
          if (ss[u] >= 0 && ok[c]) {
            x[u][c] = __ldcs(reinterpret_cast<const uint4*>(src[c] + ss[u] * slot_bytes));
            wgt[u][c] = expf(wsrc[c][ss[u] * p.group] - lse_c[c]);
          }
        }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (ss[u] >= 0) {
#pragma unroll
          for (int c = 0; c < C; ++c)
#pragma unroll
            for (int k = 0; k < kV; ++k) acc[c][k] = fmaf(wgt[u][c], PC::get(x[u][c], k), acc[c][k]);
        }
    }
  }

  if (sg > 1) {
    for (int off = ls; off < 32; off <<= 1)
#pragma unroll
      for (int k = 0; k < kV; ++k) acc[0][k] += __shfl_xor_sync(kFull, acc[0][k], off);
  }

  char* out = static_cast<char*>(p.out);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    std::uint32_t packed[kV / 2];
#pragma unroll
    for (int k = 0; k < kV / 2; ++k) packed[k] = T::pack(acc[c][2 * k], acc[c][2 * k + 1]);
    if constexpr (Part::kFragmentOrder) {
      // The chunk of row chunk index cc holds columns 8 (4 (cc / 4) + t) + 2 (cc % 4) + {0, 1}, t = 0..3
      // (bf16_part_position); cc % 4 is lane % 4 and a quad's chunks are consecutive, so a transpose
      // inside the quad gives each lane the 8 contiguous columns at col[c].
      quad_transpose(packed, lane);
    }
    if (!ok[c] || grp != 0) continue;
    const long long h = g * p.group + h0 + hh[c];
    char* o = out + sizeof(std::uint16_t) * (b * p.out_stride[0] + qi * p.out_stride[1] + h * p.out_stride[2] + col[c]);
    if (cs.vec_out) {
      if constexpr (kV == 8)
        *reinterpret_cast<uint4*>(o) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      else
        *reinterpret_cast<uint2*>(o) = make_uint2(packed[0], packed[1]);
    } else {
#pragma unroll
      for (int k = 0; k < kV; ++k)
        *reinterpret_cast<std::uint16_t*>(o + sizeof(std::uint16_t) * k) =
            static_cast<std::uint16_t>(k % 2 == 0 ? packed[k / 2] : packed[k / 2] >> 16);
    }
  }
  if (lane < nh && p.lse != nullptr)
    p.lse[b * p.lse_stride[0] + (g * p.group + h0 + lane) * p.lse_stride[1] + qi * p.lse_stride[2]] = lse_h;
}

template <class T, int D, class Part, int C>
cudaError_t combine(const Params& p, const CombineShape& cs, cudaStream_t stream) {
  const long long warps = static_cast<long long>(p.B) * p.Hkv * p.Lq * cs.tiles;
  const long long blocks = (warps + kCombineThreads / 32 - 1) / (kCombineThreads / 32);
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  combine_kernel<T, D, Part, C><<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(p, cs);
  return cudaGetLastError();
}

template <class T, int D, class Part>
struct CombineOp {
  static cudaError_t run(const Params& p, cudaStream_t stream) {
    constexpr int kV = PartChunk<Part>::kElems;
    // Widest tile within kMaxChunks loads per lane (and 32 heads, one per lane for the LSE), then
    // balanced over the warps a group needs.
    constexpr int kMaxHeads = 32 * kMaxChunks * kV / D < 32 ? 32 * kMaxChunks * kV / D : 32;
    CombineShape cs;
    cs.tiles = (p.group + kMaxHeads - 1) / kMaxHeads;
    cs.heads = (p.group + cs.tiles - 1) / cs.tiles;
    while ((1 << cs.head_bits) < cs.heads) ++cs.head_bits;
    const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(p.out);
    const long long align = kV;  // elements per store
    cs.vec_out = base % (align * sizeof(std::uint16_t)) == 0 && p.out_stride[0] % align == 0 &&
                 p.out_stride[1] % align == 0 && p.out_stride[2] % align == 0;
    const int row_chunks = cs.heads * D / kV;
    const int chunks = (row_chunks + 31) / 32;
    if (chunks <= 1) {
      int lanes = 1;
      while (lanes < row_chunks) lanes <<= 1;
      cs.slot_groups = 32 / lanes;
    }
    if (chunks <= 1) return combine<T, D, Part, 1>(p, cs, stream);
    if (chunks <= 2) return combine<T, D, Part, 2>(p, cs, stream);
    return combine<T, D, Part, kMaxChunks>(p, cs, stream);
  }
};

}  // namespace

cudaError_t launch_combine(const Params& p, bool bf16, int D, bool bf16_partials, cudaStream_t stream) {
  if (static_cast<long long>(p.B) * p.Hkv * p.Lq * p.group == 0) return cudaSuccess;
  // With merged slots the merged lists say which slots hold a partial (one per piece).
  return dispatch<CombineOp>(bf16, D, bf16_partials, index_view(p), stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
