// Per-call settings of the CUDA selectors for the GPU tests; not part of the public API. A default-
// constructed SelectorTuning is what the public functions run. The other values reach shipped code that
// the production choice takes only on other shapes (a scoring kernel, a load width, the mma.sync screen,
// the float64 fallback, a small candidate buffer), and the counters show which path a call took.
#pragma once

#include <cstdint>

namespace sparse_attn::detail {

/// Scoring kernel of the CUDA pooled selector.
enum class PooledScoring {
  automatic,          // exact_f64 where it applies and the call is small (<= 128 Mi float64 fmas), else
                      // int8_tensor_cores
  exact_f64,          // every counted pair in float64, no screen (pooled_exact_applies; elsewhere an Error
                      // naming q)
  int8_tensor_cores,  // int8 copies of the means, exact integer dots on mma.sync, float64 where undecided
};

/// Screening kernel of the lightning indexer's token form.
enum class LightningScreen {
  automatic,  // wgmma where its candidate buffers hold top_k + 256 keys, else mma.sync
  mma_sync,   // mma.sync wherever the shape allows a screen
};

struct SelectorTuning {
  PooledScoring pooled_scoring = PooledScoring::automatic;
  /// Load width of the pooled representatives kernel (every width gives the same bits): 0 lets the call
  /// choose (the widest aligned vector that leaves 8 warps per SM); 16, 8 or 4 takes the widest vector up
  /// to that many bytes that the views allow; 1 loads single elements. Any other value is an Error naming
  /// tuning.pooled_rep_bytes.
  int pooled_rep_bytes = 0;

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

/// Whether PooledScoring::exact_f64 serves a problem with `rows` = group * r query rows per tile and head
/// dimension D (the automatic choice takes it then, for calls up to its size limit).
bool pooled_exact_applies(std::int64_t rows, std::int64_t D);

}  // namespace sparse_attn::detail
