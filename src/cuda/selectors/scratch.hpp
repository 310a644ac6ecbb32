// Device scratch of one selector call: the caller's workspace (options.workspace: u8 of at least the
// bytes that <selector>_workspace_bytes reports, on the inputs' device), or, without one, a workspace
// the library keeps per (device, stream) and grows when a call needs more (growth waits for the
// stream's earlier work). A call being captured into a CUDA graph without a workspace of its own gets
// stream-ordered memory instead, which the graph owns: capture never synchronises, and no later growth
// can free memory a graph still uses.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <string>

#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend::sel {

class Scratch {
 public:
  /// `workspace`: the caller's (an empty view: none). Errors name `op` and "options.workspace" for a
  /// workspace that is not u8, not contiguous, on another device or smaller than `bytes`.
  Scratch(const std::string& op, const TensorView& workspace, std::size_t bytes, int device, cudaStream_t stream);
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();

  template <class T>
  T* as(std::size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(ptr_) + byte_offset);
  }

 private:
  void* ptr_ = nullptr;
  bool stream_ordered_ = false;
  cudaStream_t stream_ = nullptr;
  std::unique_lock<std::mutex> lock_;  // the cached workspace's, held while the call's launches are queued
};

}  // namespace sparse_attn::cuda_backend::sel
