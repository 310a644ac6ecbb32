#include "cuda/common/smem_limit.hpp"

#include <map>
#include <utility>

namespace sparse_attn::cuda_kernels {
namespace {

// The limit last set per (kernel, device); guarded by smem_limit_mutex().
std::map<std::pair<const void*, int>, std::size_t>& limits() {
  static auto* m = new std::map<std::pair<const void*, int>, std::size_t>();  // never freed: used until exit
  return *m;
}

}  // namespace

std::mutex& smem_limit_mutex() {
  static std::mutex m;
  return m;
}

cudaError_t set_smem_limit(const void* kernel, std::size_t bytes) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const auto key = std::make_pair(kernel, device);
  const auto it = limits().find(key);
  if (it != limits().end() && it->second == bytes) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e == cudaSuccess) limits()[key] = bytes;
  return e;
}

}  // namespace sparse_attn::cuda_kernels
