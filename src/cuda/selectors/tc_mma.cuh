// Warp-level tensor-core pieces of the index GEMMs (token_max, lightning): cp.async copies into
// shared memory, ldmatrix fragment loads, the bf16 m16n8k16 MMA with float32 accumulation, and an
// order-preserving integer encoding of doubles for atomic maxima.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16): with g = lane / 4 and c = 2 * (lane % 4),
//   A (16 x 16, row-major): a0 = A[g][c, c+1], a1 = A[g+8][c, c+1], a2 = A[g][c+8, c+9], a3 = A[g+8][c+8, c+9]
//   B (16 x 8, "col"):      b0 = B[c, c+1][g],  b1 = B[c+8, c+9][g]
//   C (16 x 8, float32):    c0, c1 = C[g][c, c+1], c2, c3 = C[g+8][c, c+1]
// Index rows are stored [row][d] with d contiguous, so A = query rows and B[k][n] = key row n at d = k
// are both plain (non-transposed) ldmatrix loads of [row][d] tiles.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sparse_attn::cuda_backend::tc {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; `valid` false writes zeros without reading `src`.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8 x 8 b16 matrices; lane l supplies the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

// d += a * b on a 16 x 8 x 16 tile, bf16 inputs, float32 accumulation.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                               std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Doubles (never NaN) to unsigned integers of the same order, so atomicMax on the integer is a max on
// the double: positives get the sign bit set, negatives are complemented.
__device__ __forceinline__ unsigned long long ordered_key(double v) {
  const auto u = static_cast<unsigned long long>(__double_as_longlong(v));
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
__device__ __forceinline__ double ordered_value(unsigned long long k) {
  const unsigned long long u = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
  return __longlong_as_double(static_cast<long long>(u));
}

}  // namespace sparse_attn::cuda_backend::tc
