// Internal to the CUDA pooled selector (pooled.cu): its scoring kernels, for the GPU tests and timings
// that compare them. The public pooled_select runs `automatic`.
#pragma once

#include "sparse_attn/formats.hpp"
#include "sparse_attn/selectors.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend {

enum class PooledScreen {
  automatic,          // exact_f64 where it applies and the call is small (<= 128 Mi float64 fmas), else
                      // int8_tensor_cores
  exact_f64,          // version 4: every counted pair in float64, no screen (group * r <= 64 only)
  int8_tensor_cores,  // version 3: int8 copies of the means, exact integer dots on mma.sync
  fp32,               // version 2a: float32 dots on the CUDA cores
};

/// Whether PooledScreen::exact_f64 serves a problem with `rows` = group * r query rows per tile and
/// head dimension D (the automatic choice takes it then).
bool pooled_exact_applies(std::int64_t rows, std::int64_t D);

/// Load width of the representatives kernel, for tests and A/B timings (every width gives the same bits):
/// 0 lets each call choose (the default: the widest aligned vector that leaves 8 warps per SM); 16, 8 or 4
/// takes the widest vector up to that many bytes that the views allow; 1 loads single elements. Any other
/// value throws an Error naming `bytes`. Process-wide.
void set_pooled_rep_vec(int bytes);

/// Values per CTA of a scoring kernel's profiling record (see kPhases in pooled.cu). The int8 kernel: eight
/// global-timer stamps, then the number of pairs queued for float64 in the first key pass. The float64
/// kernel: six stamps (entry, after the wait, after the staging, after the dots, after the block maxima,
/// after the ranking), the rest zero.
constexpr int kPooledPhases = 9;

/// cuda_backend::pooled_select with an explicit screen; arguments as checked by the front end;
/// exact_f64 where it does not apply throws an Error naming q. With
/// phase_ns (device memory, kPooledPhases values per CTA of the scoring grid), the int8 and float64
/// scoring kernels write the global-timer stamps of their phases there.
void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& options,
                   PooledScreen screen, unsigned long long* phase_ns = nullptr);

}  // namespace sparse_attn::cuda_backend
