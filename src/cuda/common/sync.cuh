// Hopper synchronisation primitives: mbarriers (TMA completion and stage release), named barriers,
// register reallocation between warpgroups, and the async-proxy fences.
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace sparse_attn::cuda_kernels {

namespace ptx = ::cuda::ptx;

/// Named barrier ids. Id 0 is __syncthreads; every subset barrier of the library is listed here so two
/// roles never share an id by accident.
enum class NamedBarrier : std::uint32_t {
  kSync = 0,        // whole CTA (__syncthreads)
  kMmaTurnWG0 = 1,  // consumer warpgroup 0 may issue its wgmmas (pingpong)
  kMmaTurnWG1 = 2,  // consumer warpgroup 1 may issue its wgmmas
  kEpilogueWG0 = 3,  // consumer warpgroup 0 has staged its output tile in shared memory
  kEpilogueWG1 = 4,  // consumer warpgroup 1 has staged its output tile in shared memory
  kExpTurnWG0 = 5,   // consumer warpgroup 0 may compute its exponentials (pingpong)
  kExpTurnWG1 = 6,   // consumer warpgroup 1 may compute its exponentials
  kItemWalk = 7,     // KV-centric attention: the threads of one item walk read the next item ids
  kGateWG0 = 8,      // consumer warpgroup 0 votes on the gate of a block (gate_policy.cuh)
  kGateWG1 = 9,      // consumer warpgroup 1 likewise
  kLightningWG0 = 10,   // lightning selector: consumer warpgroup 0's candidate buffers are settled
  kLightningWG1 = 11,   // consumer warpgroup 1 likewise
  kLightningMerge = 12,  // both consumer warpgroups are done with their key tiles
};

/// A value the same in every lane of the warp, made visible as such to the compiler (a broadcast from lane 0;
/// for a predicate, a warp vote). Derived from threadIdx or read from shared memory, such a value looks
/// per-lane to ptxas: the wgmma descriptors built from it, and ring state merged after branches on it, then
/// live in vector registers and are moved to uniform ones before every wgmma. Through this they stay uniform.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
__device__ __forceinline__ bool warp_uniform(bool b) { return __all_sync(0xffffffffu, b); }

__device__ __forceinline__ void named_barrier_sync(NamedBarrier id, std::uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<std::uint32_t>(id)), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(NamedBarrier id, std::uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(static_cast<std::uint32_t>(id)), "r"(threads) : "memory");
}

/// A named barrier that also ANDs a predicate over the participating threads: true for every thread
/// iff it was true for all of them.
__device__ __forceinline__ bool named_barrier_and(NamedBarrier id, std::uint32_t threads, bool pred) {
  std::uint32_t all;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.cta.red.and.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(all)
      : "r"(static_cast<std::uint32_t>(pred)), "r"(static_cast<std::uint32_t>(id)), "r"(threads)
      : "memory");
  return all != 0;
}

/// setmaxnreg needs an immediate; every warp of the warpgroup must execute the same instruction.
template <std::uint32_t kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg takes 24..256 in steps of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <std::uint32_t kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg takes 24..256 in steps of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

/// A 64-bit mbarrier in shared memory. Phases alternate parity 0, 1, 0, ...; the waiter names the
/// parity of the phase it waits for.
struct MBarrier {
  std::uint64_t word;

  __device__ __forceinline__ void init(std::uint32_t arrivals) { ptx::mbarrier_init(&word, arrivals); }

  __device__ __forceinline__ void arrive() { (void)ptx::mbarrier_arrive(&word); }

  /// One arrival that also announces `bytes` of TMA traffic completing on this barrier.
  __device__ __forceinline__ void arrive_expect_tx(std::uint32_t bytes) {
    (void)ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &word, bytes);
  }

  __device__ __forceinline__ void wait(std::uint32_t parity) {
    while (!ptx::mbarrier_try_wait_parity(&word, parity)) {
    }
  }
};

/// Makes mbarrier initialisation visible to the async proxy (TMA) before the CTA-wide barrier.
__device__ __forceinline__ void fence_barrier_init() {
  ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
}

/// Generic-proxy shared-memory writes -> visible to TMA / wgmma reads.
__device__ __forceinline__ void fence_async_shared() { ptx::fence_proxy_async(ptx::space_shared); }

/// Ring position of a stage-cycled pipeline: which slot, and the parity of its current phase.
template <int kStages>
struct PipelineState {
  std::uint32_t count = 0;
  __device__ __forceinline__ int stage() const { return static_cast<int>(count % kStages); }
  __device__ __forceinline__ std::uint32_t phase() const { return (count / kStages) & 1u; }
  __device__ __forceinline__ void advance() { ++count; }
};

}  // namespace sparse_attn::cuda_kernels
