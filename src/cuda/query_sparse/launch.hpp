// Launchers of the query_sparse kernels (one translation unit per phase); each returns the launch
// status and leaves error reporting to the host code in query_sparse.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/query_sparse/kernels.cuh"

namespace sparse_attn::cuda_kernels::qs {

cudaError_t launch_validate(const Params& p, cudaStream_t stream);
/// count -> scan -> fill -> items.
cudaError_t launch_reverse_index(const Params& p, cudaStream_t stream);
/// Persistent attention over the work items: min(ctas, max_items) CTAs (ctas: one per SM, or fewer
/// where a test asks), each taking the next item from the work queue (p.queue, zeroed by launch_reverse_index and left zeroed by every
/// launch) until the count the reverse index wrote. K and V come through TMA maps made by
/// make_bhld_tensor_map.
cudaError_t launch_attend(const Params& p, bool bf16, int D, bool bf16_partials, const CUtensorMap* tm_k,
                          const CUtensorMap* tm_v, int ctas, long long max_items, cudaStream_t stream);
/// Dynamic shared memory of the attention kernel for head dim D.
std::size_t attend_smem(int D);
cudaError_t launch_combine(const Params& p, bool bf16, int D, bool bf16_partials, cudaStream_t stream);

/// Dynamic shared memory of the group-centric kernel for head dim D and the union capacity of `p`.
std::size_t group_smem_bytes(const GroupParams& p, int D);
/// The group-centric kernel: B * Hkv * ctas_per_bg CTAs, out and LSE written directly; K and V read
/// through TMA maps of 128-key boxes (make_bhld_tensor_map).
cudaError_t launch_group(const GroupParams& p, bool bf16, int D, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                         cudaStream_t stream);

}  // namespace sparse_attn::cuda_kernels::qs
