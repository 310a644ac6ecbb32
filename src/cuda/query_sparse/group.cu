// Group-centric query_sparse (the group-centric data loading of Native Sparse Attention): the heads
// of one query's GQA group share its list, so they are the rows of one m16 MMA tile and every K/V
// block a CTA loads serves all of them. No partials, no workspace, no combine (kernels.cuh gives the
// CTA and warp roles).
//
// One CTA, 16 warps:
//   1. union of its queries' visible ids: a bitmap over the Tk blocks in shared memory, its prefix
//      popcounts give each id's position in the ascending union, and a per-position mask says which
//      of the CTA's queries chose it;
//   2. the union streams through a ring of K/V stages in ascending block order;
//   3. each warp runs the online softmax (common/online_softmax.cuh) over the streamed blocks its
//      query selected, in 64-key halves, S and O in registers, Q and the K/V fragments by ldmatrix;
//   4. out (normalised, 16-bit) and LSE (natural log, scale included) straight to global memory.
// The ring: one TMA load pair per block into 128B-swizzled stages, one mbarrier per union position
// (each used once, so no phase can alias), and the last warp to finish a block refills its stage with
// the block S positions later; warps that did not choose a block never wait for it.
// docs/notes/query_group.md records the two rings measured against it and removed (a lockstep
// cp.async ring, and this ring with half-block units).
// A query's blocks are visited in ascending order by the same instructions in any CTA, so results are
// bitwise identical run to run.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/atomic>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/smem_limit.hpp"
#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"

namespace sparse_attn::cuda_kernels::qs {
namespace {

// ---- shared memory -------------------------------------------------------------------------------

// Q rows of every warp carry kPad halves of padding so that the 8 row addresses of one ldmatrix
// phase fall on distinct 16-byte bank groups.
template <int D>
struct QSmem {
  static constexpr int kStride = D + kPad;
  static constexpr std::size_t kTileHalves = 16 * kStride;  // one warp's Q rows
  static constexpr std::size_t kBytes = 2 * kGroupWarps * kTileHalves;
};

// Union metadata after the K/V stages: the mbarriers (8 bytes per union position) first, for their
// alignment, then bitmap and its prefix (words each), union ids, query masks and the consumers left per
// position (union_cap each), 4 bytes per entry.
struct MetaSmem {
  static std::size_t bytes(int words, int union_cap) {
    return 8 * static_cast<std::size_t>(union_cap) +
           4 * (2 * static_cast<std::size_t>(words) + 3 * static_cast<std::size_t>(union_cap));
  }
};

// TMA boxes of 128 keys x 64 columns, 128B-swizzled (16 KB, 1024-byte aligned); a stage holds K
// then V, D / 64 boxes each. D = 128: Q (68 KB) + 2 stages (128 KB); D = 64: 5 stages of 32 KB, the
// deeper ring letting warps drift further apart.
template <int D>
struct TmaSmem {
  static constexpr int kStages = D == 128 ? 2 : 5;
  static constexpr std::size_t kBox = kKeys * 128;  // bytes of one 128 x 64 box
  static constexpr std::size_t kHalf = (D / 64) * kBox;  // K or V of one block
  static constexpr std::size_t kStage = 2 * kHalf;
  static constexpr std::size_t kStages0 = (QSmem<D>::kBytes + 1023) / 1024 * 1024;
  static constexpr std::size_t kMeta = kStages0 + kStages * kStage;
  // + 1024: the dynamic window is only guaranteed 16-byte aligned; the kernel rounds its base up.
  static std::size_t bytes(int words, int union_cap) { return 1024 + kMeta + MetaSmem::bytes(words, union_cap); }
};

// ---- union of a CTA's lists ------------------------------------------------------------------------

struct Union {
  unsigned* bits;
  int* word_base;
  int* ids;
  unsigned* masks;
  int n = 0;
};

struct Cta {
  long long b, g;
  int i0, nq;
};

__device__ __forceinline__ Cta cta_of(const GroupParams& p) {
  const long long cta = blockIdx.x;
  const long long bg = cta / p.ctas_per_bg;
  Cta c;
  c.b = bg / p.Hkv;
  c.g = bg % p.Hkv;
  c.i0 = static_cast<int>(cta % p.ctas_per_bg) * p.cta_queries;
  c.nq = min(p.cta_queries, p.Lq - c.i0);
  return c;
}

// Builds the ascending union of the visible ids of the CTA's queries and, per union position, the
// mask of the queries that chose it. Ends with __syncthreads.
__device__ __forceinline__ void build_union(const GroupParams& p, const Cta& c, Union& un, int* s_union) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const std::int32_t* list0 = p.idx + c.b * p.idx_stride[0] + c.g * p.idx_stride[1];
  // The KV-centric `chosen`: a valid id whose block is not entirely in the query's causal future.
  auto visible = [&](int i, int j) {
    return j >= 0 && j < p.Tk && (!p.causal || static_cast<long long>(j) * kKeys <= i + p.offset);
  };
  auto list_id = [&](int e) {
    const int qq = e / p.Kq, s = e % p.Kq;
    return list0[static_cast<long long>(c.i0 + qq) * p.idx_stride[2] + static_cast<long long>(s) * p.idx_stride[3]];
  };
  for (int w = tid; w < p.words; w += kGroupThreads) un.bits[w] = 0u;
  for (int u = tid; u < p.union_cap; u += kGroupThreads) un.masks[u] = 0u;
  __syncthreads();
  const int entries = c.nq * p.Kq;
  for (int e = tid; e < entries; e += kGroupThreads) {
    const int j = list_id(e);
    if (visible(c.i0 + e / p.Kq, j)) atomicOr(un.bits + (j >> 5), 1u << (j & 31));
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int w0 = 0; w0 < p.words; w0 += 32) {
      const int w = w0 + lane;
      const int cnt = w < p.words ? __popc(un.bits[w]) : 0;
      int incl = cnt;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
      }
      if (w < p.words) un.word_base[w] = carry + incl - cnt;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) *s_union = carry;
  }
  __syncthreads();
  un.n = *s_union;
  for (int w = tid; w < p.words; w += kGroupThreads) {
    unsigned m = un.bits[w];
    int pos = un.word_base[w];
    while (m != 0u) {
      un.ids[pos++] = w * 32 + __ffs(m) - 1;
      m &= m - 1u;
    }
  }
  for (int e = tid; e < entries; e += kGroupThreads) {
    const int j = list_id(e), qq = e / p.Kq;
    if (!visible(c.i0 + qq, j)) continue;
    const int pos = un.word_base[j >> 5] + __popc(un.bits[j >> 5] & ((1u << (j & 31)) - 1u));
    atomicOr(un.masks + pos, 1u << qq);
  }
  __syncthreads();
}

