// Index tensors for the tensor-core screening of the index selectors (lightning's token form; token_max
// takes the quantisation and the amax from here): one pass over an index tensor writes
//   - codes: bf16 [rows, Dp] (Dp = Di rounded up to 16, zero padded), values without the per-tensor
//            scale: value = code * scale up to the dequantisation rounding (see below),
//   - norms: float32 [rows], an upper bound of the 2-norm of the code row (+inf when the row holds a
//            non-finite code or value), and per group of 128 rows of one (batch, head) their maximum.
//
// Why the codes are exact in bf16 (8 significant bits, float32's exponent range):
//   bf16: the value itself (already rounded to bf16), scale 1;
//   fp8:  code = e4m3 value (4 significant bits, magnitude in [2^-9, 448]), value = fl(code * ts);
//   fp4:  code = e2m1 value (2 bits) * the block scale's e4m3 value (4 bits): at most 6 significant
//         bits, magnitude in [2^-10, 2688]; value = fl(e2m1 * fl(e4m3 * ts)).
// So value = code * ts * (1 + d1) * (1 + d2) + eta with |d| <= 2^-24 and |eta| <= 2^-147 (the two
// roundings may underflow: each contributes at most half the smallest subnormal, times 6 for the
// e2m1 factor), which is what the screening bound below charges for.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend::tc {

using sel::imax;
using sel::imin;
using sel::In;
using sel::Prec;

/// An index tensor as read by the kernels: [B, L, H, D] (or [B, L, D] with H = 1), d contiguous.
struct IndexSrc {
  const void* x;
  std::int64_t sb, sl, sh;
  std::int64_t B, L, H, D;
  // Element offset of row (b * L + l) * H + h. 64-bit division costs ~100 instructions on the GPU,
  // far more than the row's quantisation when done per lane, so rows below 2^31 use 32-bit division.
  __device__ std::int64_t offset(std::int64_t row) const {
    if (row <= 0x7fffffff && H <= 0x7fffffff && L <= 0x7fffffff) {
      const auto r = static_cast<std::uint32_t>(row), h32 = static_cast<std::uint32_t>(H);
      const std::uint32_t bl = r / h32, h = r - bl * h32, l32 = static_cast<std::uint32_t>(L);
      const std::uint32_t b = bl / l32, l = bl - b * l32;
      return static_cast<std::int64_t>(b) * sb + static_cast<std::int64_t>(l) * sl + static_cast<std::int64_t>(h) * sh;
    }
    const std::int64_t h = row % H, l = (row / H) % L, b = row / (H * L);
    return b * sb + l * sl + h * sh;
  }
  // Index of the row's group of 128 consecutive l of one (b, h): (b * H + h) * ceil(L / 128) + l / 128.
  __device__ std::int64_t group(std::int64_t row) const {
    if (row <= 0x7fffffff && H <= 0x7fffffff && L <= 0x7fffffff) {
      const auto r = static_cast<std::uint32_t>(row), h32 = static_cast<std::uint32_t>(H);
      const std::uint32_t bl = r / h32, h = r - bl * h32, l32 = static_cast<std::uint32_t>(L);
      const std::uint32_t b = bl / l32, l = bl - b * l32;
      return (static_cast<std::int64_t>(b) * H + h) * ((L + kBlockK - 1) / kBlockK) + l / kBlockK;
    }
    const std::int64_t h = row % H, l = (row / H) % L, b = row / (H * L);
    return (b * H + h) * ((L + kBlockK - 1) / kBlockK) + l / kBlockK;
  }
};

