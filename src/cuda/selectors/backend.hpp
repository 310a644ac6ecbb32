// Entry points of the CUDA selectors used by the front ends in src/selectors. Arguments have already
// passed the front end's checks (shapes, dtypes, capacities, options); these check only what the CUDA
// backend itself requires and launch on `options.stream`.
//
// Scratch: the selectors need a little device memory between their kernels (representatives,
// per-tensor scales). It comes from the stream-ordered allocator (cudaMallocAsync / cudaFreeAsync on
// the caller's stream): no host synchronisation, and the calls are capturable in a CUDA graph.
//
// Non-finite index inputs: the CPU selectors reject them with an Error; the device path does not
// synchronise to look, so NaN / inf inputs give lists computed from NaN-sanitised scores (NaN ranks
// as -inf) instead of an Error.
//
// `tuning` (tuning.hpp) is for the GPU tests; the default is what the public functions run.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/selectors/tuning.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/selectors.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend {

void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& options,
                   const detail::SelectorTuning& tuning = {});

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

/// Block form of the lightning indexer (QueryLists): float64 scores per key, block maxima, top-k (lightning.cu).
void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const QueryLists& out,
                      const LightningOptions& options);
/// Token form (TokenLists): tensor-core screening with a fused top-k, float64 only for the keys the screen
/// cannot decide (lightning_tokens.cu).
void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const TokenLists& out,
                      const LightningOptions& options, const detail::SelectorTuning& tuning = {});

}  // namespace sparse_attn::cuda_backend