// ---- one warp's work ---------------------------------------------------------------------------------

// One warp's rows: O of its 16 rows (D / 8 n-tiles) and the softmax state of rows gq and gq + 8.
template <int D>
struct WarpState {
  float acc[D / 8][4];
  RowSoftmax softmax;
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.0f;
    softmax = RowSoftmax{};
  }
};

// Keys kb .. kb + 63 of a K/V tile against the warp's 16 rows. `lim` is the last visible key
// relative to the tile (>= kb; all rows are one query, so it is warp-uniform). k_addr(key, chunk) and
// v_addr(key, chunk) give the shared address of this lane's ldmatrix row for the 8-key row group
// starting at `key` and the 16-byte column chunk `chunk`; the lane's own row offset inside the group
// is theirs to add.
template <class T, int D, class KAddr, class VAddr>
__device__ __forceinline__ void attend_half(WarpState<D>& w, std::uint32_t qa_addr, int kb, int lim, float scale_log2,
                                            KAddr k_addr, VAddr v_addr) {
  const int lane = threadIdx.x % 32, tq = lane % 4;
  float s[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll 2
  for (int ks = 0; ks < D / 16; ++ks) {
    std::uint32_t a[4];
    ldmatrix_x4(a, qa_addr + 2 * ks * 16);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      // matrices: keys +0..7 / +8..15 (lane / 16) x columns 16 ks + 0..7 / 8..15 ((lane / 8) % 2)
      std::uint32_t bk[4];
      ldmatrix_x4(bk, k_addr(kb + np * 16 + (lane / 16) * 8, 2 * ks + (lane / 8) % 2));
      mma_m16n8k16<T>(s[2 * np], a, bk[0], bk[1]);
      mma_m16n8k16<T>(s[2 * np + 1], a, bk[2], bk[3]);
    }
  }
  if (kb + 63 > lim) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (kb + nt * 8 + tq * 2 + e > lim) s[nt][e] = s[nt][2 + e] = -INFINITY;
  }
  float alpha[2];
  w.softmax.update(s, scale_log2, alpha);
  RowSoftmax::rescale(w.acc, alpha);
  std::uint32_t pa[4][4];
  pack_a<T>(s, pa);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      // matrices: keys +0..7 / +8..15 ((lane / 8) % 2) x columns 16 dp + 0..7 / 8..15 (lane / 16)
      std::uint32_t bv[4];
      ldmatrix_x4_trans(bv, v_addr(kb + kk * 16 + ((lane / 8) % 2) * 8, 2 * dp + lane / 16));
      mma_m16n8k16<T>(w.acc[2 * dp], pa[kk], bv[0], bv[1]);
      mma_m16n8k16<T>(w.acc[2 * dp + 1], pa[kk], bv[2], bv[3]);
    }
}

