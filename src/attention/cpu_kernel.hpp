// The CPU attention mainloop shared by every executor (dense, tile_sparse, bits_sparse,
// query_sparse, token_sparse).
//
// The unit of work is a RowTile (up to a few hundred query rows that share a head dim, each with its
// own causal limit) meeting one KVView (up to kBlockK keys converted to float once, held by a
// BlockStore for contiguous blocks or a KVBlock for gathered keys). `block_step`
// runs S = Q K^T, the online-softmax update and O += P V for that pair; `finalize_row` turns the
// running state into an output row and its LSE. The drivers only decide which rows go together and
// which blocks they meet, in what order:
//   - Q-centric (dense / tile_sparse / bits_sparse): a Q tile of one head visits its blocks;
//   - KV-centric (query_sparse): one block meets the gathered (query, head) rows that chose it;
//   - token_sparse: the heads of one query meet the gathered keys of that query.
//
// Causal visibility inside a contiguous block is a prefix of its keys for each row (key j is visible
// iff start + j <= limit), so masking is a per-row length, never a -inf fill; rows whose prefix is
// empty leave their state untouched, which is how "sees no key -> out 0, lse -inf" falls out.
//
// The running max m is kept unscaled and p = exp((s - m) * scale): the row's max weighs exactly 1
// whatever the scale (exp(s * scale - m * scale) would weigh it exp of the rounding error of m * scale,
// which overflows once that product is past 2^31 or so).
//
// Non-finite scores (docs/design.md §2): exp_f32 passes NaN through, so a NaN score, or a +inf one (inf - inf
// against the max it raised), makes the row's l NaN for good; a -inf score weighs 0. finalize_row
// tells "no key" (m = -inf and l = 0) from every other state, in which it divides by l; a NaN l, or a
// max whose scaled value overflows float32, gives NaN out and lse.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/cpu.hpp"
#include "sparse_attn/formats.hpp"

namespace sparse_attn::detail::attn {

// Micro-kernel shape: kRowBlock rows x kColChunk columns of accumulators. 4 x 32 floats is 16
// eight-wide vectors, which fits the register file with room for the streamed operand. (Tried:
// 4 x 64 in 512-bit registers on an AVX-512 Xeon. QK^T alone ran 1.5x faster with its operands in
// L1, but the whole dense problem ran 25% slower, so 256-bit vectors stay.)
inline constexpr std::int64_t kRowBlock = 4;
inline constexpr std::int64_t kColChunk = 32;
// Head dims are padded to this multiple in V and O so that the PV loops have no tail.
inline constexpr std::int64_t kDimPad = kColChunk;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline std::int64_t padded_dim(std::int64_t D) { return ceil_div(D, kDimPad) * kDimPad; }

// a * b + c as one fused operation where the target has FMA; the library is compiled in ISO mode,
// where GCC does not contract on its own, and the micro-kernels are FMA-bound.
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// exp(x) in float32, written so that loops over it vectorise (std::exp does not without
/// -ffast-math, and neither do floor or float->int conversions under -ftrapping-math, so rounding
/// uses the 1.5 * 2^23 shift). Cody-Waite reduction by ln 2 and the Cephes degree-5 minimax
/// polynomial: within 1.3 ulp of exp over [-87, 88] (tested). Results below FLT_MIN (x < -87.3)
/// are flushed to 0 and -inf gives 0: in a softmax they sit next to a term equal to 1. NaN gives NaN
/// (the comparisons are written so that a NaN x falls through them).
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // few mantissa bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kMin = -87.3f, kMax = 88.0f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  const float lo = x < kMin ? kMin : x;
  const float xc = lo > kMax ? kMax : lo;
  const float shifted = fmadd(xc, kLog2e, kRound);
  const float n = shifted - kRound;
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = fmadd(p, r, 1.3981999507e-3f);
  p = fmadd(p, r, 8.3334519073e-3f);
  p = fmadd(p, r, 4.1665795894e-2f);
  p = fmadd(p, r, 1.6666665459e-1f);
  p = fmadd(p, r, 5.0000001201e-1f);
  p = fmadd(p, r * r, r + 1.0f);
  const std::uint32_t biased = std::bit_cast<std::uint32_t>(shifted) - 0x4B400000u + 127u;  // n + 127
  const float two_n = std::bit_cast<float>(biased << 23);
  // The underflow flush is an integer mask: a floating select would become a branch (the multiply
  // may trap), and the branch would keep the loop from vectorising.
  const std::uint32_t keep = x < kMin ? 0u : 0xffffffffu;
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(p * two_n) & keep);
}