inline IndexSrc index_src(const TensorView& t) {
  if (t.ndim == 3) return {t.data, t.stride[0], t.stride[1], 0, t.shape[0], t.shape[1], 1, t.shape[2]};
  return {t.data, t.stride[0], t.stride[1], t.stride[2], t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
}

constexpr int kGroup = 16;  // elements per lane step: the fp4 block, and one bf16 MMA k-step

inline std::int64_t padded_dim(std::int64_t Di) { return (Di + kGroup - 1) / kGroup * kGroup; }

/// Per-tensor scale of precision `p` from the amax word (1 for bf16), as the CPU's precision_tensor_scale.
__device__ __forceinline__ float tensor_scale(int p, const unsigned int* amax_bits) {
  if (p == static_cast<int>(Prec::bf16)) return 1.0f;
  const float amax = __uint_as_float(*amax_bits);
  return p == static_cast<int>(Prec::fp8) ? sel::tensor_scale_of<Prec::fp8>(amax) : sel::tensor_scale_of<Prec::fp4>(amax);
}

// Values of the hardware formats by rounding float bits directly, equal to e4m3_to_float(float_to_e4m3(y))
// and e2m1_to_float(float_to_e2m1(y)) of common.cuh (the CPU's round trips) for every float, in a
// fraction of the instructions (no frexp / ldexp / division). Normal range: round to nearest even on
// the float's bits, keeping 3 (e4m3) or 1 (e2m1) mantissa bits, a carry moving into the exponent as
// the CPU's m = 2^(mant + 1) does; below the smallest normal (2^-6, 1): multiples of the subnormal
// quantum (2^-9, 1/2) by rintf of an exact power-of-two scaling; saturation (448, 6) as the CPU's.
__device__ __forceinline__ float e4m3_value(float y) {
  // Every candidate is formed and one is selected, so a warp takes no branches here.
  const float a = fabsf(y);
  const std::uint32_t u = __float_as_uint(a);
  const float normal = __uint_as_float((u + 0x7ffffu + ((u >> 20) & 1u)) & ~0xfffffu);
  const float sub = rintf(a * 512.0f) * 0x1p-9f;
  const float r = a >= 448.0f ? 448.0f : a >= 0x1p-6f ? normal : sub;
  return isnan(y) ? __int_as_float(0x7fc00000) : copysignf(r, y);
}

__device__ __forceinline__ float e2m1_value(float y) {
  if (isnan(y)) return 6.0f;  // e2m1 has no NaN: the CPU saturates it to +6
  const float a = fabsf(y);
  float r;
  if (a >= 6.0f) {
    r = 6.0f;
  } else if (a >= 1.0f) {
    const std::uint32_t u = __float_as_uint(a);
    r = __uint_as_float((u + 0x1fffffu + ((u >> 22) & 1u)) & ~0x3fffffu);
  } else {
    r = rintf(a * 2.0f) * 0.5f;
  }
  return copysignf(r, y);
}

// x / d rounded to nearest even (IEEE, as __fdiv_rn), for a divisor shared by many quotients: its
// reciprocal is refined once. The quotient is __fdiv_rn's own fast path (y0 = rcp.approx(d), y = y0 +
// y0 (1 - d y0), q = x y, r = x - q d, q + r y: the same operations in the same order), taken only where
// |x| and |d| lie in [2^-60, 2^60], far inside the range that path serves; anything else (zeros,
// subnormals, huge values, NaN, infinities) goes through __fdiv_rn itself. DivisionMatchesFdivRn in the
// token_max GPU tests compares the two bit for bit over every exponent pair of that range.
struct Divisor {
  float d, y;
  bool fast;
};

__device__ __forceinline__ Divisor make_divisor(float d) {
  float y0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(d));
  const float ad = fabsf(d);
  return {d, fmaf(y0, fmaf(-d, y0, 1.0f), y0), ad >= 0x1p-60f && ad <= 0x1p60f};
}

__device__ __forceinline__ float div_rn(float x, const Divisor& v) {
  const float ax = fabsf(x);
  if (v.fast && ax >= 0x1p-60f && ax <= 0x1p60f) {
    const float q = __fmul_rn(x, v.y);
    return fmaf(fmaf(-q, v.d, x), v.y, q);
  }
  return __fdiv_rn(x, v.d);
}

// fp4 values and codes of x[0, cnt), part of a 16-element block whose largest |x| is `amax` (the CPU's
// block scale e4m3(amax / 6 / ts) * ts).
__device__ __forceinline__ void fp4_values(const float* x, int cnt, float ts, float amax, float* v, float* code) {
  if (ts == 0.0f) {
    for (int i = 0; i < cnt; ++i) v[i] = code[i] = x[i];
    return;
  }
  const float bs_code = e4m3_value(__fdiv_rn(__fdiv_rn(amax, 6.0f), ts));
  const float bs = __fmul_rn(bs_code, ts);
  const Divisor by_bs = make_divisor(bs);
  for (int i = 0; i < cnt; ++i) {
    if (bs == 0.0f) {
      v[i] = code[i] = 0.0f;
    } else {
      const float e = e2m1_value(div_rn(x[i], by_bs));
      v[i] = __fmul_rn(e, bs);
      code[i] = __fmul_rn(e, bs_code);  // exact: at most 6 significant bits
    }
  }
}

