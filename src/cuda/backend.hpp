// Entry points of the CUDA backend used by the operator front ends (src/attention). Arguments have
// been resolved by the front end (core/call.hpp: q and every other tensor on a CUDA device, head dim
// 64 or 128, the selection's structure); these check what only the CUDA backend requires (TMA
// alignment, 32-bit index ranges, selection contents on the device) and launch on `a.stream`. dense
// and tile_sparse take an optional AttentionTuning (tests, benchmarks; the default is what the public
// operators run).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/call.hpp"
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
void dense(const detail::AttentionCall& a, const detail::AttentionTuning& tuning = {});

/// Q-centric block-sparse attention over TileLists on the GPU. Unless a.trusted, the kernel
/// checks each list as it takes it (no synchronisation): a faulty tile gets NaN rows and its fault is
/// recorded for raise_pending_fault / check_device_faults.
void tile_sparse(const detail::AttentionCall& a, const detail::TileCall& t,
                 const detail::AttentionTuning& tuning = {});

/// gated (BSFA) on the GPU: the Q-centric kernel walking every visible block with the gate policy
/// (attention/gate_policy.cuh). The counters go to options.counts when given (no synchronisation; the
/// returned stats are `deferred`), else through a workspace cached per (device, stream) to the host
/// (one synchronisation of the stream).
GatedStats gated(const detail::AttentionCall& a, const TensorView& thresholds, const GatedOptions& options,
                 const detail::AttentionTuning& tuning = {});

/// One calibration sample on the GPU (gated/calibrate.cu): q [1, L, Hq, D], k [1, L, Hkv, D] (bf16
/// or f16, D <= 128) on the device; per (head, gate tile) the k-th largest maximum of the gate's
/// candidate blocks for each budget, -inf below k candidates, as the CPU Calibrator defines them.
/// Waits for the device, runs on its default stream and returns float [Hq][Tg][budgets] on the host.
/// Errors name `op`.
std::vector<float> calibration_sample(const TensorView& q, const TensorView& k, float scale, std::int64_t sink_blocks,
                                      const std::vector<std::int64_t>& budgets, const std::string& op);

/// Block-sparse attention over BlockBits on the GPU: the bit sets are converted to TileLists in a
/// workspace cached per (device, stream) (B x G x Tq x Tk ids; the first call on a stream allocates
/// it), checked on the device unless a.trusted (one synchronisation), then run by tile_sparse.
void bits_sparse(const detail::AttentionCall& a, const BlockBits& bits);

/// Attention over TokenLists on the GPU (one warp per query and up to 16 heads of its group, the
/// listed K/V rows gathered by cp.async, mma.sync). Unless a.trusted, the lists are checked on
/// the device first (one kernel and a synchronisation; errors as the CPU's).
void token_sparse(const detail::AttentionCall& a, const detail::TokenCall& t);

}  // namespace sparse_attn::cuda_backend