/// One block of keys and values as float: kt is K transposed ([D][kBlockK], key j in column j) so
/// the score loop runs contiguously over keys; v is [kBlockK][DP]. Columns and rows past n may hold
/// anything finite: the score loop computes whole chunks, but nothing downstream reads past n.
struct KVView {
  const float* kt = nullptr;
  const float* v = nullptr;
  std::int64_t n = 0;      // keys held
  std::int64_t start = 0;  // position of key 0 (contiguous blocks; used by the causal prefix)
};

inline std::int64_t kt_floats(std::int64_t D) { return D * kBlockK; }
inline std::int64_t v_floats(std::int64_t D) { return kBlockK * padded_dim(D); }

/// kt[d][j] = rows[j][d] for j < n (rows is [n][D], row-major). Blocked so that both sides touch
/// few cache lines at a time: writing one key straight into its column touches D lines per key.
inline void transpose_keys(const float* rows, std::int64_t n, std::int64_t D, float* kt) {
  constexpr std::int64_t kT = 16;
  for (std::int64_t j0 = 0; j0 < n; j0 += kT) {
    const std::int64_t j1 = std::min(n, j0 + kT);
    for (std::int64_t d0 = 0; d0 < D; d0 += kT) {
      const std::int64_t d1 = std::min(D, d0 + kT);
      for (std::int64_t d = d0; d < d1; ++d)
        for (std::int64_t j = j0; j < j1; ++j) kt[d * kBlockK + j] = rows[j * D + d];
    }
  }
}

/// Keys [start, start + count) of head hk into kt / v, through `rows` ([kBlockK][D] scratch). The
/// padding of v rows is left as it was: zero when the buffer was zero-initialised.
inline void load_contiguous_block(const TensorView& k, const TensorView& v, std::int64_t b, std::int64_t start,
                                  std::int64_t count, std::int64_t hk, float* kt, float* vp, float* rows) {
  const std::int64_t D = k.shape[3], DP = padded_dim(D);
  for (std::int64_t j = 0; j < count; ++j) {
    load_bhld(k, b, start + j, hk, rows + j * D);
    load_bhld(v, b, start + j, hk, vp + j * DP);
  }
  transpose_keys(rows, count, D, kt);
}

/// An owned block of gathered keys (token_sparse): keys are appended as rows and transposed once,
/// by view().
struct KVBlock {
  std::int64_t D = 0;
  std::int64_t n = 0, start = 0;
  bool pending = false;  // rows appended since the last transpose
  std::vector<float> kt, v, rows;

  explicit KVBlock(std::int64_t d) : D(d) {
    kt.assign(static_cast<std::size_t>(kt_floats(D)), 0.0f);
    v.assign(static_cast<std::size_t>(v_floats(D)), 0.0f);
    rows.assign(static_cast<std::size_t>(kBlockK * D), 0.0f);
  }

  void begin(std::int64_t key_start) {
    start = key_start;
    n = 0;
    pending = false;
  }
  /// Appends key/value row `pos` of head hk of batch b (at most kBlockK per block).
  void push(const TensorView& k, const TensorView& v_in, std::int64_t b, std::int64_t pos, std::int64_t hk) {
    load_bhld(k, b, pos, hk, rows.data() + n * D);
    load_bhld(v_in, b, pos, hk, v.data() + n * padded_dim(D));
    ++n;
    pending = true;
  }
  /// The block as the mainloop reads it (transposes the appended keys first).
  KVView view() {
    if (pending) transpose_keys(rows.data(), n, D, kt.data());
    pending = false;
    return KVView{kt.data(), v.data(), n, start};
  }
};

