// The split tail's cost model (src/schedule/split_tail.hpp): which launches cut the units of their
// last wave into pieces, on the shapes the H200 measurements priced (docs/notes/hopper.md, v9 and v11),
// and the limits that hold whatever the costs.
#include <gtest/gtest.h>

#include "schedule/split_tail.hpp"

namespace {

using sparse_attn::cuda_kernels::kMaxPiecesPerUnit;
using sparse_attn::cuda_kernels::split_tail;
using sparse_attn::cuda_kernels::TailSplit;

constexpr int kSms = 132;

TEST(SplitTail, WholeWavesNeverSplit) {
  for (bool force : {false, true}) {
    const TailSplit t = split_tail(2 * kSms, kSms, 64, force);
    EXPECT_EQ(t.tail_ctas, 0);
    EXPECT_EQ(t.dp_units, 2 * kSms);
  }
}

// split_ab.py on the v11 kernels (dev/bench/results/h200_v11_split_ab_2026-11-30.json): splitting lost on tile16 (16
// blocks per unit), dense 4K (32) and dense 16K (128), all 1024 units on 132 CTAs, and won 35 % on a
// launch of 64 units of 32 blocks.
TEST(SplitTail, MeasuredShapes) {
  for (int walk : {16, 32, 128}) EXPECT_EQ(split_tail(1024, kSms, walk, false).tail_ctas, 0) << "walk " << walk;
  const TailSplit small = split_tail(64, kSms, 32, false);
  EXPECT_EQ(small.dp_units, 0);
  EXPECT_EQ(small.tail_ctas, kSms);
}

// Dense 4K saves 7.8 positions per CTA of the tail, more than a piece's cost (6) but not more than the
// piece plus the split-capable kernel's slower blocks over 8 walks of 32.
TEST(SplitTail, ChargesTheSplitKernelToTheWholeLaunch) {
  EXPECT_EQ(split_tail(1024, kSms, 32, false).tail_ctas, 0);
  const TailSplit forced = split_tail(1024, kSms, 32, true);
  EXPECT_EQ(forced.dp_units, 1024 - 1024 % kSms);
  EXPECT_EQ(forced.tail_ctas, kSms);
  // A single partial wave of long walks still splits.
  EXPECT_GT(split_tail(100, kSms, 512, false).tail_ctas, 0);
}

TEST(SplitTail, Limits) {
  // At most kMaxPiecesPerUnit pieces per unit and at least two positions per piece.
  const TailSplit few = split_tail(3, kSms, 1000, true);
  EXPECT_EQ(few.tail_ctas, 3 * kMaxPiecesPerUnit);
  const TailSplit short_walk = split_tail(10, kSms, 4, true);  // 40 positions: 20 pieces of 2
  EXPECT_EQ(short_walk.tail_ctas, 20);
  // One position per unit cannot be cut: no more than one CTA per unit.
  EXPECT_EQ(split_tail(5, kSms, 1, true).tail_ctas, 0);
  // A tail the kernel's 32-bit cuts cannot address stays whole.
  EXPECT_EQ(split_tail(100, kSms, 1 << 20, true).tail_ctas, 0);
}

}  // namespace
