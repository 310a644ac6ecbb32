// Executors: attention restricted to a selection (docs/design.md §5.1-5.6).
//
// Arguments follow flash-attn: q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D] (last dim contiguous,
// any other strides), out [B, Lq, Hq, D] of q's dtype, optional lse float32 [B, Hq, Lq] holding
// the natural log of the softmax denominator (scale included; not base 2). GQA is native: query head
// h uses KV head h / (Hq / Hkv); K and V are never repeated. Causal masks are aligned bottom-right.
//
// dtypes: bf16 and f16 on every backend, f32 on the CPU. The CPU backend computes in float32
// with exact float32 softmax; device tensors go to the CUDA backend, which runs on
// `options.stream` without host synchronisation or allocation, with these exceptions: validating
// the bits of bits_sparse, the lists of token_sparse or query_sparse when not `trusted` reads the
// verdict back (one synchronisation); gated, unless its counters go to GatedOptions::counts, keeps
// them in 32 bytes allocated once per (device, stream) and waits for its stream to return them; and
// dense and tile_sparse allocate a scratch buffer (about
// 140 KB per SM) once per (device, stream), on the first non-causal call whose last, partial wave of
// work they split over more CTAs. A call captured into a CUDA graph on a stream without that buffer
// does not split (it computes the same attention with the sums in another order); make one eager
// call on the stream first to capture split calls.
// An operator that has no implementation for the tensors' device throws Error; it never falls back
// silently.
//
// Non-finite scores (docs/design.md §2): a row whose visible, selected keys include a NaN or +inf score
// (scale * q.k in float32: NaN in q or k, +inf in k, or finite inputs whose score or scaled score
// overflows float32) gets NaN in every element of out and in lse, on every backend and executor
// (gated, entmax included). A -inf score weighs 0; a row with no visible, selected key, or only -inf
// scores, gets out = 0 and lse = -inf. NaN or inf in v reaches out (not lse) of the rows that visit
// its block.
//
// Outputs must not share memory with any other argument: out and lse (and gated's kept_per_tile,
// entmax's block_bits) are checked against q, k, v, the selection's tensors and each other by the
// byte span of each view (base + sum of (extent - 1) * |stride| * itemsize); an overlap throws Error
// naming the operator, the output, the other argument and the bytes shared. Inputs may overlap.
//
// Validation of TileLists on the GPU is deferred: a tile_sparse call that is not `trusted` checks
// each tile's list inside the attention kernel, by the CPU's rules (count in [0, Kmax], ids in
// [0, Tk) and strictly ascending), without a host round trip, so it costs about what a trusted call
// costs and can be captured in a CUDA graph. A faulty tile's list is never followed: its rows of out
// (every head that shares the list) and of lse are NaN, all other rows are computed as usual, and
// the first fault (in the CPU's order) is kept on the device. It is thrown as Error, with the
// operator ("tile_sparse"), argument ("tiles.cnt" or "tiles.idx") and message the CPU would give
// plus a note that an earlier call found it, either by check_device_faults or at the start of the
// next attention operator on that device that is not being captured (the fault is taken once: it
// is reported once). Other CUDA work keeps running meanwhile; only a pending fault makes the host
// wait for the device.
#pragma once

#include <cstdint>
#include <optional>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn {

struct AttentionOptions {
  std::optional<float> softmax_scale;  // default 1 / sqrt(D)
  bool causal = false;
  bool trusted = false;    // no validation of the selection at all (the caller produced it)
  void* stream = nullptr;  // cudaStream_t for device tensors; ignored on the CPU
};

/// Waits for the work queued on CUDA device `device` (on every device where a validated call has
/// run, when nullopt) and throws the first fault that validated tile_sparse calls recorded there
/// since the last report (see above), clearing it. Returns if there is none, and at once without
/// the CUDA backend.
void check_device_faults(std::optional<int> device = std::nullopt);

/// Checks q, k, v, out and lse against each other and returns the problem shape (causal taken
/// from `options`). Throws Error naming the argument at fault.
ProblemShape check_attention_args(const std::string& op, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out,
                                  const std::optional<TensorView>& lse,
                                  const AttentionOptions& options);

