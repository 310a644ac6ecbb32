// Plans: the metadata work of an executor, done once and consumed by many runs (docs/design.md §4.1), and the
// planner that chooses between the Q-centric, the KV-centric and the group-centric schedule for a
// per-query selection (docs/design.md §1, §5.2, §5.3).
//
// KV-centric query_sparse in two steps, as FlashInfer's wrappers do:
//
//   std::size_t bytes = query_sparse_workspace_bytes(shape, Kq, options.partials);
//   ... allocate `bytes` of device memory once (any allocator), view it as u8 [bytes] ...
//   QuerySparsePlan plan = query_sparse_plan(q, k, v, lists, workspace, options);  // reverse index
//   query_sparse_run(plan, q, k, v, out, lse, options);                             // attention + combine
//
// plan() validates the lists (unless options.trusted: validation reads the first fault back to the
// host, one synchronisation) and builds the reverse index in the workspace on options.stream. run()
// launches the attention and combine kernels on options.stream; it neither allocates nor
// synchronises, so it may be captured in a CUDA graph. A plan stays valid while its lists and its
// workspace stay unchanged; run() may be called any number of times with new q, k, v of the same
// shape. On the CPU the workspace is not used (pass an empty view): plan() validates and records, and
// run() executes the three phases of the CPU reference.
//
// The group-centric schedule (QuerySchedule::group_centric) has no plan step, deliberately: its only
// metadata is each CTA's union of 16 queries' lists, which the kernel builds in shared memory in a
// few microseconds from the lists themselves, and it needs no workspace. The one reusable piece of
// work, validating the lists, is skipped by options.trusted. So query_sparse_plan/run stay
// KV-centric (options.schedule must be kv_centric there); group-centric runs through query_sparse().
//
// The one-call query_sparse() (ops.hpp) plans and runs. On the GPU it keeps one workspace per
// (device, stream), grown when a problem needs more: growing synchronises the stream and reallocates,
// so a caller who needs allocation-free calls (CUDA graphs) uses plan() and run() with its own buffer.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn {

// ---- KV-centric plan / run -----------------------------------------------------------------------

/// Device bytes the KV-centric schedule needs for a problem with Kq slots per query: the reverse
/// index (CSR per (b, group, KV block)), the work items, and the partial outputs (Lq * Hq * Kq * D
/// per batch, in `partials` precision) and partial LSE (float32). 0 in a build without the CUDA
/// backend: the CPU path keeps its scratch to itself.
std::size_t query_sparse_workspace_bytes(const ProblemShape& p, std::int64_t Kq, PartialPrecision partials);

/// The merge window the KV-centric schedule runs on the GPU for lists of Kq slots per query:
/// options.merge_window as given (1 to 8) or, for 0, the automatic choice (docs/notes/kv_attention.md).
/// Error naming options.merge_window for a value it does not take. The CPU reference does not merge.
int query_sparse_merge_window(const ProblemShape& p, std::int64_t Kq, const QuerySparseOptions& options = {});

struct QuerySparsePlan {
  ProblemShape shape;  // causal included
  std::int64_t Kq = 0;
  PartialPrecision partials = PartialPrecision::f32;
  int merge_window = 1;  // the merge window in effect (QuerySparseOptions::merge_window resolved)
  int query_bands = 1;   // query bands of the reverse index's bins, fixed when planned (1 on the CPU)
  QueryLists lists;      // the lists the reverse index was built from (read again by the combine)
  TensorView workspace;  // u8 [bytes] on the device of q; empty on the CPU
  float scale = 1.0f;    // softmax scale in effect
  Device device = Device::cpu;
  int device_index = 0;
  bool planned = false;
};

/// Checks the arguments, validates the lists (unless options.trusted) and builds the reverse index
/// in `workspace` (u8, at least query_sparse_workspace_bytes, on q's device) on options.stream.
QuerySparsePlan query_sparse_plan(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const QueryLists& lists, const TensorView& workspace,
                                  const QuerySparseOptions& options = {});

/// Attention and combine of a plan: q, k, v and out must have the plan's shapes and q's device;
/// options.stream, softmax_scale, causal, partials and merge_window (as resolved) must match the plan's
/// (Error otherwise); out and lse must not share memory with q, k, v, each other or the plan's lists
/// and workspace (ops.hpp).
void query_sparse_run(const QuerySparsePlan& plan, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& out,
                      const std::optional<TensorView>& lse = std::nullopt,
                      const QuerySparseOptions& options = {});

// ---- planner: Q-centric, KV-centric or group-centric -----------------------------------------------

enum class Schedule : std::uint8_t {
  q_centric,      // query_lists_to_tile_lists (on the device for device lists), then tile_sparse over each tile's union
  kv_centric,     // query_sparse, QuerySchedule::kv_centric
  group_centric,  // query_sparse, QuerySchedule::group_centric
};

/// Consecutive queries of one (b, group) that share a CTA of the group-centric kernel: its 16 warps
/// each take 16 heads of one query, so 16 / ceil(G / 16) queries (0 where G > 256: not supported).
std::int64_t group_centric_cta_queries(std::int64_t group_size);

