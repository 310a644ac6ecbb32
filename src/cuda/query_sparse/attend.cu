// Phase 2 of query_sparse: per-block attention over gathered rows (combine.cu is phase 3).
//
// Persistent CTAs on Hopper, one per SM. A work item is (KV block, up to kRowsPerItem gathered
// (query, head) rows of it). Per CTA:
//  - one thread of the producer warpgroup loads each item's K and V block by TMA into a two-slot ring (128B-swizzled,
//    128 keys x D, rows past Lk read as zero), so the next item's K/V land while this one runs;
//  - kAttendConsumers consumer warpgroups take the item's 64-row tiles in turn (warpgroup c: tiles
//    c, c + kAttendConsumers, ...). A warpgroup gathers its tile's Q rows with cp.async into a
//    128B-swizzled buffer (the layout TMA would write, so the wgmma descriptors are the Q-centric
//    kernel's), computes S = Q K^T (SS wgmma), the softmax of the single block (no running max:
//    a partial covers exactly one block), O = P V with P from registers (RS wgmma), and writes the
//    normalised partial and its LSE. The gather of its next tile is in flight meanwhile.
// Every row is computed by the same instructions wherever it lands in a tile, so partials (and the
// combine's output) are bitwise identical run to run although the CSR order inside a block is not.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/common/wgmma.cuh"
#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/partials.cuh"

namespace sparse_attn::cuda_kernels::qs {
namespace {

constexpr int kTileRowsQ = 64;  // rows of one consumer tile (one m64 wgmma row block)
// Consumer warpgroups + one producer warpgroup (a whole one, so that register reallocation, which works
// per warpgroup, can hand its registers to the consumers): 3 x 128 x 160 + 128 x 24 <= 65536, or with
// two consumers 2 x 128 x 240 + 128 x 24.
template <int kConsumers>
struct Roles {
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr std::uint32_t kConsumerRegs = kConsumers == 3 ? 160 : 240;
  static constexpr std::uint32_t kProducerRegs = 24;
};
constexpr int kKvStages = 2;
constexpr int kQBuffers = 2;  // per consumer: the tile being computed and the next one's gather
constexpr std::uint32_t kKvHalfBytes = kKeys * 128;       // 128 keys x 64 columns of 16-bit
constexpr std::uint32_t kQHalfBytes = kTileRowsQ * 128;   // 64 rows x 64 columns of 16-bit
static_assert(kRowsPerItem % (kTileRowsQ * 2) == 0 && kRowsPerItem % (kTileRowsQ * 3) == 0,
              "an item is whole rounds of tiles");

// Named barriers of this kernel: one per consumer warpgroup (its gather has landed for all 128
// threads). Ids 1.. are free here: the Q-centric kernel's turn barriers live in another kernel.
__device__ __forceinline__ void consumer_barrier(int consumer) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + consumer) : "memory");
}

template <int D, int C>
struct alignas(1024) AttendSmem {
  static constexpr int kHalves = D / 64;
  std::uint16_t k[kKvStages][kHalves][kKeys][64];
  std::uint16_t v[kKvStages][kHalves][kKeys][64];
  std::uint16_t q[C][kQBuffers][kHalves][kTileRowsQ][64];
  MBarrier kv_full[kKvStages], kv_empty[kKvStages];
};

template <int D, int C>
constexpr std::size_t attend_smem_bytes() {
  return sizeof(AttendSmem<D, C>) + 1024;  // + alignment slack of the dynamic shared base
}

struct ItemInfo {
  int b = 0, g = 0, bg = 0;
  int j = 0;      // KV block
  int e0 = 0;     // first CSR entry of the block
  int y = 0;      // first row of the item inside the block's rows
  int nrows = 0;  // rows of the item
};

// 32-bit arithmetic throughout: check_shape bounds B * Hkv * Tk and every CSR position by INT_MAX, and
// a 64-bit division is a long subroutine (registers the producer warpgroup does not have).
__device__ __forceinline__ ItemInfo item_info(const Params& p, int item) {
  const int2 it = p.items[item];
  ItemInfo f;
  const int x = it.x;
  f.bg = x / p.Tk;
  f.b = f.bg / p.Hkv;
  f.g = f.bg - f.b * p.Hkv;
  f.j = x - f.bg * p.Tk;
  f.e0 = p.offsets[x];
  f.y = it.y;
  const int rows = (p.offsets[x + 1] - f.e0) * p.group - it.y;
  f.nrows = rows < kRowsPerItem ? rows : kRowsPerItem;
  return f;
}

