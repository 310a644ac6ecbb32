// The split tail's cost model (host only): which units of the last, partial wave are cut into pieces.
// Used by src/cuda/attention/launcher.cu; tested on the CPU (tests/cpu/test_split_tail.cpp).
#pragma once

#include <algorithm>

namespace sparse_attn::cuda_kernels {

// Split tail (scheduler.cuh): the units of the last, partial wave are cut into pieces spread over more
// CTAs. A piece covers at least kMinPieceLen walk positions and a unit about kMaxPiecesPerUnit pieces at
// most, which bounds what the last piece's combine reads. The split shortens the last wave from
// walk_len positions to walk_len * rest / share, and costs each CTA of the tail about
// kPieceCostPositions positions' time (a second Q tile, the partials, the arrival, and the combine at
// the end of the range; measured on the H200, docs/notes/hopper.md "split tail"). A launch with a split
// tail also runs the kernel instantiation that carries the pieces' code, and every block of the launch,
// whole units included, pays for it: kSplitKernelCost per block (H200, tile16 shape: 1.739 us per block
// for the kernel that carried the split and causal code, 1.681 for the instantiation without them;
// split_ab.py on the specialised kernels: split against whole -6.6 % on tile16, -3.3 % dense 4K, -0.1 %
// dense 16K, +35 % with 64 units; docs/notes/hopper.md "v11"). The split is taken only where the
// positions it saves exceed both costs, unless forced.
inline constexpr int kMaxPiecesPerUnit = 8;
inline constexpr int kMinPieceLen = 2;
inline constexpr double kPieceCostPositions = 6.0;
inline constexpr double kSplitKernelCost = 0.035;

struct TailSplit {
  int dp_units;   // units walked whole
  int tail_ctas;  // CTAs sharing the rest (0: no split)
};

inline TailSplit split_tail(int units, int ctas, int walk_len, bool force) {
  const int rest = units % ctas;  // all of them when units < ctas
  if (rest == 0) return {units, 0};
  const long long positions = static_cast<long long>(rest) * walk_len;
  const long long share = std::min({static_cast<long long>(ctas), static_cast<long long>(kMaxPiecesPerUnit) * rest,
                                    positions / kMinPieceLen});
  if (share <= rest) return {units, 0};  // no more than one CTA per unit: nothing to gain
  // The kernel cuts the tail in 32-bit arithmetic (scheduler.cuh); beyond that (a tail of more than
  // 2^31 / 132 blocks, Lk of about 2 million keys per unit of a full last wave) it stays whole.
  if (positions * share >= (1ll << 31)) return {units, 0};
  const double saved = walk_len * (1.0 - static_cast<double>(rest) / static_cast<double>(share));
  const double waves = static_cast<double>(units / ctas + 1);  // walks of the busiest CTA, whole or not
  if (!force && saved < kPieceCostPositions + kSplitKernelCost * waves * walk_len) return {units, 0};
  return {units - rest, static_cast<int>(share)};
}

}  // namespace sparse_attn::cuda_kernels
