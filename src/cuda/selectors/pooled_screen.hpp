// Internal to the CUDA pooled selector (pooled.cu): its two screens, for the GPU tests and timings
// that compare them. The public pooled_select runs the int8 tensor-core screen.
#pragma once

#include "sparse_attn/formats.hpp"
#include "sparse_attn/selectors.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend {

enum class PooledScreen {
  int8_tensor_cores,  // version 2b: int8 copies of the means, exact integer dots on mma.sync
  fp32,               // version 2a: float32 dots on the CUDA cores
};

/// Values per CTA of the int8 scoring kernel's profiling record (see kPhases in pooled.cu): eight
/// global-timer stamps, then the number of pairs queued for float64 in the first key pass.
constexpr int kPooledPhases = 9;

/// cuda_backend::pooled_select with an explicit screen; arguments as checked by the front end. With
/// phase_ns (device memory, kPooledPhases values per CTA of the scoring grid), the int8 scoring
/// kernel writes the global-timer stamps of its phases there.
void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& options,
                   PooledScreen screen, unsigned long long* phase_ns = nullptr);

}  // namespace sparse_attn::cuda_backend