// One 128-key block (`lim` relative to it, >= 0): its two halves, the second only if visible.
template <class T, int D, class KAddr, class VAddr>
__device__ __forceinline__ void attend_block(WarpState<D>& w, std::uint32_t qa_addr, int lim, float scale_log2,
                                             KAddr k_addr, VAddr v_addr) {
  attend_half<T, D>(w, qa_addr, 0, lim, scale_log2, k_addr, v_addr);
  if (lim >= 64) attend_half<T, D>(w, qa_addr, 64, lim, scale_log2, k_addr, v_addr);
}

// Loads the warp's 16 Q rows (heads 16 ht .. of query i; zeros past the group) by cp.async into its
// padded tile; returns the shared address of this lane's A-fragment row.
template <int D>
__device__ __forceinline__ std::uint32_t load_q(const GroupParams& p, const Cta& c, std::uint16_t* Qs, int i, int ht) {
  constexpr int kChunks = D / 8, kStride = QSmem<D>::kStride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto* q = static_cast<const std::uint16_t*>(p.q);
  const std::uint32_t q_smem = smem_addr(Qs + warp * QSmem<D>::kTileHalves);
  for (int e = lane; e < 16 * kChunks; e += 32) {
    const int r = e / kChunks, cc = e % kChunks, hh = ht * 16 + r;
    const bool ok = hh < p.group;
    const std::uint16_t* src =
        ok ? q + c.b * p.q_stride[0] + i * p.q_stride[1] + (c.g * p.group + hh) * p.q_stride[2] + cc * 8 : q;
    cp_async16(q_smem + 2 * (r * kStride + cc * 8), src, ok ? 16 : 0);
  }
  // A fragment: rows lane % 16, column half lane / 16
  return q_smem + 2 * ((lane % 16) * kStride + (lane / 16) * 8);
}

template <class T, int D>
__device__ __forceinline__ void store_out(const GroupParams& p, const Cta& c, WarpState<D>& w, int i, int ht) {
  const int lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  w.softmax.finish();
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int hh = ht * 16 + gq + 8 * h2;
    if (hh >= p.group) continue;
    const long long h = c.g * p.group + hh;
    const float inv = w.softmax.normaliser(h2);  // no block seen: out 0
    auto* o = static_cast<std::uint16_t*>(p.out) + c.b * p.out_stride[0] + i * p.out_stride[1] + h * p.out_stride[2];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<std::uint32_t*>(o + dn * 8 + tq * 2) =
          T::pack(w.acc[dn][2 * h2] * inv, w.acc[dn][2 * h2 + 1] * inv);
    if (tq == 0 && p.lse != nullptr)
      p.lse[c.b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = w.softmax.lse(h2, p.scale);
  }
}

// Last key query i may see, relative to the block starting at key0, capped at the block's end.
__device__ __forceinline__ int block_limit(const GroupParams& p, int i, long long key0) {
  long long last = p.Lk - 1;
  if (p.causal && i + p.offset < last) last = i + p.offset;
  return static_cast<int>(last - key0 < kKeys - 1 ? last - key0 : kKeys - 1);
}

// ---- the kernel: TMA stages, one mbarrier per union position, refilled by each block's last consumer --

