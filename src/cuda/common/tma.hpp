// TMA tensor maps for [B, L, H, D] attention tensors (host side) and the tile load (device side).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_kernels {

/// Rows of one TMA box along L. 128 matches a Q tile and a KV block.
inline constexpr std::uint32_t kTmaBoxRows = 128;
/// Columns of one box: with SWIZZLE_128B the inner extent may not exceed 128 bytes, so a D = 128
/// row of 16-bit elements comes in as two 64-column halves.
inline constexpr std::uint32_t kTmaBoxCols = 64;

/// Encodes a map over a 4-d [B, L, H, D] view (16-bit elements, D contiguous) whose box is
/// `box_rows` rows (kTmaBoxRows unless a kernel streams smaller pieces) x kTmaBoxCols columns of one
/// (b, h), 128B-swizzled. Rows past L read as zero. Throws Error(op, name) when TMA cannot address the
/// view (alignment of the base or the strides).
CUtensorMap make_bhld_tensor_map(const std::string& op, const std::string& name, const TensorView& t,
                                 std::uint32_t box_rows = kTmaBoxRows);

/// Whether make_bhld_tensor_map accepts `t` (16-bit elements, 16-byte aligned base, strides of dims
/// 0..2 positive multiples of 8 elements): for kernels that pick a TMA path only where it applies.
bool tma_addressable(const TensorView& t);

}  // namespace sparse_attn::cuda_kernels

#if defined(__CUDACC__)
#include <cuda/ptx>

namespace sparse_attn::cuda_kernels {

/// One box of a map made by make_bhld_tensor_map: columns [col, col + 64) of rows [row, row + 128) of
/// (b, h). Completes `bytes` on `bar`.
__device__ __forceinline__ void tma_load_bhld(void* smem_dst, const CUtensorMap* map, int col, int h, int row,
                                              int b, std::uint64_t* bar) {
  const std::int32_t coords[4] = {col, h, row, b};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem_dst, map, coords,
                                    bar);
}

/// The store direction: the box at (col, h, row, b) from shared memory at `smem_src` (the same swizzled
/// layout a load writes). Rows past L are not written. Joins the issuing thread's current bulk group;
/// close it with tma_store_commit().
__device__ __forceinline__ void tma_store_bhld(const CUtensorMap* map, const void* smem_src, int col, int h, int row,
                                               int b) {
  const std::int32_t coords[4] = {col, h, row, b};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_global, ::cuda::ptx::space_shared, map, coords, smem_src);
}

__device__ __forceinline__ void tma_store_commit() { ::cuda::ptx::cp_async_bulk_commit_group(); }

/// Waits until at most kPending of the issuing thread's bulk groups still read shared memory (their
/// global writes may still be in flight): afterwards their source buffers may be overwritten.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  ::cuda::ptx::cp_async_bulk_wait_group_read(::cuda::ptx::n32_t<kPending>{});
}

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

}  // namespace sparse_attn::cuda_kernels
#endif
