// BlockBits -> TileLists on the GPU (backend.hpp describes the kernel). The output equals the CPU
// function's (src/convert/convert.cpp) element for element: ids ascending, the counts, -1 in every slot
// past the count; so do the errors, whose first offending coordinate is the minimum of one fault word.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>

#include "core/check.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/fault_word.hpp"
#include "cuda/convert/backend.hpp"
#include "cuda/convert/rows.hpp"

namespace sparse_attn::cuda_kernels::convert {

constexpr int kBitsThreads = 256;  // 8 rows per CTA, one warp each

// Fault word: a stray bit (the CPU's validation, which runs over every row first) is (row << 5) | bit;
// a row over capacity is bit 63, then the row above its bit count (kCountBits bits: Tk < 2^31).
constexpr unsigned long long kOverCapacity = 1ull << 63;
constexpr int kCountBits = 31;

struct BitsParams {
  const std::uint32_t* bits = nullptr;  // [B, G, Tq, W]
  long long bits_stride[4] = {};
  std::int32_t* out_idx = nullptr;  // [B, G, Tq, Kmax], slots contiguous
  long long out_stride[3] = {};
  std::int32_t* out_cnt = nullptr;  // [B, G, Tq]
  long long cnt_stride[3] = {};
  long long rows = 0;  // B * G * Tq
  int G = 0, Tq = 0, W = 0, Tk = 0, Kmax = 0;
  unsigned long long* fault = nullptr;  // nullptr: trusted, nothing is checked
};

// One warp per row (b, g, t): lane l takes words w0 + l of each round of 32; an inclusive scan of the
// words' popcounts over the warp places each word's ids, so they leave in ascending order. Bits at or
// past Tk are never written out (trusted rows drop them; checked rows report them).
__global__ void __launch_bounds__(kBitsThreads) bits_kernel(const __grid_constant__ BitsParams p) {
  const int lane = threadIdx.x & 31;
  const long long warps = static_cast<long long>(gridDim.x) * (kBitsThreads / 32);
  const int tail = p.Tk & 31;
  const std::uint32_t last_mask = tail == 0 ? ~0u : (1u << tail) - 1u;
  for (long long r = blockIdx.x * static_cast<long long>(kBitsThreads / 32) + threadIdx.x / 32; r < p.rows;
       r += warps) {
    const long long t = r % p.Tq, g = r / p.Tq % p.G, b = r / (static_cast<long long>(p.Tq) * p.G);
    const std::uint32_t* in = p.bits + b * p.bits_stride[0] + g * p.bits_stride[1] + t * p.bits_stride[2];
    std::int32_t* out = p.out_idx + b * p.out_stride[0] + g * p.out_stride[1] + t * p.out_stride[2];
    int written = 0;  // ids of the row before this round (the same in every lane)
    for (int w0 = 0; w0 < p.W; w0 += 32) {
      const int w = w0 + lane;
      std::uint32_t x = w < p.W ? in[w * p.bits_stride[3]] : 0u;
      if (w == p.W - 1) {
        const std::uint32_t stray = x & ~last_mask;
        if (stray != 0u && p.fault != nullptr)
          atomicMin(p.fault, (static_cast<unsigned long long>(r) << 5) | static_cast<unsigned>(__ffs(stray) - 1));
        x &= last_mask;
      }
      const int n = __popc(x);
      int incl = n;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      int pos = written + incl - n;
      for (std::uint32_t y = x; y != 0u; y &= y - 1u, ++pos)
        if (pos < p.Kmax) out[pos] = w * 32 + __ffs(y) - 1;
      written += __shfl_sync(0xffffffffu, incl, 31);
    }
    for (int k = written + lane; k < p.Kmax; k += 32) out[k] = -1;
    if (lane == 0) {
      p.out_cnt[b * p.cnt_stride[0] + g * p.cnt_stride[1] + t * p.cnt_stride[2]] = min(written, p.Kmax);
      if (p.fault != nullptr && written > p.Kmax)
        atomicMin(p.fault, kOverCapacity | (static_cast<unsigned long long>(r) << kCountBits) |
                               static_cast<unsigned long long>(written));
    }
  }
}

}  // namespace sparse_attn::cuda_kernels::convert

namespace sparse_attn::cuda_backend {

void block_bits_to_tile_lists(const BlockBits& in, const TileLists& out, const ProblemShape& p,
                              const ConvertOptions& options, const std::string& op, const std::string& in_name) {
  namespace cv = cuda_kernels::convert;
  constexpr long long kIntMax = std::numeric_limits<int>::max();
  const long long G = in.bits.shape[1], Tq = p.Tq(), Tk = p.Tk(), W = in.bits.shape[3], Kmax = out.idx.shape[3];
  const long long rows = p.B * G * Tq;
  detail::require(Kmax <= kIntMax, op, "out.idx",
                  [&] { return "capacity Kmax = " + std::to_string(Kmax) + " exceeds the 32-bit range"; });
  // Row numbers travel in the fault word: above a stray bit's 5-bit index, or above a row's 31-bit count.
  detail::require(Tk < kIntMax && rows < (1LL << 32), op, "p",
                  [&] { return "too large for the CUDA conversion: " + p.describe(); });
  if (options.trusted)
    detail::require(Kmax >= Tk, op, "out.idx", [&] {
      return "trusted conversion needs room for every block of a tile, Tk = " + std::to_string(Tk) +
             " ids, but Kmax is " + std::to_string(Kmax) +
             " (without options.trusted the capacity is checked against the actual bit sets)";
    });
  cuda_kernels::DeviceGuard guard(in.bits.device_index, op);
  const auto stream = static_cast<cudaStream_t>(options.stream);

  cv::BitsParams prm;
  prm.bits = static_cast<const std::uint32_t*>(in.bits.data);
  prm.out_idx = static_cast<std::int32_t*>(out.idx.data);
  prm.out_cnt = static_cast<std::int32_t*>(out.cnt.data);
  for (int k = 0; k < 4; ++k) prm.bits_stride[k] = in.bits.stride[k];
  for (int k = 0; k < 3; ++k) {
    prm.out_stride[k] = out.idx.stride[k];
    prm.cnt_stride[k] = out.cnt.stride[k];
  }
  prm.rows = rows;
  prm.G = static_cast<int>(G);
  prm.Tq = static_cast<int>(Tq);
  prm.W = static_cast<int>(W);
  prm.Tk = static_cast<int>(Tk);
  prm.Kmax = static_cast<int>(Kmax);

  const unsigned long long f = cuda_kernels::launch_checked_unless(
      options.trusted, prm.fault, in.bits.device_index, stream, op, [&] {
        if (rows == 0) return;
        cv::bits_kernel<<<cv::warp_per_row_ctas(rows, cv::kBitsThreads), cv::kBitsThreads, 0, stream>>>(prm);
        cuda_kernels::check_cuda(cudaGetLastError(), op, "conversion launch");
      });
  if (f == cuda_kernels::kNoFault) return;
  const bool capacity = (f & cv::kOverCapacity) != 0;
  const long long r = static_cast<long long>(capacity ? (f & ~cv::kOverCapacity) >> cv::kCountBits : f >> 5);
  const auto [b, g, t] = cv::row_coord(r, G, Tq);
  if (capacity)
    throw Error(op, "out.idx", detail::over_capacity_message("the bit set", b, g, t,
                                                            static_cast<long long>(f & ((1ull << cv::kCountBits) - 1)),
                                                            Kmax));
  throw Error(op, in_name + ".bits", detail::stray_bit_message(static_cast<int>(f & 31u), W, b, g, t, Tk));
}

}  // namespace sparse_attn::cuda_backend