template <class T, int D>
__global__ void __launch_bounds__(kGroupThreads, 1)
    group_tma_kernel(const __grid_constant__ GroupParams p, const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v) {
  using S = TmaSmem<D>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ int s_union;
  // 128B-swizzled TMA destinations need 1024-byte alignment.
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  auto* Qs = reinterpret_cast<std::uint16_t*>(smem);
  unsigned char* stages = smem + S::kStages0;
  auto* full = reinterpret_cast<MBarrier*>(smem + S::kMeta);
  Union un;
  un.bits = reinterpret_cast<unsigned*>(full + p.union_cap);
  un.word_base = reinterpret_cast<int*>(un.bits + p.words);
  un.ids = un.word_base + p.words;
  un.masks = reinterpret_cast<unsigned*>(un.ids + p.union_cap);
  int* remaining = reinterpret_cast<int*>(un.masks + p.union_cap);

  const Cta c = cta_of(p);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    tma_prefetch_descriptor(&tm_k);
    tma_prefetch_descriptor(&tm_v);
  }
  build_union(p, c, un, &s_union);
  for (int u = tid; u < un.n; u += kGroupThreads) {
    full[u].init(1);
    remaining[u] = __popc(un.masks[u]) * p.head_tiles;  // every chosen query has head_tiles warps
  }
  fence_barrier_init();
  __syncthreads();

  // Block u into stage u % kStages: K then V, D / 64 boxes each; rows past Lk arrive as zeros.
  auto issue = [&](int u) {
    unsigned char* st = stages + (u % S::kStages) * S::kStage;
    const int key0 = un.ids[u] * kKeys;
    full[u].arrive_expect_tx(static_cast<std::uint32_t>(S::kStage));
#pragma unroll
    for (int h = 0; h < D / 64; ++h) {
      tma_load_bhld(st + h * S::kBox, &tm_k, h * 64, static_cast<int>(c.g), key0, static_cast<int>(c.b), &full[u].word);
      tma_load_bhld(st + S::kHalf + h * S::kBox, &tm_v, h * 64, static_cast<int>(c.g), key0, static_cast<int>(c.b),
                    &full[u].word);
    }
  };
  if (tid == 0)
    for (int u = 0; u < S::kStages && u < un.n; ++u) issue(u);

  const int qq = warp / p.head_tiles, ht = warp % p.head_tiles;
  const bool active = qq < c.nq && warp < p.cta_queries * p.head_tiles;
  if (!active) return;  // no CTA-wide barrier follows
  const int i = c.i0 + qq;
  const std::uint32_t qa_addr = load_q<D>(p, c, Qs, i, ht);
  // wait_group only covers committed groups: without the commit the Q copies could still be in flight.
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();

  // Swizzled box: row r of a 128 x 64 box at r * 128 bytes, its 16-byte chunk c at (c ^ (r % 8)) * 16.
  // Every row group an ldmatrix names starts at a multiple of 8, so r % 8 = lane % 8.
  const std::uint32_t stages_addr = smem_addr(stages) + (lane % 8) * 128;
  const int sw = lane % 8;
  WarpState<D> w;
  w.init();
  for (int u = 0; u < un.n; ++u) {
    if (((un.masks[u] >> qq) & 1u) == 0u) continue;
    full[u].wait(0);
    // Lanes leave the spin (and the release below) independently; ldmatrix and mma.sync are
    // warp-collective, so the warp reconverges before them.
    __syncwarp();
    const std::uint32_t kb = stages_addr + (u % S::kStages) * static_cast<std::uint32_t>(S::kStage);
    const std::uint32_t vb = kb + static_cast<std::uint32_t>(S::kHalf);
    attend_block<T, D>(
        w, qa_addr, block_limit(p, i, static_cast<long long>(un.ids[u]) * kKeys), p.scale_log2,
        [&](int key, int chunk) {
          return kb + (chunk / 8) * static_cast<std::uint32_t>(S::kBox) + key * 128 + (((chunk % 8) ^ sw) * 16);
        },
        [&](int key, int chunk) {
          return vb + (chunk / 8) * static_cast<std::uint32_t>(S::kBox) + key * 128 + (((chunk % 8) ^ sw) * 16);
        });
    // Release the stage: this warp's reads of block u are done; the last warp out refills it. The
    // acq_rel count orders every consumer's reads before the refill; the proxy fence orders them
    // before the TMA (async proxy) write.
    fence_async_shared();
    __syncwarp();
    if (lane == 0) {
      ::cuda::atomic_ref<int, ::cuda::thread_scope_block> left(remaining[u]);
      if (left.fetch_sub(1, ::cuda::memory_order_acq_rel) == 1) {
        fence_async_shared();
        if (u + S::kStages < un.n) issue(u + S::kStages);
      }
    }
    __syncwarp();
  }
  store_out<T, D>(p, c, w, i, ht);
}

template <class T, int D>
cudaError_t run_tma(const GroupParams& p, const CUtensorMap& tm_k, const CUtensorMap& tm_v, cudaStream_t stream) {
  const std::size_t bytes = TmaSmem<D>::bytes(p.words, p.union_cap);
  auto* kernel = group_tma_kernel<T, D>;
  const long long ctas = static_cast<long long>(p.B) * p.Hkv * p.ctas_per_bg;
  return launch_with_smem(kernel, bytes,
                          [&] { kernel<<<static_cast<unsigned>(ctas), kGroupThreads, bytes, stream>>>(p, tm_k, tm_v); });
}

}  // namespace

std::size_t group_smem_bytes(const GroupParams& p, int D) {
  return D == 128 ? TmaSmem<128>::bytes(p.words, p.union_cap) : TmaSmem<64>::bytes(p.words, p.union_cap);
}

cudaError_t launch_group(const GroupParams& p, bool bf16, int D, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                         cudaStream_t stream) {
  if (static_cast<long long>(p.B) * p.Hkv * p.ctas_per_bg == 0) return cudaSuccess;
  if (bf16)
    return D == 128 ? run_tma<Bf16Tag, 128>(p, tm_k, tm_v, stream) : run_tma<Bf16Tag, 64>(p, tm_k, tm_v, stream);
  return D == 128 ? run_tma<F16Tag, 128>(p, tm_k, tm_v, stream) : run_tma<F16Tag, 64>(p, tm_k, tm_v, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
