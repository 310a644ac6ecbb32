// CUDA backends of query_lists_to_tile_lists, block_bits_to_tile_lists and tile_lists_to_block_bits
// (formats.hpp). The front end (src/convert/convert.cpp) has checked shapes, dtypes, contiguity and
// devices; these check the contents on the device and report them with the CPU function's argument
// names, coordinates and messages.
//
// query_lists_to_tile_lists: one kernel, one CTA per (b, group, Q tile): the tile's up to 128 lists are read once (coalesced
// when the lists are packed, eight ids per thread in flight), each id sets its bit in a shared-memory
// bit set over the Tk blocks by one shared atomic, and the bit set is compacted in ascending order
// into out.idx, -1 after the count.
// Unless trusted, the same pass checks every slot (range, -1 as the only negative, no repeat within a
// query's row) and each tile's union against Kmax, and keeps the first fault in one 64-bit word
// (atomicMin: list faults by row-major slot position first, then capacity faults by tile), which the
// host reads back once.
#pragma once

#include <string>

#include "sparse_attn/formats.hpp"

namespace sparse_attn::cuda_backend {

void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                               const ConvertOptions& options);

/// BlockBits -> TileLists: one warp per (b, group, Q tile) row, the row's words read once, ids written
/// in ascending order through a warp scan of the words' popcounts, -1 after the count. Unless
/// options.trusted, stray bits (at or past Tk) and rows over Kmax are kept in the fault word and
/// reported as the CPU function reports them, with `op` and the argument `in_name` + ".bits"
/// (bits_sparse runs it as "bits_sparse", "bits"). Trusted: stray bits are dropped and Kmax >= Tk is
/// required (checked on the host).
void block_bits_to_tile_lists(const BlockBits& in, const TileLists& out, const ProblemShape& p,
                              const ConvertOptions& options, const std::string& op, const std::string& in_name);

/// TileLists -> BlockBits: one warp per (b, group, Q tile), the tile's words zeroed, then one atomicOr
/// per id. Unless options.trusted, counts outside [0, Kmax] and ids out of range or not ascending mark
/// the tile in the fault word, and the first such tile is read back and reported with the CPU's
/// message. Trusted: counts are clamped and ids out of range dropped.
void tile_lists_to_block_bits(const TileLists& in, const BlockBits& out, const ProblemShape& p,
                              const ConvertOptions& options);

}  // namespace sparse_attn::cuda_backend
