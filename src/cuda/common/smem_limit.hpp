// The dynamic shared memory limit of a kernel (cudaFuncAttributeMaxDynamicSharedMemorySize) is state of
// the kernel in each device's context, shared by every host thread: a launcher that sets it and then
// launches could otherwise launch under the value another thread set in between (a smaller one fails
// the launch), and a value set once per process holds only for the device that was current then.
// launch_with_smem sets it per (kernel, device) and launches under one lock.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

namespace sparse_attn::cuda_kernels {

/// The lock under which limits are set and kernels launched with them.
std::mutex& smem_limit_mutex();

/// Sets the limit of `kernel` on the current device to `bytes` unless it is already there (the caller
/// holds smem_limit_mutex()).
cudaError_t set_smem_limit(const void* kernel, std::size_t bytes);

/// `launch()` (which launches `kernel` with `bytes` of dynamic shared memory on the current device)
/// with the kernel's limit at `bytes`; returns the first error of the two.
template <class Kernel, class Launch>
cudaError_t launch_with_smem(Kernel* kernel, std::size_t bytes, Launch&& launch) {
  std::lock_guard<std::mutex> lock(smem_limit_mutex());
  const cudaError_t e = set_smem_limit(reinterpret_cast<const void*>(kernel), bytes);
  if (e != cudaSuccess) return e;
  launch();
  return cudaGetLastError();
}

}  // namespace sparse_attn::cuda_kernels