/// K and V as float for the blocks a pass will visit, converted once and then shared read-only by
/// every work item of the pass (converting per item would repeat the work for every Q tile, or
/// every split of a popular block). Covers `pairs` consecutive (batch, KV head) pairs starting at
/// `pair0` (pair = b * Hkv + hk). Only marked blocks get storage, so a sparse selection costs
/// memory in proportion to what it touches.
class BlockStore {
 public:
  BlockStore(std::int64_t pair0, std::int64_t pairs, std::int64_t Lk, std::int64_t D)
      : pair0_(pair0), Lk_(Lk), Tk_(ceil_div(Lk, kBlockK)), D_(D), stride_(kt_floats(D) + v_floats(D)),
        slot_(static_cast<std::size_t>(pairs * Tk_), -1) {}

  /// Block j of the store's pair `pair` (0-based within the store) will be visited.
  void mark(std::int64_t pair, std::int64_t j) { slot_[static_cast<std::size_t>(pair * Tk_ + j)] = 0; }

  /// Gives every marked block storage (zeroed: the padding of V rows must be finite) and converts
  /// it from k and v, in parallel.
  void fill(const TensorView& k, const TensorView& v) {
    std::int64_t n = 0;
    for (auto& s : slot_)
      if (s >= 0) s = n++;
    data_.assign(static_cast<std::size_t>(n * stride_), 0.0f);
    const std::int64_t Hkv = k.shape[2];
    parallel_for(static_cast<std::int64_t>(slot_.size()), [&](std::int64_t flat) {
      if (slot_[static_cast<std::size_t>(flat)] < 0) return;
      const std::int64_t pair = pair0_ + flat / Tk_, j = flat % Tk_;
      std::vector<float> rows(static_cast<std::size_t>(kBlockK * D_));
      load_contiguous_block(k, v, pair / Hkv, j * kBlockK, std::min(kBlockK, Lk_ - j * kBlockK), pair % Hkv,
                            kt(flat), this->v(flat), rows.data());
    });
  }

  /// Block j of pair `pair`, which must have been marked before fill().
  KVView view(std::int64_t pair, std::int64_t j) {
    const std::int64_t flat = pair * Tk_ + j;
    return KVView{kt(flat), v(flat), std::min(kBlockK, Lk_ - j * kBlockK), j * kBlockK};
  }

 private:
  float* kt(std::int64_t flat) { return data_.data() + slot_[static_cast<std::size_t>(flat)] * stride_; }
  float* v(std::int64_t flat) { return kt(flat) + kt_floats(D_); }

  std::int64_t pair0_, Lk_, Tk_, D_, stride_;
  std::vector<std::int64_t> slot_;  // per (pair, block): storage slot, or -1 when not visited
  std::vector<float> data_;
};

/// Running state of a set of query rows: Q as float [R][D] (scale not applied), O [R][DP], the
/// running max m (unscaled scores), the denominator l, and each row's last visible key position.
struct RowTile {
  std::int64_t D = 0, DP = 0, capacity = 0, rows = 0;
  std::vector<float> q, o, m, l, s, alpha;
  std::vector<std::int64_t> limit, visible;

  RowTile(std::int64_t d, std::int64_t cap) : D(d), DP(padded_dim(d)), capacity(cap) {
    const auto c = static_cast<std::size_t>(ceil_div(cap, kRowBlock) * kRowBlock);
    q.assign(c * static_cast<std::size_t>(D), 0.0f);
    o.assign(c * static_cast<std::size_t>(DP), 0.0f);
    s.assign(c * static_cast<std::size_t>(kBlockK), 0.0f);
    m.assign(c, kNegInf);
    l.assign(c, 0.0f);
    alpha.assign(c, 1.0f);
    limit.assign(c, -1);
    visible.assign(c, 0);
  }

  /// Starts a fresh softmax over `r` <= capacity rows (their q rows and limits are filled by the
  /// caller).
  void reset(std::int64_t r) {
    rows = r;
    std::fill(o.begin(), o.begin() + r * DP, 0.0f);
    std::fill(m.begin(), m.begin() + r, kNegInf);
    std::fill(l.begin(), l.begin() + r, 0.0f);
  }

  float* q_row(std::int64_t r) { return q.data() + r * D; }
  const float* o_row(std::int64_t r) const { return o.data() + r * DP; }
};

