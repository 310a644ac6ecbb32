#include "sparse_attn/version.hpp"

#include "core/cpu.hpp"

#ifndef SPARSE_ATTN_VERSION
#define SPARSE_ATTN_VERSION "0.0.0"
#endif

namespace sparse_attn {

BuildInfo build_info() {
  BuildInfo info;
  info.version = SPARSE_ATTN_VERSION;
#if defined(SPARSE_ATTN_WITH_CUDA)
  info.cuda = true;
  info.cuda_version = SPARSE_ATTN_CUDA_VERSION;  // the toolkit's major.minor, from the build (CMakeLists.txt)
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

#if !defined(SPARSE_ATTN_WITH_CUDA)
// With the CUDA backend, src/cuda/common/devices.cu lists the devices.
std::vector<DeviceInfo> cuda_devices() { return {}; }
#endif

bool cuda_available() {
  for (const auto& d : cuda_devices())
    if (d.supported) return true;
  return false;
}

}  // namespace sparse_attn
