#include "cuda/selectors/scratch.hpp"

#include "cuda/common/device_guard.hpp"
#include "cuda/common/workspace_cache.hpp"
#include "sparse_attn/error.hpp"

namespace sparse_attn::cuda_backend::sel {

namespace {

using cuda_kernels::check_cuda;

WorkspaceCache g_selector_workspaces;

}  // namespace

Scratch::Scratch(const std::string& op, const TensorView& workspace, std::size_t bytes, int device,
                 cudaStream_t stream)
    : stream_(stream) {
  if (workspace.defined()) {
    const bool contiguous = workspace.ndim == 1 && workspace.stride[0] == 1;
    if (workspace.dtype != DType::u8 || !contiguous || workspace.device != Device::cuda ||
        workspace.device_index != device)
      throw Error(op, "options.workspace",
                  "needs a contiguous u8 tensor on cuda:" + std::to_string(device) + ", got " + workspace.describe());
    if (static_cast<std::size_t>(workspace.shape[0]) < bytes)
      throw Error(op, "options.workspace",
                  "holds " + std::to_string(workspace.shape[0]) + " bytes, the call needs " + std::to_string(bytes));
    ptr_ = workspace.data;
    return;
  }
  if (bytes == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), op, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    check_cuda(cudaMallocAsync(&ptr_, bytes, stream), op, "cudaMallocAsync of " + std::to_string(bytes) + " bytes");
    stream_ordered_ = true;
    return;
  }
  lock_ = std::unique_lock<std::mutex>(g_selector_workspaces.mutex());
  // Rounded up, so that a run of calls whose needs grow a little does not grow the cache at each one.
  ptr_ = g_selector_workspaces.get(op, device, stream, (bytes + (std::size_t{1} << 20) - 1) >> 20 << 20);
}

Scratch::~Scratch() {
  if (stream_ordered_) cudaFreeAsync(ptr_, stream_);
}

}  // namespace sparse_attn::cuda_backend::sel