const char* schedule_name(Schedule s);

/// Statistics of a QueryLists selection (CPU tensors), counting only causally visible blocks.
struct SelectionStats {
  std::int64_t tiles = 0;            // (b, group, Q tile) triples
  std::int64_t queries = 0;          // (b, group, query) triples
  std::int64_t list_slots = 0;       // queries * Kq: the entries a conversion to TileLists walks
  std::int64_t query_blocks = 0;     // selected visible (b, group, query, block) entries
  std::int64_t tile_union = 0;       // sum over tiles of the size of the union of its queries' lists
  std::int64_t max_tile_union = 0;   // largest union of one tile
  std::int64_t selected_pairs = 0;   // selected visible (b, group, query, key) pairs
  double blocks_per_query = 0.0;     // query_blocks / queries
  double union_per_tile = 0.0;       // tile_union / tiles
  /// Mean Jaccard similarity |A ∩ B| / |A ∪ B| of the lists of neighbouring queries i, i + 1 of the
  /// same tile (pairs where both lists are empty count as 1).
  double neighbour_overlap = 0.0;
  /// query_blocks / (tile_union * queries per tile): the fraction of a tile's union that an average
  /// query uses; 1 when the queries of a tile share one list.
  double union_utilisation = 0.0;
  /// Group-centric CTAs (runs of group_centric_cta_queries(G) consecutive queries of one (b, group))
  /// and the sum over them of the size of the union of their visible lists: the blocks they stream.
  std::int64_t group_ctas = 0;
  std::int64_t group_cta_union = 0;
  double union_per_group_cta = 0.0;  // group_cta_union / group_ctas
  /// Merged slots (QuerySparseOptions::merge_window): window_pieces[W] counts, for windows of W
  /// consecutive blocks, the (b, group, query, window) pieces with a visible selected block: the
  /// partials the KV-centric schedule writes with merge window W. window_pieces[1] = query_blocks;
  /// [0] is unused.
  std::array<std::int64_t, 9> window_pieces{};
};

/// Constants of the cost model, in nanoseconds on one H200 (docs/notes/planner.md records the
/// measurement behind each one, and which ones are provisional).
struct CostModel {
  double q_visit_ns_d128 = 13.4;    // one (query head, Q tile, KV block) visit of tile_sparse, D = 128
  double q_visit_ns_d64 = 10.1;     // the same at D = 64
  double q_fixed_us = 20.0;         // the device conversion in the pipeline: its launch, tile_sparse's ramp after it
  double q_tile_ns = 7.0;           // the device conversion per (b, group, Q tile), Kq = 16
  double kv_row_block_ns = 0.13;    // attention of one (query, head, slot) against one block, D = 128, f32 partials
  double kv_row_block_bf16_ns = 0.097;  // the same with bf16 partials
  double kv_bytes_per_ns = 4270.0;  // HBM rate for the partials written and read back (4.27 TB/s)
  double kv_slot_ns = 0.017;        // reverse index work per (query, slot)
  double kv_fixed_us = 30.0;        // the reverse index's fixed part and the pipeline's launches
  double kv_bin_ns = 5.0;           // merged slots: reverse index work per (b, group, window, mask) bin
  double kv_piece_row_factor = 1.43;  // merged slots: attention per row and block, relative to kv_row_block
  double g_tile_block_ns_d128 = 2.83;  // one (query, 16-head tile, KV block) of the group-centric kernel, D = 128
  double g_tile_block_ns_d64 = 1.6;    // the same at D = 64 (scaled, not measured)
  double g_l2_bytes_per_ns = 4560.0;   // rate at which CTAs stream K/V blocks from L2 (4.56 TB/s)
  double g_fixed_us = 5.0;             // one launch
};

struct PlanEstimate {
  Schedule schedule = Schedule::q_centric;
  double q_centric_ms = 0.0;
  double kv_centric_ms = 0.0;
  /// +inf where the group-centric kernel does not run the shape (G > 256).
  double group_centric_ms = 0.0;
  int merge_window = 1;  // the KV-centric schedule's merge window the estimate assumes
  SelectionStats stats;
  std::string reason;  // one line: the three estimates and what decided
};

/// Statistics of `lists` (int32 [B, Hkv, Lq, Kq] on the CPU; ids as validate() accepts them).
SelectionStats selection_stats(const QueryLists& lists, const ProblemShape& p);

/// Estimated times of the three schedules from `stats` and the chosen one (the smallest estimate).
/// merge_window is the KV-centric schedule's QuerySparseOptions::merge_window (0: the automatic
/// choice the executor makes); the estimate uses the window it resolves to.
PlanEstimate estimate_schedules(const SelectionStats& stats, const ProblemShape& p, PartialPrecision partials,
                                const CostModel& model = {}, int merge_window = 0);

/// selection_stats + estimate_schedules; validates the lists first.
PlanEstimate plan_schedule(const QueryLists& lists, const ProblemShape& p,
                           PartialPrecision partials = PartialPrecision::f32, const CostModel& model = {},
                           int merge_window = 0);

}  // namespace sparse_attn
