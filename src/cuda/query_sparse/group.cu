// Group-centric query_sparse (the group-centric data loading of Native Sparse Attention): the heads
// of one query's GQA group share its list, so they are the rows of one m16 MMA tile and every K/V
// block a CTA loads serves all of them. No partials, no workspace, no combine (kernels.cuh gives the
// CTA and warp roles).
//
// One CTA, 16 warps:
//   1. union of its queries' visible ids: a bitmap over the Tk blocks in shared memory, its prefix
//      popcounts give each id's position in the ascending union, and a per-position mask says which
//      of the CTA's queries chose it;
//   2. the union streams through a ring of K/V stages (cp.async, every thread copies, one
//      __syncthreads per block) in ascending block order;
//   3. each warp runs the FA2 online softmax over the streamed blocks its query selected, in 64-key
//      halves, S and O in registers, Q and the K/V fragments by ldmatrix from padded rows;
//   4. out (normalised, 16-bit) and LSE (natural log, scale included) straight to global memory.
// A query's blocks are visited in ascending order by the same instructions whatever CTA it lands in,
// so results are bitwise identical run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/query_sparse/kernels.cuh"
#include "cuda/query_sparse/launch.hpp"
#include "cuda/query_sparse/mma.cuh"

namespace sparse_attn::cuda_kernels::qs {
namespace {

// Byte offsets of the dynamic shared memory. Rows carry kPad halves of padding so that the 8 row
// addresses of one ldmatrix phase fall on distinct 16-byte bank groups.
template <int D>
struct GroupSmem {
  static constexpr int kStride = D + kPad;  // halves per row of Q, K and V
  // D = 128: Q (68 KB) + 2 stages of K and V (136 KB) fill the 227 KB an SM offers; the next block's
  // copy overlaps the current block's math, which is all a 2-deep ring needs when every thread copies.
  // D = 64 halves every tile, so a third stage fits.
  static constexpr int kStages = D == 128 ? 2 : 3;
  static constexpr std::size_t kTileHalves = 16 * kStride;     // one warp's Q rows
  static constexpr std::size_t kBlockHalves = kKeys * kStride;  // one K or V block
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = kQ + 2 * kGroupWarps * kTileHalves;
  static constexpr std::size_t kV = kK + 2 * kStages * kBlockHalves;
  static constexpr std::size_t kMeta = kV + 2 * kStages * kBlockHalves;
  // bitmap and prefix (words each), union ids and query masks (union_cap each), 4 bytes per entry
  static std::size_t bytes(int words, int union_cap) {
    return kMeta + 4 * (2 * static_cast<std::size_t>(words) + 2 * static_cast<std::size_t>(union_cap));
  }
};

template <class T, int D>
__global__ void __launch_bounds__(kGroupThreads, 1) group_kernel(const __grid_constant__ GroupParams p) {
  using S = GroupSmem<D>;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kStride = S::kStride;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_union;
  auto* Qs = reinterpret_cast<std::uint16_t*>(smem + S::kQ);
  auto* Ks = reinterpret_cast<std::uint16_t*>(smem + S::kK);
  auto* Vs = reinterpret_cast<std::uint16_t*>(smem + S::kV);
  auto* bits = reinterpret_cast<unsigned*>(smem + S::kMeta);
  auto* word_base = reinterpret_cast<int*>(bits + p.words);
  int* ids = word_base + p.words;
  auto* masks = reinterpret_cast<unsigned*>(ids + p.union_cap);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  const long long cta = blockIdx.x;
  const long long bg = cta / p.ctas_per_bg, b = bg / p.Hkv, g = bg % p.Hkv;
  const int i0 = static_cast<int>(cta % p.ctas_per_bg) * p.cta_queries;
  const int nq = min(p.cta_queries, p.Lq - i0);
  const std::int32_t* list0 = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1];
  // The KV-centric `chosen`: a valid id whose block is not entirely in the query's causal future.
  auto visible = [&](int i, int j) {
    return j >= 0 && j < p.Tk && (!p.causal || static_cast<long long>(j) * kKeys <= i + p.offset);
  };
  auto list_id = [&](int e) {
    const int qq = e / p.Kq, s = e % p.Kq;
    return list0[static_cast<long long>(i0 + qq) * p.idx_stride[2] + static_cast<long long>(s) * p.idx_stride[3]];
  };