// A consumer warpgroup's position: its tile `tile` of work item `item` (item >= n_items: done).
struct Cursor {
  int item = 0;
  int tile = 0;
  ItemInfo f;
};

// The first item from `item` on (stepping by gridDim.x) that has a tile for warpgroup `consumer`.
template <int C>
__device__ __forceinline__ Cursor seek(const Params& p, int item, int consumer, int n_items) {
  Cursor c;
  c.tile = consumer;
  for (; item < n_items; item += gridDim.x) {
    c.f = item_info(p, item);
    if (consumer * kTileRowsQ < c.f.nrows) break;
  }
  c.item = item;
  return c;
}

__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Q rows [tile * 64, tile * 64 + 64) of an item into a swizzled buffer: 16-byte chunk c of row r goes
// to half c / 8, position (c % 8) ^ (r % 8) of the row's 128 bytes (TMA's SWIZZLE_128B pattern on a
// 1024-aligned base). Rows past the item are zero-filled (src-size 0).
template <int D>
__device__ __forceinline__ void gather_q(const Params& p, const ItemInfo& f, int tile, std::uint32_t buf, int t) {
  constexpr int kChunks = D / 8;
  const auto* q = static_cast<const std::uint16_t*>(p.q);
#pragma unroll
  for (int k = 0; k < kTileRowsQ * kChunks / 128; ++k) {
    const int c = t + 128 * k;
    const int r = c / kChunks, cc = c % kChunks;
    const int row = tile * kTileRowsQ + r;
    const std::uint16_t* src = q;
    int bytes = 0;
    if (row < f.nrows) {
      const int flat = f.y + row;
      const int ent = p.entries[f.e0 + flat / p.group];
      const int qi = ent / p.Kq;
      const int h = f.g * p.group + flat % p.group;
      src = q + f.b * p.q_stride[0] + qi * p.q_stride[1] + h * p.q_stride[2] + cc * 8;
      bytes = 16;
    }
    const std::uint32_t dst = buf + (cc / 8) * kQHalfBytes + r * 128 + (((cc % 8) ^ (r % 8)) * 16);
    cp_async16(dst, src, bytes);
  }
  cp_async_commit();
}

template <class Tag, int D>
__device__ __forceinline__ void issue_qk(float (&acc_s)[64], std::uint32_t s_q, std::uint32_t s_k) {
  wgmma_ss_first<Tag>(acc_s, make_desc_sw128(s_q, 16, 1024), make_desc_sw128(s_k, 16, 1024));
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk)
    wgmma_ss<Tag>(acc_s, make_desc_sw128(s_q + (kk / 4) * kQHalfBytes + (kk % 4) * 32, 16, 1024),
                  make_desc_sw128(s_k + (kk / 4) * kKvHalfBytes + (kk % 4) * 32, 16, 1024), 1);
  wgmma_commit();
}

template <class Tag, int N>
__device__ __forceinline__ void issue_pv(float (&acc_o)[N], const std::uint32_t (&pa)[8][4], std::uint32_t s_v) {
  wgmma_rs_tb_first<Tag, N>(acc_o, pa[0], make_desc_sw128(s_v, kKvHalfBytes, 1024));
#pragma unroll
  for (int kk = 1; kk < 8; ++kk)
    wgmma_rs_tb<Tag>(acc_o, pa[kk], make_desc_sw128(s_v + kk * 16 * 128, kKvHalfBytes, 1024), 1);
  wgmma_commit();
}

__device__ __forceinline__ void keep_live(std::uint32_t (&pa)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(pa[kk][r])::"memory");
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// What a consumer needs of one of its rows: the partial's element offset (-1: a padding row) and the
// last visible key relative to the block (-1: none).
struct RowOut {
  long long base = -1;
  long long lim = -1;
};

