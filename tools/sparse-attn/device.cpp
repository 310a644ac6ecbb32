#include "device.hpp"

#include <stdexcept>
#include <string>
#include <utility>

#if defined(SPARSE_ATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace sparse_attn::cli {

namespace {

#if defined(SPARSE_ATTN_WITH_CUDA)
void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}
#else
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) + ": this program was built without the CUDA backend");
}
#endif

void check_same_size(const TensorView& host, const TensorView& dev, const char* what) {
  if (host.dtype != dev.dtype || host.numel() != dev.numel() || !host.is_contiguous())
    throw std::runtime_error(std::string(what) + ": host tensor " + host.describe() + " does not match device tensor " +
                             dev.describe());
}

}  // namespace

bool cuda_compiled() {
#if defined(SPARSE_ATTN_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

DeviceTensor::DeviceTensor(DType dtype, std::vector<std::int64_t> shape, int device_index) {
#if defined(SPARSE_ATTN_WITH_CUDA)
  check_cuda(cudaSetDevice(device_index), "cudaSetDevice");
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  void* p = nullptr;
  // cudaMalloc of zero bytes returns a null pointer, which views treat as "missing".
  const std::size_t bytes = static_cast<std::size_t>(n > 0 ? n : 1) * dtype_size(dtype);
  check_cuda(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
  view_ = TensorView::contiguous(p, dtype, shape, Device::cuda, device_index);
#else
  (void)dtype;
  (void)shape;
  (void)device_index;
  no_cuda("DeviceTensor");
#endif
}

DeviceTensor::DeviceTensor(DeviceTensor&& other) noexcept : view_(std::exchange(other.view_, TensorView{})) {}

DeviceTensor& DeviceTensor::operator=(DeviceTensor&& other) noexcept {
  if (this != &other) {
    release();
    view_ = std::exchange(other.view_, TensorView{});
  }
  return *this;
}

DeviceTensor::~DeviceTensor() { release(); }

void DeviceTensor::release() noexcept {
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (view_.data) cudaFree(view_.data);
#endif
  view_ = TensorView{};
}

std::size_t DeviceTensor::bytes() const { return static_cast<std::size_t>(view_.numel()) * dtype_size(view_.dtype); }

void DeviceTensor::upload(const TensorView& host) {
  check_same_size(host, view_, "upload");
#if defined(SPARSE_ATTN_WITH_CUDA)
  check_cuda(cudaMemcpy(view_.data, host.data, bytes(), cudaMemcpyHostToDevice), "cudaMemcpy to device");
#else
  no_cuda("upload");
#endif
}

void DeviceTensor::download(const TensorView& host) const {
  check_same_size(host, view_, "download");
#if defined(SPARSE_ATTN_WITH_CUDA)
  check_cuda(cudaMemcpy(host.data, view_.data, bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy to host");
#else
  no_cuda("download");
#endif
}

void DeviceTensor::fill_bytes(unsigned char byte) {
#if defined(SPARSE_ATTN_WITH_CUDA)
  check_cuda(cudaMemset(view_.data, byte, bytes()), "cudaMemset");
#else
  (void)byte;
  no_cuda("fill_bytes");
#endif
}

void device_synchronize() {
#if defined(SPARSE_ATTN_WITH_CUDA)
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

double device_time_ms(const std::function<void()>& f) {
#if defined(SPARSE_ATTN_WITH_CUDA)
  cudaEvent_t start = nullptr, stop = nullptr;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  float ms = 0.0f;
  try {
    check_cuda(cudaEventRecord(start), "cudaEventRecord");
    f();
    check_cuda(cudaEventRecord(stop), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "kernel execution");
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
#else
  (void)f;
  no_cuda("device_time_ms");
#endif
}

}  // namespace sparse_attn::cli
