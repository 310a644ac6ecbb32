// The online softmax of every attention kernel, per row of a score fragment (mma_sync.cuh's Frag: a
// wgmma m64nN accumulator or mma.sync m16n8 C tiles; each thread owns two rows, g and g + 8 of its
// warp's 16-row slab, and a row lives in the 4 lanes of a quad, so row reductions are two
// xor-shuffles).
//
// Arithmetic, in the log2 domain: with the running max m of the raw scores s (-inf before any visible
// key), the base b = m * scale_log2, p = 2^(s * scale_log2 - b) by one fma and ex2.approx, and the row
// sum l adds the float32 p one by one (the P V operand sees them rounded to the 16-bit type, as in
// FlashAttention). When the max rises from m to m', O and l are scaled by 2^(m * scale_log2 - b').
// At the end out = O / l and the natural-log LSE is m * scale + ln l.
//
// A row that sees no visible key (all its scores -inf, masked) keeps m = -inf: its base is 0 so that
// p = 2^-inf = 0 rather than NaN (-inf - -inf), its rescale factor is 1, and at the end l = 0 gives
// out = 0 and LSE = -inf.
//
// Non-finite scores (docs/design.md §2) cost nothing in the loop: fmaxf passes over a NaN score, so m stays
// the max of the others, but its p = 2^NaN is NaN and poisons l for good; a +inf score raises m to
// +inf and its p = 2^(inf - inf) is NaN too; a -inf score weighs 0 like a masked key. Only the
// epilogue tells the cases apart, from m as well as l: "no key" is m = -inf with l = 0; with m = -inf,
// l is 0 or NaN (only NaN scores), and every other state divides by l, so a NaN l gives NaN out and
// LSE, and so does l = 0 under a finite or +inf m (every p underflowed: the scaled max overflowed).
//
// Users: RowSoftmax (eager rescaling) is the softmax of the KV-centric attention (query_sparse/
// attend.cu, wgmma fragments), the group-centric kernel (query_sparse/group.cu) and the token kernel
// (attention/token_sparse.cu), both mma.sync fragments. The Q-centric mainloop's OnlineSoftmax
// (attention/softmax.cuh) is built from the same row pieces (row_max, quad_max, exponentiate,
// quad_sum) with a lazy rescale policy of its own: it keeps m in log2 units and raises it only past a
// threshold.
#pragma once

#include <cmath>

#include "cuda/common/mma_sync.cuh"

