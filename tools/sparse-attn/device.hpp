// Device memory for the command-line program: owning CUDA buffers, copies and timing. Only compiled
// into real CUDA calls when the library's CUDA backend is (SPARSE_ATTN_WITH_CUDA); otherwise every
// function that would touch a device throws, so callers decide on the CPU path up front.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cli {

/// True when this program was built with the CUDA backend.
bool cuda_compiled();

/// A densely packed tensor in the memory of one CUDA device. Move-only; frees on destruction.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::vector<std::int64_t> shape, int device_index);
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& other) noexcept;
  DeviceTensor& operator=(DeviceTensor&& other) noexcept;
  ~DeviceTensor();

  const TensorView& view() const { return view_; }
  std::size_t bytes() const;

  /// Copies a densely packed host tensor of the same dtype and element count into this buffer.
  void upload(const TensorView& host);
  /// Copies this buffer into a densely packed host tensor of the same dtype and element count.
  void download(const TensorView& host) const;
  /// Sets every byte to `byte` (poisoning outputs before a run).
  void fill_bytes(unsigned char byte);

 private:
  void release() noexcept;
  TensorView view_;
};

/// Waits for all work on the current device.
void device_synchronize();

/// Milliseconds that `f` takes on the device, measured with CUDA events on the default stream
/// around the launches (the host waits only at the end).
double device_time_ms(const std::function<void()>& f);

}  // namespace sparse_attn::cli
