// Per-call settings of the CUDA selectors for the GPU tests; not part of the public API. A default-
// constructed SelectorTuning is what the public functions run. The other values reach shipped code that
// the production choice takes only on other shapes, and the counters show which path a call took.
#pragma once

#include <cstdint>

namespace sparse_attn::detail {

struct SelectorTuning {
  /// token_max: while non-null (device memory of two unsigned long long), a call adds to [0] the number
  /// of candidate blocks it ranked and to [1] the number of (list, block) pairs whose screened score was
  /// too close to the k-th to decide, so they were re-scored in float64.
  unsigned long long* token_max_counters = nullptr;
};

}  // namespace sparse_attn::detail
