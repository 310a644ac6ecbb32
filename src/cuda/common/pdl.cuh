// Programmatic dependent launch: a kernel launched as a programmatic dependent of the one before it on
// the stream may start (and run its part before pdl_wait) while that one finishes, once every CTA of
// the earlier grid has called pdl_launch_dependents or exited.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace sparse_attn::cuda_kernels {

/// Launches `kernel` on `stream` with the launch attribute `attr` when `with_attr`. Returns the launch's error.
template <class... Params, class... Args>
cudaError_t launch_with(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                        cudaLaunchAttribute attr, bool with_attr, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = with_attr ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/// Launches `kernel` on `stream`; with `programmatic`, as a programmatic dependent of the previous
/// kernel there (the kernel must call pdl_wait() before it touches memory that earlier work on the
/// stream writes, or reads and it overwrites). Returns the launch's error.
template <class... Params, class... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                                cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_with(kernel, grid, block, smem, stream, attr, programmatic, std::forward<Args>(args)...);
}

/// Launches `kernel` on `stream` as a cooperative grid: every CTA is resident at once (the launch fails
/// with cudaErrorCooperativeLaunchTooLarge otherwise), so the CTAs may wait for each other. Not a
/// programmatic dependent; the kernel may let its own dependents start. Returns the launch's error.
template <class... Params, class... Args>
cudaError_t launch_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                               Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return launch_with(kernel, grid, block, smem, stream, attr, true, std::forward<Args>(args)...);
}

#if defined(__CUDACC__)
/// Waits until the previous grid on the stream has completed and its memory is visible; a no-op in a
/// grid launched without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
/// Lets the next programmatic dependent grid start launching (it still waits in pdl_wait for this grid).
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }
#endif

}  // namespace sparse_attn::cuda_kernels
