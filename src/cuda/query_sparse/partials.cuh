// Partial-output element types of the KV-centric pipeline and the dispatch over (input type, head
// dim, partial type) that attend.cu and combine.cu share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/elem_tag.cuh"

namespace sparse_attn::cuda_kernels::qs {

// Where column d of a bf16 partial row is stored. The attention kernel's output fragment gives lane q
// of a quad the column pairs (8i + 2q, 8i + 2q + 1), i = 0 .. D / 8 - 1; a row stores pair (q, i) at
// pair position 16 (i / 4) + 4 q + i % 4, so each lane writes four of its pairs as one 16-byte store
// and a quad's four stores fill 64 contiguous bytes (whole sectors). The combine reads the row in
// 16-byte chunks in this order and puts the columns back in place with a transpose inside each quad
// before it writes `out`. f32 partials keep the natural order: there a quad's 8-byte stores already
// fill a 32-byte sector.
__host__ __device__ constexpr int bf16_part_position(int d) {
  const int i = d / 8, q = (d % 8) / 2;
  return 2 * (16 * (i / 4) + 4 * q + i % 4) + d % 2;
}

struct PartF32 {
  using Elem = float;
  static constexpr bool kFragmentOrder = false;
  /// Row r (0: the lane's row g, 1: row g + 8) of a 64 x D output fragment (N = D / 2 values per
  /// lane), times inv, into the partial row at dst, by streaming stores (st.global.cs), which L2
  /// evicts first.
  template <int N>
  __device__ static void put_row(float* dst, const float (&o)[N], int r, float inv, int q4) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      __stcs(reinterpret_cast<float2*>(dst + 8 * i + 2 * q4),
             make_float2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv));
  }
};

struct PartBf16 {
  using Elem = __nv_bfloat16;
  static constexpr bool kFragmentOrder = true;  // bf16_part_position
  template <int N>
  __device__ static void put_row(__nv_bfloat16* dst, const float (&o)[N], int r, float inv, int q4) {
    std::uint32_t w[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] = Bf16Tag::pack(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    auto* row = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int s = 0; s < N / 16; ++s) __stcs(row + 4 * s + q4, make_uint4(w[4 * s], w[4 * s + 1], w[4 * s + 2], w[4 * s + 3]));
  }
};

template <template <class, int, class> class F, class... A>
cudaError_t dispatch(bool bf16, int D, bool bf16_partials, A... args) {
  if (bf16) {
    if (D == 128)
      return bf16_partials ? F<Bf16Tag, 128, PartBf16>::run(args...) : F<Bf16Tag, 128, PartF32>::run(args...);
    return bf16_partials ? F<Bf16Tag, 64, PartBf16>::run(args...) : F<Bf16Tag, 64, PartF32>::run(args...);
  }
  if (D == 128) return bf16_partials ? F<F16Tag, 128, PartBf16>::run(args...) : F<F16Tag, 128, PartF32>::run(args...);
  return bf16_partials ? F<F16Tag, 64, PartBf16>::run(args...) : F<F16Tag, 64, PartF32>::run(args...);
}

}  // namespace sparse_attn::cuda_kernels::qs
