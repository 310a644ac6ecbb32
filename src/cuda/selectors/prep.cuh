// Preparation of the index tensors, shared by the token_max and lightning selectors (docs/design.md §5.7):
//  - amax (launch_amax, prep.cu): the largest |x| of one or two tensors as float bits, one launch;
//  - codes (codes_kernel below, a programmatic dependent of the amax): every element rounded through the
//    precision exactly as the CPU's load_quantized (tc_index.cuh), stored in the selector's layout:
//    token_max's padded rows (RowLayout) or lightning's 128B-swizzled wgmma tiles (TileLayout).
// Both are bound by memory traffic, so both keep several 16-byte loads in flight per thread before using
// any, and spend few instructions per element (docs/notes/selectors_token_max.md, "prep v2").
#pragma once

#include <cuda_fp8.h>

#include <cooperative_groups.h>

#include <string>
#include <type_traits>

#include "cuda/selectors/common.cuh"
#include "cuda/selectors/tc_index.cuh"

namespace sparse_attn::cuda_backend::prep {

using sel::imax;
using sel::imin;
using sel::In;
using sel::Prec;
using tc::IndexSrc;

constexpr int kThreads = 256;  // both kernels

/// Whether the tensor is one flat array from a 16-byte aligned base (rows of pitch D, dense batch and head
/// strides): then its elements are read as 16-byte units without row arithmetic.
__host__ __device__ __forceinline__ bool contiguous_rows(const IndexSrc& s) {
  return (s.H == 1 || s.sh == s.D) && s.sl == s.H * s.D && (s.B == 1 || s.sb == s.L * s.H * s.D) &&
         reinterpret_cast<std::uintptr_t>(s.x) % 16 == 0;
}

/// Launches the amax of `a` and, when `b` is not null, of `b` on `stream`: amax[0] (and amax[1]) become the
/// float bits of the largest |x| (NaN skipped, as std::fmax on the CPU), words the caller zeroed. One plain
/// launch, which lets a programmatic dependent (the codes) be scheduled beside it. `op` names the caller.
void launch_amax(const std::string& op, const TensorView& a, const TensorView* b, unsigned int* amax, cudaStream_t stream);

// The running max of |x| over a thread's 32-bit words of one input type: per word of 16-bit elements a sign
// clear and a max.bf16x2 / max.f16x2 (which return the other operand for a NaN, as std::fmax); per f32
// element one max with |x|. Used by the amax and by the fused amax and codes.
template <In T>
struct Packed;
template <>
struct Packed<In::bf16> {
  __nv_bfloat162 m = __floats2bfloat162_rn(0.0f, 0.0f);
  // |x| by clearing the sign bits (ptxas would form __habs2 with an fma, whose subnormal handling the max
  // then depends on).
  __device__ void fold(unsigned w) {
    const unsigned a = w & 0x7fff7fffu;
    m = __hmax2(m, *reinterpret_cast<const __nv_bfloat162*>(&a));
  }
  __device__ float value() const { return fmaxf(__low2float(m), __high2float(m)); }
};
template <>
struct Packed<In::f16> {
  __half2 m = __floats2half2_rn(0.0f, 0.0f);
  __device__ void fold(unsigned w) { m = __hmax2(m, __habs2(*reinterpret_cast<const __half2*>(&w))); }
  __device__ float value() const { return fmaxf(__low2float(m), __high2float(m)); }
};
template <>
struct Packed<In::f32> {
  float m = 0.0f;
  __device__ void fold(unsigned w) { m = fmaxf(m, fabsf(__uint_as_float(w))); }
  __device__ float value() const { return m; }
};

/// Folds the four words of a 16-byte unit into acc.
template <In T>
__device__ __forceinline__ void fold_unit(Packed<T>& acc, const uint4& u) {
  acc.fold(u.x), acc.fold(u.y), acc.fold(u.z), acc.fold(u.w);
}

// ---- codes ----------------------------------------------------------------------------------------------
//
// Work items of 8 consecutive elements of a code row (rows padded with zero codes past Di); a CTA takes
// rounds of kRound x kThreads consecutive items (thread t the items t, t + kThreads, ...; positions kept by
// a Cursor, no division per item), and issues the loads of its next round before it quantises the current
// one, so kRound 16-byte loads (twice that for f32) are in flight during the quantisation. Persistent: two
// CTAs per SM (launch bounds), rounds by a grid stride.
// fp4: an NVFP4 block of 16 is the items of an even-odd lane pair (rows and tensors start at even items, the
// item stride kThreads is even), which share the block's amax by a shuffle: every lane of a warp quantises.

constexpr int kRound = 4;
constexpr int kCodesCtasPerSm = 2;
constexpr int kTileRows = 128;                   // lightning: rows of a tile
constexpr int kChunkBytes = kTileRows * 128;     // lightning: one 128-byte column chunk of a tile

/// token_max: codes [rows, pitch bytes], code row r the source row r.
struct RowLayout {
  std::int64_t pitch;
  bool contiguous;  // contiguous_rows(src): the row's offset is r D
  __device__ std::int64_t src_offset(const IndexSrc& s, std::int64_t r) const {
    return contiguous ? r * s.D : s.offset(r);
  }
  __device__ std::int64_t dst_offset(std::int64_t r, int byte) const { return r * pitch + byte; }
};

/// lightning: per batch `tiles` tiles of 128 rows, row r of tile t the source position t per_tile + r / hp,
/// head r % hp (hp a power of two; rows of positions past L and of heads past H are zero). A tile is
/// [chunks][128 rows][128 B], 16-byte unit u of row r at r 128 + (u ^ r % 8) 16 of its chunk: what TMA's
/// SWIZZLE_128B writes and the wgmma descriptors expect.
struct TileLayout {
  std::int64_t tiles;
  int per_tile, hp_log2, chunks;
  __device__ std::int64_t src_offset(const IndexSrc& s, std::int64_t row) const {
    const std::int64_t bt = row / kTileRows;
    const int r = static_cast<int>(row % kTileRows);
    std::int64_t b = 0, t = bt;  // one batch (lightning's usual case): no division
    if (s.B > 1 && bt <= 0x7fffffff && tiles <= 0x7fffffff) {  // 64-bit division costs ~100 instructions
      const auto bt32 = static_cast<std::uint32_t>(bt), t32 = static_cast<std::uint32_t>(tiles);
      b = bt32 / t32, t = bt32 - static_cast<std::uint32_t>(b) * t32;
    } else if (s.B > 1) {
      b = bt / tiles, t = bt - b * tiles;
    }
    const std::int64_t l = t * per_tile + (r >> hp_log2);
    const int h = r & ((1 << hp_log2) - 1);
    return l < s.L && h < s.H ? b * s.sb + l * s.sl + h * s.sh : -1;
  }
  __device__ std::int64_t dst_offset(std::int64_t row, int byte) const {
    const std::int64_t bt = row / kTileRows;
    const int r = static_cast<int>(row % kTileRows), c = byte / 128, u = byte % 128;
    return (bt * chunks + c) * kChunkBytes + r * 128 + (((u / 16) ^ (r % 8)) * 16) + u % 16;
  }
};

template <class Layout>
struct CodesParams {
  IndexSrc src[2];
  In type[2];
  unsigned char* dst[2];
  Layout lay[2];
  std::int64_t rows0, rows;    // code rows of tensor 0, of both
  int lanes;                   // items per code row (even: an fp4 block never straddles rows)
  __host__ __device__ std::int64_t items() const { return rows * lanes; }
  const unsigned int* amax;    // [2] float bits (from launch_amax); null: no amax (bf16 codes, scale 1)
  bool bf16_down;              // bf16 codes times 2^-e, 2^e the power of two above amax (token_max)
};

/// Code bytes per element of precision P: e4m3 for fp8, bf16 for bf16 and fp4 (an NVFP4 value, e2m1 x its
/// e4m3 block scale, has up to 6 significant bits: exact in bf16, not in e4m3).
template <Prec P>
constexpr int kCodeBytes = P == Prec::fp8 ? 1 : 2;

struct Item {
  int which, d0;
  std::int64_t row;
  bool in;
};

// An item's 8 elements as loaded: 16-bit types packed in lo (element 2 w in the low half of word w), f32 in
// lo (0-3) and hi (4-7); zero past Di and for an item or a row that does not exist.
struct Raw {
  uint4 lo, hi;
};


// Where a thread is in the items: code row R of both tensors' rows (tensor 1's after tensor 0's) and lane.
// Its items advance by kThreads within a round and by the grid stride between rounds: an addition with a
// carry instead of a division per item.
struct Cursor {
  std::int64_t R;
  int lane;
};
struct Stride {
  std::int64_t dR;
  int dl;
};

// A round's items (as cursors: fewer registers than Items across the quantisation of the previous round)
// and their loads.
struct Round {
  Cursor c[kRound];
  Raw r[kRound];
};

template <class Layout>
__device__ __forceinline__ Stride stride_of(const CodesParams<Layout>& p, std::int64_t items) {
  return {items / p.lanes, static_cast<int>(items % p.lanes)};
}

template <class Layout>
__device__ __forceinline__ Item item_at(const CodesParams<Layout>& p, const Cursor& c) {
  Item it;
  it.which = c.R < p.rows0 ? 0 : 1;
  it.row = it.which ? c.R - p.rows0 : c.R;
  it.d0 = c.lane * 8;
  it.in = c.R < p.rows;
  return it;
}

template <class Layout>
__device__ __forceinline__ void advance(const CodesParams<Layout>& p, Cursor& c, const Stride& s) {
  c.R += s.dR, c.lane += s.dl;
  if (c.lane >= p.lanes) c.lane -= p.lanes, ++c.R;
}

// Issues the loads of an item and uses none of their values: one 16-byte load (two for f32) where the 8
// elements lie in the row and are 16-byte aligned, one load per element otherwise (strided or unaligned
// views, Di not a multiple of 8).
template <class Layout>
__device__ __forceinline__ Raw load_raw(const CodesParams<Layout>& p, const Item& it) {
  Raw r{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
  if (!it.in) return r;
  const IndexSrc& s = it.which ? p.src[1] : p.src[0];
  const In t = it.which ? p.type[1] : p.type[0];
  const int cnt = imax(0, imin(8, static_cast<int>(s.D) - it.d0));
  const std::int64_t off = (it.which ? p.lay[1] : p.lay[0]).src_offset(s, it.row);
  if (off < 0 || cnt == 0) return r;
  const std::int64_t e = off + it.d0;
  if (t == In::f32) {
    const auto* a = static_cast<const unsigned*>(s.x) + e;
    if (cnt == 8 && reinterpret_cast<std::uintptr_t>(a) % 16 == 0) {
      r.lo = __ldg(reinterpret_cast<const uint4*>(a));
      r.hi = __ldg(reinterpret_cast<const uint4*>(a) + 1);
    } else {
      unsigned u[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) u[i] = i < cnt ? __ldg(a + i) : 0u;
      r.lo = make_uint4(u[0], u[1], u[2], u[3]);
      r.hi = make_uint4(u[4], u[5], u[6], u[7]);
    }
  } else {
    const auto* a = static_cast<const unsigned short*>(s.x) + e;
    if (cnt == 8 && reinterpret_cast<std::uintptr_t>(a) % 16 == 0) {
      r.lo = __ldg(reinterpret_cast<const uint4*>(a));
    } else {
      unsigned u[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) u[i] = i < cnt ? static_cast<unsigned>(__ldg(a + i)) : 0u;
      r.lo = make_uint4(u[0] | u[1] << 16, u[2] | u[3] << 16, u[4] | u[5] << 16, u[6] | u[7] << 16);
    }
  }
  return r;
}

// The loads of a round from the cursor's item on; the cursor ends at the next round's first item.
template <class Layout>
__device__ __forceinline__ Round load_round(const CodesParams<Layout>& p, Cursor& c, const Stride& one, const Stride& jump) {
  Round q;
#pragma unroll
  for (int k = 0; k < kRound; ++k) {
    q.c[k] = c;
    q.r[k] = load_raw(p, item_at(p, c));
    advance(p, c, k + 1 < kRound ? one : jump);
  }
  return q;
}

// The item's elements as floats: one branch per item on the (tensor-uniform) type, none per element.
__device__ __forceinline__ void to_floats(In t, const Raw& r, float (&x)[8]) {
  const unsigned w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  if (t == In::f32) {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __uint_as_float(w[i]);
  } else if (t == In::bf16) {
#pragma unroll
    for (int k = 0; k < 4; ++k) x[2 * k] = __uint_as_float(w[k] << 16), x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[k]);
      x[2 * k] = __low2float(h), x[2 * k + 1] = __high2float(h);
    }
  }
}

