// CPU building blocks shared by the gated executor, its calibration and the entmax executor: the
// causal geometry of (Q tile, KV block) pairs and the exact scaled QK of one such pair.
//
// Scores of a pair are always produced by `tile_scores` from the same packed operands, so a pass
// that recomputes them (entmax's row-max, histogram, candidate and output passes) sees bit-identical
// values and the passes agree on which entries are active.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cpu.hpp"
#include "sparse_attn/formats.hpp"

namespace sparse_attn::detail {

/// Keys [0, end) are visible to query i: all of them without a causal mask, else those with
/// j <= i + (Lk - Lq) (bottom-right alignment), clamped to [0, Lk].
inline std::int64_t visible_key_end(const ProblemShape& p, std::int64_t i) {
  if (!p.causal) return p.Lk;
  return std::clamp<std::int64_t>(i + p.Lk - p.Lq + 1, 0, p.Lk);
}

/// Rows [begin, end) of Q tile t and keys [begin, end) of KV block j.
struct Span {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};
inline Span q_tile_rows(const ProblemShape& p, std::int64_t t) {
  return {t * kTileQ, std::min(p.Lq, (t + 1) * kTileQ)};
}
inline Span kv_block_keys(const ProblemShape& p, std::int64_t j) {
  return {j * kBlockK, std::min(p.Lk, (j + 1) * kBlockK)};
}

/// Rows of gate tile g (kGateRows queries; docs/design.md §5.5), and the number of gate tiles.
inline Span gate_tile_rows(const ProblemShape& p, std::int64_t g) {
  return {g * kGateRows, std::min(p.Lq, (g + 1) * kGateRows)};
}
inline std::int64_t gate_tiles(const ProblemShape& p) { return ceil_div(p.Lq, kGateRows); }

/// Number of KV blocks holding at least one key visible to some row of the tile (they are a prefix).
inline std::int64_t visible_blocks(const ProblemShape& p, Span rows) {
  return ceil_div(visible_key_end(p, rows.end - 1), kBlockK);
}

/// True when some (row, key) pair of the tile and block is masked: the block straddles the causal
/// diagonal. The first row of a tile sees the fewest keys, so it decides.
inline bool straddles_diagonal(const ProblemShape& p, Span rows, Span keys) {
  return keys.end > visible_key_end(p, rows.begin);
}

/// Whether visible block j (keys `keys`) of the gate tile `rows` is subject to the gate: it does not
/// straddle the gate tile's causal diagonal and is not one of the first `sink_blocks` blocks.
inline bool gate_candidate(const ProblemShape& p, Span rows, Span keys, std::int64_t j, std::int64_t sink_blocks) {
  return j >= sink_blocks && !straddles_diagonal(p, rows, keys);
}

/// Rows [rows.begin, rows.end) of head h of q ([B, L, H, D]) packed as float [rows x D].
inline void pack_rows(const TensorView& t, std::int64_t b, std::int64_t h, Span rows, float* dst) {
  const std::int64_t D = t.shape[3];
  for (std::int64_t r = rows.begin; r < rows.end; ++r) load_bhld(t, b, r, h, dst + (r - rows.begin) * D);
}

/// Keys of a block packed transposed, float [D x kBlockK], so the score loop runs along keys with
/// unit stride and a fixed summation order over D.
inline void pack_keys_transposed(const TensorView& k, std::int64_t b, std::int64_t hk, Span keys, float* kt,
                                 float* row_scratch) {
  const std::int64_t D = k.shape[3];
  for (std::int64_t c = keys.begin; c < keys.end; ++c) {
    load_bhld(k, b, c, hk, row_scratch);
    const std::int64_t col = c - keys.begin;
    for (std::int64_t d = 0; d < D; ++d) kt[d * kBlockK + col] = row_scratch[d];
  }
}

/// s[r * kBlockK + c] = scale * q_r . k_c for r < rows, c < cols (q [rows x D], kt [D x kBlockK]).
inline void tile_scores(const float* q, std::int64_t rows, const float* kt, std::int64_t cols, std::int64_t D,
                        float scale, float* s) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * kBlockK;
    const float* qr = q + r * D;
    for (std::int64_t c = 0; c < cols; ++c) sr[c] = 0.0f;
    for (std::int64_t d = 0; d < D; ++d) {
      const float qd = qr[d];
      const float* kd = kt + d * kBlockK;
      for (std::int64_t c = 0; c < cols; ++c) sr[c] += qd * kd[c];
    }
    for (std::int64_t c = 0; c < cols; ++c) sr[c] *= scale;
  }
}

/// Scratch space of one work item (one Q tile of one head), sized once per item.
struct TileScratch {
  std::vector<float> q, kt, v, s, row;
  explicit TileScratch(std::int64_t D)
      : q(static_cast<std::size_t>(kTileQ * D)),
        kt(static_cast<std::size_t>(D * kBlockK), 0.0f),
        v(static_cast<std::size_t>(kBlockK * D)),
        s(static_cast<std::size_t>(kTileQ * kBlockK)),
        row(static_cast<std::size_t>(D)) {}
};

}  // namespace sparse_attn::detail
