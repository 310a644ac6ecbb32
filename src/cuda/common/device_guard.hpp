// Host side of the CUDA entry points: CUDA status checks that throw sparse_attn::Error, and the guard
// that makes a tensor's device current for one call and restores the caller's afterwards.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sparse_attn/error.hpp"

namespace sparse_attn::cuda_kernels {

/// Throws Error(op) naming `what` and the runtime's message when `e` is not cudaSuccess.
inline void check_cuda(cudaError_t e, const std::string& op, const std::string& what) {
  if (e != cudaSuccess) throw Error(op, "", what + ": " + cudaGetErrorString(e));
}

/// Switches to `device` for its lifetime (if it is not current already) and back at scope exit.
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& op) {
    check_cuda(cudaGetDevice(&previous_), op, "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), op, "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace sparse_attn::cuda_kernels
