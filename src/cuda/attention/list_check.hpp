// The check of a validated tile_sparse call's lists (docs/design.md §3.1): a kernel launched after the
// attention kernel on the same stream, as its programmatic dependent.
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention/params.hpp"

namespace sparse_attn::cuda_kernels {

/// Checks every list of p (idx, cnt, Kmax, Tk) by the CPU's rules (count in [0, Kmax], the first
/// count ids in [0, Tk) and strictly ascending). A faulty list's tile gets NaN in out (2-byte
/// elements) and lse for every row and every head sharing the list, once the attention before it on
/// `stream` has finished, and the first fault in the CPU's order goes to the device's record (p.fault,
/// p.fault_flag). Valid lists are only read. Returns the launch's error.
cudaError_t launch_list_check(const TileAttentionParams& p, int head_dim, cudaStream_t stream);

}  // namespace sparse_attn::cuda_kernels
