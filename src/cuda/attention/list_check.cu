// The validated tile_sparse call's list check (list_check.hpp). One warp per list reads its ids 32 at a
// time; the first broken rule in slot order is found with one ballot per chunk, with the same kind,
// slot and values as the CPU's sequential scan (a slot's range is checked before its order, against
// the id before it, which passed both checks). The check reads only the lists, which the attention
// before it also only reads, so it runs before pdl_wait; the NaN rows are written after it.
//
// The attention kernel calls pdl_launch_dependents as it starts, so this grid is launched while the
// attention runs and its CTAs take the SMs the attention leaves: its cost on a valid selection is a
// launch that overlaps the attention's tail.
#include "cuda/attention/list_check.hpp"

#include <cstdint>

#include "cuda/common/fault_word.hpp"
#include "cuda/common/pdl.cuh"

namespace sparse_attn::cuda_kernels {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr std::uint16_t kNaN16 = 0x7fff;  // NaN in bf16 and in f16

struct Found {
  ListFault kind = ListFault::kNone;
  int slot = 0, value = 0, prev = 0;
};

__device__ Found check_list(const TileAttentionParams& p, const std::int32_t* list, std::int64_t stride, int c,
                            int lane) {
  if (c < 0 || c > p.Kmax) return {ListFault::kCount, -1, c, -1};
  int prev_chunk = -1;  // the last id of the previous chunk (all of whose slots passed)
  for (int s0 = 0; s0 < c; s0 += 32) {
    const int s = s0 + lane;
    const bool in = s < c;
    const int j = in ? __ldg(list + s * stride) : 0;
    int before = __shfl_up_sync(0xffffffffu, j, 1);
    if (lane == 0) before = prev_chunk;
    const bool range_bad = in && (j < 0 || j >= p.Tk);
    const bool order_bad = in && !range_bad && j <= before;
    const unsigned bad = __ballot_sync(0xffffffffu, range_bad || order_bad);
    if (bad != 0) {
      const int first = __ffs(bad) - 1;
      const int fj = __shfl_sync(0xffffffffu, j, first);
      const int fbefore = __shfl_sync(0xffffffffu, before, first);
      const bool frange = __shfl_sync(0xffffffffu, range_bad, first);
      return frange ? Found{ListFault::kRange, s0 + first, fj, fbefore} : Found{ListFault::kOrder, s0 + first, fj, fbefore};
    }
    prev_chunk = __shfl_sync(0xffffffffu, j, 31);
  }
  return {};
}

__global__ void __launch_bounds__(kWarpsPerCta * 32)
    list_check_kernel(const __grid_constant__ TileAttentionParams p, int head_dim, int lists) {
  const int list_id = static_cast<int>(blockIdx.x) * kWarpsPerCta + static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int G = p.Hq / p.heads_per_list;
  Found f;
  int b = 0, g = 0, t = 0;
  if (list_id < lists) {
    t = list_id % p.Tq;
    g = (list_id / p.Tq) % G;
    b = list_id / (p.Tq * G);
    const std::int32_t* list = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + t * p.idx_stride[2];
    const int c = __ldg(p.cnt + b * p.cnt_stride[0] + g * p.cnt_stride[1] + t * p.cnt_stride[2]);
    f = check_list(p, list, p.idx_stride[3], c, lane);
  }
  const bool faulty = f.kind != ListFault::kNone;
  if (faulty && lane == 0) {
    // Ordered as the CPU scans: tile (b, g, t) row-major, its count before its slots.
    const unsigned long long tile = (static_cast<unsigned long long>(b) * G + g) * p.Tq + t;
    const unsigned long long position = tile * (static_cast<unsigned long long>(p.Kmax) + 1) + (f.slot + 1);
    record_list_fault(FaultSink{p.fault, p.fault_flag},
                      DeviceFault{(position << 2) | static_cast<unsigned>(f.kind), 0, f.kind, b, g, t, f.slot, f.value,
                                  f.prev, p.Kmax, p.Tk});
  }
  pdl_wait();  // the attention has written out and lse
  if (!faulty) return;
  const int row0 = t * 128, rows = min(128, p.Lq - row0);
  const int words = head_dim / 2;  // pairs of 2-byte elements per (row, head); out is 4-byte aligned
  const int per_row = p.heads_per_list * words;
  for (int i = lane; i < rows * per_row; i += 32) {
    const int r = i / per_row, h = g * p.heads_per_list + (i % per_row) / words, w = i % words;
    auto* dst = static_cast<std::uint16_t*>(p.out) + b * p.out_stride[0] + static_cast<std::int64_t>(row0 + r) * p.out_stride[1] +
                h * p.out_stride[2] + 2 * w;
    *reinterpret_cast<std::uint32_t*>(dst) = (static_cast<std::uint32_t>(kNaN16) << 16) | kNaN16;
  }
  if (p.lse != nullptr)
    for (int i = lane; i < rows * p.heads_per_list; i += 32) {
      const int r = i / p.heads_per_list, h = g * p.heads_per_list + i % p.heads_per_list;
      p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + static_cast<std::int64_t>(row0 + r) * p.lse_stride[2]] =
          __int_as_float(0x7fffffff);
    }
}

}  // namespace

cudaError_t launch_list_check(const TileAttentionParams& p, int head_dim, cudaStream_t stream) {
  const int lists = p.B * (p.Hq / p.heads_per_list) * p.Tq;
  if (lists == 0) return cudaSuccess;
  const int ctas = (lists + kWarpsPerCta - 1) / kWarpsPerCta;
  return launch_programmatic(list_check_kernel, dim3(ctas), dim3(kWarpsPerCta * 32), 0, stream, true, p, head_dim,
                             lists);
}

}  // namespace sparse_attn::cuda_kernels