// Rounds x[0, cnt) through the precision exactly as the CPU's quantize_dequantize (values v) and returns the codes.
template <Prec P>
__device__ __forceinline__ void quantize_codes(const float* x, int cnt, float ts, float* v, float* code) {
  if constexpr (P == Prec::bf16) {
    for (int i = 0; i < cnt; ++i) v[i] = code[i] = sel::round_bf16(x[i]);
  } else {
    if (ts == 0.0f) {  // an all-zero tensor (or one whose amax underflows): values stay as they are
      for (int i = 0; i < cnt; ++i) v[i] = code[i] = x[i];
      return;
    }
    if constexpr (P == Prec::fp8) {
      const Divisor by_ts = make_divisor(ts);
      for (int i = 0; i < cnt; ++i) {
        code[i] = e4m3_value(div_rn(x[i], by_ts));
        v[i] = __fmul_rn(code[i], ts);
      }
    } else {
      float amax = 0.0f;
      for (int i = 0; i < cnt; ++i) amax = fmaxf(amax, fabsf(x[i]));
      fp4_values(x, cnt, ts, amax, v, code);
    }
  }
}

/// quantize_codes of the 8 consecutive elements one lane holds. fp4: the lane's 16-element block is its 8
/// and those of its xor-1 partner lane, whose amax they share by a shuffle (every lane of the warp calls).
template <Prec P>
__device__ __forceinline__ void quantize_lane8(const float (&x)[8], float ts, float (&v)[8], float (&c)[8]) {
  if constexpr (P == Prec::fp4) {
    float am = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) am = fmaxf(am, fabsf(x[i]));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    fp4_values(x, 8, ts, am, v, c);
  } else {
    quantize_codes<P>(x, 8, ts, v, c);
  }
}

__device__ __forceinline__ float load_elem_rt(const void* base, std::int64_t i, In t) {
  switch (t) {
    case In::f32: return sel::load_elem<In::f32>(base, i);
    case In::f16: return sel::load_elem<In::f16>(base, i);
    default: return sel::load_elem<In::bf16>(base, i);
  }
}

// ---- preparation of both index tensors ------------------------------------------------------------------
//
// A selector call prepares its two index tensors (queries, keys) in two launches, each covering both
// tensors (CTAs [0, blocks0) take tensor 0, the rest tensor 1): the amax words (fp8, fp4), then the
// codes and norms. Dense tensors with Di a power of two take prepare_dense (8 elements per lane, one
// 16-byte load); the others the row path: a warp takes kPrepRows rows at a time and issues the loads of
// all of them before it uses any; lane l holds elements [b + 4 l, b + 4 l + 4) of each 128-element
// stretch b, so all lanes are busy at Di = 128; fp4: the 4 lanes of a quad hold one 16-element block and
// share its amax by shuffles (a max is order-free, so it equals the CPU's). On the H200 the row path
// spends most of its instructions on index arithmetic (about 350 per row at Di = 128, ncu); the dense
// path is about 1.4x faster at tile16 (docs/notes/selectors.md, token_max v3).

constexpr int kPrepG = 4;       // elements per lane and stretch
constexpr int kPrepRows = 4;    // rows per warp and step
constexpr int kPrepThreads = 256;
static_assert(kGroup % kPrepG == 0 && 32 * kPrepG % kGroup == 0);

struct PrepOut {
  __nv_bfloat16* codes;    // [rows, Dp]
  float* norms;            // [rows]
  unsigned int* group_max; // [B, H, ceil(L / 128)] float bits, zeroed by the caller
  std::int64_t Dp;
};

/// Two index tensors of one launch; blocks0 CTAs serve tensor 0.
struct IndexPair {
  IndexSrc src[2];
  In type[2];
  PrepOut out[2];           // prepare only
  unsigned int* amax;       // [2] float bits: written by the amax launch, read by the preparation
  unsigned int blocks0;
};