// Per-tensor constants of the quantisation, from its amax word.
struct TensorScale {
  float ts;          // the CPU's precision_tensor_scale (1 for bf16)
  float down;        // bf16 codes: 2^-e (token_max) or 1
  tc::Fp8Scale f8;   // fp8
};

// a or b field by field (selecting the struct itself would put both in local memory).
__device__ __forceinline__ TensorScale pick(bool second, const TensorScale& a, const TensorScale& b) {
  TensorScale s;
  s.ts = second ? b.ts : a.ts;
  s.down = second ? b.down : a.down;
  s.f8.by.d = second ? b.f8.by.d : a.f8.by.d;
  s.f8.by.y = second ? b.f8.by.y : a.f8.by.y;
  s.f8.by.fast = second ? b.f8.by.fast : a.f8.by.fast;
  s.f8.lo = second ? b.f8.lo : a.f8.lo;
  s.f8.hi = second ? b.f8.hi : a.f8.hi;
  s.f8.clamped = second ? b.f8.clamped : a.f8.clamped;
  return s;
}

// From the amax's float bits.
template <Prec P>
__device__ __forceinline__ TensorScale tensor_constants_of(unsigned bits, bool bf16_down) {
  TensorScale s{1.0f, 1.0f, {}};
  s.ts = tc::tensor_scale(static_cast<int>(P), &bits);
  if constexpr (P == Prec::fp8) s.f8 = tc::make_fp8_scale(s.ts);
  if (P == Prec::bf16 && bf16_down) {  // codes below 1 in magnitude (0 amax: 2^0)
    int e = 0;
    frexpf(__uint_as_float(bits), &e);
    s.down = ldexpf(1.0f, -imax(-100, imin(128, e)));
  }
  return s;
}

