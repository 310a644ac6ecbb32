// CPU backend helpers: element access through views of any supported dtype, and parallel loops.
#pragma once

#include <cstdint>
#include <cstring>

#include "sparse_attn/dtype.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::detail {

/// Element e of a floating tensor (f32, f16, bf16, f64) as float.
inline float load_float(const TensorView& t, const void* p) {
  switch (t.dtype) {
    case DType::f32: return *static_cast<const float*>(p);
    case DType::f16: return f16_to_float(*static_cast<const std::uint16_t*>(p));
    case DType::bf16: return bf16_to_float(*static_cast<const std::uint16_t*>(p));
    case DType::f64: return static_cast<float>(*static_cast<const double*>(p));
    default: return 0.0f;
  }
}

inline void store_float(const TensorView& t, void* p, float x) {
  switch (t.dtype) {
    case DType::f32: *static_cast<float*>(p) = x; break;
    case DType::f16: *static_cast<std::uint16_t*>(p) = float_to_f16(x); break;
    case DType::bf16: *static_cast<std::uint16_t*>(p) = float_to_bf16(x); break;
    case DType::f64: *static_cast<double*>(p) = x; break;
    default: break;
  }
}

/// Byte address of element (i0, i1, i2, i3) of a 4-d view.
inline char* addr4(const TensorView& t, std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int64_t i3) {
  const std::int64_t off = i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2] + i3 * t.stride[3];
  return static_cast<char*>(t.data) + off * static_cast<std::int64_t>(dtype_size(t.dtype));
}

/// Copies n contiguous elements starting at p (dtype of t) into dst as float.
void load_row(const TensorView& t, const void* p, std::int64_t n, float* dst);
/// Writes n floats to contiguous elements at p (dtype of t), rounding to nearest even.
void store_row(const TensorView& t, void* p, std::int64_t n, const float* src);

/// Row (b, l, h, :) of a [B, L, H, D] tensor, as float.
inline void load_bhld(const TensorView& t, std::int64_t b, std::int64_t l, std::int64_t h, float* dst) {
  load_row(t, addr4(t, b, l, h, 0), t.shape[3], dst);
}

/// Number of threads the CPU backend uses (OpenMP's, or 1 without OpenMP).
int cpu_threads();

/// Runs f(i) for i in [0, n) on the CPU backend's threads, dynamically scheduled. Exceptions
/// thrown by f are rethrown on the calling thread (the first one wins).
template <class F>
void parallel_for(std::int64_t n, F&& f);

}  // namespace sparse_attn::detail

#include "core/parallel_impl.hpp"
