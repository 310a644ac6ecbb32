// The entmax transform of the Q-centric mainloop (attention/mainloop.cuh): with each row's threshold
// already known (entmax/threshold.cu), a block's scores s become p = [(alpha - 1)(z - z_tau)]_+^r,
// z = scale * s, r = 1 / (alpha - 1), and O += P V as for softmax. No running max and no rescale: the
// weights of a row never exceed one (sum p = 1 at the exact threshold), so P fits the 16-bit operand as
// it is. The epilogue divides by l = sum of the float32 p of the visited blocks (m = 0), which makes
// the output's weights sum to one whatever the threshold's last-bit rounding.
//
// Row states (entmax/params.hpp): a live row gets m = 0; a row that sees no key m = -inf (l stays 0:
// out = 0); a row with a NaN or +inf score m = l = NaN (out NaN). Split pieces combine as they do for
// softmax: every piece of a live row has m = 0, so the combine is sum o / sum l.
//
// Powers: alpha = 2 is p = x, alpha = 1.5 is p = x * x (no special function), any other alpha
// 2^(r log2 x) on the SFU, which takes ExpTurns like the softmax's exponentials.
#pragma once

#include <cmath>

#include "cuda/attention/softmax.cuh"
#include "cuda/attention/entmax_params.hpp"

namespace sparse_attn::cuda_kernels {

struct EntmaxTransform : OnlineSoftmax {
  using Params = EntmaxTransformParams;

  float z_tau[2];  // per owned row: the threshold in score units (+inf: nothing passes)
  float c = 1.0f, r = 1.0f, scale = 1.0f;
  int power = 0;

  __device__ __forceinline__ void start(const Params& e, const TileAttentionParams& p, int b, int head, int first_row,
                                        int thread) {
    reset();
    c = e.am1;
    r = e.r;
    scale = e.scale;
    power = e.power;
    const int w = thread / 32, g = (thread % 32) / 4;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = first_row + 16 * w + g + 8 * i;
      z_tau[i] = INFINITY;
      if (row >= p.Lq) continue;
      const EntmaxRow st = e.rows[(static_cast<std::int64_t>(b) * p.Hq + head) * p.Lq + row];
      if (st.status == EntmaxRow::kLive) {
        m[i] = 0.0f;
        z_tau[i] = st.z_tau;
      } else if (st.status == EntmaxRow::kPoisoned) {
        m[i] = l[i] = __int_as_float(0x7fffffff);
      }
    }
  }

  template <int kPower>
  __device__ __forceinline__ void weigh(float (&s)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int row = (i / 2) % 2;  // fragment element 4k + j belongs to row j / 2
      const float x = c * (s[i] * scale - z_tau[row]);
      float pw = 0.0f;
      if (x > 0.0f) pw = kPower == 1 ? x : (kPower == 2 ? x * x : fast_exp2(r * __log2f(x)));
      s[i] = pw;
      l[row] += pw;
    }
  }

  template <class BeforeExp, class AfterExp>
  __device__ __forceinline__ void update(float (&s)[64], const float (&)[2] /*row maxima*/, float /*scale_log2*/,
                                         float (&factor)[2], BeforeExp before_exp, AfterExp after_exp) {
    factor[0] = factor[1] = 1.0f;
    if (power == 1) {
      weigh<1>(s);
    } else if (power == 2) {
      weigh<2>(s);
    } else {
      before_exp();
      weigh<0>(s);
      after_exp();
    }
  }

  template <int N>
  __device__ __forceinline__ static void rescale(float (&)[N], const float (&)[2]) {}
};

}  // namespace sparse_attn::cuda_kernels