/// Softmax scale in effect: options.softmax_scale or 1 / sqrt(D). Throws if not finite and > 0.
float resolve_scale(const std::string& op, const std::optional<float>& scale, std::int64_t D);

/// Dense attention: every visible key.
void dense(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
           const std::optional<TensorView>& lse = std::nullopt, const AttentionOptions& options = {});

/// Q-centric block-sparse attention over per-tile lists.
void tile_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TileLists& tiles, const TensorView& out,
                 const std::optional<TensorView>& lse = std::nullopt,
                 const AttentionOptions& options = {});

/// Block-sparse attention over per-tile bit sets (walks the set bits). On the GPU the bit sets are
/// converted to ascending TileLists on the device (in a workspace cached per device and stream, of
/// B x G x Tq x Tk ids, allocated by the first call on a stream) and run by the tile_sparse kernel;
/// unless options.trusted, stray bits are reported as on the CPU (one synchronisation).
void bits_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                 const BlockBits& bits, const TensorView& out,
                 const std::optional<TensorView>& lse = std::nullopt,
                 const AttentionOptions& options = {});

enum class PartialPrecision : std::uint8_t { f32, bf16 };

/// How query_sparse runs on the GPU. Both give the same attention (within docs/design.md §6 bounds); the CPU
/// backend runs its reference for either.
///  - kv_centric: reverse index -> one partial output + LSE per (query, head, slot) -> combine.
///  - group_centric: one query's heads of a group are the rows of an MMA tile; a CTA streams the union
///    of its queries' lists once and each query's rows visit only their own blocks; no partials.
///    Suited to large GQA groups (Hq / Hkv >= 8) and small KV block counts.
enum class QuerySchedule : std::uint8_t { kv_centric, group_centric };

const char* query_schedule_name(QuerySchedule s);

struct QuerySparseOptions : AttentionOptions {
  PartialPrecision partials = PartialPrecision::f32;  // storage of partial outputs (kv_centric)
  QuerySchedule schedule = QuerySchedule::kv_centric;
  /// kv_centric on the GPU: a query's chosen blocks within one window of this many consecutive
  /// blocks are computed together and leave one partial output instead of one per block (fewer bytes
  /// written and combined; the work items group the queries with the same blocks in a window).
  /// 1: off; 2 to 8: that window (at most 64 slots per query, and at most 12288 window-and-mask bins
  /// per batch and KV head: ceil(Tk / W) * 2^W); 0: chosen from the lists' shape, merging only where
  /// most partials go away (docs/notes/kv_attention.md). The result is the same attention either way;
  /// the CPU checks the value and ignores it.
  int merge_window = 0;
};

/// KV-centric attention over per-query block lists: reverse index -> partial outputs and LSE per
/// (query, head, slot) -> LSE-weighted combine in slot order (deterministic).
void query_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                  const QueryLists& lists, const TensorView& out,
                  const std::optional<TensorView>& lse = std::nullopt,
                  const QuerySparseOptions& options = {});

/// Attention over per-query key positions, shared by the heads of a group. On the GPU one warp takes
/// a query and up to 16 heads of its group and gathers the listed K/V rows (docs/notes/token_sparse.md);
/// unless options.trusted the lists are checked on the device first (one synchronisation; errors as
/// on the CPU). Checked lists need a bit set of Lk positions in shared memory (Lk up to about 1.8 M on
/// the H200).
void token_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TokenLists& tokens, const TensorView& out,
                  const std::optional<TensorView>& lse = std::nullopt,
                  const AttentionOptions& options = {});

/// Any selection: dispatches on the alternative held.
void sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Selection& selection, const TensorView& out,
                      const std::optional<TensorView>& lse = std::nullopt,
                      const AttentionOptions& options = {});

// ---- gated (BSFA, docs/design.md §5.5) -----------------------------------------------------------------

