// QueryLists -> TileLists on the GPU (backend.hpp describes the kernel). The output equals the CPU
// function's (src/convert/convert.cpp) element for element: the same ids in the same ascending order,
// the same counts, -1 in every slot past the count; so do the errors, whose first offending
// coordinate is the minimum of one fault word.
//
// Versions measured on the H200 (trusted, CUDA events around back-to-back calls; tile16 64 tiles,
// query16of32 256, query-long 2048, query-long B = 4 8192, Lk = 256K Hkv = 8 512 tiles of 64 words):
//   1  one id per thread and iteration, lanes of a word merged by __match_any_sync + __reduce_or_sync,
//      one atomic per word and warp: 9.1 / 8.4 / 41.1 / 144.6 / 34.3 us. One load in flight per
//      thread: about 20 us per wave of CTAs whatever the work.
//   2  eight ids per thread loaded first, then merged as in 1: 8.5 / 7.3 / 42.1 / 140.4 / 33.8 us.
//   3  eight ids per thread loaded first, one shared atomicOr per id: 6.3 / 7.9 / 19.7 / 65.0 / 14.8 us.
//   4  eight ids loaded first, folded into per-thread words of an 8-word window of the bit set and
//      ORed across the warp by redux: 6.5 / 8.1 / 25.2 / 87.2 / 14.9 us.
// Version 3 is the one kept: the merging in 1, 2 and 4 costs more than the atomics it saves.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "core/check.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/fault_word.hpp"
#include "cuda/common/smem_limit.hpp"
#include "cuda/convert/backend.hpp"

namespace sparse_attn::cuda_kernels::convert {

// 8 warps: a tile of 128 queries x 16 slots is one round of 8 loads per thread.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Fault word layout. The first fault is the smallest word, so the classes are ordered as the CPU
// function reports them: every list fault (validation runs over all rows first) before any capacity
// fault. List fault: (row-major slot position << 1) | code. Capacity fault: bit 63, then the tile
// (row-major (b, group, Q tile)) above the union's size, which needs 25 bits for Tk <= 2^24.
constexpr unsigned long long kCapacityClass = 1ull << 63;
constexpr int kUnionBits = 25;
constexpr unsigned kBadValue = 0;  // below -1 or at or past Tk
constexpr unsigned kRepeat = 1;    // an id an earlier slot of the same query already holds

struct Params {
  const std::int32_t* idx = nullptr;  // [B, Hkv, Lq, Kq], slots contiguous
  long long idx_stride[3] = {};
  std::int32_t* out_idx = nullptr;  // [B, Hkv, Tq, Kmax], slots contiguous
  long long out_stride[3] = {};
  std::int32_t* out_cnt = nullptr;  // [B, Hkv, Tq]
  long long cnt_stride[3] = {};
  long long Lq = 0;
  int Hkv = 0, Tq = 0, Kq = 0, Tk = 0, W = 0, Kmax = 0;
  unsigned long long* fault = nullptr;  // nullptr: trusted, nothing is checked
};

// Checks slot s of a row whose id is v; records a fault in p.fault.
__device__ __forceinline__ void check_slot(const Params& p, const std::int32_t* row, int s, int v, long long r) {
  const bool valid = v >= 0 && v < p.Tk;
  bool repeat = false;
  for (int s2 = 0; s2 < s && valid && !repeat; ++s2) repeat = row[s2] == v;
  if (valid && !repeat && v != -1) return;
  if (v == -1) return;
  const unsigned long long pos = static_cast<unsigned long long>(r * p.Kq + s);
  atomicMin(p.fault, (pos << 1) | (valid ? kRepeat : kBadValue));
}

// Ids per thread loaded before any is used: eight independent loads in flight per thread keep the
// lists streaming, where one load per iteration left them at a tenth of the HBM rate.
constexpr int kPer = 8;

__global__ void __launch_bounds__(kThreads) union_kernel(const __grid_constant__ Params p) {
  extern __shared__ unsigned bits[];  // p.W words: bit j of the tile's union set iff block j is in it
  __shared__ int warp_sums[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long tile = blockIdx.x;
  const int t = static_cast<int>(tile % p.Tq);
  const long long bg = tile / p.Tq, b = bg / p.Hkv, g = bg % p.Hkv;
  for (int w = tid; w < p.W; w += kThreads) bits[w] = 0u;
  __syncthreads();

  const long long i0 = static_cast<long long>(t) * 128;
  const int nq = static_cast<int>(min(128LL, p.Lq - i0));
  const std::int32_t* rows = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + i0 * p.idx_stride[2];
  const int total = nq * p.Kq;
  // Consecutive threads take consecutive slots, so packed lists are read in full lines.
  for (int c0 = 0; c0 < total; c0 += kThreads * kPer) {
    int v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = c0 + j * kThreads + tid;
      v[j] = -1;
      if (e < total) {
        const int qi = e / p.Kq;
        v[j] = rows[qi * p.idx_stride[2] + (e - qi * p.Kq)];
      }
    }
    if (p.fault != nullptr) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int e = c0 + j * kThreads + tid;
        if (e < total) {
          const int qi = e / p.Kq;
          check_slot(p, rows + qi * p.idx_stride[2], e - qi * p.Kq, v[j], bg * p.Lq + i0 + qi);
        }
      }
    }
    // One shared atomic per id: merging the lanes of a word first (match/redux, or per-thread window
    // words ORed across the warp) measured slower (docs/notes/convert.md). Trusted lists never reach
    // outside the bit set: ids out of range are dropped here.
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (v[j] >= 0 && v[j] < p.Tk) atomicOr(&bits[v[j] >> 5], 1u << (v[j] & 31));
  }
  __syncthreads();

  // Compaction: thread k of a round takes word w0 + k; an exclusive scan of the words' popcounts over
  // the CTA gives where its ids go, so ids leave in ascending order.
  std::int32_t* out_row = p.out_idx + b * p.out_stride[0] + g * p.out_stride[1] + t * p.out_stride[2];
  int written = 0;  // ids of the union before this round (the same in every thread)
  for (int w0 = 0; w0 < p.W; w0 += kThreads) {
    const int w = w0 + tid;
    const unsigned x = w < p.W ? bits[w] : 0u;
    const int n = __popc(x);
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0, round = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      const int c = warp_sums[k];
      before += k < warp ? c : 0;
      round += c;
    }
    int pos = written + before + incl - n;
    for (unsigned y = x; y != 0u; y &= y - 1u, ++pos)
      if (pos < p.Kmax) out_row[pos] = w * 32 + __ffs(y) - 1;
    written += round;
    __syncthreads();  // warp_sums is rewritten by the next round
  }
  for (int k = written + tid; k < p.Kmax; k += kThreads) out_row[k] = -1;
  if (tid == 0) {
    p.out_cnt[b * p.cnt_stride[0] + g * p.cnt_stride[1] + t * p.cnt_stride[2]] = min(written, p.Kmax);
    if (p.fault != nullptr && written > p.Kmax)
      atomicMin(p.fault, kCapacityClass | (static_cast<unsigned long long>(tile) << kUnionBits) |
                             static_cast<unsigned long long>(written));
  }
}

}  // namespace sparse_attn::cuda_kernels::convert

