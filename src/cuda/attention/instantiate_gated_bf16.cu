// bf16 instantiation of the gated kernel (the tile attention kernel with BlockMaxGate; one dtype per file
// keeps builds parallel).
#define SPARSE_ATTN_INSTANTIATE_TILE_ATTENTION
#include "cuda/attention/kernel.cuh"

namespace sparse_attn::cuda_kernels {
template cudaError_t launch_gated_attention<Bf16Tag, 128>(const TileAttentionParams&, const GateParams&, const CUtensorMap&,
                                                     const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, int,
                                                     cudaStream_t);
template cudaError_t launch_gated_attention<Bf16Tag, 64>(const TileAttentionParams&, const GateParams&, const CUtensorMap&,
                                                    const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, int,
                                                    cudaStream_t);
}