// S[r][0:nc) = Q[r] . K[:, 0:nc) for RB rows starting at q (row stride D). nc is a multiple of
// kColChunk. The accumulators stay in registers across the whole reduction over d.
template <std::int64_t RB>
inline void qk_rows(const float* q, std::int64_t D, const float* kt, std::int64_t nc, float* s) {
  for (std::int64_t j0 = 0; j0 < nc; j0 += kColChunk) {
    float acc[RB][kColChunk] = {};
    for (std::int64_t d = 0; d < D; ++d) {
      const float* kr = kt + d * kBlockK + j0;
      for (std::int64_t r = 0; r < RB; ++r) {
        const float qv = q[r * D + d];
#pragma omp simd
        for (std::int64_t jj = 0; jj < kColChunk; ++jj) acc[r][jj] = fmadd(qv, kr[jj], acc[r][jj]);
      }
    }
    for (std::int64_t r = 0; r < RB; ++r)
#pragma omp simd
      for (std::int64_t jj = 0; jj < kColChunk; ++jj) s[r * kBlockK + j0 + jj] = acc[r][jj];
  }
}

// O[r] = alpha[r] * O[r] + sum_{j < n} P[r][j] V[j] for RB rows (P rows are zero past each row's
// visible prefix).
template <std::int64_t RB>
inline void pv_rows(const float* p, const float* alpha, const float* v, std::int64_t n, std::int64_t DP, float* o) {
  for (std::int64_t d0 = 0; d0 < DP; d0 += kColChunk) {
    float acc[RB][kColChunk];
    for (std::int64_t r = 0; r < RB; ++r)
#pragma omp simd
      for (std::int64_t dd = 0; dd < kColChunk; ++dd) acc[r][dd] = o[r * DP + d0 + dd] * alpha[r];
    for (std::int64_t j = 0; j < n; ++j) {
      const float* vr = v + j * DP + d0;
      for (std::int64_t r = 0; r < RB; ++r) {
        const float pv = p[r * kBlockK + j];
#pragma omp simd
        for (std::int64_t dd = 0; dd < kColChunk; ++dd) acc[r][dd] = fmadd(pv, vr[dd], acc[r][dd]);
      }
    }
    for (std::int64_t r = 0; r < RB; ++r)
#pragma omp simd
      for (std::int64_t dd = 0; dd < kColChunk; ++dd) o[r * DP + d0 + dd] = acc[r][dd];
  }
}

// Online-softmax update of row r against its scores s[0:n) in place (they become P): keys at or
// past `nv` are invisible to the row.
inline void softmax_row(RowTile& t, std::int64_t r, std::int64_t n, std::int64_t nv, float scale) {
  float* srow = t.s.data() + r * kBlockK;
  const auto ri = static_cast<std::size_t>(r);
  if (nv <= 0) {
    std::fill(srow, srow + n, 0.0f);
    t.alpha[ri] = 1.0f;
    return;
  }
  // Reductions run lane-wise over whole chunks: GCC in ISO mode vectorises neither a float sum nor
  // a max written as a single accumulator.
  float lanes[kColChunk];
  std::fill(lanes, lanes + kColChunk, kNegInf);
  std::int64_t j = 0;
  for (; j + kColChunk <= nv; j += kColChunk)
    for (std::int64_t jj = 0; jj < kColChunk; ++jj) lanes[jj] = lanes[jj] > srow[j + jj] ? lanes[jj] : srow[j + jj];
  float mx = kNegInf;
  for (; j < nv; ++j) mx = std::max(mx, srow[j]);
  for (std::int64_t jj = 0; jj < kColChunk; ++jj) mx = std::max(mx, lanes[jj]);

  // The max passes over NaN (std::max with the running value first), so m is never NaN.
  const float m_new = std::max(t.m[ri], mx);
  // While every score seen is -inf, m stays -inf: subtracting 0 instead makes p = exp(-inf) = 0
  // rather than NaN (-inf - -inf).
  const float base = m_new == kNegInf ? 0.0f : m_new;
  const float a = exp_f32((t.m[ri] - base) * scale);  // m = -inf on the first visible block: a = 0
  for (j = 0; j < nv; ++j) srow[j] = exp_f32((srow[j] - base) * scale);

  std::fill(lanes, lanes + kColChunk, 0.0f);
  for (j = 0; j + kColChunk <= nv; j += kColChunk)
    for (std::int64_t jj = 0; jj < kColChunk; ++jj) lanes[jj] += srow[j + jj];
  float sum = 0.0f;
  for (; j < nv; ++j) sum += srow[j];
  for (std::int64_t jj = 0; jj < kColChunk; ++jj) sum += lanes[jj];
  std::fill(srow + nv, srow + n, 0.0f);
  t.l[ri] = fmadd(t.l[ri], a, sum);
  t.m[ri] = m_new;
  t.alpha[ri] = a;
}

