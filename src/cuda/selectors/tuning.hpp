// Per-call settings of the CUDA selectors for the GPU tests; not part of the public API. A default-
// constructed SelectorTuning is what the public functions run. The other values reach shipped code that
// the production choice takes only on other shapes (a scoring kernel, a load width), and the counters show
// which path a call took.
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

struct SelectorTuning {
  PooledScoring pooled_scoring = PooledScoring::automatic;
  /// Load width of the pooled representatives kernel (every width gives the same bits): 0 lets the call
  /// choose (the widest aligned vector that leaves 8 warps per SM); 16, 8 or 4 takes the widest vector up
  /// to that many bytes that the views allow; 1 loads single elements. Any other value is an Error naming
  /// tuning.pooled_rep_bytes.
  int pooled_rep_bytes = 0;

  /// token_max: while non-null (device memory of two unsigned long long), a call adds to [0] the number
  /// of candidate blocks it ranked and to [1] the number of (list, block) pairs whose screened score was
  /// too close to the k-th to decide, so they were re-scored in float64.
  unsigned long long* token_max_counters = nullptr;
};

/// Whether PooledScoring::exact_f64 serves a problem with `rows` = group * r query rows per tile and head
/// dimension D (the automatic choice takes it then, for calls up to its size limit).
bool pooled_exact_applies(std::int64_t rows, std::int64_t D);

}  // namespace sparse_attn::detail