// A 16-bit element's bits (bf16 or f16) as a float.
__device__ __forceinline__ float bits16_to_float(unsigned h, In t) {
  return t == In::bf16 ? __uint_as_float(h << 16) : __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

// Whether the tensor's rows are contiguous (pitch D, dense batch and head strides) from a 16-byte aligned
// base: then it is one flat array.
__device__ __forceinline__ bool contiguous_rows(const IndexSrc& s) {
  return (s.H == 1 || s.sh == s.D) && s.sl == s.H * s.D && (s.B == 1 || s.sb == s.L * s.H * s.D) &&
         reinterpret_cast<std::uintptr_t>(s.x) % 16 == 0;
}

// Elements [d0, d0 + cnt) (cnt <= kPrepG) of the row at element offset `off` as floats, zero past cnt or
// when off < 0 (no row); one 8- or 16-byte load where the four elements are aligned for it.
__device__ __forceinline__ void load_group(const void* x, In t, std::int64_t off, int d0, int cnt, float (&v)[kPrepG]) {
#pragma unroll
  for (int i = 0; i < kPrepG; ++i) v[i] = 0.0f;
  if (off < 0 || cnt <= 0) return;
  const std::int64_t e = off + d0;
  if (cnt == kPrepG) {
    if (t == In::f32) {
      const float* a = static_cast<const float*>(x) + e;
      if (reinterpret_cast<std::uintptr_t>(a) % 16 == 0) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(a));
        v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        return;
      }
    } else {
      const auto* a = static_cast<const unsigned short*>(x) + e;
      if (reinterpret_cast<std::uintptr_t>(a) % 8 == 0) {
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(a));
        const unsigned h[4] = {w.x & 0xffffu, w.x >> 16, w.y & 0xffffu, w.y >> 16};  // lower address first
#pragma unroll
        for (int i = 0; i < kPrepG; ++i) v[i] = bits16_to_float(h[i], t);
        return;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPrepG; ++i)
    if (i < cnt) v[i] = load_elem_rt(x, e + i, t);  // unrolled: a dynamic index would put v in local memory
}

struct PairSlice {
  int which;
  unsigned block, blocks;  // this CTA among the CTAs of its tensor
};
__device__ __forceinline__ PairSlice pair_slice(const IndexPair& pp) {
  const int which = blockIdx.x < pp.blocks0 ? 0 : 1;
  return {which, which ? blockIdx.x - pp.blocks0 : blockIdx.x, which ? gridDim.x - pp.blocks0 : pp.blocks0};
}

/// Largest |x| over each tensor as float bits (non-negative floats order like their bits); NaN is skipped
/// by fmaxf, as std::fmax does on the CPU. (A template so that the header can be included by several
/// translation units.)
template <int R = kPrepRows>
__global__ void __launch_bounds__(kPrepThreads) amax_pair_kernel(const __grid_constant__ IndexPair pp) {
  // Always a plain launch; lets a preparation launched as its programmatic dependent be scheduled.
  sel::pdl_launch_dependents();
  constexpr int G = kPrepG;
  const PairSlice ps = pair_slice(pp);
  const IndexSrc s = ps.which ? pp.src[1] : pp.src[0];
  const In t = ps.which ? pp.type[1] : pp.type[0];
  const std::int64_t rows = s.B * s.L * s.H;
  const int lane = threadIdx.x % 32, D = static_cast<int>(s.D);
  const std::int64_t warps = static_cast<std::int64_t>(ps.blocks) * (kPrepThreads / 32);
  float m = 0.0f;
  // A dense tensor is one flat array: 16-byte loads with a grid stride, no row arithmetic.
  const int es = t == In::f32 ? 4 : 2;
  const std::int64_t n = rows * s.D;
  const bool flat = contiguous_rows(s) && n * es % 16 == 0;
  if (flat) {
    const auto* v = static_cast<const uint4*>(s.x);
    auto fold = [&](const uint4& w) {
      const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (t == In::f32) {
          m = fmaxf(m, fabsf(__uint_as_float(u[k])));
        } else {  // the element at the lower address is the low half
          m = fmaxf(m, fabsf(bits16_to_float(u[k] & 0xffffu, t)));
          m = fmaxf(m, fabsf(bits16_to_float(u[k] >> 16, t)));
        }
      }
    };
    // Eight loads in flight per thread.
    constexpr int kInFlight = 8;
    const std::int64_t nv = n * es / 16, stride = static_cast<std::int64_t>(ps.blocks) * kPrepThreads;
    std::int64_t i = static_cast<std::int64_t>(ps.block) * kPrepThreads + threadIdx.x;
    for (; i + (kInFlight - 1) * stride < nv; i += kInFlight * stride) {
      uint4 w[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) w[u] = __ldg(v + i + u * stride);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) fold(w[u]);
    }
    for (; i < nv; i += stride) fold(__ldg(v + i));
  }
  for (std::int64_t row0 = (static_cast<std::int64_t>(ps.block) * (kPrepThreads / 32) + threadIdx.x / 32) * R;
       !flat && row0 < rows; row0 += warps * R) {
    std::int64_t off[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) off[rr] = row0 + rr < rows ? s.offset(row0 + rr) : -1;
    for (int base = 0; base < D; base += 32 * G) {
      const int d0 = base + lane * G, cnt = imax(0, imin(G, D - d0));
      float x[R][G];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) load_group(s.x, t, off[rr], d0, cnt, x[rr]);
#pragma unroll
      for (int rr = 0; rr < R; ++rr)
#pragma unroll
        for (int i = 0; i < G; ++i) m = fmaxf(m, fabsf(x[rr][i]));
    }
  }
  // One atomic per block: atomics on one address serialise in L2, so per-warp atomics from thousands
  // of warps would cost more than reading the tensor.
  __shared__ float red[kPrepThreads / 32];
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kPrepThreads / 32; ++w) m = fmaxf(m, red[w]);
    atomicMax(pp.amax + ps.which, __float_as_uint(m));
  }
}

