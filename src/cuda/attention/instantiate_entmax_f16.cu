// f16 instantiation of entmax's output pass (the tile attention kernel with EntmaxTransform; its lists
// come from entmax's support pass, so only the trusted kernel).
#define SPARSE_ATTN_INSTANTIATE_TILE_ATTENTION
#include "cuda/attention/kernel.cuh"

namespace sparse_attn::cuda_kernels {
template cudaError_t launch_entmax_attention<F16Tag, 128>(const TileAttentionParams&, const EntmaxTransformParams&,
                                                     const CUtensorMap&, const CUtensorMap&, const CUtensorMap&,
                                                     const CUtensorMap&, int, cudaStream_t);
template cudaError_t launch_entmax_attention<F16Tag, 64>(const TileAttentionParams&, const EntmaxTransformParams&,
                                                    const CUtensorMap&, const CUtensorMap&, const CUtensorMap&,
                                                    const CUtensorMap&, int, cudaStream_t);
}  // namespace sparse_attn::cuda_kernels