__device__ __forceinline__ RowOut row_out(const Params& p, const ItemInfo& f, int row) {
  RowOut o;
  if (row >= f.nrows) return o;
  const int flat = f.y + row;
  const int ent = p.entries[f.e0 + flat / p.group];
  const int qi = ent / p.Kq;
  o.base = (static_cast<long long>(f.bg) * p.Lq * p.Kq + ent) * p.group + flat % p.group;
  long long lim = p.Lk - 1;
  if (p.causal && qi + p.offset < lim) lim = qi + p.offset;
  o.lim = lim - static_cast<long long>(f.j) * kKeys;
  return o;
}

template <class Tag, int D, class Part, int C>
__global__ void __launch_bounds__(Roles<C>::kThreads, 1)
    attend_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap tm_k,
                  const __grid_constant__ CUtensorMap tm_v) {
  constexpr int kHalves = D / 64;
  extern __shared__ std::uint8_t smem_raw[];
  using R = Roles<C>;
  auto& sm = *reinterpret_cast<AttendSmem<D, C>*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~static_cast<std::uintptr_t>(1023));
  const int tid = threadIdx.x;
  const int n_items = p.item_offsets[p.nblk];

  if (tid == 0) {
    for (int s = 0; s < kKvStages; ++s) {
      sm.kv_full[s].init(1);
      sm.kv_empty[s].init(128 * C);  // every consumer thread arrives
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (tid >= 128 * C) {  // producer warpgroup: one thread issues the TMA loads
    warpgroup_reg_dealloc<R::kProducerRegs>();
    if (tid == 128 * C) {
      tma_prefetch_descriptor(&tm_k);
      tma_prefetch_descriptor(&tm_v);
      PipelineState<kKvStages> st;
      for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
        const ItemInfo f = item_info(p, item);
        const int s = st.stage();
        sm.kv_empty[s].wait(st.phase() ^ 1u);
        sm.kv_full[s].arrive_expect_tx(2u * kHalves * kKvHalfBytes);
        for (int half = 0; half < kHalves; ++half) {
          tma_load_bhld(&sm.k[s][half][0][0], &tm_k, 64 * half, static_cast<int>(f.g), f.j * kKeys,
                        static_cast<int>(f.b), &sm.kv_full[s].word);
          tma_load_bhld(&sm.v[s][half][0][0], &tm_v, 64 * half, static_cast<int>(f.g), f.j * kKeys,
                        static_cast<int>(f.b), &sm.kv_full[s].word);
        }
        st.advance();
      }
    }
    return;
  }

  warpgroup_reg_alloc<R::kConsumerRegs>();
  const int consumer = tid / 128, t = tid % 128;
  const int warp = t / 32, g8 = (t % 32) / 4, q4 = t % 4;
  const std::uint32_t q_base = static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.q[consumer][0][0][0][0]));
  constexpr std::uint32_t kQBufBytes = kHalves * kQHalfBytes;

  PipelineState<kKvStages> st;
  int released = blockIdx.x;  // the first item whose K/V slot this warpgroup has not released yet
  Cursor cur = seek<C>(p, blockIdx.x, consumer, n_items);
  int buf = 0;
  if (cur.item < n_items) gather_q<D>(p, cur.f, cur.tile, q_base, t);

  while (cur.item < n_items) {
    // Items before this one that had no tile for this warpgroup still pass through the K/V ring: it
    // waits for their K/V (which keeps its arrivals on the empty barrier in item order) and releases
    // them at once.
    for (; released < cur.item; released += gridDim.x) {
      sm.kv_full[st.stage()].wait(st.phase());
      sm.kv_empty[st.stage()].arrive();
      st.advance();
    }
    const ItemInfo& f = cur.f;
    const int tile = cur.tile;
    // Next tile of this warpgroup, possibly in a later item.
    Cursor next = cur;
    next.tile += C;
    if (next.tile * kTileRowsQ >= f.nrows) next = seek<C>(p, cur.item + gridDim.x, consumer, n_items);

    cp_async_wait<0>();
    fence_async_shared();
    consumer_barrier(consumer);  // every thread's rows of this tile have landed; the other buffer is free
    if (next.item < n_items) gather_q<D>(p, next.f, next.tile, q_base + (buf ^ 1) * kQBufBytes, t);

    const int s = st.stage();
    sm.kv_full[s].wait(st.phase());
    const std::uint32_t s_q = q_base + buf * kQBufBytes;
    const std::uint32_t s_k = static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.k[s][0][0][0]));
    const std::uint32_t s_v = static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.v[s][0][0][0]));
    float acc_s[64];  // written by the first k-step (wgmma_ss_first): live only inside this tile
    wgmma_fence();
    issue_qk<Tag, D>(acc_s, s_q, s_k);
    wgmma_wait<0>();
    fence_operands(acc_s);

    const int r0 = tile * kTileRowsQ + 16 * warp + g8;
    const RowOut ro[2] = {row_out(p, f, r0), row_out(p, f, r0 + 8)};
    float m[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = 8 * i + 2 * q4 + (j % 2);
        if (col > ro[j / 2].lim) acc_s[4 * i + j] = -INFINITY;
        m[j / 2] = fmaxf(m[j / 2], acc_s[4 * i + j]);
      }
    float base[2], l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
      m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
      base[r] = m[r] == -INFINITY ? 0.0f : m[r] * p.scale_log2;  // no visible key: p = 0, not NaN
    }
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float e = exp2_approx(fmaf(acc_s[4 * i + j], p.scale_log2, -base[j / 2]));
        acc_s[4 * i + j] = e;
        l[j / 2] += e;
      }
    std::uint32_t pa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = Tag::pack(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);

    float acc_o[D / 2];
    wgmma_fence();
    issue_pv<Tag>(acc_o, pa, s_v);
    wgmma_wait<0>();
    fence_operands(acc_o);
    keep_live(pa);

    // The last tile of this warpgroup in the item releases the K/V slot.
    const bool last_of_item = (tile + C) * kTileRowsQ >= f.nrows;
    if (last_of_item) {
      sm.kv_empty[s].arrive();
      st.advance();
      released = cur.item + gridDim.x;
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (ro[r].base < 0) continue;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      typename Part::Elem* dst = static_cast<typename Part::Elem*>(p.part) + ro[r].base * D + 2 * q4;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) Part::put2(dst + 8 * i, acc_o[4 * i + 2 * r] * inv, acc_o[4 * i + 2 * r + 1] * inv);
      if (q4 == 0) p.lse_part[ro[r].base] = l[r] > 0.0f ? m[r] * p.scale + logf(l[r]) : -INFINITY;
    }

    cur = next;
    buf ^= 1;
  }
  for (; released < n_items; released += gridDim.x) {
    sm.kv_full[st.stage()].wait(st.phase());
    sm.kv_empty[st.stage()].arrive();
    st.advance();
  }
  cp_async_wait<0>();
}

