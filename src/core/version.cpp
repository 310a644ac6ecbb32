#include "sparse_attn/version.hpp"

#include "core/cpu.hpp"

#if defined(SPARSE_ATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#ifndef SPARSE_ATTN_VERSION
#define SPARSE_ATTN_VERSION "0.0.0"
#endif

namespace sparse_attn {

BuildInfo build_info() {
  BuildInfo info;
  info.version = SPARSE_ATTN_VERSION;
#if defined(SPARSE_ATTN_WITH_CUDA)
  info.cuda = true;
  info.cuda_version = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
  info.cuda_archs = "sm_90a";
#endif
#if defined(__clang__)
  info.compiler = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info.compiler = "g++ " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
                  std::to_string(__GNUC_PATCHLEVEL__);
#endif
  info.cpu_threads = detail::cpu_threads();
  return info;
}

std::vector<DeviceInfo> cuda_devices() {
  std::vector<DeviceInfo> out;
#if defined(SPARSE_ATTN_WITH_CUDA)
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
#endif
  return out;
}

bool cuda_available() {
  for (const auto& d : cuda_devices())
    if (d.supported) return true;
  return false;
}

}  // namespace sparse_attn
