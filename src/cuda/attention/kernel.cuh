// The Q-centric block-sparse attention kernel (dense = every block): warp roles, register budgets,
// shared memory, and the host-side launch of one instantiation.
//
// 384 threads: warpgroup 0 is the producer (one thread issues every TMA; the others exit), warpgroups
// 1 and 2 are consumers, 64 query rows each. Registers: 128 * (24 + 2 * 240) = 64512 <= 65536, the
// budget FA3 uses for two MMA warpgroups fed by TMA; a consumer holds S (64 f32), O (D / 2 f32) and P
// (32 b32) live at once, with S of the next block in flight while P of the current one is read.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda/attention/entmax_transform.cuh"
#include "cuda/attention/mainloop.cuh"
#include "cuda/attention/params.hpp"
#include "cuda/common/pdl.cuh"
#include "cuda/common/smem_limit.hpp"

namespace sparse_attn::cuda_kernels {

inline constexpr int kKernelThreads = 128 + kConsumerThreads;
inline constexpr std::uint32_t kProducerRegs = 24;
inline constexpr std::uint32_t kConsumerRegs = 240;
static_assert(sizeof(SharedStorage<Bf16Tag::Elem, 128>) + 1024 <= 227 * 1024, "shared memory over budget");

// One instantiation per (causal, split tail) setting: kCausal = p.causal, kSplit = (p.tail_ctas > 0);
// the launcher instantiates (false, false), (false, true) and (true, false) with NoGate, and
// gated's (true, false, false) with BlockMaxGate (gate_policy.cuh), whose parameters come last so
// that the others' argument layout is what it was without a gate; and entmax's output pass, (causal,
// false, false) with EntmaxTransform (entmax_transform.cuh) as the score transform, its parameters
// after the gate's.
template <class Tag, int kHeadDim, bool kCausal, bool kSplit, class Gate = NoGate,
          class Transform = OnlineSoftmax>
__global__ void __launch_bounds__(kKernelThreads, 1)
    tile_attention_kernel(const __grid_constant__ TileAttentionParams p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                          const __grid_constant__ CUtensorMap tm_out,
                          const __grid_constant__ typename Gate::Params gate,
                          const __grid_constant__ typename Transform::Params transform) {
  using Storage = SharedStorage<typename Tag::Elem, kHeadDim>;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  // The swizzle pattern is applied to absolute address bits: tiles must start 1024-aligned.
  Storage& sm = *reinterpret_cast<Storage*>(smem_raw + ((1024u - (raw & 1023u)) & 1023u));
  // warp_uniform: the Q tile's descriptors and the gate's geometry derived from it stay in uniform registers.
  const int warpgroup = warp_uniform(static_cast<int>(threadIdx.x) / 128);
  const int thread = static_cast<int>(threadIdx.x) % 128;

  if (threadIdx.x == 0) {
    tma_prefetch_descriptor(&tm_q);
    tma_prefetch_descriptor(&tm_k);
    tma_prefetch_descriptor(&tm_v);
    if (p.tma_store) tma_prefetch_descriptor(&tm_out);
    for (int s = 0; s < kQStages; ++s) {
      sm.q_full[s].init(1);
      sm.q_empty[s].init(kConsumerThreads);
    }
    for (int s = 0; s < kKStages; ++s) {
      sm.k_full[s].init(1);
      sm.k_empty[s].init(kConsumerThreads);
    }
    for (int s = 0; s < kVStages; ++s) {
      sm.v_full[s].init(1);
      sm.v_empty[s].init(kConsumerThreads);
    }
    fence_barrier_init();
    // A validated call's list check (list_check.cu) may launch now and take the SMs this grid leaves.
    pdl_launch_dependents();
  }
  __syncthreads();

  const StaticPersistentScheduler sched{p.num_units, p.B,        p.Hkv,
                                        p.group_size, p.Tq,      kCausal,
                                        kSplit ? p.dp_units : p.num_units, kSplit ? p.tail_ctas : 0, p.tail_len};
  if (warpgroup == 0) {
    warpgroup_reg_dealloc<kProducerRegs>();
    if (thread == 0)
      producer_loop<typename Tag::Elem, kHeadDim, kCausal, Gate>(p, gate, sched, sm, &tm_q, &tm_k, &tm_v);
  } else {
    warpgroup_reg_alloc<kConsumerRegs>();
    consumer_loop<Tag, kHeadDim, kCausal, kSplit, Gate, Transform>(p, gate, transform, sched, sm,
                                                                            warpgroup - 1, thread, &tm_out);
  }
}

template <class Tag, int kHeadDim>
constexpr std::size_t tile_attention_smem_bytes() {
  return sizeof(SharedStorage<typename Tag::Elem, kHeadDim>) + 1024;  // + slack for the manual alignment
}

/// Launches one instantiation on `stream` with a persistent grid of `grid` CTAs (at most one per SM;
/// the scheduler's split of the work assumes exactly this grid). Returns the CUDA error of the launch
/// (cudaSuccess on success).
template <class Tag, int kHeadDim>
cudaError_t launch_tile_attention(const TileAttentionParams& p, const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                                  const CUtensorMap& tm_v, const CUtensorMap& tm_out, int grid, cudaStream_t stream);

/// The same for gated (causal, never split): the kernel with BlockMaxGate.
template <class Tag, int kHeadDim>
cudaError_t launch_gated_attention(const TileAttentionParams& p, const GateParams& gate, const CUtensorMap& tm_q,
                                   const CUtensorMap& tm_k, const CUtensorMap& tm_v, const CUtensorMap& tm_out,
                                   int grid, cudaStream_t stream);

/// The same for entmax's output pass (trusted lists, never split): the kernel with EntmaxTransform.
template <class Tag, int kHeadDim>
cudaError_t launch_entmax_attention(const TileAttentionParams& p, const EntmaxTransformParams& entmax,
                                    const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                    const CUtensorMap& tm_out, int grid, cudaStream_t stream);

}  // namespace sparse_attn::cuda_kernels

