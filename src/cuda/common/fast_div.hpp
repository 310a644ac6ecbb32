// Division of non-negative 31-bit integers by a divisor fixed at launch: one multiply-high, one add and
// one shift instead of the ~20 instructions (a reciprocal on the MUFU and two fix-ups) of `/`.
//
// With s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s for
// every 0 <= n < 2^31 (Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994, section 4; here the sum cannot overflow because mulhi(n, m) < n). Usable from
// host and device code; FastDivTest in the CPU suite checks it against `/` and `%`.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/common/host_device.hpp"

namespace sparse_attn::cuda_kernels {

struct FastDiv {
  std::uint32_t m = 1;  // d = 1: s = 0, m = 1 gives (0 + n) >> 0 = n
  std::uint32_t s = 0;
  std::int32_t d = 1;

  /// Throws std::invalid_argument unless 1 <= d < 2^31.
  static FastDiv make(std::int64_t d) {
    if (d < 1 || d > 0x7fffffffLL)
      throw std::invalid_argument("FastDiv: divisor " + std::to_string(d) + " is outside [1, 2^31)");
    FastDiv f;
    f.d = static_cast<std::int32_t>(d);
    while ((std::int64_t{1} << f.s) < d) ++f.s;
    const std::uint64_t num = (std::uint64_t{1} << 32) * ((std::uint64_t{1} << f.s) - static_cast<std::uint64_t>(d));
    f.m = static_cast<std::uint32_t>(num / static_cast<std::uint64_t>(d) + 1);
    return f;
  }

  /// n / d for 0 <= n < 2^31.
  SPARSE_ATTN_HD std::int32_t div(std::int32_t n) const {
    const auto u = static_cast<std::uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const std::uint32_t hi = __umulhi(u, m);
#else
    const auto hi = static_cast<std::uint32_t>((static_cast<std::uint64_t>(u) * m) >> 32);
#endif
    return static_cast<std::int32_t>((hi + u) >> s);
  }

  /// n % d for 0 <= n < 2^31.
  SPARSE_ATTN_HD std::int32_t mod(std::int32_t n) const { return n - div(n) * d; }
};

}  // namespace sparse_attn::cuda_kernels
