// CPU access to the rows of selection tensors, shared by the format validators (formats.cpp) and the
// conversions' CPU implementation (src/convert): element loads and stores, the CPU-device check, and the
// parallel row scan that reports the fault of the lowest faulty row.
//
// The scan runs on the CPU backend's threads over contiguous chunks of rows, and the fault of the
// lowest chunk wins, so the coordinate reported does not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/check.hpp"
#include "core/cpu.hpp"
#include "sparse_attn/error.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::detail {

struct Fault {
  std::string argument;
  std::string message;
};

template <class T>
T load4(const TensorView& t, std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int64_t i3) {
  T x;
  std::memcpy(&x, addr4(t, i0, i1, i2, i3), sizeof(T));
  return x;
}

inline std::int32_t load3_i32(const TensorView& t, std::int64_t i0, std::int64_t i1, std::int64_t i2) {
  const std::int64_t off = i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
  std::int32_t x;
  std::memcpy(&x, static_cast<const char*>(t.data) + off * 4, sizeof(x));
  return x;
}

inline void store3_i32(const TensorView& t, std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int32_t x) {
  const std::int64_t off = i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
  std::memcpy(static_cast<char*>(t.data) + off * 4, &x, sizeof(x));
}

/// Runs check(r, scratch) for every row r in [0, n) and throws the fault of the lowest faulty row.
/// `scratch` is a per-chunk vector the check may use for duplicate stamps.
template <class Check>
void scan_rows(const std::string& op, std::int64_t n, Check&& check) {
  if (n <= 0) return;
  const std::int64_t chunks = std::min<std::int64_t>(n, std::int64_t(std::max(1, cpu_threads())) * 4);
  std::vector<std::optional<Fault>> faults(static_cast<std::size_t>(chunks));
  parallel_for(chunks, [&](std::int64_t c) {
    const std::int64_t r0 = n / chunks * c + std::min(c, n % chunks);
    const std::int64_t r1 = r0 + n / chunks + (c < n % chunks ? 1 : 0);
    std::vector<std::int64_t> scratch;
    for (std::int64_t r = r0; r < r1; ++r) {
      if (std::optional<Fault> f = check(r, scratch)) {
        faults[static_cast<std::size_t>(c)] = std::move(f);
        return;
      }
    }
  });
  for (const auto& f : faults)
    if (f) throw Error(op, f->argument, f->message);
}

/// Throws the standard "no implementation on this device" error unless `t` is on the CPU.
inline void require_cpu(const std::string& op, const std::string& arg, const TensorView& t) {
  if (t.device != Device::cpu) unsupported_device(op, arg, t);
}

/// 32-bit words per BlockBits row.
inline std::int64_t bit_words(const ProblemShape& p) { return ceil_div(p.Tk(), 32); }

}  // namespace sparse_attn::detail