#if defined(SPARSE_ATTN_INSTANTIATE_TILE_ATTENTION)
namespace sparse_attn::cuda_kernels {

template <class Tag, int kHeadDim, bool kCausal, bool kSplit, class Gate = NoGate,
          class Transform = OnlineSoftmax>
cudaError_t launch_tile_attention_variant(const TileAttentionParams& p, const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                                          const CUtensorMap& tm_v, const CUtensorMap& tm_out, int grid,
                                          cudaStream_t stream, const typename Gate::Params& gate = {},
                                          const typename Transform::Params& transform = {}) {
  constexpr std::size_t smem = tile_attention_smem_bytes<Tag, kHeadDim>();
  auto* kernel = &tile_attention_kernel<Tag, kHeadDim, kCausal, kSplit, Gate, Transform>;
  return launch_with_smem(kernel, smem, [&] {
    kernel<<<grid, kKernelThreads, smem, stream>>>(p, tm_q, tm_k, tm_v, tm_out, gate, transform);
  });
}

template <class Tag, int kHeadDim>
cudaError_t launch_tile_attention(const TileAttentionParams& p, const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                                  const CUtensorMap& tm_v, const CUtensorMap& tm_out, int grid, cudaStream_t stream) {
  // Causal launches are never split (launcher.cu: their units of paired tiles already balance the
  // CTAs), so there is no causal instantiation with the split code.
  if (p.causal)
    return p.tail_ctas > 0 ? cudaErrorInvalidValue
                           : launch_tile_attention_variant<Tag, kHeadDim, true, false>(p, tm_q, tm_k, tm_v,
                                                                                                   tm_out, grid, stream);
  return p.tail_ctas > 0
             ? launch_tile_attention_variant<Tag, kHeadDim, false, true>(p, tm_q, tm_k, tm_v, tm_out, grid,
                                                                                   stream)
             : launch_tile_attention_variant<Tag, kHeadDim, false, false>(p, tm_q, tm_k, tm_v, tm_out, grid,
                                                                                    stream);
}

template <class Tag, int kHeadDim>
cudaError_t launch_gated_attention(const TileAttentionParams& p, const GateParams& gate, const CUtensorMap& tm_q,
                                   const CUtensorMap& tm_k, const CUtensorMap& tm_v, const CUtensorMap& tm_out,
                                   int grid, cudaStream_t stream) {
  if (!p.causal || p.tail_ctas > 0 || p.fault != nullptr) return cudaErrorInvalidValue;
  return launch_tile_attention_variant<Tag, kHeadDim, true, false, BlockMaxGate>(p, tm_q, tm_k, tm_v, tm_out,
                                                                                        grid, stream, gate);
}

template <class Tag, int kHeadDim>
cudaError_t launch_entmax_attention(const TileAttentionParams& p, const EntmaxTransformParams& entmax,
                                    const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                    const CUtensorMap& tm_out, int grid, cudaStream_t stream) {
  if (p.tail_ctas > 0 || p.fault != nullptr) return cudaErrorInvalidValue;
  return p.causal ? launch_tile_attention_variant<Tag, kHeadDim, true, false, NoGate, EntmaxTransform>(
                        p, tm_q, tm_k, tm_v, tm_out, grid, stream, {}, entmax)
                  : launch_tile_attention_variant<Tag, kHeadDim, false, false, NoGate, EntmaxTransform>(
                        p, tm_q, tm_k, tm_v, tm_out, grid, stream, {}, entmax);
}

}  // namespace sparse_attn::cuda_kernels
#endif
