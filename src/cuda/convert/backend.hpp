// CUDA backend of query_lists_to_tile_lists (formats.hpp). The front end (src/core/formats.cpp) has
// checked shapes, dtypes, contiguity and devices; this checks the contents on the device and reports
// them with the CPU function's argument names, coordinates and messages.
//
// One kernel, one CTA per (b, group, Q tile): the tile's up to 128 lists are read once (coalesced
// when the lists are packed), each id sets its bit in a shared-memory bit set over the Tk blocks
// (lanes of a warp that hit the same word merge their bits first, so a word takes one shared atomic
// per warp), and the bit set is compacted in ascending order into out.idx, -1 after the count.
// Unless trusted, the same pass checks every slot (range, -1 as the only negative, no repeat within a
// query's row) and each tile's union against Kmax, and keeps the first fault in one 64-bit word
// (atomicMin: list faults by row-major slot position first, then capacity faults by tile), which the
// host reads back once.
#pragma once

#include "sparse_attn/formats.hpp"

namespace sparse_attn::cuda_backend {

void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                               const ConvertOptions& options);

/// The kernel version query_lists_to_tile_lists runs (query_to_tiles.cu: 1 one id per thread and
/// iteration, lanes of a word merged by match/redux; 2 eight ids per thread loaded first, then as 1;
/// 3 eight ids loaded first, one shared atomic per id; 4 eight ids loaded first, folded into
/// per-thread words of a window of the bit set and ORed across the warp, version 3 past 32 words).
inline constexpr int kConvertVersion = 4;

/// The conversion with an explicit kernel version (tests and timing compare them).
void query_lists_to_tile_lists_version(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                                       const ConvertOptions& options, int version);

}  // namespace sparse_attn::cuda_backend
