#include "cuda/common/workspace_cache.hpp"

#include <cuda_runtime.h>

#include <string>

#include "cuda/common/device_guard.hpp"

namespace sparse_attn::cuda_backend {

void* WorkspaceCache::get(const std::string& op, int device, void* stream, std::size_t need) {
  Entry& ws = entries_[{device, stream}];
  if (ws.bytes < need) {
    if (ws.ptr != nullptr) {
      cuda_kernels::check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), op, "workspace growth");
      cuda_kernels::check_cuda(cudaFree(ws.ptr), op, "workspace growth");
    }
    ws = Entry{};
    cuda_kernels::check_cuda(cudaMalloc(&ws.ptr, need), op, "workspace of " + std::to_string(need) + " bytes");
    ws.bytes = need;
  }
  return ws.ptr;
}

void* WorkspaceCache::find(int device, void* stream, std::size_t need) const {
  const auto it = entries_.find({device, stream});
  return it != entries_.end() && it->second.bytes >= need ? it->second.ptr : nullptr;
}

}  // namespace sparse_attn::cuda_backend
