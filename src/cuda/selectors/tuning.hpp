// Per-call settings of the CUDA selectors for the GPU tests; not part of the public API. A default-
// constructed SelectorTuning is what the public functions run. The other values reach shipped code that
// the production choice takes only on other shapes (the mma.sync screen, the float64 fallback, a small
// candidate buffer), and the counters show which path a call took.
#pragma once

#include <cstdint>

namespace sparse_attn::detail {

/// Screening kernel of the lightning indexer's token form.
enum class LightningScreen {
  automatic,  // wgmma where its candidate buffers hold top_k + 256 keys, else mma.sync
  mma_sync,   // mma.sync wherever the shape allows a screen
};

struct SelectorTuning {
  /// token_max: while non-null (device memory of two unsigned long long), a call adds to [0] the number
  /// of candidate blocks it ranked and to [1] the number of (list, block) pairs whose screened score was
  /// too close to the k-th to decide, so they were re-scored in float64.
  unsigned long long* token_max_counters = nullptr;

  /// lightning, token form: while non-null (device memory of four unsigned long long), a call adds to [0]
  /// the query rows screened on the tensor cores (rows seeing more than top_k keys), to [1] the (row, key)
  /// pairs re-scored in float64, to [2] the rows handed to the float64 streaming fallback (candidate
  /// buffer or undecided list overflowed, non-finite inputs, shapes beyond the screen) and to [3] the
  /// candidate buffer compactions.
  unsigned long long* lightning_counters = nullptr;
  LightningScreen lightning_screen = LightningScreen::automatic;
  /// Every row on the float64 streaming fallback (the path that overflowing rows and shapes beyond the
  /// screening kernels take).
  bool lightning_fallback_only = false;
  /// Cap on the per-query candidate buffer (0: as large as shared memory allows). A small cap makes short
  /// rows exercise the compaction; values below top_k + 256 (wgmma) or top_k + 64 (mma.sync) are raised.
  int lightning_capacity = 0;
};

}  // namespace sparse_attn::detail
