// Online softmax over the m64n128 score fragment of one consumer warpgroup, in the log2 domain:
// t = s * scale * log2(e), p = 2^(t - m). Each thread owns two rows (g and g + 8 of its warp's 16-row
// slab), and a row lives in the 4 lanes of a quad, so row reductions are two xor-shuffles.
//
// Lazy rescaling: the running max m is raised only when a new row max exceeds it by more than
// kRescaleThreshold (log2 units). Until then p may reach 2^8, which fp32 sums and the 16-bit P
// operand hold without loss of range, and the 64 multiplies of the O rescale are skipped.
//
// The row pieces (max, quad reductions, the exponentials and row sums) are those of every attention
// kernel (common/online_softmax.cuh); the lazy policy and m in log2 units are this mainloop's own.
#pragma once

#include <cmath>

#include "cuda/attention/params.hpp"
#include "cuda/common/online_softmax.cuh"

namespace sparse_attn::cuda_kernels {

inline constexpr float kRescaleThreshold = 8.0f;

struct OnlineSoftmax {
  // The score transform policy of the consumer loop (mainloop.cuh): its kernel argument (Params),
  // start() per work item, update() per kept block, rescale() of o, finish(), and the (m, l) that the
  // epilogue normalises by. entmax's policy (entmax_transform.cuh) derives from this one.
  struct Params {};

  float m[2];  // running max of t per owned row (-inf before any visible key)
  float l[2];  // this thread's partial sums of p per owned row (quad-reduced at the end)

  __device__ __forceinline__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }
  __device__ __forceinline__ void start(const Params&, const TileAttentionParams&, int /*b*/, int /*head*/,
                                        int /*first_row*/, int /*thread*/) {
    reset();
  }

  /// Sets element (row, col) of the fragment to -inf where key col of block j is not visible to that
  /// row: past Lk, or in the row's causal future.
  __device__ __forceinline__ static void apply_mask(float (&s)[64], int thread, int first_row, int key0, int Lk,
                                                    bool causal, int causal_offset) {
    const int w = thread / 32, g = (thread % 32) / 4, q = thread % 4;
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = first_row + 16 * w + g + 8 * (j / 2);
        const int key = key0 + 8 * i + 2 * q + (j % 2);
        const int key_end = causal ? min(Lk, row + causal_offset + 1) : Lk;
        if (key >= key_end) s[4 * i + j] = -INFINITY;
      }
  }

  /// The maxima mx of the raw scores of the thread's two rows over the block (quad-reduced). kKeepNan:
  /// a row holding a NaN score gets NaN (the gate keeps its block); the update below then leaves m
  /// alone and the NaN p makes l NaN, as with the NaN passed over.
  template <bool kKeepNan>
  __device__ __forceinline__ static void row_maxima(const float (&s)[64], float (&mx)[2]) {
    thread_maxima<kKeepNan>(s, mx);
    quad_maxima<kKeepNan>(mx);
  }
  /// row_maxima in two steps: the thread's share of each row (no shuffle), then the quad's.
  template <bool kKeepNan>
  __device__ __forceinline__ static void thread_maxima(const float (&s)[64], float (&mx)[2]) {
    mx[0] = mx[1] = -INFINITY;
    row_max<kKeepNan>(s, mx);
  }
  template <bool kKeepNan>
  __device__ __forceinline__ static void quad_maxima(float (&mx)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = quad_max<kKeepNan>(mx[r]);
  }

  /// Turns scores s, whose row maxima row_maxima gave in mx, into p (in place) and updates m and l.
  /// `factor` receives what o must be scaled by (1 when m did not move); the caller applies it with
  /// rescale() once no wgmma is accumulating into o. before_exp() and after_exp() run around the
  /// exponentials.
  template <class BeforeExp, class AfterExp>
  __device__ __forceinline__ void update(float (&s)[64], const float (&mx)[2], float scale_log2, float (&factor)[2],
                                         BeforeExp before_exp, AfterExp after_exp) {
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float t_max = mx[r] * scale_log2;  // scale > 0, so the max commutes with the scaling
      factor[r] = 1.0f;
      if (t_max > m[r] + kRescaleThreshold) {
        // First visible key of the row (m = -inf): the factor is 0 and o, l are still 0.
        factor[r] = fast_exp2(m[r] - t_max);
        l[r] *= factor[r];
        m[r] = t_max;
      }
      // A row that has seen no visible key yet keeps m = -inf; subtracting 0 makes its p exactly 0
      // (2^-inf) instead of NaN (-inf - -inf).
      m_use[r] = m[r] == -INFINITY ? 0.0f : m[r];
    }
    before_exp();
    exponentiate(s, m_use, l, scale_log2);
    after_exp();
  }

  template <int N>
  __device__ __forceinline__ static void rescale(float (&o)[N], const float (&factor)[2]) {
    if (factor[0] == 1.0f && factor[1] == 1.0f) return;  // the common case under lazy rescaling
    RowSoftmax::rescale(o, factor);
  }

  /// Quad-reduces l; afterwards every lane of a quad holds the full row sums.
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
  }

  /// After finish: what row r of O is multiplied by (0 for a row that saw no key; online_softmax.cuh).
  __device__ __forceinline__ float normaliser(int r) const { return row_normaliser(m[r], l[r]); }
  /// After finish: the natural-log LSE of row r, with no test: no key seen (m = -inf, l = 0) gives
  /// -inf + log2 0 = -inf; m is in log2 units, so l = 0 under m = +inf (the scaled max overflowed)
  /// gives inf - inf = NaN, and a NaN l (or a faulty item's NaN m) gives NaN. A finite m comes with
  /// l >= 1 (the max's own p).
  __device__ __forceinline__ float lse(int r) const {
    constexpr float kLn2 = 0.69314718055994530942f;
    return (m[r] + __log2f(l[r])) * kLn2;
  }
};

}  // namespace sparse_attn::cuda_kernels
