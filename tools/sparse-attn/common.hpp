// Pieces shared by the subcommands: where to run, tensors mirrored on host and device, timing,
// progress lines and the metadata that goes into every JSON result.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "device.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace CLI {
class Validator;
}

namespace sparse_attn::cli {

/// Option check: a finite number in [lo, hi]. CLI::Range alone lets "nan" through.
CLI::Validator finite_range(double lo, double hi);
/// Option check: a decimal integer in [0, 2^64) (CLI11 would turn "-1" into 2^64 - 1).
CLI::Validator unsigned_integer();

/// Throws std::runtime_error naming `options` when `bytes` (the estimate of what they allocate,
/// in double so that it cannot overflow) exceed the machine's physical memory: extents that are
/// each within their option's range can still ask for far more together.
void check_memory(double bytes, const std::string& options);

/// Deterministic across platforms (std::normal_distribution is implementation-defined).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : gen_(seed) {}
  double uniform() { return double(gen_() >> 11) * 0x1.0p-53; }
  double normal();
  /// Uniform integer in [0, n).
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(uniform() * double(n)); }

 private:
  std::mt19937_64 gen_;
};

/// Where a subcommand runs: the CPU backend or one CUDA device.
struct Placement {
  bool cuda = false;
  int index = 0;
  std::string name;  // "CPU (N threads)" or the GPU's name

  /// --device auto|cpu|cuda. auto picks the first supported GPU when the CUDA backend is built.
  static Placement choose(const std::string& flag);
  /// The line every subcommand prints first.
  std::string banner() const;
};

/// True for the library's "no <device> implementation of <op>" error: the operator exists, only not
/// for that device. Every other error is a real failure.
bool is_missing_implementation(const Error& e);

/// What the table says for work that had to run on the CPU while the rest ran on the GPU.
inline constexpr const char* kCpuFallbackNote = "cpu (no cuda implementation yet)";

/// A host tensor with an optional mirror on the device; views of either side.
class Mirrored {
 public:
  Mirrored() = default;
  Mirrored(DType dtype, std::vector<std::int64_t> shape, const Placement& where);
  explicit Mirrored(HostTensor host, const Placement& where);

  HostTensor& host() { return host_; }
  const HostTensor& host() const { return host_; }
  /// The device copy when `device` and one exists (allocated on first use), else the host tensor.
  TensorView view(bool device);
  void upload();
  void download();
  /// Fills both sides with a byte pattern so unwritten outputs are visible (0xff: NaN, or -1 ids).
  void poison();

 private:
  HostTensor host_;
  std::optional<DeviceTensor> dev_;
  int device_index_ = 0;
};

/// Seconds since the program started, for progress lines.
double elapsed_s();

template <class... Args>
void progress(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, "[{:7.1f} s] {}\n", elapsed_s(), fmt::format(f, std::forward<Args>(args)...));
  std::fflush(stderr);
}

/// Milliseconds of one call: CUDA events on the device, the steady clock on the CPU.
double time_ms(bool device, const std::function<void()>& f);

/// Relative error ||a - b|| / ||b|| in float64 over two host views of equal shape (any floating
/// dtype, any strides). NaN anywhere gives +inf.
double relative_error(const TensorView& a, const TensorView& b);
/// True when no element of a densely packed floating host tensor is NaN or infinite.
bool all_finite(const TensorView& t);

/// Median of a non-empty list.
double median(std::vector<double> v);

/// "2026-11-29T15:04:47Z"
std::string iso8601_now();
/// Library version, compiler and CUDA toolkit, and the device, for JSON results.
nlohmann::json build_json(const Placement& where);
/// Throws std::runtime_error unless `path` can be opened for writing (checked before long runs).
void check_writable(const std::string& path);
/// Writes `j` (pretty-printed) to `path`; throws std::runtime_error when the file cannot be written.
void write_json(const std::string& path, const nlohmann::json& j);

}  // namespace sparse_attn::cli
