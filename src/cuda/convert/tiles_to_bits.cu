// TileLists -> BlockBits on the GPU (backend.hpp describes the kernel). The output equals the CPU
// function's (src/convert/convert.cpp) word for word; so do the errors: the kernel keeps the first faulty
// tile in the fault word and the host reads that tile back and reports it with the CPU's message
// (detail::tile_row_message).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/fault_word.hpp"
#include "cuda/convert/backend.hpp"
#include "cuda/convert/rows.hpp"

namespace sparse_attn::cuda_kernels::convert {

constexpr int kTileBitsThreads = 256;  // 8 tiles per CTA, one warp each

struct TileBitsParams {
  const std::int32_t* idx = nullptr;  // [B, G, Tq, Kmax]
  long long idx_stride[4] = {};
  const std::int32_t* cnt = nullptr;  // [B, G, Tq]
  long long cnt_stride[3] = {};
  std::uint32_t* bits = nullptr;      // [B, G, Tq, W], words contiguous
  long long bits_stride[3] = {};
  long long rows = 0;                 // B * G * Tq
  int G = 0, Tq = 0, W = 0, Tk = 0, Kmax = 0;
  unsigned long long* fault = nullptr;  // nullptr: trusted, nothing is checked
};

// One warp per tile: the lanes zero the tile's words, then each sets the bits of its ids (global
// atomics on words of its own tile). Checked tiles: a count outside [0, Kmax], an id outside [0, Tk) or
// an id not above the one before it marks the tile (its row number) in the fault word. Trusted tiles:
// the count is clamped to [0, Kmax] and ids outside [0, Tk) are dropped, so nothing is written out of
// bounds.
__global__ void __launch_bounds__(kTileBitsThreads) tile_bits_kernel(const __grid_constant__ TileBitsParams p) {
  const int lane = threadIdx.x & 31;
  const long long warps = static_cast<long long>(gridDim.x) * (kTileBitsThreads / 32);
  for (long long r = blockIdx.x * static_cast<long long>(kTileBitsThreads / 32) + threadIdx.x / 32; r < p.rows;
       r += warps) {
    const long long t = r % p.Tq, g = r / p.Tq % p.G, b = r / (static_cast<long long>(p.Tq) * p.G);
    std::uint32_t* words = p.bits + b * p.bits_stride[0] + g * p.bits_stride[1] + t * p.bits_stride[2];
    const std::int32_t* ids = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + t * p.idx_stride[2];
    for (int w = lane; w < p.W; w += 32) words[w] = 0u;
    __syncwarp();
    const int c = p.cnt[b * p.cnt_stride[0] + g * p.cnt_stride[1] + t * p.cnt_stride[2]];
    bool bad = c < 0 || c > p.Kmax;
    const int n = min(max(c, 0), p.Kmax);
    for (int k = lane; k < n; k += 32) {
      const int id = ids[static_cast<long long>(k) * p.idx_stride[3]];
      const bool in_range = id >= 0 && id < p.Tk;
      if (in_range) atomicOr(&words[id >> 5], 1u << (id & 31));
      if (!in_range || (k > 0 && id <= ids[static_cast<long long>(k - 1) * p.idx_stride[3]])) bad = true;
    }
    if (__any_sync(0xffffffffu, bad) && lane == 0 && p.fault != nullptr)
      atomicMin(p.fault, static_cast<unsigned long long>(r));
  }
}

}  // namespace sparse_attn::cuda_kernels::convert

namespace sparse_attn::cuda_backend {

void tile_lists_to_block_bits(const TileLists& in, const BlockBits& out, const ProblemShape& p,
                              const ConvertOptions& options) {
  namespace cv = cuda_kernels::convert;
  const std::string op = "tile_lists_to_block_bits";
  constexpr long long kIntMax = std::numeric_limits<int>::max();
  const long long G = in.idx.shape[1], Tq = p.Tq(), Kmax = in.idx.shape[3];
  const long long rows = p.B * G * Tq;
  detail::require(Kmax <= kIntMax, op, "in.idx",
                  [&] { return "capacity Kmax = " + std::to_string(Kmax) + " exceeds the 32-bit range"; });
  detail::require(p.Tk() < kIntMax && rows < (1LL << 62), op, "p",
                  [&] { return "too large for the CUDA conversion: " + p.describe(); });
  cuda_kernels::DeviceGuard guard(in.idx.device_index, op);
  const auto stream = static_cast<cudaStream_t>(options.stream);

  cv::TileBitsParams prm;
  prm.idx = static_cast<const std::int32_t*>(in.idx.data);
  prm.cnt = static_cast<const std::int32_t*>(in.cnt.data);
  prm.bits = static_cast<std::uint32_t*>(out.bits.data);
  for (int k = 0; k < 4; ++k) prm.idx_stride[k] = in.idx.stride[k];
  for (int k = 0; k < 3; ++k) {
    prm.cnt_stride[k] = in.cnt.stride[k];
    prm.bits_stride[k] = out.bits.stride[k];
  }
  prm.rows = rows;
  prm.G = static_cast<int>(G);
  prm.Tq = static_cast<int>(Tq);
  prm.W = static_cast<int>(out.bits.shape[3]);
  prm.Tk = static_cast<int>(p.Tk());
  prm.Kmax = static_cast<int>(Kmax);

  const unsigned long long f = cuda_kernels::launch_checked_unless(
      options.trusted, prm.fault, in.idx.device_index, stream, op, [&] {
        if (rows == 0) return;
        cv::tile_bits_kernel<<<cv::warp_per_row_ctas(rows, cv::kTileBitsThreads), cv::kTileBitsThreads, 0, stream>>>(prm);
        cuda_kernels::check_cuda(cudaGetLastError(), op, "conversion launch");
      });
  if (f == cuda_kernels::kNoFault) return;
  // The faulty tile, read back and reported as the CPU reports it.
  const auto [b, g, t] = cv::row_coord(static_cast<long long>(f), G, Tq);
  const std::int32_t c = cuda_kernels::read_back(
      prm.cnt + b * prm.cnt_stride[0] + g * prm.cnt_stride[1] + t * prm.cnt_stride[2], stream, op);
  const std::vector<std::int32_t> ids = cuda_kernels::read_back_row(
      prm.idx + b * prm.idx_stride[0] + g * prm.idx_stride[1] + t * prm.idx_stride[2], prm.idx_stride[3],
      static_cast<std::size_t>(std::clamp<long long>(c, 0, Kmax)), stream, op);
  if (auto m = detail::tile_row_message(ids.data(), 1, c, Kmax, p.Tk(), b, g, t)) throw Error(op, "in." + m->first, m->second);
  throw Error(op, "in.idx", "the device check found a fault in tile " + detail::coord_string({b, g, t}) +
                                " that the tile read back does not show");
}

}  // namespace sparse_attn::cuda_backend
