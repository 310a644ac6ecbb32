// Index tensors for the tensor-core screening of the index selectors (token_max; lightning can use the
// same): one pass over an index tensor writes
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
// The float64 re-scoring path recomputes the CPU's dequantised values (load_quantized) of the few rows it
// needs from the input with the same function (row_values), instead of storing a float32 copy.
// So value = code * ts * (1 + d1) * (1 + d2) + eta with |d| <= 2^-24 and |eta| <= 2^-147 (the two
// roundings may underflow: each contributes at most half the smallest subnormal, times 6 for the
// e2m1 factor), which is what the screening bound (score_interval) charges for.
#pragma once

#include <cuda_bf16.h>

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

/// Largest |x| over the tensor as float bits (non-negative floats order like their bits); NaN is
/// skipped by fmaxf, as std::fmax does on the CPU.
template <In T>
__global__ void amax_kernel(const IndexSrc s, unsigned int* amax_bits) {
  const std::int64_t rows = s.B * s.L * s.H;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  float m = 0.0f;
  for (std::int64_t row = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const std::int64_t off = s.offset(row);
    for (std::int64_t d = threadIdx.x % 32; d < s.D; d += 32) m = fmaxf(m, fabsf(sel::load_elem<T>(s.x, off + d)));
  }
  // One atomic per block: atomics on one address serialise in L2, so per-warp atomics from thousands
  // of warps would cost more than reading the tensor.
  __shared__ float red[32];
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = fmaxf(m, red[w]);
    atomicMax(amax_bits, __float_as_uint(m));
  }
}

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
  if (isnan(y)) return __int_as_float(0x7fc00000);
  const float a = fabsf(y);
  float r;
  if (a >= 448.0f) {
    r = 448.0f;
  } else if (a >= 0x1p-6f) {
    const std::uint32_t u = __float_as_uint(a);
    r = __uint_as_float((u + 0x7ffffu + ((u >> 20) & 1u)) & ~0xfffffu);
  } else {
    r = rintf(a * 512.0f) * 0x1p-9f;
  }
  return copysignf(r, y);
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

// fp4 values and codes of x[0, cnt), part of a 16-element block whose largest |x| is `amax` (the CPU's
// block scale e4m3(amax / 6 / ts) * ts).
__device__ __forceinline__ void fp4_values(const float* x, int cnt, float ts, float amax, float* v, float* code) {
  if (ts == 0.0f) {
    for (int i = 0; i < cnt; ++i) v[i] = code[i] = x[i];
    return;
  }
  const float bs_code = e4m3_value(__fdiv_rn(__fdiv_rn(amax, 6.0f), ts));
  const float bs = __fmul_rn(bs_code, ts);
  for (int i = 0; i < cnt; ++i) {
    if (bs == 0.0f) {
      v[i] = code[i] = 0.0f;
    } else {
      const float e = e2m1_value(__fdiv_rn(x[i], bs));
      v[i] = __fmul_rn(e, bs);
      code[i] = __fmul_rn(e, bs_code);  // exact: at most 6 significant bits
    }
  }
}

// Rounds x[0, cnt) through the precision exactly as sel::quantize_row (values v) and returns the codes.
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
      for (int i = 0; i < cnt; ++i) {
        code[i] = e4m3_value(__fdiv_rn(x[i], ts));
        v[i] = __fmul_rn(code[i], ts);
      }
    } else {
      float amax = 0.0f;
      for (int i = 0; i < cnt; ++i) amax = fmaxf(amax, fabsf(x[i]));
      fp4_values(x, cnt, ts, amax, v, code);
    }
  }
}

struct PrepOut {
  __nv_bfloat16* codes;    // [rows, Dp]
  float* norms;            // [rows]
  unsigned int* group_max; // [B, H, ceil(L / 128)] float bits, zeroed by the caller
  std::int64_t Dp;
};

