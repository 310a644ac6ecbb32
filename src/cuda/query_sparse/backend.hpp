// CUDA backend of the KV-centric query_sparse (docs/design.md §5.3). Arguments have been resolved by the
// front end (core/call.hpp: tensors on a CUDA device, 16-bit dtypes, head dim 64 or 128, the lists'
// shape, a known schedule and partial precision, the merge window); these functions check what only
// this backend requires (16-byte aligned rows of q, k, v, 32-bit index ranges, shared memory,
// workspace size) and launch on a.stream.
//
// KV-centric pipeline, every kernel on one stream:
//   plan:    [validate lists -> host]  [merge: the pieces of each query's lists, merge window > 1]
//            count (per (b, g, bin): a KV block, in a band of queries when Q is large, or a window
//            and block mask) -> scan (one CTA) ->
//            fill (CSR entries query * Kq + slot) + items (each bin's rows cut into <= kRowsPerItem)
//   attend:  persistent CTAs (attend.cu): per work item (a bin and up to kRowsPerItem of its
//            gathered (query, head) rows) K and V by TMA, 64-row tiles of gathered Q, QK and PV on
//            wgmma over the bin's blocks, partial output (normalised) and partial LSE per (query,
//            head, slot or piece)
//   combine: one warp per (query, head tile): LSE-weighted sum of its slots in slot order
// The order of entries inside a block's CSR list depends on atomics, but every row's partial is
// computed by the same instructions wherever it lands in a CTA, and the combine walks slots in a
// fixed order, so outputs are bitwise identical run to run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/call.hpp"
#include "cuda/tuning.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend {

/// What a plan fixes for its runs, resolved once when it is made: the merge window (merge_window.hpp,
/// resolve_merge_window, by the front end) and the query bands (resolve_query_bands) of the reverse
/// index's bins. The
/// attention and the combine read the bins under these values, so a run must be given its plan's.
struct QuerySparseBins {
  int window = 1;
  int bands = 1;
};

/// The bins the KV-centric pipeline plans for these lists, the resolved merge window (QueryCall's) and
/// tuning.
QuerySparseBins query_sparse_bins(const ProblemShape& p, std::int64_t Kq, int merge_window,
                                  const detail::QuerySparseTuning& tuning = {});

/// Workspace bytes of the KV-centric pipeline (see query_sparse_workspace_bytes in plan.hpp): enough
/// for the bins of any merge window under `tuning`'s query bands.
std::size_t query_sparse_workspace_bytes(const ProblemShape& p, std::int64_t Kq, PartialPrecision partials,
                                         const detail::QuerySparseTuning& tuning = {});

/// Reverse index of c.lists under `bins` into `workspace` (device memory of at least the bytes above).
/// Unless a.trusted, validates the lists on the device first (one host synchronisation). Reads a's
/// shape, device, stream and trust only (a plan has no output yet).
void query_sparse_plan(const detail::AttentionCall& a, const detail::QueryCall& c, const QuerySparseBins& bins,
                       void* workspace, std::size_t bytes);

/// Phase 2: partial outputs and LSE of every (query, head, slot), from a workspace planned with `bins`.
void query_sparse_attend(const detail::AttentionCall& a, const detail::QueryCall& c, const QuerySparseBins& bins,
                         void* workspace, std::size_t bytes, const detail::QuerySparseTuning& tuning = {});

/// Phase 3: out and lse from the partials of a workspace planned with `bins` that has been through
/// attend.
void query_sparse_combine(const detail::AttentionCall& a, const detail::QueryCall& c, const QuerySparseBins& bins,
                          void* workspace, std::size_t bytes);

/// The group-centric schedule of query_sparse (c.schedule is not read).
void query_sparse_group(const detail::AttentionCall& a, const detail::QueryCall& c);

/// c.schedule == kv_centric: plan + attend + combine with a workspace cached per (device,
/// stream) (plan.hpp describes when it grows), under `tuning`.
/// c.schedule == group_centric: one kernel (group.cu) that writes out and LSE directly; any
/// group size up to 256 query heads per KV head (ceil(G / 16) m16 tiles per query, rows past G
/// padded), D 64 and 128, causal or not. Unless a.trusted the lists are validated on the
/// device first (one synchronisation; the fault word lives in the cached workspace, 256 bytes).
/// Throws Error naming options.schedule for a group larger than 256, and lists.idx when the union
/// of a CTA's lists does not fit in shared memory (thousands of slots per query).
void query_sparse(const detail::AttentionCall& a, const detail::QueryCall& c,
                  const detail::QuerySparseTuning& tuning = {});

}  // namespace sparse_attn::cuda_backend