// The group maxima of one CTA step: rows [0, n) of the step have group ids `group` (-1: no row) and norms
// `norm`. Each warp takes 32 of them at a time; the lanes holding one group id (__match_any_sync) reduce
// their norms with __reduce_max_sync (norms are >= 0 or +inf, so their float bits order like the values)
// and the lowest of them issues one atomic for the group. A group holds 128 consecutive rows when H = 1,
// so a step usually issues one atomic per group it touches (one per row put 128 on each address, and
// same-address atomics serialise in L2; a single thread scanning the run left the CTA waiting at the
// barrier for a third of the kernel's time on the H200). Every thread of the CTA calls it; it ends with
// the barrier after which the arrays may be rewritten.
__device__ __forceinline__ void flush_group_maxima(const long long* group, const float* norm, int n, unsigned int* group_max) {
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int base = static_cast<int>(threadIdx.x) - lane; base < n; base += static_cast<int>(blockDim.x)) {  // warp-uniform
    const int i = base + lane;
    const long long gi = i < n ? group[i] : -1;
    const unsigned bits = i < n ? __float_as_uint(norm[i]) : 0u;
    const unsigned same = __match_any_sync(0xffffffffu, gi);
    const unsigned m = __reduce_max_sync(same, bits);
    if (gi >= 0 && lane == __ffs(static_cast<int>(same)) - 1) atomicMax(group_max + gi, m);
  }
  __syncthreads();
}

// Rows per CTA step of the dense path at most (Di = 16: two lanes per row).
constexpr int kDenseMaxRows = kPrepThreads / 2;

/// Whether a tensor takes the dense path of the preparation: rows contiguous (pitch Di), a 16-byte aligned
/// base, Di in {16, 32, 64, 128, 256} (so Dp = Di and a row is a power-of-two segment of 8-element lanes
/// within a warp).
__device__ __forceinline__ bool dense_rows(const IndexSrc& s) {
  const bool pow2 = s.D == 16 || s.D == 32 || s.D == 64 || s.D == 128 || s.D == 256;
  return pow2 && contiguous_rows(s);
}