// One warp per row; lane l handles elements [b + 4 l, b + 4 l + 4) of each 128-element stretch b, so all
// lanes are busy at Di = 128. fp4: the 4 lanes of a quad hold one 16-element block and share its amax
// by shuffles (a max is order-free, so it equals the CPU's). Elements past Di (padding up to Dp) get
// zero codes.
template <In T, Prec P>
__global__ void __launch_bounds__(256) prepare_kernel(const IndexSrc s, int prec, const unsigned int* amax_bits,
                                                      const PrepOut o) {
  constexpr int G = 4;
  static_assert(kGroup % G == 0 && 32 * G % kGroup == 0);
  const std::int64_t rows = s.B * s.L * s.H;
  const int lane = threadIdx.x % 32, D = static_cast<int>(s.D), Dp = static_cast<int>(o.Dp);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const float ts = tensor_scale(prec, amax_bits);
  for (std::int64_t row = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const std::int64_t off = s.offset(row);
    // Sum of squares rounded upward (every term is >= 0, so each upward rounding keeps an upper bound);
    // an overflow gives +inf, which the bound treats like a non-finite row.
    float sq = 0.0f;
    bool finite = true;
    for (int base = 0; base < Dp; base += 32 * G) {  // uniform across the warp (shuffles inside)
      const int d0 = base + lane * G;
      const int cnt = imax(0, imin(G, D - d0));
      float x[G], v[G], c[G];
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = i < cnt ? sel::load_elem<T>(s.x, off + d0 + i) : 0.0f;
      if constexpr (P == Prec::fp4) {
        float am = 0.0f;
#pragma unroll
        for (int i = 0; i < G; ++i) am = fmaxf(am, fabsf(x[i]));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
        fp4_values(x, G, ts, am, v, c);
      } else {
        quantize_codes<P>(x, G, ts, v, c);
      }
      __align__(8) __nv_bfloat16 cb[G];
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const float ci = i < cnt ? c[i] : 0.0f;
        cb[i] = __float2bfloat16_rn(ci);
        if (i < cnt) {
          finite = finite && isfinite(ci) && isfinite(v[i]);
          sq = __fmaf_ru(ci, ci, sq);
        }
      }
      if (d0 < Dp) *reinterpret_cast<uint2*>(o.codes + row * o.Dp + d0) = *reinterpret_cast<const uint2*>(cb);
    }
    for (int w = 16; w > 0; w >>= 1) sq = __fadd_ru(sq, __shfl_xor_sync(0xffffffffu, sq, w));
    finite = __all_sync(0xffffffffu, finite);
    if (lane == 0) {
      const float n = finite ? __fsqrt_ru(sq) : INFINITY;
      o.norms[row] = n;
      atomicMax(o.group_max + s.group(row), __float_as_uint(n));
    }
  }
}

__device__ __forceinline__ float load_elem_rt(const void* base, std::int64_t i, In t) {
  switch (t) {
    case In::f32: return sel::load_elem<In::f32>(base, i);
    case In::f16: return sel::load_elem<In::f16>(base, i);
    default: return sel::load_elem<In::bf16>(base, i);
  }
}

/// The CPU's dequantised values of elements [d0, d0 + cnt) (cnt <= 16, d0 a multiple of 16) of the row
/// at element offset `off`: the same arithmetic as prepare_kernel, so the same floats.
__device__ __forceinline__ void group_values(const IndexSrc& s, In t, int prec, float ts, std::int64_t off,
                                             std::int64_t d0, int cnt, float* v) {
  float x[kGroup], c[kGroup];
  for (int i = 0; i < cnt; ++i) x[i] = load_elem_rt(s.x, off + d0 + i, t);
  if (prec == static_cast<int>(Prec::bf16)) quantize_codes<Prec::bf16>(x, cnt, ts, v, c);
  else if (prec == static_cast<int>(Prec::fp8)) quantize_codes<Prec::fp8>(x, cnt, ts, v, c);
  else quantize_codes<Prec::fp4>(x, cnt, ts, v, c);
}

