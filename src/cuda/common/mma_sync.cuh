// Warp-level tensor-core and copy vocabulary: mma.sync m16n8k16 (16-bit inputs, f32 accumulators),
// ldmatrix fragment loads, cp.async copies into shared memory and the packing of f32 fragments into
// 16-bit A operands. Used by the group-centric query_sparse kernel (query_sparse/group.cu), the token
// kernel (attention/token_sparse.cu) and the index GEMMs of the selectors (token_max, lightning); the
// KV-centric attention (query_sparse/attend.cu) takes its cp.async copies and the P packing from here
// and its MMAs from wgmma.cuh.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4, t = lane % 4:
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 (k x n):    b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8 f32:        c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
// The C fragments of two neighbouring n-tiles are exactly the A fragment of one 16-wide k-step
// (pack_a), so P = softmax(S) never leaves registers. A wgmma m64nN accumulator (wgmma.cuh) holds per
// warp the same values as N / 8 consecutive C fragments, and its register A operand has the A layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/elem_tag.cuh"

namespace sparse_attn::cuda_kernels {

/// c += a * b on a 16 x 8 x 16 tile, float32 accumulation.
template <class Tag>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1);

#define SA_MMA_M16N8K16(TAG, TY)                                                                        \
  template <>                                                                                          \
  __device__ __forceinline__ void mma_m16n8k16<TAG>(float (&c)[4], const std::uint32_t (&a)[4],        \
                                                    std::uint32_t b0, std::uint32_t b1) {              \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, "              \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                             \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                      \
  }

SA_MMA_M16N8K16(Bf16Tag, "bf16")
SA_MMA_M16N8K16(F16Tag, "f16")

#undef SA_MMA_M16N8K16

/// A thread's share of an f32 fragment of m16n8 C tiles (or of a wgmma accumulator) as values 0 .. kSize
/// - 1, value 4i + j at row j / 2 and column 8i + 2t + j % 2 of n-tile i: a flat float[N] (wgmma.cuh's
/// accumulators) or float[NT][4] (one mma_m16n8k16 C operand per n-tile). Indices are compile-time
/// constants after unrolling, so either form stays in registers.
template <class F>
struct Frag;
template <int N>
struct Frag<float[N]> {
  static constexpr int kSize = N;
  __device__ __forceinline__ static float& at(float (&c)[N], int k) { return c[k]; }
  __device__ __forceinline__ static float at(const float (&c)[N], int k) { return c[k]; }
};
template <int NT>
struct Frag<float[NT][4]> {
  static constexpr int kSize = 4 * NT;
  __device__ __forceinline__ static float& at(float (&c)[NT][4], int k) { return c[k / 4][k % 4]; }
  __device__ __forceinline__ static float at(const float (&c)[NT][4], int k) { return c[k / 4][k % 4]; }
};

/// The A fragments of kSize / 8 k-steps from an f32 fragment of kSize / 4 n-tiles: k-step kk takes
/// n-tiles 2kk and 2kk + 1.
template <class Tag, class F>
__device__ __forceinline__ void pack_a(const F& c, std::uint32_t (&a)[Frag<F>::kSize / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < Frag<F>::kSize / 8; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[kk][r] = Tag::pack(Frag<F>::at(c, 8 * kk + 2 * r), Frag<F>::at(c, 8 * kk + 2 * r + 1));
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// Four 8x8 16-bit matrices; lanes 8m..8m+7 give the row addresses of matrix m, and each lane gets
/// (row lane / 4, columns 2 (lane % 4) .. + 1) of every matrix. `addr`: a shared-window byte address.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) { ldmatrix_x4(r, smem_addr(row)); }

/// As ldmatrix_x4, each matrix transposed: a lane gets (rows 2 (lane % 4) .. + 1, column lane / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// 16-byte global -> shared copy; `src_bytes` = 0 fills the destination with zeros without reading.
__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/// The same to a shared-memory pointer; `valid` false writes zeros without reading `src`.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16(smem_addr(dst), src, valid ? 16 : 0);
}

/// cp_async16 under an L2 cache policy (evict_last_policy).
__device__ __forceinline__ void cp_async16_policy(std::uint32_t dst, const void* src, int src_bytes,
                                                  std::uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}

__device__ __forceinline__ std::uint64_t evict_last_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/// Waits until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace sparse_attn::cuda_kernels