/// The dense path: lane l of a row's segment holds elements [8 l, 8 l + 8) (one or two 16-byte loads,
/// one 16-byte store of codes); the segment reduces the row's sum of squares and finiteness; the CTA's
/// step covers kPrepThreads / (Di / 8) consecutive rows and reduces their group maxima per run. Same
/// values and codes as the row path (the same quantisation of the same floats), and an upper bound of
/// the same norm (every partial sum rounds upward, in whatever order).
template <Prec P>
__device__ __forceinline__ void prepare_dense(const IndexSrc& s, In t, const PrepOut& o, float ts, unsigned block,
                                              unsigned blocks, long long* step_group, float* step_norm) {
  const std::int64_t rows = s.B * s.L * s.H;
  const int lpr = static_cast<int>(s.D) / 8, rows_per_step = kPrepThreads / lpr;
  const int seg = static_cast<int>(threadIdx.x) / lpr, sl = static_cast<int>(threadIdx.x) % lpr;
  const unsigned lane = threadIdx.x % 32;
  const unsigned seg_mask = lpr == 32 ? 0xffffffffu : ((1u << lpr) - 1u) << (lane & ~static_cast<unsigned>(lpr - 1));
  for (std::int64_t step_row = static_cast<std::int64_t>(block) * rows_per_step; step_row < rows;
       step_row += static_cast<std::int64_t>(blocks) * rows_per_step) {
    const std::int64_t row = step_row + seg;
    const bool in = row < rows;
    float x[8];
    if (in) {
      const std::int64_t e = row * s.D + sl * 8;
      if (t == In::f32) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(s.x) + e));
        const float4 b = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(s.x) + e + 4));
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
      } else {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(s.x) + e));
        const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) x[2 * k] = bits16_to_float(u[k] & 0xffffu, t), x[2 * k + 1] = bits16_to_float(u[k] >> 16, t);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    }
    float v[8], c[8];
    quantize_lane8<P>(x, ts, v, c);  // fp4: a 16-element block is the lanes 2 m, 2 m + 1 of the segment (lpr >= 2)
    float sq = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      finite = finite && isfinite(c[i]) && isfinite(v[i]);
      sq = __fmaf_ru(c[i], c[i], sq);
    }
    if (in) {
      const __nv_bfloat162 c01 = __floats2bfloat162_rn(c[0], c[1]), c23 = __floats2bfloat162_rn(c[2], c[3]);
      const __nv_bfloat162 c45 = __floats2bfloat162_rn(c[4], c[5]), c67 = __floats2bfloat162_rn(c[6], c[7]);
      *reinterpret_cast<uint4*>(o.codes + row * o.Dp + sl * 8) =
          make_uint4(*reinterpret_cast<const unsigned*>(&c01), *reinterpret_cast<const unsigned*>(&c23),
                     *reinterpret_cast<const unsigned*>(&c45), *reinterpret_cast<const unsigned*>(&c67));
    }
    for (int w = lpr / 2; w > 0; w /= 2) sq = __fadd_ru(sq, __shfl_xor_sync(0xffffffffu, sq, w));
    const bool fin = (__ballot_sync(0xffffffffu, !finite) & seg_mask) == 0u;
    if (sl == 0) {
      const float n = fin ? __fsqrt_ru(sq) : INFINITY;
      if (in) o.norms[row] = n;
      step_group[seg] = in ? s.group(row) : -1;
      step_norm[seg] = n;
    }
    flush_group_maxima(step_group, step_norm, rows_per_step, o.group_max);
  }
}

/// Codes, norms and group maxima of both tensors. Elements past Di (padding up to Dp) get zero codes.
template <Prec P>
__global__ void __launch_bounds__(kPrepThreads) prepare_pair_kernel(const __grid_constant__ IndexPair pp) {
  // As a programmatic dependent of the amax (launch_prepare_pair): wait for its words, then let the next
  // kernel be scheduled. Both are no-ops in a plain launch.
  sel::pdl_wait();
  sel::pdl_launch_dependents();
  constexpr int R = kPrepRows, G = kPrepG;
  const PairSlice ps = pair_slice(pp);
  // Selected by value, not by a dynamic index into the parameter arrays (which the compiler copies to the stack).
  const IndexSrc s = ps.which ? pp.src[1] : pp.src[0];
  const In t = ps.which ? pp.type[1] : pp.type[0];
  const PrepOut o = ps.which ? pp.out[1] : pp.out[0];
  const std::int64_t rows = s.B * s.L * s.H;
  const int lane = threadIdx.x % 32, D = static_cast<int>(s.D), Dp = static_cast<int>(o.Dp);
  const float ts = tensor_scale(static_cast<int>(P), pp.amax + ps.which);
  constexpr int kCtaRows = R * (kPrepThreads / 32);  // consecutive rows of one CTA step
  // The step's group ids and norms for flush_group_maxima.
  static_assert(kDenseMaxRows >= kCtaRows);
  __shared__ long long step_group[kDenseMaxRows];
  __shared__ float step_norm[kDenseMaxRows];
  if (dense_rows(s)) {  // uniform over the CTA
    prepare_dense<P>(s, t, o, ts, ps.block, ps.blocks, step_group, step_norm);
    return;
  }
  const int warp = threadIdx.x / 32;
  // The loop is uniform over the CTA (barriers inside): the CTA's warps take consecutive rows.
  for (std::int64_t cta_row = static_cast<std::int64_t>(ps.block) * kCtaRows; cta_row < rows;
       cta_row += static_cast<std::int64_t>(ps.blocks) * kCtaRows) {
    const std::int64_t row0 = cta_row + warp * R;
    std::int64_t off[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) off[rr] = row0 + rr < rows ? s.offset(row0 + rr) : -1;
    // Sum of squares rounded upward (every term is >= 0, so each upward rounding keeps an upper bound);
    // an overflow gives +inf, which the bound treats like a non-finite row.
    float sq[R];
    bool finite[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) sq[rr] = 0.0f, finite[rr] = true;
    for (int base = 0; base < Dp; base += 32 * G) {  // uniform across the warp (shuffles inside)
      const int d0 = base + lane * G;
      const int cnt = imax(0, imin(G, D - d0));
      float x[R][G];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) load_group(s.x, t, off[rr], d0, cnt, x[rr]);
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (off[rr] < 0) continue;  // warp-uniform
        const std::int64_t row = row0 + rr;
        float v[G], c[G];
        if constexpr (P == Prec::fp4) {
          float am = 0.0f;
#pragma unroll
          for (int i = 0; i < G; ++i) am = fmaxf(am, fabsf(x[rr][i]));
          am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
          am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
          fp4_values(x[rr], G, ts, am, v, c);
        } else {
          quantize_codes<P>(x[rr], G, ts, v, c);
        }
        float cz[G];
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const float ci = i < cnt ? c[i] : 0.0f;
          cz[i] = ci;
          if (i < cnt) {
            finite[rr] = finite[rr] && isfinite(ci) && isfinite(v[i]);
            sq[rr] = __fmaf_ru(ci, ci, sq[rr]);
          }
        }
        static_assert(G == 4);
        if (d0 < Dp) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(cz[0], cz[1]), hi = __floats2bfloat162_rn(cz[2], cz[3]);
          *reinterpret_cast<uint2*>(o.codes + row * o.Dp + d0) =
              make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
        }
      }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      float n = 0.0f;
      if (off[rr] >= 0) {  // warp-uniform
        float q = sq[rr];
        for (int w = 16; w > 0; w >>= 1) q = __fadd_ru(q, __shfl_xor_sync(0xffffffffu, q, w));
        const bool fin = __all_sync(0xffffffffu, finite[rr]);
        n = fin ? __fsqrt_ru(q) : INFINITY;
        if (lane == 0) o.norms[row0 + rr] = n;
      }
      if (lane == 0) {
        step_group[warp * R + rr] = off[rr] >= 0 ? s.group(row0 + rr) : -1;
        step_norm[warp * R + rr] = n;
      }
    }
    flush_group_maxima(step_group, step_norm, kCtaRows, o.group_max);
  }
}

