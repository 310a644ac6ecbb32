// Helpers shared by the GPU selector tests: device copies of host tensors, poisoned int32 outputs, and an
// element-by-element comparison of int32 results that names the coordinates of the first differences.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "sparse_attn/sparse_attn.hpp"

/// Skips the current test where no supported GPU is present.
#define SPARSE_ATTN_SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                                      \
    if (!sparse_attn::cuda_available()) GTEST_SKIP() << "no supported CUDA device (sm_90): GPU test skipped"; \
  } while (0)

namespace sparse_attn::testing {

inline void cuda_ok(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

/// A device copy of a host tensor (dense strides), freed on destruction.
struct Dev {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  TensorView view;
  explicit Dev(const HostTensor& h) {
    bytes = static_cast<std::size_t>(h.numel()) * dtype_size(h.dtype());
    cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc");
    cuda_ok(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), "upload");
    view = TensorView::contiguous(ptr, h.dtype(), h.shape(), Device::cuda, 0);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (ptr) cudaFree(ptr);
  }
  HostTensor download(const HostTensor& like) const {
    HostTensor h(like.dtype(), like.shape());
    cudaMemcpy(h.view().data, ptr, bytes, cudaMemcpyDeviceToHost);
    return h;
  }
};

/// A poisoned int32 output (every byte 0x5a: an id no selector produces), to be uploaded with Dev.
inline HostTensor poisoned_i32(const std::vector<std::int64_t>& shape) {
  HostTensor h(DType::i32, shape);
  std::memset(h.view().data, 0x5a, static_cast<std::size_t>(h.numel()) * 4);
  return h;
}

/// Compares two int32 tensors element by element; reports the first few differences with coordinates.
inline void expect_equal_i32(const HostTensor& gpu, const HostTensor& cpu, const std::string& what) {
  ASSERT_EQ(gpu.numel(), cpu.numel());
  const auto* g = gpu.data<std::int32_t>();
  const auto* c = cpu.data<std::int32_t>();
  const auto& shape = cpu.shape();
  int reported = 0;
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < cpu.numel(); ++i) {
    if (g[i] == c[i]) continue;
    ++bad;
    if (reported++ < 5) {
      std::string coord;
      std::int64_t rest = i;
      for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
        coord = std::to_string(rest % shape[static_cast<std::size_t>(d)]) + (coord.empty() ? "" : ", ") + coord;
        rest /= shape[static_cast<std::size_t>(d)];
      }
      ADD_FAILURE() << what << ": at [" << coord << "] gpu " << g[i] << " != cpu " << c[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << cpu.numel() << " elements differ";
}

}  // namespace sparse_attn::testing
