// The device conversions' fault word: one 64-bit word per device into which a checking kernel
// atomicMin's its faults, so that the smallest (the first in the order the CPU function reports them)
// survives, read back by the host after the launch. Never freed (freeing at exit could run after the
// runtime has shut down). fault_mutex() is held from the reset to the read-back: calls on different
// streams or host threads must not share the word at the same time.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>

#include "cuda/common/device_guard.hpp"

namespace sparse_attn::cuda_kernels::convert {

constexpr unsigned long long kNoFault = ~0ull;

inline std::mutex& fault_mutex() {
  static std::mutex m;
  return m;
}

/// The fault word of `device` (the current device), allocated on first use; the caller holds fault_mutex().
inline unsigned long long* fault_word(int device, const std::string& op) {
  static auto* words = new std::map<int, unsigned long long*>();
  unsigned long long*& w = (*words)[device];
  if (w == nullptr) check_cuda(cudaMalloc(&w, sizeof(unsigned long long)), op, "fault word allocation");
  return w;
}

/// One value copied back from the device after the work queued on `stream` (a synchronisation).
template <class T>
T read_back(const T* ptr, cudaStream_t stream, const std::string& op) {
  T v{};
  check_cuda(cudaMemcpyAsync(&v, ptr, sizeof(T), cudaMemcpyDeviceToHost, stream), op, "reading the fault back");
  check_cuda(cudaStreamSynchronize(stream), op, "reading the fault back");
  return v;
}

}  // namespace sparse_attn::cuda_kernels::convert
