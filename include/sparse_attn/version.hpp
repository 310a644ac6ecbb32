// Build information.
#pragma once

#include <string>
#include <vector>

namespace sparse_attn {

struct BuildInfo {
  std::string version;
  bool cuda = false;            // CUDA backend compiled in
  std::string cuda_version;     // toolkit the backend was built with ("" without CUDA)
  std::string cuda_archs;       // e.g. "sm_90a"
  std::string compiler;
  int cpu_threads = 1;          // threads the CPU backend uses
};

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;
  int multiprocessors = 0;
  std::size_t memory_bytes = 0;
  bool supported = false;       // sm_90 (Hopper): the CUDA kernels run on it
};

BuildInfo build_info();
/// CUDA devices visible to the process (empty without CUDA or without a device).
std::vector<DeviceInfo> cuda_devices();
/// True when at least one supported CUDA device is present.
bool cuda_available();

}  // namespace sparse_attn