// From amax word w (null: no amax, bf16 codes at scale 1).
template <Prec P>
__device__ __forceinline__ TensorScale tensor_constants(const unsigned* amax, bool bf16_down, int w) {
  if (amax == nullptr) return TensorScale{1.0f, 1.0f, {}};
  return tensor_constants_of<P>(__ldcg(amax + w), bf16_down);
}

// The codes of 8 values (as the CPU's load_quantized): fp8 e4m3 bytes in w[0..1], bf16 codes (bf16 and fp4) in
// w[0..3]. fp4 shuffles with the even-odd lane partner: every lane of the warp calls it.
template <Prec P>
__device__ __forceinline__ void quantize8(const float (&x)[8], const TensorScale& s, unsigned (&w)[4]) {
  if constexpr (P == Prec::fp8) {
    // The e4m3 byte of the quotient: cvt.rn.satfinite rounds to nearest even with e4m3's subnormals and
    // saturates at 448, as float_to_e4m3 (Fp8CodesEqualCpu checks every float).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = tc::fp8_quotient(x[4 * h + i], s.f8);
      const auto lo = __nv_cvt_float2_to_fp8x2(make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);
      const auto hi = __nv_cvt_float2_to_fp8x2(make_float2(q[2], q[3]), __NV_SATFINITE, __NV_E4M3);
      w[h] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
    }
    w[2] = w[3] = 0u;
  } else {
    float v[8], c[8];
    tc::quantize_lane8<P>(x, s.ts, v, c);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      // bf16: times 2^-e, exact unless subnormal; fp4: down = 1.
      const __nv_bfloat162 b2 = __floats2bfloat162_rn(__fmul_rn(c[2 * h], s.down), __fmul_rn(c[2 * h + 1], s.down));
      w[h] = *reinterpret_cast<const unsigned*>(&b2);
    }
  }
}

