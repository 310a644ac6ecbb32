// The deferred faults of validated calls (fault_word.hpp): one DeviceFault record per device, a
// __device__ variable of this module (so it starts out clean without a memset), and one pinned,
// host-mapped flag per device that a faulting kernel raises. The host reads the flag without
// synchronising; only when it is raised does it wait for the device, take the record and reset it.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/fault_word.hpp"
#include "sparse_attn/error.hpp"

namespace sparse_attn::cuda_kernels {
namespace {

constexpr DeviceFault kClean{kNoFault, 0, ListFault::kNone, 0, 0, 0, 0, 0, 0, 0, 0};

// One per device: each device loads its own copy of the module.
__device__ DeviceFault g_record = kClean;

struct Sinks {
  std::mutex mutex;
  std::map<int, FaultSink> device_side;
  std::map<int, volatile int*> host_flags;  // the same flags, host addresses
};

Sinks& sinks() {
  static auto* s = new Sinks();  // never freed: see the fault word
  return *s;
}

/// Waits for `device`, takes its record and resets it (the caller holds the mutex and has seen the
/// flag raised). A fault is found by an earlier call: Error names its operator and argument.
[[noreturn]] void take_and_throw(int device, const FaultSink& sink, volatile int* flag, const std::string& op) {
  DeviceGuard guard(device, op);
  check_cuda(cudaDeviceSynchronize(), op, "waiting for the device to read its fault record");
  DeviceFault f{};
  check_cuda(cudaMemcpy(&f, sink.record, sizeof f, cudaMemcpyDeviceToHost), op, "reading the fault record");
  check_cuda(cudaMemcpy(sink.record, &kClean, sizeof kClean, cudaMemcpyHostToDevice), op, "resetting the fault record");
  *flag = 0;
  const auto [arg, message] = f.kind == ListFault::kCount
                                  ? detail::tile_count_message(f.value, f.Kmax, f.b, f.g, f.t)
                                  : detail::tile_id_message(f.value, f.prev, f.Tk, f.b, f.g, f.t, f.slot);
  throw Error("tile_sparse", "tiles." + arg,
              message + " (found on CUDA device " + std::to_string(device) +
                  " by an earlier validated tile_sparse call, whose out and lse hold NaN for that tile; reported " +
                  (op == "check_device_faults" ? std::string("by check_device_faults") : "at the start of " + op) + ")");
}

}  // namespace

FaultSink fault_sink(int device, const std::string& op) {
  Sinks& s = sinks();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = s.device_side.find(device);
  if (it != s.device_side.end()) return it->second;
  // Allowed while this thread captures a stream (the allocation is not part of any graph).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), op, "capture mode");
  FaultSink sink;
  void* host = nullptr;
  cudaError_t e = cudaGetSymbolAddress(reinterpret_cast<void**>(&sink.record), g_record);
  if (e == cudaSuccess) e = cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    *static_cast<volatile int*>(host) = 0;
    e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&sink.flag), host, 0);
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  check_cuda(e, op, "fault record allocation");
  s.host_flags[device] = static_cast<volatile int*>(host);
  return s.device_side[device] = sink;
}

}  // namespace sparse_attn::cuda_kernels

namespace sparse_attn::cuda_backend {

using cuda_kernels::check_cuda;

void raise_pending_fault(int device, void* stream, const std::string& op) {
  auto& s = cuda_kernels::sinks();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = s.host_flags.find(device);
  if (it == s.host_flags.end() || *it->second == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  {
    cuda_kernels::DeviceGuard guard(device, op);
    check_cuda(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture), op, "stream capture query");
  }
  if (capture != cudaStreamCaptureStatusNone) return;  // no waiting inside a capture
  cuda_kernels::take_and_throw(device, s.device_side.at(device), it->second, op);
}

void check_device_faults(std::optional<int> device) {
  const std::string op = "check_device_faults";
  auto& s = cuda_kernels::sinks();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<int> devices;
  if (device) devices.push_back(*device);
  else
    for (const auto& [d, flag] : s.host_flags) devices.push_back(d);
  for (const int d : devices) {
    const auto it = s.host_flags.find(d);
    if (it == s.host_flags.end()) continue;  // no validated call has run there
    cuda_kernels::DeviceGuard guard(d, op);
    // The kernels still running may yet raise the flag.
    check_cuda(cudaDeviceSynchronize(), op, "waiting for the device");
    if (*it->second != 0) cuda_kernels::take_and_throw(d, s.device_side.at(d), it->second, op);
  }
}

}  // namespace sparse_attn::cuda_backend
