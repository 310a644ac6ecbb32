// Device-side checks that report to the host, in two forms.
//
// Synchronous (conversions, token_sparse): one 64-bit fault word per device into which a checking
// kernel atomicMin's its faults, so that the smallest (the first in the order the CPU reports them)
// survives, read back by the host after the launch; and the read-back of the data a fault points at.
// The word is never freed (freeing at exit could run after the runtime has shut down).
//
// Deferred (tile_sparse): a kernel that meets a fault while it runs keeps it in the device's
// DeviceFault record and raises the device's flag in pinned, host-mapped memory, and goes on; the
// host sees the flag at the next call or at check_device_faults (device_faults.cu), with no
// synchronisation while no fault is pending, so validated calls can be captured in CUDA graphs.
#pragma once

#include <cuda/atomic>
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

// ---- deferred faults ----------------------------------------------------------------------------

/// What a DeviceFault holds: a TileLists count outside [0, Kmax], an id outside [0, Tk), an id not
/// above the one before it (the rules of detail::tile_row_message, in its order).
enum class ListFault : int { kNone = 0, kCount = 1, kRange = 2, kOrder = 3 };

/// The first fault found by validated calls on one device since the host last reported one: the
/// smallest `key` wins. Lives in device memory (one per device, device_faults.cu); written only by
/// record_list_fault, read and reset by the host once the device is idle.
struct DeviceFault {
  unsigned long long key;  // (position << 2) | kind, position = row-major (b, g, t, slot + 1); kNoFault: none
  int lock;                // held by the thread writing the fields below
  ListFault kind;
  int b, g, t, slot;  // the tile (b, g, t) and the slot of the id (kCount: -1)
  int value;          // the count (kCount) or id (kRange, kOrder) as read
  int prev;           // kOrder: the id before it
  int Kmax, Tk;       // the call's list capacity and block count, for the message
};

/// Where a validated kernel reports: the device's record and its flag in pinned host memory (the
/// device address of the mapping). Null record: the call is trusted, nothing is checked.
struct FaultSink {
  DeviceFault* record = nullptr;
  int* flag = nullptr;
};

#if defined(__CUDACC__)
/// Keeps `f` in the record if it comes before the fault held there, then raises the host flag. Rare
/// (a fault) and taken by one thread per faulty work item: a spin lock orders the writers.
__device__ __forceinline__ void record_list_fault(FaultSink sink, const DeviceFault& f) {
  cuda::atomic_ref<int, cuda::thread_scope_device> lock(sink.record->lock);
  while (lock.exchange(1, cuda::memory_order_acquire) != 0) {
  }
  DeviceFault& r = *sink.record;
  if (f.key < r.key) {  // every field but the lock
    r.key = f.key;
    r.kind = f.kind;
    r.b = f.b, r.g = f.g, r.t = f.t, r.slot = f.slot;
    r.value = f.value, r.prev = f.prev;
    r.Kmax = f.Kmax, r.Tk = f.Tk;
  }
  lock.store(0, cuda::memory_order_release);
  cuda::atomic_ref<int, cuda::thread_scope_system>(*sink.flag).store(1, cuda::memory_order_release);
}
#endif

/// The sink of the current device `device` for a validated launch, created on first use (a record
/// and a pinned flag that live as long as the process; their allocation is allowed while a stream
/// of this thread is being captured). Throws Error(op) when CUDA fails.
FaultSink fault_sink(int device, const std::string& op);

}  // namespace sparse_attn::cuda_kernels
