// Entry points of the CUDA selectors used by the front ends in src/selectors. Arguments have already
// passed the front end's checks (shapes, dtypes, capacities, options); these check only what the CUDA
// backend itself requires and launch on `options.stream`.
//
// Scratch: each call takes one piece of device memory between its kernels (representatives, per-tensor
// scales, codes), of the size its *_scratch_bytes below gives: the caller's options.workspace, or a
// workspace the library keeps per (device, stream) (scratch.hpp).
//
// Non-finite index inputs: the CPU selectors reject them with an Error; the device path does not
// synchronise to look, so NaN / inf inputs give lists computed from NaN-sanitised scores (NaN ranks
// as -inf) instead of an Error.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/selectors.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend {

void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& options);

/// Device scratch of one pooled_select call for this shape and these options (pooled.cu).
std::size_t pooled_scratch_bytes(const ProblemShape& shape, const PooledOptions& options);

/// Error bound of the CUDA pooled selector's scores (derivation beside its kernels in pooled.cu). For one
/// representative pair with the CPU's float32 means cq, ck and the means of |x| over the same tokens aq, ak
/// (per column), the device score is within pair(...) of the CPU's float64 score; a block's score within
/// the largest bound over its counted pairs; and each list is a top-k of the CPU's block scores up to the
/// sum of two block bounds. Valid while every mean is finite and below 2^60 in magnitude.
struct PooledErrorBound {
  double mean_rel = 0.0;  // delta: |device mean - CPU mean| <= delta * a (+ the absolute term)
  double dot_rel = 0.0;   // relative to sum_d (|cq| + delta aq) (|ck| + delta ak)
  double abs_rel = 0.0;   // times 1 + D + sum_d (|cq| + |ck| + aq + ak)

  double pair(const double* cq, const double* aq, const double* ck, const double* ak, std::int64_t D) const {
    double mean = 0.0, dot = 0.0, mass = 1.0 + static_cast<double>(D);
    for (std::int64_t d = 0; d < D; ++d) {
      const double q = std::abs(cq[d]), k = std::abs(ck[d]);
      mean += aq[d] * k + q * ak[d] + mean_rel * aq[d] * ak[d];
      dot += (q + mean_rel * aq[d]) * (k + mean_rel * ak[d]);
      mass += q + k + aq[d] + ak[d];
    }
    return mean_rel * mean + dot_rel * dot + abs_rel * mass;
  }
};
PooledErrorBound pooled_error_bound(std::int64_t D, int representatives);

void token_max_select(const TensorView& qidx, const TensorView& kidx, const QueryLists& out,
                      const TokenMaxOptions& options);
void token_max_select(const TensorView& qidx, const TensorView& kidx, const TileLists& out,
                      const TokenMaxOptions& options);
/// Bytes of the one scratch allocation of a token_max call of this shape (TileLists when `tiles`).
std::size_t token_max_scratch_bytes(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t Hkv, std::int64_t Hk,
                                    std::int64_t Di, IndexPrecision precision, bool tiles);
/// token_max's bound on |screened - exact| of one (list, block) score (the derivation in token_max.cu):
/// `nq`, `nk` bound the 2-norms of the dequantised query rows of the list and key rows of the block,
/// `sq`, `sk` the per-tensor scales from above (amax / 448 for fp8, amax / 2688 for fp4, 2 amax for bf16).
/// A list is a top-k of the exact scores within eps = 2 x the largest bound over its candidate blocks.
double token_max_score_error(IndexPrecision precision, std::int64_t Di, double nq, double nk, double sq, double sk);

/// Lightning indexer (lightning.cu): one pass per query tile that scores keys on the tensor cores (fp8 or bf16
/// wgmma) and selects on chip; each list is a top-k of the exact scores up to lightning_epsilon. Block form
/// (QueryLists) and token form (TokenLists).
void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const QueryLists& out,
                      const LightningOptions& options);
void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const TokenLists& out,
                      const LightningOptions& options);
/// Device scratch of one lightning_select call (its single allocation: the amax words and the fp8 / bf16 codes
/// of qI and kI in the kernel's tile layout); 0 where the call is refused (top_k too large for the candidate
/// buffers, HI > 128, Di > 256).
std::size_t lightning_scratch_bytes(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t HI, std::int64_t Di,
                                    int top_k, IndexPrecision precision, bool blocks);
/// The bound ε of the GPU lightning indexer for one query row (derivation in lightning.cu): every list is a
/// top-k of the exact (CPU float64) scores up to ε. `w` holds the row's HI weights, `q_values` its HI x Di
/// dequantised index queries (the CPU's load_quantized values); key_inf and key_norm bound the largest |value|
/// and 2-norm of the dequantised keys the row sees; zero_scale: fp8 with a per-tensor scale of 0.
double lightning_epsilon(IndexPrecision precision, std::int64_t HI, std::int64_t Di, const float* w,
                         const float* q_values, double key_inf, double key_norm, bool zero_scale);

}  // namespace sparse_attn::cuda_backend
