// The counts of the gate (gate_policy.cuh) that follow from a gate tile's geometry alone, host and
// device code (SPARSE_ATTN_HD), so that the CPU suite test_gate_geometry checks the closed form
// against the CPU reference's block-by-block rule (src/gated/tile_kernels.hpp) on every shape it runs.
#pragma once

#include <algorithm>

#include "cuda/common/host_device.hpp"

namespace sparse_attn::cuda_kernels {

/// A gate tile whose first and last rows below Lq see keys [0, key_end_first) and [0, key_end_last)
/// (bottom-right causal: key_end_first <= key_end_last <= Lk), in blocks of `block_keys` keys, with the
/// first `sink_blocks` blocks always kept: `visible`, the blocks of the walk that some row of the gate
/// tile sees, and `candidates`, those the gate decides (neither a sink nor straddling the diagonal).
/// The causal walk of its Q tile is blocks [0, n) with n covering the tile's last row, so the visible
/// blocks are [0, ceil(key_end_last / block_keys)). Block j straddles the diagonal when
/// min((j + 1) block_keys, Lk) > key_end_first: j >= key_end_first / block_keys while key_end_first < Lk,
/// no block when the first row sees every key.
SPARSE_ATTN_HD void gate_counts(int key_end_first, int key_end_last, int Lk, int sink_blocks, int block_keys,
                                int& visible, int& candidates) {
  visible = (key_end_last + block_keys - 1) / block_keys;
  const int diagonal = key_end_first < Lk ? key_end_first / block_keys : visible;
  candidates = std::max(0, std::min(visible, diagonal) - sink_blocks);
}

}  // namespace sparse_attn::cuda_kernels
