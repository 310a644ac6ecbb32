// wgmma with e4m3 inputs: m64n128k32 and m64n64k32, float32 accumulators in the layout of the 16-bit
// m64n128 and m64n64 wrappers (wgmma.cuh). fp8 wgmma has no transpose operands: A and B are both K-major in
// shared memory, and a k32 step reads 32 bytes of each row, the same +32 B descriptor step as a bf16 k16 step.
#pragma once

#include <cstdint>

namespace sparse_attn::cuda_kernels {

// The accumulator operands, eight at a time (read and written: `accumulate` = 0 ignores their old values).
#define SA_FP8_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                     "+f"(d[i + 6]), "+f"(d[i + 7])
#define SA_FP8_R32 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"

/// d (+)= A(64x32 e4m3, smem, K-major) * B(32x128 e4m3, smem, K-major).
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" SA_FP8_R32 ","
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
               : SA_FP8_D8(0), SA_FP8_D8(8), SA_FP8_D8(16), SA_FP8_D8(24), SA_FP8_D8(32), SA_FP8_D8(40),
                 SA_FP8_D8(48), SA_FP8_D8(56)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/// d (+)= A(64x32 e4m3, smem, K-major) * B(32x64 e4m3, smem, K-major): the m64n64k32 shape (d[32] as the 16-bit
/// m64n64 wrappers).
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" SA_FP8_R32 "}, %32, %33, p, 1, 1;\n}\n"
               : SA_FP8_D8(0), SA_FP8_D8(8), SA_FP8_D8(16), SA_FP8_D8(24)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

#undef SA_FP8_D8
#undef SA_FP8_R32

}  // namespace sparse_attn::cuda_kernels