/// One block against every row of the tile. `causal_prefix`: the block is contiguous and some rows
/// may see only a prefix of it (their limit falls inside or before it); otherwise every row sees
/// all n keys.
inline void block_step(RowTile& t, const KVView& kv, float scale, bool causal_prefix) {
  const std::int64_t n = kv.n;
  if (n == 0 || t.rows == 0) return;
  const std::int64_t nc = ceil_div(n, kColChunk) * kColChunk;
  const std::int64_t R = t.rows;
  std::int64_t r = 0;
  for (; r + kRowBlock <= R; r += kRowBlock) qk_rows<kRowBlock>(t.q_row(r), t.D, kv.kt, nc, t.s.data() + r * kBlockK);
  for (; r < R; ++r) qk_rows<1>(t.q_row(r), t.D, kv.kt, nc, t.s.data() + r * kBlockK);

  std::int64_t any_visible = 0;
  for (r = 0; r < R; ++r) {
    std::int64_t nv = n;
    if (causal_prefix) nv = std::clamp<std::int64_t>(t.limit[static_cast<std::size_t>(r)] - kv.start + 1, 0, n);
    t.visible[static_cast<std::size_t>(r)] = nv;
    any_visible |= nv;
    softmax_row(t, r, n, nv, scale);
  }
  if (!any_visible) return;

  for (r = 0; r + kRowBlock <= R; r += kRowBlock) {
    std::int64_t nmax = 0;
    for (std::int64_t i = 0; i < kRowBlock; ++i) nmax = std::max(nmax, t.visible[static_cast<std::size_t>(r + i)]);
    if (nmax == 0) continue;  // no row saw a key: state and O unchanged (alpha = 1)
    pv_rows<kRowBlock>(t.s.data() + r * kBlockK, t.alpha.data() + r, kv.v, nmax, t.DP, t.o.data() + r * t.DP);
  }
  for (; r < R; ++r) {
    const std::int64_t nv = t.visible[static_cast<std::size_t>(r)];
    if (nv == 0) continue;
    pv_rows<1>(t.s.data() + r * kBlockK, t.alpha.data() + r, kv.v, nv, t.DP, t.o.data() + r * t.DP);
  }
}

/// Output row r (D floats) and its LSE: 0 and -inf for a row that saw no key; NaN for a row with a
/// NaN or +inf score, or whose scaled max overflows float32.
inline float finalize_row(const RowTile& t, std::int64_t r, float* out_row, float scale) {
  const auto ri = static_cast<std::size_t>(r);
  const float l = t.l[ri];
  if (l == 0.0f && t.m[ri] == kNegInf) {
    std::fill(out_row, out_row + t.D, 0.0f);
    return kNegInf;
  }
  const float m_scaled = t.m[ri] * scale;
  const bool in_range = std::isfinite(m_scaled);
  const float inv = in_range ? 1.0f / l : std::numeric_limits<float>::quiet_NaN();
  const float* o = t.o_row(r);
#pragma omp simd
  for (std::int64_t d = 0; d < t.D; ++d) out_row[d] = o[d] * inv;
  return in_range ? m_scaled + std::log(l) : std::numeric_limits<float>::quiet_NaN();
}

/// Address of lse[b, h, i] (float32 [B, Hq, Lq], any strides).
inline float* lse_ptr(const TensorView& lse, std::int64_t b, std::int64_t h, std::int64_t i) {
  return lse.ptr<float>() + b * lse.stride[0] + h * lse.stride[1] + i * lse.stride[2];
}

}  // namespace sparse_attn::detail::attn
