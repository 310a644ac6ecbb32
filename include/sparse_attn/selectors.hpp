// Selectors: decide which KV blocks (or keys) each query sees (docs/design.md §5.7).
//
// On the CPU, top-k is exact (float64 scores) with ties broken by the lower index. On a CUDA device
// every selector scores on the tensor cores in float32 and returns a top-k of the exact scores up to a
// bound eps that its kernel derives and states (docs/design.md §5.7): for every list, the lowest exact
// score selected is at least the highest exact score left out minus eps. Lists come out ascending, so
// TileLists are valid for tile_sparse as produced. All selectors are deterministic: two runs give
// bitwise equal lists.
//
// Shared rules of the CPU implementations:
// - Candidates are the blocks (keys) holding at least one causally visible key; a list holds
//   min(top_k, candidates) ids and its unused slots are -1 (a tile or query that sees no key gets
//   an empty list). Every slot of the output is written.
// - Forced / reserved blocks rank above every scored block and count towards top_k; if more are
//   forced than top_k allows, the lower block ids win (the general tie rule).
// - Scores are float64 dot products of the (dequantised) float32 inputs; products of floats are
//   exact in float64, so results do not depend on FMA contraction or thread count.
// - Index inputs holding NaN or infinity are rejected with an Error naming the coordinate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn {

struct PooledOptions {
  int representatives = 1;   // r in {1, 4}: 128 / r consecutive tokens per representative
  int top_k = 16;            // blocks per (b, group, Q tile); fewer when fewer are visible
  bool force_local = true;   // always keep the diagonal block(s) of the tile (causal) or the block
                             // holding the tile's first query's aligned key (non-causal)
  bool force_block0 = false; // always keep block 0 (attention sink)
  bool causal = false;       // only blocks visible to some query of the tile are candidates
  void* stream = nullptr;
  /// Device scratch of a CUDA call: u8 [>= pooled_workspace_bytes(...)] on the inputs' device.
  /// Empty: the library's own workspace per (device, stream), grown when a call needs more (growth
  /// waits for the stream).
  /// Ignored on the CPU.
  TensorView workspace{};
};

/// R1 / R4 pooled selector. q [B, Lq, Hq, D], k [B, Lk, Hkv, D]. Representatives are means of
/// 128 / r consecutive queries (keys) of a tile (block), partial tiles averaging what they hold;
/// block score = max over representative pairs and over the query heads of the group of the
/// representative dot products. out.idx int32 [B, Hkv, Tq, Kmax >= top_k], out.cnt [B, Hkv, Tq].
///
/// A representative group holding no token (past Lq or Lk) is absent. Causal: block j is a
/// candidate iff the tile's last query sees the block's first key, and a representative pair
/// (query group a, key group c) counts iff the LAST query of group a sees the FIRST key of group
/// c (for R1 this is the candidate rule itself; every candidate has at least one counted pair).
/// force_local: causal, the blocks holding keys i + (Lk - Lq) >= 0 for the tile's queries i (one
/// or two blocks); non-causal, the block holding key min(first query * Lk / Lq, Lk - 1).
/// force_block0 applies to tiles that see any key.
/// On a CUDA device the scores are float32: each list is a top-k of the scores above up to a derived
/// bound (docs/design.md §5.7), ties to the lower id, the same bits on every run. A device call keeps a
/// tile's block scores and at least 16 query and 16 key representative rows in one CTA's shared memory:
/// on an H200, D up to 1,776 and Lk up to about 4 M keys at D = 128; beyond the device's limit it
/// raises an Error naming Lk and D.
void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out,
                   const PooledOptions& options = {});
/// Bytes of device scratch a CUDA pooled_select of these inputs and options takes (options.workspace);
/// 0 for CPU tensors and in a build without CUDA.
std::size_t pooled_workspace_bytes(const TensorView& q, const TensorView& k, const PooledOptions& options = {});

enum class IndexPrecision : std::uint8_t {
  bf16,      // inputs rounded to bf16, products accumulated in float32
  fp8_e4m3,  // per-tensor scaled e4m3 (saturating, round to nearest even), float32 accumulation
  fp4_e2m1,  // e2m1 values with an e4m3 scale per 16 consecutive elements (NVFP4 layout)
};

const char* precision_name(IndexPrecision p);

struct TokenMaxOptions {
  int top_k = 16;              // blocks per list, the reserved local block included
  IndexPrecision precision = IndexPrecision::bf16;
  bool causal = false;       // bottom-right causal visibility; false like every other option struct
  bool reserve_local = true;   // the block holding the query's own position (causal diagonal) is
                               // always selected and counts towards top_k
  bool force_block0 = false;   // always keep block 0 (attention sink) in lists that see any key
  void* stream = nullptr;
  /// Device scratch of a CUDA call: u8 [>= token_max_workspace_bytes(...)] on the inputs' device.
  /// Empty: the library's own workspace per (device, stream), grown when a call needs more (growth
  /// waits for the stream).
  /// Ignored on the CPU.
  TensorView workspace{};
};