  // ---- 1. the union of the CTA's lists, ascending, and which query chose each member
  for (int w = tid; w < p.words; w += kGroupThreads) bits[w] = 0u;
  for (int u = tid; u < p.union_cap; u += kGroupThreads) masks[u] = 0u;
  __syncthreads();
  const int entries = nq * p.Kq;
  for (int e = tid; e < entries; e += kGroupThreads) {
    const int j = list_id(e);
    if (visible(i0 + e / p.Kq, j)) atomicOr(bits + (j >> 5), 1u << (j & 31));
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int w0 = 0; w0 < p.words; w0 += 32) {
      const int w = w0 + lane;
      const int c = w < p.words ? __popc(bits[w]) : 0;
      int incl = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
      }
      if (w < p.words) word_base[w] = carry + incl - c;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s_union = carry;
  }
  __syncthreads();
  const int n_union = s_union;
  for (int w = tid; w < p.words; w += kGroupThreads) {
    unsigned m = bits[w];
    int pos = word_base[w];
    while (m != 0u) {
      ids[pos++] = w * 32 + __ffs(m) - 1;
      m &= m - 1u;
    }
  }
  for (int e = tid; e < entries; e += kGroupThreads) {
    const int j = list_id(e), qq = e / p.Kq;
    if (!visible(i0 + qq, j)) continue;
    const int pos = word_base[j >> 5] + __popc(bits[j >> 5] & ((1u << (j & 31)) - 1u));
    atomicOr(masks + pos, 1u << qq);
  }
  __syncthreads();

  // ---- this warp's unit: one query and 16 heads of its group
  const int qq = warp / p.head_tiles, ht = warp % p.head_tiles;
  const bool active = qq < nq && warp < p.cta_queries * p.head_tiles;
  const int i = i0 + qq;
  const auto* q = static_cast<const std::uint16_t*>(p.q);
  const auto* k = static_cast<const std::uint16_t*>(p.k);
  const auto* v = static_cast<const std::uint16_t*>(p.v);
  const std::uint32_t q_smem = smem_addr(Qs + warp * S::kTileHalves);
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks, cc = c % kChunks, hh = ht * 16 + r;
    const bool ok = active && hh < p.group;
    const std::uint16_t* src =
        ok ? q + b * p.q_stride[0] + i * p.q_stride[1] + (g * p.group + hh) * p.q_stride[2] + cc * 8 : q;
    cp_async_16(q_smem + 2 * (r * kStride + cc * 8), src, ok ? 16 : 0);
  }
  // Keys past Lk arrive as zeros: their scores are masked, and zero V rows keep 0 * garbage out of PV.
  // Each thread copies the same chunks of every block: kChunks divides kGroupThreads, so its column
  // is fixed and its rows step by kGroupThreads / kChunks.
  static_assert(kGroupThreads % kChunks == 0, "a thread's column must not change between rows");
  constexpr int kRowStep = kGroupThreads / kChunks;
  const int copy_row = tid / kChunks, copy_col = (tid % kChunks) * 8;
  const std::uint16_t* k_src = k + b * p.k_stride[0] + g * p.k_stride[2] + copy_col;
  const std::uint16_t* v_src = v + b * p.v_stride[0] + g * p.v_stride[2] + copy_col;
  const std::uint32_t k_dst = smem_addr(Ks) + 2 * (copy_row * kStride + copy_col);
  const std::uint32_t v_dst = smem_addr(Vs) + 2 * (copy_row * kStride + copy_col);
  auto load_block = [&](int stage, int u) {
    const long long key0 = static_cast<long long>(ids[u]) * kKeys + copy_row;
    const std::uint32_t off = 2 * stage * static_cast<std::uint32_t>(S::kBlockHalves);
#pragma unroll
    for (int r = 0; r < kKeys; r += kRowStep) {
      const long long key = key0 + r;
      const bool ok = key < p.Lk;
      cp_async_16(k_dst + off + 2 * r * kStride, ok ? k_src + key * p.k_stride[1] : k, ok ? 16 : 0);
      cp_async_16(v_dst + off + 2 * r * kStride, ok ? v_src + key * p.v_stride[1] : v, ok ? 16 : 0);
    }
  };
  // Q rides in the first group.