namespace sparse_attn::cuda_backend {
namespace {

namespace cv = cuda_kernels::convert;
using detail::coord_string;
using detail::require;

const std::string kOp = "query_lists_to_tile_lists";

void check_cuda(cudaError_t e, const std::string& what) { cuda_kernels::check_cuda(e, kOp, what); }

struct DeviceGuard : cuda_kernels::DeviceGuard {
  explicit DeviceGuard(int device) : cuda_kernels::DeviceGuard(device, kOp) {}
};

template <class T>
T read_back(const T* ptr, cudaStream_t stream) {
  return cuda_kernels::read_back(ptr, stream, kOp);
}

// The CPU function's message for the fault `f` (formats.cpp: list_row_fault; convert.cpp: check_capacity).
[[noreturn]] void throw_fault(unsigned long long f, const cv::Params& prm, const ProblemShape& p, cudaStream_t stream) {
  if (f & cv::kCapacityClass) {
    const long long tile = static_cast<long long>((f & ~cv::kCapacityClass) >> cv::kUnionBits);
    const long long n = static_cast<long long>(f & ((1ull << cv::kUnionBits) - 1));
    const long long Tq = p.Tq();
    throw Error(kOp, "out.idx",
                detail::over_capacity_message("the union", tile / (p.Hkv * Tq), tile / Tq % p.Hkv, tile % Tq, n, prm.Kmax));
  }
  const unsigned code = static_cast<unsigned>(f & 1u);
  const long long pos = static_cast<long long>(f >> 1);
  const long long s = pos % prm.Kq, r = pos / prm.Kq;
  const long long i = r % p.Lq, bg = r / p.Lq, b = bg / p.Hkv, g = bg % p.Hkv;
  const std::int32_t v = read_back(
      prm.idx + b * prm.idx_stride[0] + g * prm.idx_stride[1] + i * prm.idx_stride[2] + s, stream);
  const std::string at = coord_string({b, g, i, s});
  if (code == cv::kRepeat) throw Error(kOp, "in.idx", "duplicate block id " + std::to_string(v) + " at " + at);
  if (v < -1)
    throw Error(kOp, "in.idx", "invalid value " + std::to_string(v) + " at " + at + " (only -1 may mark an empty slot)");
  throw Error(kOp, "in.idx", "block id " + std::to_string(v) + " at " + at + " is out of range [0, " +
                                 std::to_string(prm.Tk) + ")");
}

}  // namespace

void query_lists_to_tile_lists(const QueryLists& in, const TileLists& out, const ProblemShape& p,
                               const ConvertOptions& options) {
  constexpr long long kIntMax = std::numeric_limits<int>::max();
  const long long Kq = in.idx.shape[3], Kmax = out.idx.shape[3], Tk = p.Tk(), Tq = p.Tq();
  const long long tiles = p.B * p.Hkv * Tq;
  // A tile's slots and the chunk past them are indexed in int.
  const long long most_slots = (kIntMax - cv::kThreads * cv::kPer) / kTileQ;
  require(Kq <= most_slots, kOp, "in.idx",
          [&] { return "holds " + std::to_string(Kq) + " slots per query; the CUDA conversion takes at most " +
                                               std::to_string(most_slots); });
  require(Kmax <= kIntMax, kOp, "out.idx",
          [&] { return "capacity Kmax = " + std::to_string(Kmax) + " exceeds the 32-bit range"; });
  require(p.Lk <= kIntMax && tiles <= kIntMax && p.B * p.Hkv * p.Lq * Kq < (1LL << 61), kOp, "p",
          [&] { return
              "too large for the CUDA conversion's 32-bit grid and ids: " + p.describe() + " with " + std::to_string(Kq) +
              " slots per query"; });
  if (options.trusted) {
    const long long most = std::min(Tk, std::min<long long>(kTileQ, p.Lq) * Kq);
    require(Kmax >= most, kOp, "out.idx",
            [&] { return "trusted conversion needs room for the largest possible union, min(Tk, min(128, Lq) * Kq) = " +
                std::to_string(most) + " ids per tile, but Kmax is " + std::to_string(Kmax) +
                " (without options.trusted the capacity is checked against the actual unions)"; });
  }
  DeviceGuard guard(in.idx.device_index);
  const auto stream = static_cast<cudaStream_t>(options.stream);

  cv::Params prm;
  prm.idx = static_cast<const std::int32_t*>(in.idx.data);
  prm.out_idx = static_cast<std::int32_t*>(out.idx.data);
  prm.out_cnt = static_cast<std::int32_t*>(out.cnt.data);
  for (int k = 0; k < 3; ++k) {
    prm.idx_stride[k] = in.idx.stride[k];
    prm.out_stride[k] = out.idx.stride[k];
    prm.cnt_stride[k] = out.cnt.stride[k];
  }
  prm.Lq = p.Lq;
  prm.Hkv = static_cast<int>(p.Hkv);
  prm.Tq = static_cast<int>(Tq);
  prm.Kq = static_cast<int>(Kq);
  prm.Tk = static_cast<int>(Tk);
  prm.W = static_cast<int>(ceil_div(Tk, 32));
  prm.Kmax = static_cast<int>(Kmax);

  const std::size_t smem = static_cast<std::size_t>(prm.W) * sizeof(unsigned);
  constexpr std::size_t kDefaultSmem = 48 * 1024;
  if (smem > kDefaultSmem) {
    int optin = 0;
    check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, in.idx.device_index),
               "cudaDeviceGetAttribute");
    const std::size_t room = static_cast<std::size_t>(optin) - sizeof(int) * cv::kWarps;
    require(smem <= room, kOp, "p",
            [&] { return "Lk = " + std::to_string(p.Lk) + " (" + std::to_string(Tk) + " blocks) needs a bit set of " +
                std::to_string(smem) + " bytes per Q tile, more than the " + std::to_string(room) +
                " bytes of shared memory a CTA of this device can have"; });
  }

  const unsigned long long f = cuda_kernels::launch_checked_unless(
      options.trusted, prm.fault, in.idx.device_index, stream, kOp, [&] {
        check_cuda(cuda_kernels::launch_with_smem(
                       cv::union_kernel, smem,
                       [&] { cv::union_kernel<<<static_cast<unsigned>(tiles), cv::kThreads, smem, stream>>>(prm); }),
                   "conversion launch");
      });
  if (f != cuda_kernels::kNoFault) throw_fault(f, prm, p, stream);
}

}  // namespace sparse_attn::cuda_backend
