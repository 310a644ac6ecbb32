// Problem shapes and the selection formats (docs/design.md §3).
//
// Conventions: q [B, Lq, Hq, D]; k, v [B, Lk, Hkv, D]; a Q tile is 128 consecutive queries and a
// KV block 128 consecutive keys (the last ones may be partial). Causal visibility is aligned to the
// bottom right: query i sees key j iff j <= i + (Lk - Lq).
//
// Selection semantics: each query normalises its softmax over the keys it selected that are also
// visible; every other key has weight zero. A query that sees no key gets out = 0, lse = -inf.
#pragma once

#include <cstdint>
#include <string>
#include <variant>

#include "sparse_attn/tensor.hpp"

namespace sparse_attn {

inline constexpr std::int64_t kTileQ = 128;   // queries per Q tile
inline constexpr std::int64_t kBlockK = 128;  // keys per KV block
/// Queries per gate tile of `gated` (docs/design.md §5.5): the gate decides per 64 rows x 128 keys,
/// the rows of one consumer warpgroup of the Hopper kernel. A Q tile holds two gate tiles.
inline constexpr std::int64_t kGateRows = 64;

inline constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

struct ProblemShape {
  std::int64_t B = 0, Lq = 0, Lk = 0, Hq = 0, Hkv = 0, D = 0;
  bool causal = false;

  std::int64_t Tq() const { return ceil_div(Lq, kTileQ); }
  std::int64_t Tk() const { return ceil_div(Lk, kBlockK); }
  std::int64_t group_size() const { return Hq / Hkv; }
  /// Causal offset: query i sees key j iff j <= i + offset().
  std::int64_t offset() const { return Lk - Lq; }
  bool visible(std::int64_t i, std::int64_t j) const { return !causal || j <= i + offset(); }
  /// Last key (exclusive) that query i may see.
  std::int64_t key_end(std::int64_t i) const;
  /// Number of visible (query, key) pairs per (batch, head) under the causal rule alone.
  std::int64_t visible_pairs() const;
  std::string describe() const;
};

/// Per Q tile lists of KV block ids. idx int32 [B, G, Tq, Kmax], cnt int32 [B, G, Tq], G = Hkv
/// (one list per GQA group) or G = Hq (per head). idx[..., :cnt] are distinct and ascending.
struct TileLists {
  TensorView idx;
  TensorView cnt;
};

/// Per Q tile bit sets. bits uint32 [B, G, Tq, ceil(Tk / 32)]; bit j % 32 of word j / 32 set iff
/// KV block j is selected. Bits at or past Tk are zero.
struct BlockBits {
  TensorView bits;
};

/// Per query KV block ids. idx int32 [B, Hkv, Lq, Kq]; -1 marks an empty slot. Ids are distinct
/// within a row; order is free.
struct QueryLists {
  TensorView idx;
};

/// Per query key positions. idx int32 [B, Hkv, Lq, Kt]; -1 marks an empty slot. Positions are
/// distinct within a row; order is free.
struct TokenLists {
  TensorView idx;
};

/// Every block of every tile (dense attention, possibly causal), as a selection.
struct AllBlocks {};

using Selection = std::variant<AllBlocks, TileLists, BlockBits, QueryLists, TokenLists>;

/// Name of the selection's format: "dense", "TileLists", ...
const char* selection_name(const Selection& s);

// ---- validation --------------------------------------------------------------------------------
// Each validator checks shapes, dtypes, devices and contents, and throws Error naming `op`, the
// argument (`name` + ".idx" etc.) and the first offending coordinate: ids out of range, duplicates,
// counts over capacity, unsorted lists, stray high bits. Contents are checked on the CPU; device
// tensors are checked by the device backend.

void validate(const TileLists& s, const ProblemShape& p, const std::string& op,
              const std::string& name = "tiles");
void validate(const BlockBits& s, const ProblemShape& p, const std::string& op,
              const std::string& name = "bits");
void validate(const QueryLists& s, const ProblemShape& p, const std::string& op,
              const std::string& name = "lists");
void validate(const TokenLists& s, const ProblemShape& p, const std::string& op,
              const std::string& name = "tokens");
void validate(const Selection& s, const ProblemShape& p, const std::string& op);

/// The G dimension of a block selection (Hkv or Hq); throws if it is neither.
std::int64_t selection_groups(const Selection& s, const ProblemShape& p, const std::string& op);

// ---- conversions --------------------------------------------------------------------------------

/// TileLists -> BlockBits of the same [B, G, Tq] layout. in and out on one device; device tensors run
/// on the default stream, the overload below takes a stream.
void tile_lists_to_block_bits(const TileLists& in, const BlockBits& out, const ProblemShape& p);
/// BlockBits -> TileLists (ascending ids, -1 past the count). Throws if a tile holds more than Kmax
/// blocks (Error naming out.idx) or a bit at or past Tk is set (naming in.bits). in and out on one
/// device; device tensors run on the default stream, the overload below takes a stream.
void block_bits_to_tile_lists(const BlockBits& in, const TileLists& out, const ProblemShape& p);
/// QueryLists -> TileLists: the union of the lists of the (up to 128) queries of each tile,
/// ascending, -1 past the count (causal visibility is not applied: a block a query selected is in its
/// tile's union even where that query cannot see it). out.idx [B, Hkv, Tq, Kmax] with Kmax >= the
/// largest union (else Error naming out.idx); in and out on one device. Device tensors run on the
/// default stream; the overload below takes a stream.
void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p);

