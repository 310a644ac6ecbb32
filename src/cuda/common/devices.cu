// The CUDA devices visible to the process (version.hpp: cuda_devices; without the CUDA backend
// src/core/version.cpp reports none).
#include <cuda_runtime.h>

#include <vector>

#include "sparse_attn/version.hpp"

namespace sparse_attn {

std::vector<DeviceInfo> cuda_devices() {
  std::vector<DeviceInfo> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: report none
    return out;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.major = prop.major;
    d.minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    d.memory_bytes = prop.totalGlobalMem;
    d.supported = prop.major == 9 && prop.minor == 0;
    out.push_back(d);
  }
  return out;
}

}  // namespace sparse_attn
