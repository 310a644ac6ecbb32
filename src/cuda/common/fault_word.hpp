// Device-side checks that report to the host: one 64-bit fault word per device into which a checking
// kernel atomicMin's its faults, so that the smallest (the first in the order the CPU reports them)
// survives, read back by the host after the launch; and the read-back of the data a fault points at.
// The word is never freed (freeing at exit could run after the runtime has shut down).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/common/device_guard.hpp"

namespace sparse_attn::cuda_kernels {

constexpr unsigned long long kNoFault = ~0ull;

/// One value copied back from the device after the work queued on `stream` (a synchronisation).
template <class T>
T read_back(const T* ptr, cudaStream_t stream, const std::string& op) {
  T v{};
  check_cuda(cudaMemcpyAsync(&v, ptr, sizeof(T), cudaMemcpyDeviceToHost, stream), op, "reading the fault back");
  check_cuda(cudaStreamSynchronize(stream), op, "reading the fault back");
  return v;
}

/// n int32 values `stride` elements apart, copied back after the work queued on `stream` (a
/// synchronisation): the entries of a faulty row.
inline std::vector<std::int32_t> read_back_row(const std::int32_t* src, long long stride, std::size_t n,
                                               cudaStream_t stream, const std::string& op) {
  std::vector<std::int32_t> row(n);
  if (n == 0) return row;
  check_cuda(cudaMemcpy2DAsync(row.data(), sizeof(std::int32_t), src, static_cast<std::size_t>(stride) * sizeof(std::int32_t),
                               sizeof(std::int32_t), n, cudaMemcpyDeviceToHost, stream),
             op, "reading the faulty row");
  check_cuda(cudaStreamSynchronize(stream), op, "reading the faulty row");
  return row;
}

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

/// Runs `launch(fault)` on `stream` with the fault word of `device` (the current device) reset to
/// kNoFault, and returns the word afterwards (one synchronisation). Calls on different streams or host
/// threads take turns: the word is theirs from the reset to the read-back.
template <class Launch>
unsigned long long checked_launch(int device, cudaStream_t stream, const std::string& op, Launch&& launch) {
  std::lock_guard<std::mutex> lock(fault_mutex());
  unsigned long long* word = fault_word(device, op);
  check_cuda(cudaMemsetAsync(word, 0xff, sizeof(unsigned long long), stream), op, "fault word reset");
  launch(word);
  return read_back(word, stream, op);
}

/// `launch()` once on `stream`: as it is when `trusted` (nothing is checked: returns kNoFault), otherwise
/// with `fault` pointed at the fault word of `device` (checked_launch), whose value it returns.
template <class Launch>
unsigned long long launch_checked_unless(bool trusted, unsigned long long*& fault, int device, cudaStream_t stream,
                                         const std::string& op, Launch&& launch) {
  if (trusted) {
    launch();
    return kNoFault;
  }
  return checked_launch(device, stream, op, [&](unsigned long long* word) {
    fault = word;
    launch();
  });
}

}  // namespace sparse_attn::cuda_kernels