// Stores the 8 codes quantize8 left in w: 8 bytes (fp8) or 16 (bf16 codes).
template <Prec P>
__device__ __forceinline__ void store8(unsigned char* dst, const unsigned (&w)[4]) {
  if constexpr (P == Prec::fp8)
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Quantises the item's 8 values (as the CPU's load_quantized) and stores their codes; every lane of the warp
// calls it (fp4's shuffle), items that do not exist store nothing.
template <Prec P, class Layout>
__device__ __forceinline__ void store_codes(const CodesParams<Layout>& p, const Item& it, const float (&x)[8],
                                            const TensorScale& s) {
  unsigned char* dst = (it.which ? p.dst[1] : p.dst[0]) +
                       (it.which ? p.lay[1] : p.lay[0]).dst_offset(it.row, it.d0 * kCodeBytes<P>);
  unsigned w[4];
  quantize8<P>(x, s, w);
  if (it.in) store8<P>(dst, w);
}

/// The codes of both tensors (p.items() items). As a programmatic dependent of the amax it issues its first
/// round of loads before it waits (the inputs were complete before the amax, a plain launch, started).
template <Prec P, class Layout>
__global__ void __launch_bounds__(kThreads, kCodesCtasPerSm) codes_kernel(const __grid_constant__ CodesParams<Layout> p) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kRound * kThreads;
  std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kRound * kThreads;
  const Stride one = stride_of(p, kThreads), jump = stride_of(p, step - (kRound - 1) * kThreads);
  const Stride first = stride_of(p, base + threadIdx.x);
  Cursor c{first.dR, first.dl};
  Round cur = load_round(p, c, one, jump);
  sel::pdl_wait();
  sel::pdl_launch_dependents();
  const TensorScale s0 = tensor_constants<P>(p.amax, p.bf16_down, 0), s1 = tensor_constants<P>(p.amax, p.bf16_down, 1);
  for (const std::int64_t items = p.items(); base < items; base += step) {  // uniform over the CTA
    const Round next = load_round(p, c, one, jump);
#pragma unroll
    for (int k = 0; k < kRound; ++k) {
      const Item it = item_at(p, cur.c[k]);
      float x[8];
      to_floats(it.which ? p.type[1] : p.type[0], cur.r[k], x);
      store_codes<P>(p, it, x, pick(it.which != 0, s0, s1));
    }
    cur = next;
  }
}

