// f16 instantiation of the tile attention kernel (dense and tile_sparse); one dtype per file keeps
// builds parallel.
#define SPARSE_ATTN_INSTANTIATE_TILE_ATTENTION
#include "cuda/attention/kernel.cuh"

namespace sparse_attn::cuda_kernels {
template cudaError_t launch_tile_attention<F16Tag, 128>(const TileAttentionParams&, const CUtensorMap&,
                                                          const CUtensorMap&, const CUtensorMap&, const CUtensorMap&,
                                                          int, cudaStream_t);
template cudaError_t launch_tile_attention<F16Tag, 64>(const TileAttentionParams&, const CUtensorMap&,
                                                         const CUtensorMap&, const CUtensorMap&, const CUtensorMap&,
                                                         int, cudaStream_t);
}  // namespace sparse_attn::cuda_kernels