/// CTAs per tensor of a pair launch: enough warps for every group of kPrepRows rows, at most `cap`.
inline unsigned pair_blocks(const IndexSrc& s, std::int64_t cap) {
  const std::int64_t rows = s.B * s.L * s.H, per_block = kPrepRows * (kPrepThreads / 32);
  return static_cast<unsigned>(imin<std::int64_t>((rows + per_block - 1) / per_block, cap));
}

/// The amax words of both tensors (amax[0], amax[1], zeroed by the caller), in one launch on `stream`.
/// `b` may be null (then only `a` is measured).
inline void launch_amax_pair(const TensorView& a, const TensorView* b, unsigned int* amax, cudaStream_t stream) {
  IndexPair pp{};
  pp.src[0] = index_src(a), pp.type[0] = sel::in_type(a.dtype);
  if (b != nullptr) pp.src[1] = index_src(*b), pp.type[1] = sel::in_type(b->dtype);
  pp.amax = amax;
  // About two CTAs per SM in all, shared in proportion to the tensors' elements: the max needs no more
  // parallelism than the bandwidth does, and every CTA ends in an atomic on one of two words (768 CTAs,
  // one load per thread, took 8.7 us for the 10 MB of tile16 at 16K on the H200).
  constexpr std::int64_t kCtas = 256;
  const double na = static_cast<double>(a.numel()), nb = b != nullptr ? static_cast<double>(b->numel()) : 0.0;
  const auto share = [&](double n) {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::llround(kCtas * n / std::max(1.0, na + nb))));
  };
  pp.blocks0 = pair_blocks(pp.src[0], share(na));
  const unsigned grid = pp.blocks0 + (b != nullptr ? pair_blocks(pp.src[1], share(nb)) : 0u);
  if (grid > 0) amax_pair_kernel<><<<grid, kPrepThreads, 0, stream>>>(pp);
}

