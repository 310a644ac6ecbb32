// Entry points of the CUDA entmax (docs/design.md §5.6): the operator front end (src/entmax/entmax.cpp)
// has resolved and checked the arguments. The output pass is the Q-centric kernel's (cuda/backend.hpp,
// entmax_output); these are the passes that find the thresholds and the bits it walks.
#pragma once

#include <mutex>

#include "core/call.hpp"
#include "cuda/attention/entmax_params.hpp"
#include "cuda/tuning.hpp"
#include "sparse_attn/ops.hpp"

namespace sparse_attn::cuda_backend {

/// What the threshold passes leave for the output pass: the set bits as TileLists (G = Hq, in this
/// (device, stream)'s workspace), the rows' thresholds, and the device counters (support, active tiles).
struct EntmaxPlan {
  detail::TileCall tiles;
  cuda_kernels::EntmaxTransformParams transform;
  const unsigned long long* counters = nullptr;
};

/// The lock of the workspaces that plans live in (one per (device, stream)).
std::mutex& entmax_workspace_mutex();

/// The threshold passes on the GPU (row max, bracketing passes, support and block bits; copied to
/// options.block_bits where given) and the conversion of the bits to TileLists. No synchronisation.
/// The caller holds entmax_workspace_mutex() from this call until it is done with the plan (a later
/// call on the same stream may reuse the workspace).
EntmaxPlan entmax_thresholds(const detail::AttentionCall& a, const EntmaxOptions& options);

/// entmax on the GPU: entmax_thresholds, the output pass (entmax_output, cuda/backend.hpp, over the
/// plan's lists), then the statistics read back (one
/// synchronisation).
EntmaxStats entmax(const detail::AttentionCall& a, const EntmaxOptions& options, const detail::AttentionTuning& tuning = {});

}  // namespace sparse_attn::cuda_backend