/// Launches amax (fp8, fp4) and the preparation of one index tensor on `stream`.
inline void launch_prepare(const TensorView& t, IndexPrecision prec, unsigned int* amax, const PrepOut& o,
                           cudaStream_t stream) {
  const IndexSrc s = index_src(t);
  const std::int64_t rows = s.B * s.L * s.H;
  const In in = sel::in_type(t.dtype);
  if (prec != IndexPrecision::bf16) {
    const unsigned blocks = static_cast<unsigned>(imin<std::int64_t>((rows + 7) / 8, 512));
    switch (in) {
      case In::f32: amax_kernel<In::f32><<<blocks, 256, 0, stream>>>(s, amax); break;
      case In::f16: amax_kernel<In::f16><<<blocks, 256, 0, stream>>>(s, amax); break;
      case In::bf16: amax_kernel<In::bf16><<<blocks, 256, 0, stream>>>(s, amax); break;
    }
  }
  const unsigned blocks = static_cast<unsigned>(imin<std::int64_t>((rows + 7) / 8, 8192));
  const int p = prec == IndexPrecision::bf16 ? static_cast<int>(Prec::bf16)
                : prec == IndexPrecision::fp8_e4m3 ? static_cast<int>(Prec::fp8)
                                                   : static_cast<int>(Prec::fp4);
  auto go = [&](auto kernel) { kernel<<<blocks, 256, 0, stream>>>(s, p, amax, o); };
#define SA_TC_PREP(T)                                                                         \
  switch (prec) {                                                                             \
    case IndexPrecision::bf16: go(prepare_kernel<T, Prec::bf16>); break;                      \
    case IndexPrecision::fp8_e4m3: go(prepare_kernel<T, Prec::fp8>); break;                   \
    case IndexPrecision::fp4_e2m1: go(prepare_kernel<T, Prec::fp4>); break;                   \
  }
  switch (in) {
    case In::f32: SA_TC_PREP(In::f32) break;
    case In::f16: SA_TC_PREP(In::f16) break;
    case In::bf16: SA_TC_PREP(In::bf16) break;
  }
#undef SA_TC_PREP
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
// with nq' = sq |cq| and nk' = sk |ck| (the 2^-19 covers items 2-4 with room to spare). Every term is
// evaluated in float32 rounded upward, so the computed E is >= the bound. A block (or tile) score is a
// max over pairs, and |max s^ - max s| <= max E, so the largest query and key norms of the block give
// its E. When a norm is +inf (a non-finite value), when sq, sk or the score are not finite, or when
// |cq| |ck| > 2^120 (float32 overflow inside the MMA becomes possible), the interval is everything.
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

/// [lo, hi] holding the exact score for the screened code-space maximum m, scales sq, sk and code
/// norm bounds nq, nk (see above).
__device__ __forceinline__ void score_interval(float m, float sq, float sk, float nq, float nk, const BoundConsts& c,
                                               float& lo, float& hi) {
  lo = -INFINITY;
  hi = INFINITY;
  const float nn = __fmul_ru(nq, nk);
  if (!(nn <= 0x1p120f) || !isfinite(sq) || !isfinite(sk)) return;
  const float s = __fmul_rn(__fmul_rn(m, sq), sk);
  if (!isfinite(s)) return;
  const float nqr = __fmul_ru(nq, sq), nkr = __fmul_ru(nk, sk);
  float e = __fmul_ru(c.rel, __fmul_ru(nqr, nkr));
  e = __fadd_ru(e, __fmul_ru(c.deq, __fadd_ru(nqr, nkr)));
  e = __fadd_ru(e, __fmul_ru(c.tc_abs, __fmul_ru(sq, sk)));
  e = __fadd_ru(e, __fmul_ru(0x1p-148f, __fadd_ru(sk, 1.0f)));
  e = __fadd_ru(e, 0x1p-140f);
  if (!isfinite(e)) return;
  lo = __fsub_rd(s, e);
  hi = __fadd_ru(s, e);
}

}  // namespace sparse_attn::cuda_backend::tc
