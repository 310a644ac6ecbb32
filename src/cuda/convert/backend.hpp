// CUDA backend of query_lists_to_tile_lists (formats.hpp). The front end (src/core/formats.cpp) has
// checked shapes, dtypes, contiguity and devices; this checks the contents on the device and reports
// them with the CPU function's argument names, coordinates and messages.
//
// One kernel, one CTA per (b, group, Q tile): the tile's up to 128 lists are read once (coalesced
// when the lists are packed, eight ids per thread in flight), each id sets its bit in a shared-memory
// bit set over the Tk blocks by one shared atomic, and the bit set is compacted in ascending order
// into out.idx, -1 after the count.
// Unless trusted, the same pass checks every slot (range, -1 as the only negative, no repeat within a
// query's row) and each tile's union against Kmax, and keeps the first fault in one 64-bit word
// (atomicMin: list faults by row-major slot position first, then capacity faults by tile), which the
// host reads back once.
#pragma once

#include "sparse_attn/formats.hpp"

namespace sparse_attn::cuda_backend {

void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                               const ConvertOptions& options);

}  // namespace sparse_attn::cuda_backend
