// Shared pieces of the query_sparse GPU suites (KV-centric and group-centric): the skip for machines
// without a supported GPU, a device copy of a host tensor, and the random per-query lists and inputs
// both suites check against the CPU reference.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::testing::query_lists {

inline void cuda_ok(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

/// Device memory holding a copy of a host tensor, or `n` bytes viewed as u8.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  TensorView view;
  DeviceBuffer() = default;
  explicit DeviceBuffer(const HostTensor& h) {
    bytes = static_cast<std::size_t>(h.numel()) * dtype_size(h.dtype());
    cuda_ok(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    if (bytes) cuda_ok(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), "upload");
    view = TensorView::contiguous(ptr, h.dtype(), h.shape(), Device::cuda, 0);
  }
  explicit DeviceBuffer(std::size_t n) : bytes(n) {
    cuda_ok(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    view = TensorView::contiguous(ptr, DType::u8, {static_cast<std::int64_t>(bytes)}, Device::cuda, 0);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  void download(HostTensor& h) const {
    if (bytes) cuda_ok(cudaMemcpy(h.view().data, ptr, bytes, cudaMemcpyDeviceToHost), "download");
  }
};

/// QueryLists idx [B, Hkv, Lq, kq]: per (b, g, query) 1..min(kq, Tk) distinct ids in random slots, -1
/// elsewhere; every 7th query selects nothing, and with `empty_tile` neither do queries 128..255; with
/// `popular` every selecting query has block 0. Lists differ across b and g.
inline HostTensor random_lists(const ProblemShape& p, std::int64_t kq, bool empty_tile, bool popular,
                               std::uint64_t seed) {
  HostTensor t(DType::i32, {p.B, p.Hkv, p.Lq, kq});
  auto* d = t.data<std::int32_t>();
  std::mt19937_64 rng(seed);
  const std::int64_t Tk = p.Tk();
  std::vector<std::int32_t> all(static_cast<std::size_t>(Tk));
  std::vector<std::int64_t> slots(static_cast<std::size_t>(kq));
  for (std::int64_t bg = 0; bg < p.B * p.Hkv; ++bg) {
    for (std::int64_t i = 0; i < p.Lq; ++i) {
      std::int32_t* row = d + (bg * p.Lq + i) * kq;
      std::fill(row, row + kq, -1);
      if (i % 7 == 3 || (empty_tile && i >= 128 && i < 256)) continue;
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      if (popular) std::iter_swap(all.begin(), std::find(all.begin(), all.end(), 0));
      const auto n = static_cast<std::int64_t>(1 + rng() % static_cast<std::uint64_t>(std::min(kq, Tk)));
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      for (std::int64_t s = 0; s < n; ++s) row[slots[static_cast<std::size_t>(s)]] = all[static_cast<std::size_t>(s)];
    }
  }
  return t;
}

struct Inputs {
  ProblemShape p;
  HostTensor q, k, v, idx;
};

/// Random q, k, v of `dtype` and random_lists for the problem `p`.
inline Inputs random_inputs(const ProblemShape& p, DType dtype, std::int64_t kq, bool empty_tile, bool popular,
                            std::uint64_t seed) {
  Inputs in;
  in.p = p;
  in.q = random_tensor(dtype, {p.B, p.Lq, p.Hq, p.D}, seed * 7 + 1);
  in.k = random_tensor(dtype, {p.B, p.Lk, p.Hkv, p.D}, seed * 7 + 2);
  in.v = random_tensor(dtype, {p.B, p.Lk, p.Hkv, p.D}, seed * 7 + 3);
  in.idx = random_lists(p, kq, empty_tile, popular, seed * 7 + 4);
  return in;
}

}  // namespace sparse_attn::testing::query_lists