#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    if (s < n_union) load_block(s, s);
    cp_async_commit();
  }

  // ldmatrix row addresses of this lane (kernels.cuh / mma.cuh give the fragment layouts): A of Q
  // (rows lane % 16, column half lane / 16), B of K (keys lane % 8 + 8 (lane / 16), column half
  // (lane / 8) % 2), B of V transposed (keys lane % 8 + 8 ((lane / 8) % 2), column half lane / 16).
  const std::uint32_t qa_addr = q_smem + 2 * ((lane % 16) * kStride + (lane / 16) * 8);
  const std::uint32_t kb_addr = smem_addr(Ks) + 2 * ((lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8);
  const std::uint32_t vb_addr = smem_addr(Vs) + 2 * ((lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8);

  // Last key this warp's query may see (absolute); every streamed block it selected holds key0 <= it.
  long long last_key = p.Lk - 1;
  if (p.causal && i + p.offset < last_key) last_key = i + p.offset;

  float acc[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;  // rows gq and gq + 8

  // ---- 2-3. stream the union; each warp computes the blocks its query chose
  for (int u = 0; u < n_union; ++u) {
    cp_async_wait<S::kStages - 2>();
    __syncthreads();  // block u is in; every warp is done with the stage the next copy overwrites
    const int next = u + S::kStages - 1;
    if (next < n_union) load_block(next % S::kStages, next);
    cp_async_commit();
    if (!active || ((masks[u] >> qq) & 1u) == 0u) continue;

    const std::uint32_t stage_off = 2 * (u % S::kStages) * static_cast<std::uint32_t>(S::kBlockHalves);
    const std::uint32_t Kb = kb_addr + stage_off, Vb = vb_addr + stage_off;
    const long long key0 = static_cast<long long>(ids[u]) * kKeys;
    const int lim = static_cast<int>(last_key - key0 < kKeys - 1 ? last_key - key0 : kKeys - 1);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int kb = half * 64;
      if (kb > lim) break;  // the rest of the block is past the diagonal or past Lk
      float s[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll 2
      for (int ks = 0; ks < D / 16; ++ks) {
        std::uint32_t a[4];
        ldmatrix_x4(a, qa_addr + 2 * ks * 16);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          std::uint32_t bk[4];
          ldmatrix_x4(bk, Kb + 2 * ((kb + np * 16) * kStride + ks * 16));
          T::mma(s[2 * np], a, bk[0], bk[1]);
          T::mma(s[2 * np + 1], a, bk[2], bk[3]);
        }
      }
      if (kb + 63 > lim) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (kb + nt * 8 + tq * 2 + e > lim) s[nt][e] = s[nt][2 + e] = -INFINITY;
      }
      float mx_a = m_a, mx_b = m_b;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
      }
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o));
      }
      // Key kb <= lim is visible, so mx is finite; the first visit rescales by exp2(-inf) = 0.
      const float alpha_a = exp2f((m_a - mx_a) * p.scale_log2);
      const float alpha_b = exp2f((m_b - mx_b) * p.scale_log2);
      m_a = mx_a;
      m_b = mx_b;
      l_a *= alpha_a;
      l_b *= alpha_b;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        acc[dn][0] *= alpha_a;
        acc[dn][1] *= alpha_a;
        acc[dn][2] *= alpha_b;
        acc[dn][3] *= alpha_b;
      }
      const float base_a = mx_a * p.scale_log2, base_b = mx_b * p.scale_log2;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        // The row sum (and so the LSE) uses the float32 probabilities; PV sees them rounded to the
        // 16-bit type, as in FlashAttention and the KV-centric kernel.
        s[nt][0] = exp2f(fmaf(s[nt][0], p.scale_log2, -base_a));
        s[nt][1] = exp2f(fmaf(s[nt][1], p.scale_log2, -base_a));
        s[nt][2] = exp2f(fmaf(s[nt][2], p.scale_log2, -base_b));
        s[nt][3] = exp2f(fmaf(s[nt][3], p.scale_log2, -base_b));
        l_a += s[nt][0] + s[nt][1];
        l_b += s[nt][2] + s[nt][3];
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const std::uint32_t a[4] = {T::pack(s[2 * kk][0], s[2 * kk][1]), T::pack(s[2 * kk][2], s[2 * kk][3]),
                                    T::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    T::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          std::uint32_t bv[4];
          ldmatrix_x4_trans(bv, Vb + 2 * ((kb + kk * 16) * kStride + dp * 16));
          T::mma(acc[2 * dp], a, bv[0], bv[1]);
          T::mma(acc[2 * dp + 1], a, bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing may be in flight into shared memory when the CTA retires

  // ---- 4. out and LSE
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, o);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, o);
  }
  if (!active) return;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int hh = ht * 16 + gq + 8 * h2;
    if (hh >= p.group) continue;
    const long long h = g * p.group + hh;
    const float l = h2 == 0 ? l_a : l_b, m = h2 == 0 ? m_a : m_b;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // no block seen: out 0
    auto* o = static_cast<std::uint16_t*>(p.out) + b * p.out_stride[0] + i * p.out_stride[1] + h * p.out_stride[2];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<std::uint32_t*>(o + dn * 8 + tq * 2) = T::pack(acc[dn][2 * h2] * inv, acc[dn][2 * h2 + 1] * inv);
    if (tq == 0 && p.lse != nullptr)
      p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = l > 0.0f ? m * p.scale + logf(l) : -INFINITY;
  }
}

template <class T, int D>
cudaError_t run_group(const GroupParams& p, cudaStream_t stream) {
  const std::size_t bytes = GroupSmem<D>::bytes(p.words, p.union_cap);
  auto* kernel = group_kernel<T, D>;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  const long long ctas = static_cast<long long>(p.B) * p.Hkv * p.ctas_per_bg;
  kernel<<<static_cast<unsigned>(ctas), kGroupThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

std::size_t group_smem_bytes(const GroupParams& p, int D) {
  return D == 128 ? GroupSmem<128>::bytes(p.words, p.union_cap) : GroupSmem<64>::bytes(p.words, p.union_cap);
}

cudaError_t launch_group(const GroupParams& p, bool bf16, int D, cudaStream_t stream) {
  if (static_cast<long long>(p.B) * p.Hkv * p.ctas_per_bg == 0) return cudaSuccess;
  if (bf16) return D == 128 ? run_group<Bf16, 128>(p, stream) : run_group<Bf16, 64>(p, stream);
  return D == 128 ? run_group<F16, 128>(p, stream) : run_group<F16, 64>(p, stream);
}

}  // namespace sparse_attn::cuda_kernels::qs