template <class T>
struct TagOf;
template <>
struct TagOf<Bf16> {
  using type = Bf16Tag;
};
template <>
struct TagOf<F16> {
  using type = F16Tag;
};

template <class T, int D, class Part, int C>
cudaError_t attend(const Params& p, const CUtensorMap* tm_k, const CUtensorMap* tm_v, int sms, long long max_items,
                   cudaStream_t stream) {
  auto* kernel = attend_kernel<typename TagOf<T>::type, D, Part, C>;
  constexpr std::size_t smem = attend_smem_bytes<D, C>();
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const long long grid = max_items < sms ? max_items : sms;
  kernel<<<static_cast<unsigned>(grid), Roles<C>::kThreads, smem, stream>>>(p, *tm_k, *tm_v);
  return cudaGetLastError();
}

template <class T, int D, class Part>
struct AttendOp {
  static cudaError_t run(const Params& p, const CUtensorMap* tm_k, const CUtensorMap* tm_v, int sms,
                         long long max_items, cudaStream_t stream) {
    return attend<T, D, Part, kAttendConsumers>(p, tm_k, tm_v, sms, max_items, stream);
  }
};

}  // namespace

std::size_t attend_smem(int D) {
  return D == 128 ? attend_smem_bytes<128, kAttendConsumers>() : attend_smem_bytes<64, kAttendConsumers>();
}

cudaError_t launch_attend(const Params& p, bool bf16, int D, bool bf16_partials, const CUtensorMap* tm_k,
                          const CUtensorMap* tm_v, int sms, long long max_items, cudaStream_t stream) {
  if (max_items <= 0) return cudaSuccess;
  return dispatch<AttendOp>(bf16, D, bf16_partials, p, tm_k, tm_v, sms, max_items, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