// ---- flat codes ---------------------------------------------------------------------------------------
//
// token_max's usual case: both tensors contiguous rows of 16-bit elements (bf16 or f16) and code rows without
// padding (Di a multiple of 16), fp8 or bf16 codes. Then item i (8 elements) of a tensor reads elements
// [8 i, 8 i + 8) and writes its codes at byte 8 i kCodeBytes: an elementwise map, no row arithmetic, one
// 16-byte load per item; a CTA takes items of one tensor only (its scale and type uniform). Each thread
// takes kFlatItems items kThreads apart, all loads issued before any use (and before the wait for the
// amax), in under 64 registers: 4 CTAs per SM, 16 KB of loads in flight per CTA. (The general kernel's
// cursors and per-item layout cost 128 registers and 2 CTAs per SM.)

constexpr int kFlatItems = 4;

struct FlatParams {
  const uint4* src[2];    // 8 elements per uint4
  unsigned char* dst[2];
  In type[2];
  std::int64_t items[2];  // items of each tensor
  unsigned ctas0;         // CTAs of tensor 0; the rest take tensor 1
  const unsigned* amax;
  bool bf16_down;
};

// The item's 8 codes into dst (8 i code bytes); `fast`: fp8's clamped division (s.f8.clamped, uniform).
template <Prec P, bool kFast>
__device__ __forceinline__ void flat_item(In type, const uint4& raw, const TensorScale& s, unsigned char* dst) {
  float x[8];
  to_floats(type, Raw{raw, make_uint4(0u, 0u, 0u, 0u)}, x);
  TensorScale t = s;
  if constexpr (P == Prec::fp8) t.f8.clamped = kFast;  // a constant: one path of fp8_quotient, no per-element test
  unsigned w[4];
  quantize8<P>(x, t, w);
  store8<P>(dst, w);
}