namespace sparse_attn::cuda_kernels {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// max(a, b); with kKeepNan, NaN when either is NaN (max.NaN, the same cost as fmaxf).
template <bool kKeepNan>
__device__ __forceinline__ float max2(float a, float b) {
  if constexpr (kKeepNan) {
    float y;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
  } else {
    return fmaxf(a, b);
  }
}

/// The thread's share of each of its two rows' maxima, folded into m (quad_max completes it). By
/// default NaN scores are passed over (see above); kKeepNan makes the max of a row holding one NaN,
/// for a caller that must notice it (the gate, attention/gate_policy.cuh).
template <bool kKeepNan = false, class F>
__device__ __forceinline__ void row_max(const F& s, float (&m)[2]) {
#pragma unroll
  for (int i = 0; i < Frag<F>::kSize / 4; ++i) {
    m[0] = max2<kKeepNan>(m[0], max2<kKeepNan>(Frag<F>::at(s, 4 * i), Frag<F>::at(s, 4 * i + 1)));
    m[1] = max2<kKeepNan>(m[1], max2<kKeepNan>(Frag<F>::at(s, 4 * i + 2), Frag<F>::at(s, 4 * i + 3)));
  }
}

/// A row's maximum over the four lanes of the quad that share it.
template <bool kKeepNan = false>
__device__ __forceinline__ float quad_max(float m) {
  m = max2<kKeepNan>(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return max2<kKeepNan>(m, __shfl_xor_sync(0xffffffffu, m, 2));
}

/// A row's sum over the four lanes of its quad (every lane gets it).
__device__ __forceinline__ float quad_sum(float l) {
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  return l + __shfl_xor_sync(0xffffffffu, l, 2);
}

/// Scores to p = 2^(s * scale_log2 - base[row]) in place, each added to its row's l in fragment order.
template <class F>
__device__ __forceinline__ void exponentiate(F& s, const float (&base)[2], float (&l)[2], float scale_log2) {
#pragma unroll
  for (int i = 0; i < Frag<F>::kSize / 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p = fast_exp2(fmaf(Frag<F>::at(s, 4 * i + j), scale_log2, -base[j / 2]));
      Frag<F>::at(s, 4 * i + j) = p;
      l[j / 2] += p;
    }
}

/// After the quad reduction of l: what a row of O is multiplied by. Under m = -inf, l itself: 0 for a
/// row that saw no key, NaN for one that saw only NaN scores. Otherwise 1 / l: NaN for a NaN l, and
/// +inf for l = 0, which O = 0 turns into NaN. (As cheap as the test of l alone it replaces.)
__device__ __forceinline__ float row_normaliser(float m, float l) { return m == -INFINITY ? l : 1.0f / l; }

/// The running state of a thread's two rows under eager rescaling: every rise of a row's max rescales
/// its O and l at once.
struct RowSoftmax {
  float m[2] = {-INFINITY, -INFINITY};  // running max of the raw scores (-inf: no visible key yet)
  float l[2] = {0.0f, 0.0f};            // this thread's share of the row sums (quad-reduced by finish)

  /// The first scores of the rows (m = -inf, l = 0, O not yet accumulated): s becomes p.
  template <class F>
  __device__ __forceinline__ void first(F& s, float scale_log2) {
    row_max(s, m);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[r] = quad_max(m[r]);
      base[r] = m[r] == -INFINITY ? 0.0f : m[r] * scale_log2;
    }
    exponentiate(s, base, l, scale_log2);
  }

  /// Later scores: s becomes p, l is rescaled and extended; `alpha` receives the factor O must be
  /// scaled by (rescale) before p V is added to it.
  template <class F>
  __device__ __forceinline__ void update(F& s, float scale_log2, float (&alpha)[2]) {
    float mx[2] = {m[0], m[1]};
    row_max(s, mx);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = quad_max(mx[r]);
      base[r] = mx[r] == -INFINITY ? 0.0f : mx[r] * scale_log2;
      alpha[r] = mx[r] == -INFINITY ? 1.0f : fast_exp2(fmaf(m[r], scale_log2, -base[r]));
      m[r] = mx[r];
      l[r] *= alpha[r];
    }
    exponentiate(s, base, l, scale_log2);
  }

  /// O of the two rows (a fragment of the same layout) times their factors.
  template <class F>
  __device__ __forceinline__ static void rescale(F& o, const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < Frag<F>::kSize / 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) Frag<F>::at(o, 4 * i + j) *= alpha[j / 2];
  }

  /// Quad-reduces l: afterwards every lane of a quad holds the full row sums.
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
  }

  /// After finish: what row r of O is multiplied by (0 for a row that saw no key).
  __device__ __forceinline__ float normaliser(int r) const { return row_normaliser(m[r], l[r]); }
  /// After finish: the natural-log LSE of row r, scale in natural-log units. No key seen gives
  /// -inf + log 0 = -inf, a NaN l NaN; l = 0 under a finite m (m * scale_log2 overflowed, m * scale
  /// need not have) is made NaN explicitly.
  __device__ __forceinline__ float lse(int r, float scale) const {
    const float x = m[r] * scale + logf(l[r]);
    return l[r] == 0.0f && m[r] != -INFINITY ? __int_as_float(0x7fffffff) : x;
  }
};

}  // namespace sparse_attn::cuda_kernels
