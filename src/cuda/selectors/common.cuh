// Device pieces shared by the CUDA selectors: element loads, the index quantisation round trips
// (bit-identical to src/selectors/quantize.cpp, so the GPU scores the values the CPU oracle scores),
// and the host-side launch helpers. The selectors' contract (docs/design.md §5.7) bounds the error of
// their float32 scores against the CPU's float64 ones; the quantised values themselves are exact.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "cuda/common/device_guard.hpp"
#include "cuda/common/pdl.cuh"
#include "sparse_attn/error.hpp"
#include "sparse_attn/selectors.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn::cuda_backend::sel {

// Input element types, as template parameters of the kernels.
enum class In : int { f32, f16, bf16 };

template <In T>
__device__ __forceinline__ float load_elem(const void* base, std::int64_t i) {
  if constexpr (T == In::f32) return static_cast<const float*>(base)[i];
  else if constexpr (T == In::f16) return __half2float(static_cast<const __half*>(base)[i]);
  else return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

template <class T>
__host__ __device__ __forceinline__ T imin(T a, T b) { return a < b ? a : b; }
template <class T>
__host__ __device__ __forceinline__ T imax(T a, T b) { return a < b ? b : a; }

// NaN ranks as -inf, as detail::sanitize on the CPU.
__device__ __forceinline__ double sanitize(double s) { return isnan(s) ? -INFINITY : s; }

// Order-preserving key of a float: a larger float gives a larger key (-0 below +0); order_value inverts it.
__device__ __forceinline__ std::uint32_t order_key(float f) {
  const std::uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float order_value(std::uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// ---- quantisation: device ports of src/selectors/quantize.cpp ------------------------------------

enum class Prec : int { bf16, fp8, fp4 };

__device__ __forceinline__ float round_bf16(float f) {
  const std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((u >> 16) | 0x40u) << 16);
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return __uint_as_float(((u + rounding) >> 16) << 16);
}

// |a| (finite, >= 0, below the format's max) to a magnitude code; see round_magnitude on the CPU.
__device__ __forceinline__ int round_magnitude(float a, int mant_bits, int bias) {
  const int min_exp = 1 - bias;
  int e;
  frexpf(a, &e);
  int E = e - 1;
  const bool subnormal = a == 0.0f || E < min_exp;
  if (subnormal) E = min_exp;
  const int m = static_cast<int>(rintf(__fdiv_rn(a, ldexpf(1.0f, E - mant_bits))));
  return subnormal ? m : (((E + bias) << mant_bits) + (m - (1 << mant_bits)));
}

__device__ __forceinline__ std::uint8_t float_to_e4m3(float f) {
  if (isnan(f)) return 0x7f;
  const std::uint8_t sign = signbit(f) ? 0x80 : 0x00;
  const float a = fabsf(f);
  if (a >= 448.0f) return static_cast<std::uint8_t>(sign | 0x7e);
  return static_cast<std::uint8_t>(sign | round_magnitude(a, 3, 7));
}

__device__ __forceinline__ float e4m3_to_float(std::uint8_t b) {
  const bool neg = (b & 0x80) != 0;
  const int e = (b >> 3) & 0xf;
  const int m = b & 0x7;
  if (e == 0xf && m == 0x7) return __int_as_float(0x7fc00000);
  const float v = e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(static_cast<float>(8 + m), e - 10);
  return neg ? -v : v;
}

__device__ __forceinline__ std::uint8_t float_to_e2m1(float f) {
  if (isnan(f)) return 0x7;
  const std::uint8_t sign = signbit(f) ? 0x8 : 0x0;
  const float a = fabsf(f);
  if (a >= 6.0f) return static_cast<std::uint8_t>(sign | 0x7);
  return static_cast<std::uint8_t>(sign | round_magnitude(a, 1, 1));
}

__device__ __forceinline__ float e2m1_to_float(std::uint8_t b) {
  const bool neg = (b & 0x8) != 0;
  const int e = (b >> 1) & 0x3;
  const int m = b & 0x1;
  const float v = e == 0 ? 0.5f * static_cast<float>(m) : ldexpf(static_cast<float>(2 + m), e - 2);
  return neg ? -v : v;
}

template <Prec P>
__device__ __forceinline__ float tensor_scale_of(float amax) {
  if constexpr (P == Prec::fp8) return __fdiv_rn(amax, 448.0f);
  else if constexpr (P == Prec::fp4) return __fdiv_rn(amax, 448.0f * 6.0f);
  else return 1.0f;
}

// ---- host helpers ----------------------------------------------------------------------------------

using cuda_kernels::check_cuda;  // Error(op) naming `what` and the runtime's message

/// Launches `kernel` on `stream`; with `programmatic`, as a programmatic dependent of the previous kernel
/// there: its launch and the part before its griddepcontrol.wait (pdl_wait) overlap the previous grid's
/// tail, and the kernel must call pdl_wait() before it touches memory that earlier work on the stream reads
/// or writes. Without it, a plain launch.
template <class... Params, class... Args>
void launch_kernel(const std::string& op, const char* what, void (*kernel)(Params...), dim3 grid, dim3 block,
                   std::size_t smem, cudaStream_t stream, bool programmatic, Args&&... args) {
  check_cuda(cuda_kernels::launch_programmatic(kernel, grid, block, smem, stream, programmatic, std::forward<Args>(args)...),
             op, what);
}
/// launch_kernel as a programmatic dependent.
template <class... Params, class... Args>
void launch_dependent(const std::string& op, const char* what, void (*kernel)(Params...), dim3 grid, dim3 block,
                      std::size_t smem, cudaStream_t stream, Args&&... args) {
  launch_kernel(op, what, kernel, grid, block, smem, stream, true, std::forward<Args>(args)...);
}

// Device side of launch_dependent: the shared programmatic-dependent-launch helpers (cuda/common/pdl.cuh).
using cuda_kernels::pdl_launch_dependents;
using cuda_kernels::pdl_wait;

// The tensor's device must be usable by this process; otherwise the Error names the argument (as the
// CPU-only build's unsupported-device Error does) and the runtime's reason. Returns the largest
// dynamic shared memory a block may opt in to.
inline int usable_device_smem(const std::string& op, const std::string& name, const TensorView& t) {
  int dev = -1, count = 0, max_smem = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess && t.device_index >= count) e = cudaErrorInvalidDevice;
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != t.device_index) {
    throw Error(op, name, "tensor " + t.describe() + " is not on the current CUDA device " + std::to_string(dev));
  }
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) {
    cudaGetLastError();  // the failure is reported here; do not leave it for the caller's next check
    throw Error(op, name, "no usable cuda device for tensor " + t.describe() + ": " + cudaGetErrorString(e));
  }
  return max_smem;
}

// A view labelled cuda must point at device (or managed) memory: a host pointer would fault inside a
// kernel, asynchronously, instead of giving an Error. The query does not synchronise.
inline void check_device_memory(const std::string& op, const std::string& name, const TensorView& t) {
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, t.data);
  if (e != cudaSuccess) cudaGetLastError();
  if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged))
    throw Error(op, name, "tensor " + t.describe() + " is labelled cuda but its memory is not CUDA device memory");
}

// The number of SMs of the current device (grids of one wave).
inline int current_sm_count(const std::string& op) {
  int dev = 0, sms = 0;
  check_cuda(cudaGetDevice(&dev), op, "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op, "cudaDeviceGetAttribute");
  return sms;
}

inline In in_type(DType d) { return d == DType::f32 ? In::f32 : d == DType::f16 ? In::f16 : In::bf16; }

inline std::size_t align_up(std::size_t x, std::size_t a = 256) { return (x + a - 1) / a * a; }

}  // namespace sparse_attn::cuda_backend::sel