/// MSA-style block scores from index vectors: qidx [B, Lq, Hkv, Di], kidx [B, Lk, 1 or Hkv, Di].
/// Score of block j for query i = max over visible keys s of block j of qidx_i . kidx_s.
/// Per-query lists (QueryLists idx [B, Hkv, Lq, Kq >= top_k], -1 padded, ascending).
///
/// Each of qidx and kidx is rounded through options.precision with its own per-tensor scale
/// (amax over the whole tensor: amax / 448 for fp8, amax / (448 * 6) for fp4's scale-of-scales).
/// The local block is the one holding the query's aligned key i + (Lk - Lq): causal, only when
/// that key exists (>= 0); non-causal, clamped to [0, Lk - 1]. force_block0 forces block 0 like the
/// local block (PooledOptions::force_block0).
///
/// On CUDA devices the scores come from the tensor cores in float32 (docs/design.md §5.7): each list is
/// a top-k of the exact (float64) scores within a bound eps derived in src/cuda/selectors/token_max.cu
/// from the row norms, not necessarily the CPU's ids; runs are bitwise repeatable.
void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out,
                      const TokenMaxOptions& options = {});
/// Per-tile lists: the block score is also maxed over the queries of the tile; the reserved blocks
/// are the local blocks of all the tile's queries (one or two). out.idx [B, Hkv, Tq, Kmax >= top_k],
/// out.cnt [B, Hkv, Tq].
void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out,
                      const TokenMaxOptions& options = {});
/// Bytes of device scratch a CUDA token_max_select of these inputs takes (options.workspace), for
/// TileLists (`tile_lists`) or QueryLists; 0 for CPU tensors and in a build without CUDA.
std::size_t token_max_workspace_bytes(const TensorView& qidx, const TensorView& kidx, bool tile_lists,
                                      const TokenMaxOptions& options = {});

struct LightningOptions {
  int top_k = 2048;
  bool causal = false;       // bottom-right causal visibility; false like every other option struct
  IndexPrecision precision = IndexPrecision::fp8_e4m3;  // bf16 or fp8_e4m3
  int sink_keys = 0;         // keys 0 .. sink_keys - 1 (those the query sees) are always selected and count
                             // towards top_k (lower ids first); the block form forces the blocks holding them
  void* stream = nullptr;
  /// Device scratch of a CUDA call: u8 [>= lightning_workspace_bytes(...)] on the inputs' device.
  /// Empty: the library's own workspace per (device, stream), grown when a call needs more (growth
  /// waits for the stream).
  /// Ignored on the CPU.
  TensorView workspace{};
};

/// DSA lightning indexer: I[t, s] = sum_j w[t, j] * ReLU(qI[t, j] . kI[s]) with qI [B, Lq, HI, Di],
/// w [B, Lq, HI] (float32), kI [B, Lk, Di]. Top-k keys per query, written to every group of
/// out.idx [B, G, Lq, Kt >= top_k] (ascending, -1 padded). The [Lq, Lk] score matrix is never stored.
/// qI and kI are rounded through options.precision with per-tensor scales; w stays float32. A query
/// seeing fewer than top_k keys gets all of them. On the CPU the lists are the exact top-k of the
/// float64 scores; on the GPU a top-k of them up to the bound ε of docs/design.md §5.7 (the
/// tensor-core scores in float32 may order near-ties differently).
void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI,
                      const TokenLists& out, const LightningOptions& options = {});
/// Same scores max-pooled to KV blocks (over each block's visible keys); top-k blocks per query.
void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI,
                      const QueryLists& out, const LightningOptions& options = {});
/// Bytes of device scratch a CUDA lightning_select of these inputs takes (options.workspace), for
/// TokenLists (`token_lists`) or the block form; 0 for CPU tensors and in a build without CUDA.
std::size_t lightning_workspace_bytes(const TensorView& qI, const TensorView& kI, bool token_lists,
                                      const LightningOptions& options = {});

// ---- low-precision formats (exactly as the hardware defines them) --------------------------------

/// float -> e4m3 (fn: no infinities, max 448, saturating, round to nearest even; NaN -> 0x7f).
std::uint8_t float_to_e4m3(float f);
float e4m3_to_float(std::uint8_t b);
/// float -> e2m1 (max 6, saturating, round to nearest even), 4-bit code in the low nibble. e2m1
/// has no NaN: NaN maps to +6.
std::uint8_t float_to_e2m1(float f);
float e2m1_to_float(std::uint8_t b);

/// Rounds a row of n values through the given precision in place (fp4: blocks of 16 with an e4m3
/// scale = amax / 6, then e2m1 values; fp8: x / scale rounded to e4m3, times scale). `tensor_scale`
/// is the per-tensor scale for fp8 (amax / 448) and the scale-of-scales for fp4. The fp4 block scale
/// is e4m3(amax_block / 6 / tensor_scale) * tensor_scale; a final block shorter than 16 (n not a
/// multiple of 16) is scaled over the elements it holds. bf16 ignores `tensor_scale`; otherwise it
/// must be finite and >= 0, and 0 only for an all-zero row.
void quantize_dequantize(float* row, std::int64_t n, IndexPrecision p, float tensor_scale);

}  // namespace sparse_attn
