// The gate's counts from a gate tile's geometry (src/cuda/attention/gate_geometry.hpp, host and device
// code): the closed form the CUDA gated kernel uses for the visible blocks and the candidates of every
// gate tile, against the CPU reference's block-by-block rule (src/gated/tile_kernels.hpp) and against the
// kernel's own per-block rule over its causal walk (gate_policy.cuh, keep()), on shapes with Lq < Lk,
// Lq = Lk and Lq > Lk (rows that see no key), partial blocks and partial tiles, 0-4 sink blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/attention/gate_geometry.hpp"
#include "gated/tile_kernels.hpp"

namespace sparse_attn {
namespace {

TEST(GateGeometry, ClosedFormEqualsTheBlockByBlockRules) {
  int tiles = 0;
  for (const std::int64_t Lq : {1, 17, 63, 64, 65, 127, 128, 129, 300, 520, 1000, 1013, 2100})
    for (const std::int64_t Lk : {1, 100, 127, 128, 129, 255, 256, 400, 777, 1000, 1013, 2100, 4096})
      for (const std::int64_t sinks : {0, 1, 2, 4}) {
        const ProblemShape p{1, Lq, Lk, 1, 1, 64, true};
        for (std::int64_t t = 0; t < detail::gate_tiles(p); ++t) {
          const detail::Span rows = detail::gate_tile_rows(p, t);
          const auto first = static_cast<int>(detail::visible_key_end(p, rows.begin));
          const auto last = static_cast<int>(detail::visible_key_end(p, rows.end - 1));
          int visible = -1, candidates = -1;
          cuda_kernels::gate_counts(first, last, static_cast<int>(Lk), static_cast<int>(sinks),
                                    static_cast<int>(kBlockK), visible, candidates);
          const std::string where = "Lq " + std::to_string(Lq) + ", Lk " + std::to_string(Lk) + ", sinks " +
                                    std::to_string(sinks) + ", gate tile " + std::to_string(t);
          // The CPU reference: the visible prefix, then gate_candidate per block.
          const std::int64_t ref_visible = detail::visible_blocks(p, rows);
          std::int64_t ref_candidates = 0;
          for (std::int64_t j = 0; j < ref_visible; ++j)
            ref_candidates += detail::gate_candidate(p, rows, detail::kv_block_keys(p, j), j, sinks) ? 1 : 0;
          EXPECT_EQ(visible, ref_visible) << where;
          EXPECT_EQ(candidates, ref_candidates) << where;
          // The kernel's rule: the causal walk of the 128-row Q tile visits blocks j with 128 j <= its
          // last row's last visible key; keep() counts a walked block as visible when 128 j < last and
          // as a candidate unless j < sinks or min(128 (j + 1), Lk) > first.
          const std::int64_t q_last = std::min(Lq, (t / 2 + 1) * kTileQ) - 1;
          const std::int64_t last_key = std::min(q_last + Lk - Lq, Lk - 1);
          std::int64_t walk_visible = 0, walk_candidates = 0;
          for (std::int64_t j = 0; j * kBlockK <= last_key && j < (Lk + kBlockK - 1) / kBlockK; ++j) {
            if (j * kBlockK >= last) continue;
            ++walk_visible;
            if (j < sinks || std::min((j + 1) * kBlockK, Lk) > first) continue;
            ++walk_candidates;
          }
          EXPECT_EQ(visible, walk_visible) << where;
          EXPECT_EQ(candidates, walk_candidates) << where;
          ++tiles;
        }
      }
  EXPECT_GT(tiles, 1000);
}

}  // namespace
}  // namespace sparse_attn