// The codes of a thread's items first + k stride (k < count, below n) from their loads in raw; fp8's
// division path picked once (s.f8.clamped is uniform over the tensor).
template <Prec P, int kN>
__device__ __forceinline__ void flat_items(In type, const uint4 (&raw)[kN], const TensorScale& sc, unsigned char* dst,
                                           std::int64_t first, std::int64_t stride, int count, std::int64_t n) {
  const bool fast = P == Prec::fp8 && sc.f8.clamped;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const std::int64_t i = first + k * stride;
    if (k >= count || i >= n) break;
    if (fast)
      flat_item<P, true>(type, raw[k], sc, dst + i * 8 * kCodeBytes<P>);
    else
      flat_item<P, false>(type, raw[k], sc, dst + i * 8 * kCodeBytes<P>);
  }
}

template <Prec P>
__global__ void __launch_bounds__(kThreads) flat_codes_kernel(const __grid_constant__ FlatParams p) {
  static_assert(P != Prec::fp4, "fp4 blocks span lanes: the general kernel");
  // Each CTA takes items of one tensor, so its scale and input type are uniform over the CTA.
  const int which = blockIdx.x >= p.ctas0 ? 1 : 0;
  const unsigned cta = which ? blockIdx.x - p.ctas0 : blockIdx.x;
  const std::int64_t first = static_cast<std::int64_t>(cta) * kFlatItems * kThreads + threadIdx.x, n = p.items[which];
  const uint4* src = p.src[which];
  uint4 raw[kFlatItems];
#pragma unroll
  for (int k = 0; k < kFlatItems; ++k) {
    const std::int64_t i = first + k * kThreads;
    raw[k] = i < n ? __ldg(src + i) : make_uint4(0u, 0u, 0u, 0u);
  }
  sel::pdl_wait();
  sel::pdl_launch_dependents();
  const TensorScale sc = tensor_constants<P>(p.amax, p.bf16_down, which);
  flat_items<P>(p.type[which], raw, sc, p.dst[which], first, kThreads, kFlatItems, n);
}

// ---- amax and codes in one launch ---------------------------------------------------------------------
//
// The flat case whose items fit in one resident wave, at most kFusedItems a thread: each thread issues the
// loads of all its items at once and folds their |x| into its CTA's maximum, which the CTA stores in its own
// slot; the grid meets at the runtime's grid barrier (a cooperative launch: every CTA is resident; no
// counter or amax word of the caller's to zero); each CTA then maxes its tensor's slots and quantises the
// items its threads still hold in registers. The inputs are read once, from HBM, instead of by the amax and
// again by the codes, and neither a memset nor the codes' launch is needed. CTAs split between the tensors in
// proportion to their items, as the amax's do; a thread's items are a grid stride apart (coalesced).

constexpr int kFusedItems = 6;
constexpr int kFusedCtasPerSm = 4;
constexpr int kFusedMaxCtas = 2048;  // slots of the caller's scratch (fused_slot_bytes)

/// Scratch bytes launch_fused needs for its per-CTA maxima.
constexpr std::size_t fused_slot_bytes() { return kFusedMaxCtas * sizeof(float); }

struct FusedParams {
  FlatParams f;        // f.amax unused
  float* slots;        // [gridDim.x] the CTAs' maxima of |x|
  unsigned* amax;      // [2] float bits of each tensor's amax, written by its first CTA (for the caller)
  int per_thread[2];   // items a thread of each tensor holds (<= kFusedItems)
};