/// Launches the amax (fp8, fp4) and the preparation of both index tensors on `stream`: two launches. With
/// `dependent`, the preparation is a programmatic dependent of the amax (it waits for it in-kernel), so its
/// launch overlaps the amax's tail; the first launch is always plain. `op` names the caller in errors.
inline void launch_prepare_pair(const TensorView& q, const TensorView& k, IndexPrecision prec, unsigned int* amax,
                                const PrepOut& oq, const PrepOut& ok, cudaStream_t stream, const std::string& op,
                                bool dependent = false) {
  const bool has_amax = prec != IndexPrecision::bf16;
  if (has_amax) launch_amax_pair(q, &k, amax, stream);
  IndexPair pp{};
  pp.src[0] = index_src(q), pp.type[0] = sel::in_type(q.dtype), pp.out[0] = oq;
  pp.src[1] = index_src(k), pp.type[1] = sel::in_type(k.dtype), pp.out[1] = ok;
  pp.amax = amax;
  pp.blocks0 = pair_blocks(pp.src[0], 4096);
  const unsigned grid = pp.blocks0 + pair_blocks(pp.src[1], 4096);
  if (grid == 0) return;
  void (*kernel)(IndexPair) = prec == IndexPrecision::bf16       ? prepare_pair_kernel<Prec::bf16>
                              : prec == IndexPrecision::fp8_e4m3 ? prepare_pair_kernel<Prec::fp8>
                                                                 : prepare_pair_kernel<Prec::fp4>;
  sel::launch_kernel(op, "preparation launch", kernel, dim3(grid), dim3(kPrepThreads), 0, stream, dependent && has_amax,
                     pp);
}

// ---- the screening bound -----------------------------------------------------------------------------
//
// Exact score (the CPU's): s = sum_d vq_d * vk_d in float64, d in order. Screened score:
// s^ = fl(fl(T^ * sq) * sk), T^ the tensor-core float32 dot of the bf16 codes, sq and sk the per-tensor
// scales. With S = sum_d |cq_d ck_d| <= |cq| |ck| (Cauchy-Schwarz; |.| the code-row norms bounded
// above by `norms`), P = sq sk |cq| |ck| and n = Dp / 16 MMA k-steps:
//  1. tensor cores: each m16n8k16 step adds 16 exact products (8 x 8 bits fit float32) to the
//     accumulator. Hopper's float32 accumulation is not IEEE: terms are aligned to the largest
//     exponent and truncated (>= 24 bits kept), then normalised once. Per step the error is at most
//     17 * 2^-23 * max|term| + 2^-23 |result| <= 2^-18 * (|acc| + sum of the step's |products|), even
//     if a step is internally two chained k = 8 halves (20 * 2^-23); both are <= S (1 + tiny). Products
//     or partial sums below 2^-126 may be flushed: <= 17 * 2^-126 < 2^-121 per step. Total:
//     |T^ - T| <= n 2^-18 S + n 2^-121.
//  2. scaling: two float32 roundings, 2^-23 relative to |T^ sq sk| plus underflow: 2^-149 (1 + sk).
//  3. dequantisation (tc_index.cuh header): |vq vk - cq ck sq sk| <= (4 * 2^-24 + tiny) |cq ck| sq sk
//     plus eta terms: sum |eta_q vk| + |vq eta_k| <= 2^-146 sqrt(Di) (|vq| + |vk|), plus Di 2^-294.
//  4. the CPU's float64 sum: <= Di 2^-53 sum |vq vk|, below 2^-40 P for Di <= 2^13.
// Hence |s^ - s| <= (n 2^-18 + 2^-19) P + 2^-146 sqrt(Di) (nq' + nk') + n 2^-121 sq sk
//                   + 2^-148 (1 + sk) + 2^-140,
// with nq' = sq |cq| and nk' = sk |ck| (the 2^-19 covers items 2-4 with room to spare). A user evaluates
// every term in float32 rounded upward, so its computed E is >= the bound. When a norm is +inf (a
// non-finite value), when sq, sk or the score are not finite, or when |cq| |ck| > 2^120 (float32 overflow
// inside the MMA becomes possible), no finite E holds.
struct BoundConsts {
  float rel;     // n 2^-18 + 2^-19
  float deq;     // 2^-146 sqrt(Di)
  float tc_abs;  // n 2^-121
};

inline BoundConsts bound_consts(std::int64_t Di, std::int64_t Dp) {
  const double n = static_cast<double>(Dp / kGroup);
  BoundConsts c;
  c.rel = static_cast<float>(n * 0x1p-18 + 0x1p-19);  // exact in float for n < 2^20
  c.deq = static_cast<float>(std::ldexp(std::sqrt(static_cast<double>(Di)) * (1.0 + 0x1p-20), -146));
  c.tc_abs = static_cast<float>(n * 0x1p-121);
  return c;
}

}  // namespace sparse_attn::cuda_backend::tc
