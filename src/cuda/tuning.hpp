// Per-call tuning of the CUDA executors, for tests and benchmarks: an optional last argument of the
// backend entry points (cuda/backend.hpp, cuda/query_sparse/backend.hpp). The defaults are what the
// public operators run. None of these settings changes what is computed, only how the work is spread
// (the split tail's pieces round their P against their own running max: see `split`). Private to the
// library and its tests: no public header includes this one.
#pragma once

#include <cstdint>

namespace sparse_attn::detail {

/// The split tail of the Q-centric kernel (split_tail.hpp): the units of the last, partial wave cut
/// into pieces over more CTAs.
enum class SplitTail : std::uint8_t {
  automatic,  // where the cost model expects a gain (production)
  off,        // every unit walked whole
  force,      // wherever a split is possible, gain or not
};

/// dense and tile_sparse on the GPU (launcher.cu).
struct AttentionTuning {
  /// At most this many CTAs in the persistent grid (0: one per SM), so that a small problem still gives
  /// every CTA a long run of work items (ring wrap-around, Q buffer reuse, chained items). The split
  /// tail is planned for the capped grid.
  int max_ctas = 0;
  /// Outputs of split units differ from whole ones in the last bits: each piece rounds its P against
  /// its own running max. Causal launches are never split.
  SplitTail split = SplitTail::automatic;
};

/// The KV-centric query_sparse on the GPU (query_sparse.cu).
struct QuerySparseTuning {
  /// Query bands of the reverse index's bins (merge_window.hpp, resolve_query_bands): 0 automatic,
  /// n > 0 asks for n wherever the lists are not merged (capped by Lq and the shared histogram). Read
  /// where a workspace is sized and where bins are resolved for a plan; the plan's runs take the bins
  /// it was made with (QuerySparseBins).
  int query_bands = 0;
  /// At most this many CTAs for the attention kernel (0: one per SM).
  int attend_max_ctas = 0;
};

}  // namespace sparse_attn::detail
