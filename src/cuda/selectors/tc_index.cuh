// Quantisation arithmetic of the index selectors' codes (token_max, lightning; their preparation kernels
// are in prep.cuh): the CPU's load_quantized (src/selectors/quantize.cpp) rounding, bit for bit, in few
// instructions, and the tensor-core accumulation analysis the selectors' bounds cite (end of the file).
// A code is a value without the per-tensor scale: value = code * scale up to the dequantisation rounding.
//
// Why the codes are exact in bf16 (8 significant bits, float32's exponent range):
//   bf16: the value itself (already rounded to bf16), scale 1;
//   fp8:  code = e4m3 value (4 significant bits, magnitude in [2^-9, 448]), value = fl(code * ts);
//   fp4:  code = e2m1 value (2 bits) * the block scale's e4m3 value (4 bits): at most 6 significant
//         bits, magnitude in [2^-10, 2688]; value = fl(e2m1 * fl(e4m3 * ts)).
// So value = code * ts * (1 + d1) * (1 + d2) + eta with |d| <= 2^-24 and |eta| <= 2^-147 (the two
// roundings may underflow: each contributes at most half the smallest subnormal, times 6 for the
// e2m1 factor), which is what the selectors' bounds charge for.
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

// The quotient of the fp8 path, x / ts with ts = fl(amax / 448) the per-tensor scale, as far as its e4m3
// rounding goes: float_to_e4m3(fp8_quotient(x, s)) == float_to_e4m3(fl(x / ts)) for every float x (the
// CPU's quantize_dequantize divides in IEEE float). Where ts lies in [2^-48, 2^48] (amax in about
// [1.6e-12, 1.3e17]; uniform over the tensor), |x| is first clamped to [lo, hi] = [ts 2^-12, ts 2^10]
// (both products exact: powers of two, no underflow), its sign kept, and the clamped value divided by
// div_rn's fast path alone, with no per-element range test or branch:
//   - |x| in [lo, hi]: x is unchanged, and |x| in [2^-60, 2^58], ts in [2^-48, 2^48] lie inside the range
//     where div_rn's fast path is __fdiv_rn's, i.e. the IEEE quotient (DivisionMatchesFdivRn);
//   - |x| < lo (zeros and float subnormals included): the exact quotient is below 2^-12, so fl(x / ts) <=
//     2^-12 < 2^-10, half of e4m3's smallest subnormal 2^-9, and rounds to a zero of x's sign; the clamped
//     quotient is exactly +-2^-12 and rounds to the same zero;
//   - |x| > hi (infinities included): fl(x / ts) >= 2^10 > 448 saturates to +-448, as +-hi / ts = +-2^10;
//   - NaN: max.NaN / min.NaN keep it, the quotient is NaN (a NaN code, 0x7f on the CPU).
// Per element: two min/max, a sign copy, a multiply and two fmas. Outside that range of ts (or ts = 0, an
// amax below 448 x 2^-150, where the CPU keeps the raw values: the quotient is x itself), div_rn.
struct Fp8Scale {
  Divisor by;     // ts
  float lo, hi;   // ts 2^-12, ts 2^10
  bool clamped;   // ts in [2^-48, 2^48]
};

__device__ __forceinline__ Fp8Scale make_fp8_scale(float ts) {
  return {make_divisor(ts), ts * 0x1p-12f, ts * 0x1p10f, ts >= 0x1p-48f && ts <= 0x1p48f};
}

__device__ __forceinline__ float fp8_quotient(float x, const Fp8Scale& s) {
  if (s.clamped) {
    float a;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(a) : "f"(fabsf(x)), "f"(s.lo));
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(a) : "f"(a), "f"(s.hi));
    const float xc = copysignf(a, x);
    const float q = __fmul_rn(xc, s.by.y);
    return fmaf(fmaf(-q, s.by.d, xc), s.by.y, q);
  }
  return s.by.d == 0.0f ? x : div_rn(x, s.by);
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
      const Fp8Scale s = make_fp8_scale(ts);
      for (int i = 0; i < cnt; ++i) {
        code[i] = e4m3_value(fp8_quotient(x[i], s));
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

// ---- the screening bound -----------------------------------------------------------------------------
//
// Exact score (the CPU's): s = sum_d vq_d * vk_d in float64, d in order. Screened score:
// s^ = fl(fl(T^ * sq) * sk), T^ the tensor-core float32 dot of the bf16 codes, sq and sk the per-tensor
// scales. With S = sum_d |cq_d ck_d| <= |cq| |ck| (Cauchy-Schwarz; |.| the code-row 2-norms),
// P = sq sk |cq| |ck| and n = Dp / 16 MMA k-steps:
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
// with nq' = sq |cq| and nk' = sk |ck| (the 2^-19 covers items 2-4 with room to spare). When a norm is
// not finite, when sq, sk or the score are not finite, or when |cq| |ck| > 2^120 (float32 overflow inside
// the MMA becomes possible), no finite bound holds.
}  // namespace sparse_attn::cuda_backend::tc
