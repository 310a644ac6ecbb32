// Instrumentation of the CUDA token_max selector (tests and timing only; not part of the public API).
#pragma once

#include <cuda_runtime.h>

namespace sparse_attn::cuda_backend {

/// While non-null, every token_max_select call on the device adds to device_counters[0] the number of
/// candidate blocks it ranked and to device_counters[1] the number of (list, block) pairs whose
/// screened score was too close to the k-th to decide, so they were re-scored in float64. The pointer
/// must be device memory holding two unsigned long long; pass nullptr to stop counting.
void set_token_max_stats(unsigned long long* device_counters);

/// Screening GEMM of later calls: 0 = warp-specialised wgmma with TMA (the default), 1 = mma.sync
/// (m16n8k16), 2 = wgmma (m64n128k16) with cp.async, every warp loading. All give the same ids.
void set_token_max_screen(int kernel);

/// Whether later calls launch each kernel after the first as a programmatic dependent of the one before
/// (on by default; off for A/B timings). The ids are the same either way. Calls that record stage events
/// (set_token_max_events) launch plainly.
void set_token_max_pdl(bool on);

/// While non-null, later calls record events[0 .. 5] on their stream: after the scratch memset, after
/// the index preparation, the screening GEMM, the decision, the float64 re-scoring and the final ranking.
void set_token_max_events(cudaEvent_t* events);

}  // namespace sparse_attn::cuda_backend
