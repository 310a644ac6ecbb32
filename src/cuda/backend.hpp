// Entry points of the CUDA backend used by the operator front ends (src/attention). Arguments have
// already passed check_attention_args; these check what only the CUDA backend requires (head dim,
// TMA alignment, selection contents on the device) and launch on `options.stream`. dense and
// tile_sparse take an optional AttentionTuning (tests, benchmarks; the default is what the public
// operators run).
#pragma once

#include <optional>
#include <string>

#include "cuda/tuning.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend {

/// At the start of an operator on `device` with `stream`: if a validated call left a fault there
/// (cuda/common/fault_word.hpp), waits for the device, takes the fault from its record and throws it as
/// Error (the operator, argument and message of the CPU's validation, noting the earlier call). One
/// read of host memory while no fault is pending; on a stream being captured a pending fault is left
/// for a later call.
void raise_pending_fault(int device, void* stream, const std::string& op);

/// sparse_attn::check_device_faults on the GPU: waits for `device` (each device with a fault record,
/// when nullopt) and throws the first recorded fault.
void check_device_faults(std::optional<int> device);

/// Dense attention on the GPU: the tile_sparse kernel walking every block.
void dense(const ProblemShape& p, const TensorView& q, const TensorView& k, const TensorView& v,
           const TensorView& out, const std::optional<TensorView>& lse, const AttentionOptions& options,
           const detail::AttentionTuning& tuning = {});

/// Q-centric block-sparse attention over TileLists on the GPU. Unless options.trusted, the kernel
/// checks each list as it takes it (no synchronisation): a faulty tile gets NaN rows and its fault is
/// recorded for raise_pending_fault / check_device_faults.
void tile_sparse(const ProblemShape& p, const TensorView& q, const TensorView& k, const TensorView& v,
                 const TileLists& tiles, const TensorView& out, const std::optional<TensorView>& lse,
                 const AttentionOptions& options, const detail::AttentionTuning& tuning = {});

/// Block-sparse attention over BlockBits on the GPU: the bit sets are converted to TileLists in a
/// workspace cached per (device, stream) (B x G x Tq x Tk ids; the first call on a stream allocates
/// it), checked on the device unless options.trusted (one synchronisation), then run by tile_sparse.
void bits_sparse(const ProblemShape& p, const TensorView& q, const TensorView& k, const TensorView& v,
                 const BlockBits& bits, const TensorView& out, const std::optional<TensorView>& lse,
                 const AttentionOptions& options);

/// Attention over TokenLists on the GPU (one warp per query and up to 16 heads of its group, the
/// listed K/V rows gathered by cp.async, mma.sync). Unless options.trusted, the lists are checked on
/// the device first (one kernel and a synchronisation; errors as the CPU's).
void token_sparse(const ProblemShape& p, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TokenLists& tokens, const TensorView& out, const std::optional<TensorView>& lse,
                  const AttentionOptions& options);

}  // namespace sparse_attn::cuda_backend
