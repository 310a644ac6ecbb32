#include "core/cpu.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace sparse_attn::detail {

void load_row(const TensorView& t, const void* p, std::int64_t n, float* dst) {
  switch (t.dtype) {
    case DType::f32: std::memcpy(dst, p, static_cast<std::size_t>(n) * sizeof(float)); break;
    case DType::f16: {
      const auto* s = static_cast<const std::uint16_t*>(p);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
      break;
    }
    case DType::bf16: {
      const auto* s = static_cast<const std::uint16_t*>(p);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
    case DType::f64: {
      const auto* s = static_cast<const double*>(p);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      break;
    }
    default: break;
  }
}

void store_row(const TensorView& t, void* p, std::int64_t n, const float* src) {
  switch (t.dtype) {
    case DType::f32: std::memcpy(p, src, static_cast<std::size_t>(n) * sizeof(float)); break;
    case DType::f16: {
      auto* d = static_cast<std::uint16_t*>(p);
      for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_f16(src[i]);
      break;
    }
    case DType::bf16: {
      auto* d = static_cast<std::uint16_t*>(p);
      for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      break;
    }
    case DType::f64: {
      auto* d = static_cast<double*>(p);
      for (std::int64_t i = 0; i < n; ++i) d[i] = src[i];
      break;
    }
    default: break;
  }
}

int cpu_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace sparse_attn::detail