struct ConvertOptions {
  /// Device tensors only: skip the validation of `in` and the capacity check, so that the conversion
  /// neither synchronises nor reads anything back (CUDA-graph safe). Ids outside [0, Tk) are then
  /// ignored rather than reported, and out.idx must hold the largest possible union,
  /// Kmax >= min(Tk, min(128, Lq) * Kq), checked on the host (Error otherwise). Ignored on the CPU,
  /// which always validates.
  bool trusted = false;
  void* stream = nullptr;  // cudaStream_t for device tensors; ignored on the CPU
};

/// The same conversion with options. On the device it is one kernel (one CTA per Q tile: the union
/// as a bit set in shared memory, then compacted in ascending order) on options.stream; unless
/// options.trusted, the lists and the capacity are checked by the same kernel, and its one fault word
/// is read back (one synchronisation) so that errors are those of the CPU function, same argument,
/// same first offending coordinate and message. After an error the contents of `out` are unspecified.
void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                               const ConvertOptions& options);

/// TileLists -> BlockBits with options. On the device it is one kernel (a warp per Q tile) on
/// options.stream; unless options.trusted, the same kernel checks the lists and the first faulty tile
/// is read back (one synchronisation) and reported as the CPU function reports it. options.trusted:
/// nothing is read back (CUDA-graph safe), counts are clamped to [0, Kmax] and ids outside [0, Tk)
/// are ignored. After an error the contents of `out` are unspecified.
void tile_lists_to_block_bits(const TileLists& in, const BlockBits& out, const ProblemShape& p,
                              const ConvertOptions& options);

/// BlockBits -> TileLists with options. On the device it is one kernel (a warp per Q tile row) on
/// options.stream; unless options.trusted, the same kernel checks for stray bits and rows over Kmax and
/// its one fault word is read back (one synchronisation), so that errors are those of the CPU
/// function. options.trusted: nothing is read back (CUDA-graph safe), bits at or past Tk are ignored,
/// and out.idx must hold every block, Kmax >= Tk (Error otherwise). After an error the contents of
/// `out` are unspecified.
void block_bits_to_tile_lists(const BlockBits& in, const TileLists& out, const ProblemShape& p,
                              const ConvertOptions& options);

// ---- masks -------------------------------------------------------------------------------------

/// Row i of the explicit mask of (b, query head h): row[j] = 1 iff key j is selected for that query
/// and visible. `row` has p.Lk entries.
void selection_row(const Selection& s, const ProblemShape& p, std::int64_t b, std::int64_t h,
                   std::int64_t i, std::uint8_t* row);
/// The whole explicit mask, u8 [B, Hq, Lq, Lk]. Meant for tests and small problems.
HostTensor expand_mask(const Selection& s, const ProblemShape& p);

}  // namespace sparse_attn