template <Prec P>
__global__ void __launch_bounds__(kThreads, kFusedCtasPerSm) fused_codes_kernel(const __grid_constant__ FusedParams p) {
  static_assert(P != Prec::fp4, "fp4 blocks span lanes: the general kernel");
  const FlatParams& f = p.f;
  const int which = blockIdx.x >= f.ctas0 ? 1 : 0;
  const unsigned cta = which ? blockIdx.x - f.ctas0 : blockIdx.x, ctas = which ? gridDim.x - f.ctas0 : f.ctas0;
  const std::int64_t first = static_cast<std::int64_t>(cta) * kThreads + threadIdx.x, n = f.items[which];
  const std::int64_t stride = static_cast<std::int64_t>(ctas) * kThreads;
  const int count = p.per_thread[which];
  const uint4* src = f.src[which];
  uint4 raw[kFusedItems];
#pragma unroll
  for (int k = 0; k < kFusedItems; ++k) {
    const std::int64_t i = first + k * stride;
    raw[k] = k < count && i < n ? __ldg(src + i) : make_uint4(0u, 0u, 0u, 0u);  // zeros leave the max alone
  }
  const In type = f.type[which];
  auto units_max = [&](auto acc) {
#pragma unroll
    for (int k = 0; k < kFusedItems; ++k) fold_unit(acc, raw[k]);
    return acc.value();
  };
  float m = type == In::f16 ? units_max(Packed<In::f16>{}) : units_max(Packed<In::bf16>{});
  __shared__ float red[kThreads / 32];
  auto block_max = [&](float v) {  // to every thread
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < kThreads / 32; ++w) v = fmaxf(v, red[w]);
    __syncthreads();  // red is free again
    return v;
  };
  m = block_max(m);
  if (threadIdx.x == 0) p.slots[blockIdx.x] = m;
  ::cooperative_groups::this_grid().sync();  // every CTA's slot is written and visible
  sel::pdl_launch_dependents();
  const unsigned lo = which ? f.ctas0 : 0u, hi = which ? gridDim.x : f.ctas0;
  float t = 0.0f;
  for (unsigned c = lo + threadIdx.x; c < hi; c += kThreads) t = fmaxf(t, __ldcg(p.slots + c));
  t = block_max(t);
  if (cta == 0 && threadIdx.x == 0) p.amax[which] = __float_as_uint(t);
  const TensorScale sc = tensor_constants_of<P>(__float_as_uint(t), f.bf16_down);
  flat_items<P>(type, raw, sc, f.dst[which], first, stride, count, n);
}

/// Whether `p` (token_max's rows) is the flat kernels' case ("flat codes" above).
template <Prec P>
bool flat_case(const CodesParams<RowLayout>& p) {
  if (P == Prec::fp4) return false;
  for (int w = 0; w < 2; ++w)
    if (!p.lay[w].contiguous || p.lay[w].pitch != p.src[w].D * kCodeBytes<P> || p.src[w].D % 8 != 0 ||
        p.type[w] == In::f32 || reinterpret_cast<std::uintptr_t>(p.dst[w]) % 16 != 0)
      return false;
  return true;
}

// The flat kernels' parameters for `p` (flat_case<P>(p) holds), without the CTA split.
template <Prec P>
FlatParams flat_params(const CodesParams<RowLayout>& p) {
  FlatParams f{};
  for (int w = 0; w < 2; ++w) {
    f.src[w] = static_cast<const uint4*>(p.src[w].x);
    f.dst[w] = p.dst[w];
    f.type[w] = p.type[w];
  }
  f.items[0] = p.rows0 * p.lanes;
  f.items[1] = p.items() - f.items[0];
  f.amax = p.amax;
  f.bf16_down = p.bf16_down;
  return f;
}

