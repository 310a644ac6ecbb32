// The merge window of the KV-centric query_sparse (src/schedule/merge_window.hpp): the bins it
// implies, its estimate for random lists, the automatic choice on the benchmark workloads, and the
// errors for values it does not take.
#include <gtest/gtest.h>

#include <cmath>

#include "schedule/merge_window.hpp"
#include "sparse_attn/error.hpp"

namespace {

namespace cb = sparse_attn::cuda_backend;

int resolve(std::int64_t Tk, std::int64_t Kq, std::int64_t rows, int requested) {
  return cb::resolve_merge_window(Tk, Kq, rows, requested, "test", "options.merge_window");
}

TEST(MergeWindow, Bins) {
  EXPECT_EQ(cb::max_merge_bins(256, 16), 8192);      // W = 8
  EXPECT_EQ(cb::max_merge_bins(1024, 16), 10944);  // W = 7 and 8 exceed 12288 bins: W = 6 (171 windows x 64)
  EXPECT_EQ(cb::max_merge_bins(100000, 16), 100000);  // no window fits: the blocks
  EXPECT_EQ(cb::max_merge_bins(256, 65), 256);        // too many slots to merge
  EXPECT_EQ(cb::merge_bins(256, 1), 256);
  EXPECT_EQ(cb::merge_bins(256, 8), 32 * 256);
  EXPECT_EQ(cb::merge_bins(11, 2), 6 * 4);   // a last window of one block still has 2^W masks
  EXPECT_EQ(cb::merge_bins(32, 4), 8 * 16);
  EXPECT_EQ(cb::merge_bins(32, 7), 5 * 128);  // windows of 7, 7, 7, 7 and 4 blocks
}

// Every block chosen: each window is one piece of W blocks, so W - 1 of every W slots are saved and
// the bin of the full mask holds every row.
TEST(MergeWindow, EstimateOfFullLists) {
  const cb::MergeEstimate e = cb::merge_estimate(64, 64, 1000, 8);
  EXPECT_NEAR(e.saved, 7.0 / 8.0, 1e-12);
  EXPECT_NEAR(e.rows_per_bin, 1000.0, 1e-9);
  const cb::MergeEstimate none = cb::merge_estimate(64, 64, 1000, 1);
  EXPECT_EQ(none.saved, 0.0);
}

// query16of32 (Tk 32, 16 slots, group 16 x Lq 4096): every mask of a window is equally likely (rho =
// 1/2), 256 rows per bin, three quarters of the slots saved: merged with W = 8 (measured -8.8 %).
// query-long (Tk 256, 16 slots, group 4 x Lq 32768): pairs dominate, about 300 rows in a pair's bin,
// but only a fifth of the slots saved: not merged (W = 8 measured +31 %).
TEST(MergeWindow, BenchmarkWorkloads) {
  const cb::MergeEstimate q16 = cb::merge_estimate(32, 16, 16 * 4096, 8);
  EXPECT_NEAR(q16.rows_per_bin, 256.0, 1e-6);
  EXPECT_NEAR(q16.saved, 0.75, 0.01);
  EXPECT_EQ(resolve(32, 16, 16 * 4096, 0), 8);
  // W = 7: windows of 7, 7, 7, 7 and 4 blocks save less than W = 8 (measured: 1.678 against 1.669 ms).
  const cb::MergeEstimate q7 = cb::merge_estimate(32, 16, 16 * 4096, 7);
  EXPECT_NEAR(q7.saved, (4 * (3.5 - (1 - std::pow(0.5, 7))) + (2 - (1 - std::pow(0.5, 4)))) / 16, 1e-9);
  EXPECT_LT(q7.saved, q16.saved);
  const cb::MergeEstimate ql = cb::merge_estimate(256, 16, 4 * 32768, 8);
  EXPECT_GT(ql.rows_per_bin, 250.0);
  EXPECT_LT(ql.rows_per_bin, 350.0);
  EXPECT_GT(ql.saved, 0.15);
  EXPECT_LT(ql.saved, 0.25);
  EXPECT_EQ(resolve(256, 16, 4 * 32768, 0), 1);
  // W = 4 on query16of32 saves about half the slots (measured: no gain): below kMinSavedShare.
  EXPECT_LT(cb::merge_estimate(32, 16, 16 * 4096, 4).saved, cb::kMinSavedShare);
}

// Automatic: off when the bins would be nearly empty, with one slot, with too many slots for the merge
// pass, or when the bins exceed the reverse index's shared histogram.
TEST(MergeWindow, AutomaticStaysOffWhereItCannotPay) {
  EXPECT_EQ(resolve(256, 16, 64, 0), 1);           // few rows: a pair's bin would hold a fraction of a tile
  EXPECT_EQ(resolve(32, 1, 16 * 4096, 0), 1);      // one slot: nothing to merge
  EXPECT_EQ(resolve(128, 65, 16 * 4096, 0), 1);    // over kMaxMergeSlots
  EXPECT_EQ(resolve(100000, 16, 1 << 30, 0), 1);   // 8, 4 and 2 all exceed kMaxMergeBins
  EXPECT_EQ(resolve(1024, 1024, 1 << 24, 0), 1);  // over kMaxMergeSlots
  EXPECT_EQ(resolve(128, 64, 1 << 24, 0), 8);     // half the blocks: 8 fits (4096 bins)
  EXPECT_EQ(resolve(2048, 64, 1 << 24, 0), 1);    // 64 of 2048 blocks: little to merge
}

TEST(MergeWindow, ExplicitValues) {
  for (int w = 1; w <= 8; ++w) EXPECT_EQ(resolve(256, 16, 64, w), w);
  EXPECT_EQ(resolve(256, 200, 64, 1), 1);  // off works with any Kq
}

TEST(MergeWindow, RejectsValuesItDoesNotTake) {
  for (int w : {-1, 9, 16}) {
    try {
      resolve(256, 16, 4096, w);
      ADD_FAILURE() << "expected an Error for merge_window " << w;
    } catch (const sparse_attn::Error& e) {
      EXPECT_EQ(e.argument(), "options.merge_window") << e.what();
    }
  }
  try {
    resolve(1024, 16, 4096, 8);  // 128 windows x 256 masks
    ADD_FAILURE() << "expected an Error for 32768 bins";
  } catch (const sparse_attn::Error& e) {
    EXPECT_EQ(e.argument(), "options.merge_window");
    EXPECT_NE(std::string(e.what()).find("32768"), std::string::npos) << e.what();
  }
  EXPECT_EQ(resolve(1024, 16, 4096, 4), 4);  // 256 windows x 16 masks
  try {
    resolve(256, 65, 4096, 4);
    ADD_FAILURE() << "expected an Error for 65 slots";
  } catch (const sparse_attn::Error& e) {
    EXPECT_EQ(e.argument(), "options.merge_window");
    EXPECT_NE(std::string(e.what()).find("65"), std::string::npos) << e.what();
  }
}

// Query bands: Q of a (b, group) in bands of at most 8 MiB, while every band's bins keep a work item
// of rows; never with merging; a forced count is capped by Lq and the shared histogram (12288 bins).
TEST(QueryBands, AutomaticAndForced) {
  using cb::resolve_query_bands;
  // query-long: 32768 queries x 4 heads x 128 x 2 bytes = 32 MiB of Q per (b, group): 4 bands.
  EXPECT_EQ(resolve_query_bands(32768, 4, 128, 2, 256, 16, 1, 0), 4);
  EXPECT_EQ(resolve_query_bands(32768, 4, 128, 2, 256, 16, 8, 0), 1);  // merged
  // query16of32 without merging: 16 MiB of Q, 2 bands.
  EXPECT_EQ(resolve_query_bands(4096, 16, 128, 2, 32, 16, 1, 0), 2);
  EXPECT_EQ(resolve_query_bands(1000, 4, 128, 2, 64, 8, 1, 0), 1);  // 1 MiB of Q
  // 8 MiB exactly is one band.
  EXPECT_EQ(resolve_query_bands(16384, 2, 128, 2, 64, 16, 1, 0), 1);
  // Bins too thin for a work item of rows (32768 x 16 x 4 rows over 4096 blocks: 512 rows per block).
  EXPECT_EQ(resolve_query_bands(32768, 4, 128, 2, 4096, 16, 1, 0), 1);
  // 64 MiB of Q (8 bands) but rows for only 5 bands of 768 rows per block.
  EXPECT_EQ(resolve_query_bands(65536, 4, 128, 2, 1024, 15, 1, 0), 5);
  EXPECT_EQ(resolve_query_bands(1000, 4, 128, 2, 64, 8, 1, 7), 7);
  EXPECT_EQ(resolve_query_bands(1000, 4, 128, 2, 256, 8, 1, 100), 48);  // 48 x 256 = 12288 bins
  EXPECT_EQ(resolve_query_bands(3, 4, 128, 2, 64, 8, 1, 5), 3);         // at most one band per query
  EXPECT_EQ(resolve_query_bands(1000, 4, 128, 2, 64, 8, 4, 7), 1);      // merged: never
  EXPECT_EQ(resolve_query_bands(100, 1, 64, 2, 20000, 4, 1, 3), 1);     // Tk past the histogram
}

}  // namespace
