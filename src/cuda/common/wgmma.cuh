// wgmma (warpgroup matrix multiply) wrappers for m64n128k16 with f32 accumulators, bf16 or f16
// inputs, and the shared-memory matrix descriptors for 128-byte swizzled tiles.
//
// Layout facts (verified on the H200 by shared/hopper/wgmma_tma_example.cu):
//  - a 128-wide tile is stored as two 64-column halves [half][rows][64], each 1024-byte aligned; one
//    half-row is one 128 B swizzle row, which is what TMA SWIZZLE_128B writes;
//  - K-major operands (Q, K): SBO = 1024 (next 8-row group), LBO unused; a k16 step adds 32 B;
//  - MN-major operand (V in O = P V): LBO = distance between the two 64-column halves, SBO = 1024,
//    a k16 step is 16 rows = 2048 B;
//  - accumulator d[4i + j] of thread t (w = t / 32, g = (t % 32) / 4, q = t % 4) holds
//    row 16w + g + 8(j / 2), column 8i + 2q + (j % 2).
#pragma once

#include <cstdint>

#include "cuda/common/elem_tag.cuh"

namespace sparse_attn::cuda_kernels {

/// 64-bit wgmma matrix descriptor for a 128B-swizzled tile whose pattern starts 1024-aligned.
__device__ __forceinline__ std::uint64_t make_desc_sw128(std::uint32_t smem_addr, std::uint32_t lbo,
                                                         std::uint32_t sbo) {
  return static_cast<std::uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<std::uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

/// The descriptor of the tile `bytes` further on (a 16-byte multiple) from the one `desc` describes:
/// the start-address field holds address / 16 in its 14 low bits, and no shared address reaches 2^18,
/// so the offset adds to the low word without a carry. One add instead of rebuilding the descriptor.
__device__ __forceinline__ std::uint64_t desc_advance(std::uint64_t desc, std::uint32_t bytes) {
  const std::uint32_t lo = static_cast<std::uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

/// Compiler-only fence on accumulator registers: nothing that reads them may move above the
/// preceding (volatile) wait, and nothing that writes them below the following wgmma.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/// Keeps the register A operand of an in-flight RS wgmma (P: 8 k-steps x 4 registers) live until the
/// wait that retires it: without this the compiler may reuse the registers as soon as the wgmma
/// instruction has been issued.
template <int K>
__device__ __forceinline__ void keep_live(std::uint32_t (&pa)[K][4]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(pa[kk][r])::"memory");
}

#define SA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define SA_D64 SA_D8(0), SA_D8(8), SA_D8(16), SA_D8(24), SA_D8(32), SA_D8(40), SA_D8(48), SA_D8(56)
#define SA_DREGS                                                                                         \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"             \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"  \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

/// d (+)= A(64x16, smem, K-major) * B(16x128, smem, K-major). `accumulate` = 0 ignores the old d.
template <class Tag>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b, int accumulate);

template <>
__device__ __forceinline__ void wgmma_ss<Bf16Tag>(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                                  int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SA_DREGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
               : SA_D64
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_ss<F16Tag>(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                                 int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " SA_DREGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
               : SA_D64
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

#define SA_D32 SA_D8(0), SA_D8(8), SA_D8(16), SA_D8(24)
#define SA_DREGS32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"

/// d (+)= A(64x16, smem, K-major) * B(16x64, smem, K-major): scores of 64 keys.
template <class Tag>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b, int accumulate);

template <>
__device__ __forceinline__ void wgmma_ss<Bf16Tag>(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b,
                                                  int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SA_DREGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
               : SA_D32
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_ss<F16Tag>(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b,
                                                 int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " SA_DREGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
               : SA_D32
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/// d (+)= A(64x16, registers) * B(16x128, smem, MN-major: imm-trans-b = 1).
template <class Tag>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                            int accumulate);

template <>
__device__ __forceinline__ void wgmma_rs_tb<Bf16Tag>(float (&d)[64], const std::uint32_t (&a)[4],
                                                     std::uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SA_DREGS
               ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
               : SA_D64
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<F16Tag>(float (&d)[64], const std::uint32_t (&a)[4],
                                                    std::uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " SA_DREGS
               ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
               : SA_D64
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/// d (+)= A(64x16, registers) * B(16x64, smem, MN-major): the P V product for head dim 64.
template <class Tag>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                            int accumulate);

template <>
__device__ __forceinline__ void wgmma_rs_tb<Bf16Tag>(float (&d)[32], const std::uint32_t (&a)[4],
                                                     std::uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SA_DREGS32
               ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
               : SA_D32
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_rs_tb<F16Tag>(float (&d)[32], const std::uint32_t (&a)[4],
                                                    std::uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " SA_DREGS32
               ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
               : SA_D32
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}


// First k-step variants: scale-d = 0, so the accumulator is only written. Its registers are outputs
// ("=f"), not inputs, which keeps a kernel from carrying the previous tile's accumulator (or zeros)
// in registers up to the first wgmma of the next one.
#define SA_OUT8(i) "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), \
                   "=f"(d[i + 6]), "=f"(d[i + 7])
#define SA_OUT64 SA_OUT8(0), SA_OUT8(8), SA_OUT8(16), SA_OUT8(24), SA_OUT8(32), SA_OUT8(40), SA_OUT8(48), SA_OUT8(56)
#define SA_OUT32 SA_OUT8(0), SA_OUT8(8), SA_OUT8(16), SA_OUT8(24)
#define SA_REGS64                                                                                        \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"             \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"  \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define SA_REGS32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"

/// d = A(64x16, smem, K-major) * B(16x128, smem, K-major), or B(16x64) for d[32].
template <class Tag>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b);
template <class Tag>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b);
/// d = A(64x16, registers) * B(16xN, smem, MN-major), N = 128 (d[64]) or 64 (d[32]).
template <class Tag, int N>
__device__ __forceinline__ void wgmma_rs_tb_first(float (&d)[N], const std::uint32_t (&a)[4], std::uint64_t desc_b);

#define SA_FIRST_VARIANTS(TAG, TY)                                                                          \
  template <>                                                                                              \
  __device__ __forceinline__ void wgmma_ss_first<TAG>(float (&d)[64], std::uint64_t desc_a,                \
                                                      std::uint64_t desc_b) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " SA_REGS64                       \
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                           \
                 : SA_OUT64                                                                                \
                 : "l"(desc_a), "l"(desc_b));                                                              \
  }                                                                                                        \
  template <>                                                                                              \
  __device__ __forceinline__ void wgmma_ss_first<TAG>(float (&d)[32], std::uint64_t desc_a,                \
                                                      std::uint64_t desc_b) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " SA_REGS32                        \
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                                           \
                 : SA_OUT32                                                                                \
                 : "l"(desc_a), "l"(desc_b));                                                              \
  }                                                                                                        \
  template <>                                                                                              \
  __device__ __forceinline__ void wgmma_rs_tb_first<TAG, 64>(float (&d)[64], const std::uint32_t (&a)[4],  \
                                                             std::uint64_t desc_b) {                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " SA_REGS64                       \
                 ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                                                \
                 : SA_OUT64                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                               \
  }                                                                                                        \
  template <>                                                                                              \
  __device__ __forceinline__ void wgmma_rs_tb_first<TAG, 32>(float (&d)[32], const std::uint32_t (&a)[4],  \
                                                             std::uint64_t desc_b) {                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " SA_REGS32                        \
                 ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"                                                \
                 : SA_OUT32                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                               \
  }

SA_FIRST_VARIANTS(Bf16Tag, "bf16")
SA_FIRST_VARIANTS(F16Tag, "f16")

#undef SA_FIRST_VARIANTS
#undef SA_OUT8
#undef SA_OUT64
#undef SA_OUT32
#undef SA_REGS64
#undef SA_REGS32

#undef SA_D8
#undef SA_D32
#undef SA_D64
#undef SA_DREGS
#undef SA_DREGS32

}  // namespace sparse_attn::cuda_kernels