/// Launches codes_kernel<P> for `p` on `stream` (flat_codes_kernel<P> where flat_case holds), as a programmatic
/// dependent of the previous kernel when `dependent` (the amax), else plainly.
template <Prec P, class Layout>
void launch_codes(const std::string& op, const CodesParams<Layout>& p, bool dependent, cudaStream_t stream) {
  if (p.items() <= 0) return;
  if constexpr (std::is_same_v<Layout, RowLayout> && P != Prec::fp4) {
    if (flat_case<P>(p)) {
      FlatParams f = flat_params<P>(p);
      constexpr std::int64_t kPerCta = kFlatItems * kThreads;
      const std::int64_t ctas0 = (f.items[0] + kPerCta - 1) / kPerCta, ctas1 = (f.items[1] + kPerCta - 1) / kPerCta;
      f.ctas0 = static_cast<unsigned>(ctas0);
      sel::launch_kernel(op, "codes launch", flat_codes_kernel<P>, dim3(static_cast<unsigned>(ctas0 + ctas1)), dim3(kThreads),
                         0, stream, dependent, f);
      return;
    }
  }
  const int sms = sel::current_sm_count(op);
  const std::int64_t rounds = (p.items() + kRound * kThreads - 1) / (kRound * kThreads);
  const auto grid = static_cast<unsigned>(imin<std::int64_t>(rounds, static_cast<std::int64_t>(sms) * kCodesCtasPerSm));
  sel::launch_kernel(op, "codes launch", codes_kernel<P, Layout>, dim3(grid), dim3(kThreads), 0, stream, dependent, p);
}

/// The amax and the codes of `p` in one cooperative launch of fused_codes_kernel<P> on `stream`, where
/// flat_case<P>(p) holds, both tensors have items and every item fits in the resident wave (kFusedItems a
/// thread, at most kFusedMaxCtas CTAs): amax[0] and [1] become the amax words (as launch_amax's; they need
/// not be zeroed; p.amax is not read), `slots` (fused_slot_bytes() of scratch) holds the CTAs' maxima.
/// Returns false and launches nothing otherwise (the caller then zeroes the amax words and launches
/// launch_amax and launch_codes).
template <Prec P>
bool launch_fused(const std::string& op, const CodesParams<RowLayout>& p, unsigned* amax, float* slots,
                  cudaStream_t stream) {
  if constexpr (P == Prec::fp4) {
    return false;
  } else {
    if (!flat_case<P>(p)) return false;
    FusedParams fp{};
    fp.f = flat_params<P>(p);
    const std::int64_t items[2] = {fp.f.items[0], fp.f.items[1]};
    if (items[0] <= 0 || items[1] <= 0) return false;
    // kFusedCtasPerSm CTAs of an SM are resident together: the launch bounds hold the registers to it, and
    // 1024 threads and 32 bytes of shared memory fit any sm_90 SM (a cooperative launch checks it again).
    const std::int64_t resident =
        imin<std::int64_t>(kFusedMaxCtas, std::int64_t{kFusedCtasPerSm} * sel::current_sm_count(op));
    // CTAs in proportion to the items (at least one each), no more than a thread per item.
    const std::int64_t total = items[0] + items[1];
    std::int64_t ctas[2];
    ctas[0] = imax<std::int64_t>(1, imin(resident - 1, (resident * items[0] + total / 2) / total));
    ctas[1] = resident - ctas[0];
    for (int w = 0; w < 2; ++w) {
      ctas[w] = imin(ctas[w], (items[w] + kThreads - 1) / kThreads);
      if (ctas[w] < 1) return false;
      const std::int64_t per = (items[w] + ctas[w] * kThreads - 1) / (ctas[w] * kThreads);
      if (per > kFusedItems) return false;
      fp.per_thread[w] = static_cast<int>(per);
    }
    fp.f.ctas0 = static_cast<unsigned>(ctas[0]);
    fp.slots = slots;
    fp.amax = amax;
    sel::check_cuda(cuda_kernels::launch_cooperative(fused_codes_kernel<P>, dim3(static_cast<unsigned>(ctas[0] + ctas[1])),
                                                     dim3(kThreads), 0, stream, fp),
                    op, "amax and codes launch");
    return true;
  }
}

}  // namespace sparse_attn::cuda_backend::prep