struct GatedOptions {
  std::optional<float> softmax_scale;
  void* stream = nullptr;
  /// The first `sink_blocks` KV blocks are always kept, like the diagonal (attention sinks). Must
  /// equal the ThresholdTable's sink_blocks the thresholds come from (calibration excludes them).
  std::int64_t sink_blocks = 1;
  /// Optional int32 [B, Hq, Tg] output (Tg = ceil(Lq / kGateRows)): blocks kept per (batch, head,
  /// gate tile), diagonal and sinks included.
  std::optional<TensorView> kept_per_tile;
  /// Optional int32 [4] output on q's device: the counters of GatedStats (kept_blocks,
  /// visible_blocks, gated_candidates, gated_kept), overwritten. When given, gated() on a CUDA
  /// device does not wait for it: the counters are left there in stream order and the returned
  /// GatedStats has `deferred` set and zero counts (the CPU returns them as well). Without it, a
  /// CUDA call waits for its stream to return the counters. Refused where B x Hq x Tg x Tk
  /// exceeds int32.
  std::optional<TensorView> counts;
};

/// Counters in units of (b, h, gate tile, kv block) visits: a gate tile is kGateRows queries.
struct GatedStats {
  std::int64_t kept_blocks = 0;       // visits that ran PV
  std::int64_t visible_blocks = 0;    // visits that were causally visible (all of them ran QK)
  std::int64_t gated_candidates = 0;  // visible visits off the diagonal and past the sinks (subject to the gate)
  std::int64_t gated_kept = 0;        // ... of which passed the gate
  bool deferred = false;              // the counters went to GatedOptions::counts instead
  double density() const { return visible_blocks ? double(kept_blocks) / double(visible_blocks) : 0.0; }
};

/// Causal attention that computes QK for every visible block and, per gate tile of kGateRows
/// queries (docs/design.md §5.5), takes the block max of the scaled scores over the gate tile's
/// rows and skips the exponentials, PV and softmax update of the block where that max is below
/// thresholds[h][min(g, T - 1)] (float32 [Hq, T], one budget and layer of a ThresholdTable; g the
/// gate tile). Blocks that straddle the gate tile's causal diagonal, and the first
/// options.sink_blocks blocks, are always kept. A threshold of -inf keeps every block; a block
/// holding a NaN score is kept (the NaN reaches its rows). NaN thresholds are refused on the CPU;
/// on a CUDA device they are not read back and keep every block, as -inf does.
GatedStats gated(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& thresholds, const TensorView& out,
                 const std::optional<TensorView>& lse = std::nullopt, const GatedOptions& options = {});

// ---- entmax (docs/design.md §5.6) ----------------------------------------------------------------------

/// The largest alpha the CUDA entmax executor takes (tested from 1.01 to 3 against the CPU).
inline constexpr float kMaxCudaEntmaxAlpha = 3.0f;

struct EntmaxOptions {
  float alpha = 1.5f;  // > 1; alpha = 2 is sparsemax
  std::optional<float> softmax_scale;  // z = scale * q.k
  bool causal = false;
  int histogram_bins = 64;  // bins of the threshold bound, 2 to 4096 (held per row of a tile)
  void* stream = nullptr;
  /// Optional uint32 [B, Hq, Tq, ceil(Tk / 32)] output: the tiles holding any nonzero weight.
  std::optional<TensorView> block_bits;
};

struct EntmaxStats {
  std::int64_t active_tiles = 0;   // (b, h, q tile, kv block) tiles visited by the output pass
  std::int64_t visible_tiles = 0;  // causally visible tiles
  std::int64_t support = 0;        // (query, key) pairs with nonzero weight
};

/// p = [(alpha - 1) z - tau]_+^(1 / (alpha - 1)) per row, out = p V. Exact for any alpha > 1: equal to
/// full-context entmax up to rounding (alpha = 1.01 to 1000 tested). Rows that see no key (causal with
/// Lq > Lk) give out = 0; rows with a NaN or +inf score give NaN (and mark no tile in block_bits).
/// On the GPU (q and k with 16-byte aligned bases and strides in multiples of 8 elements; alpha at most
/// kMaxCudaEntmaxAlpha, larger alphas are refused) the threshold is held in float32 score units: exact
/// up to that resolution, which at large alpha leaves the weight of a support score lying within it of
/// the threshold unresolved (5-10 % relative error at alpha 16, hence the bound); block_bits may
/// hold extra tiles whose scores lie within 2^-10 max(1, |z_max|) of the threshold (never fewer than
/// the support needs); histogram_bins is not used; the statistics are read back (one synchronisation).
EntmaxStats entmax(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const EntmaxOptions& options = {});

}  // namespace sparse_attn
