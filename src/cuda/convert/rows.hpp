// Host helpers shared by the one-warp-per-row conversion kernels (tiles_to_bits.cu, bits_to_tiles.cu).
#pragma once

#include <algorithm>

namespace sparse_attn::cuda_kernels::convert {

/// CTAs of `threads` threads for one warp per row over `rows` rows, at most 2^20 (the kernels stride
/// over the rest).
inline unsigned warp_per_row_ctas(long long rows, int threads) {
  const long long per_cta = threads / 32;
  return static_cast<unsigned>(std::min<long long>((rows + per_cta - 1) / per_cta, 1LL << 20));
}

/// The (b, g, t) of row-major row r of a [B, G, Tq] grid of rows.
struct RowCoord {
  long long b = 0, g = 0, t = 0;
};
inline RowCoord row_coord(long long r, long long G, long long Tq) { return {r / (Tq * G), r / Tq % G, r % Tq}; }

}  // namespace sparse_attn::cuda_kernels::convert
