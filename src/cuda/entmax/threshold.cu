// entmax on the GPU (docs/design.md §5.6): per-row thresholds by passes over recomputed scores, the
// block bits of the support, then the output pass (the Q-centric kernel with the entmax transform,
// attention/entmax_transform.cuh) over the set bits.
//
// Scores are never stored. Every pass recomputes S = Q K^T with wgmma for a CTA of one Q tile (128
// rows) of one (b, head): a producer warp streams the visible K blocks (128 keys) by TMA through a ring
// of kStages slots, and two consumer warpgroups of 64 rows each run the SS wgmma (m64n128, float32
// accumulation) with the next block's product in flight while they read the current one. No P V. The
// per-row arithmetic is bracket.hpp's (host and device code, checked on the CPU):
//   1. first pass: the row max and, for alpha = 2 and 1.5, the ring of bins of bracket.hpp, which
//      slides up with the running max, its bottom raised now and then to where the scores seen so
//      far settle the threshold (ring_settled); at the end each row is closed where the root's bin
//      holds no score (closed form), or left with the bracket of that bin and its count. NaN/+inf
//      rows and rows without keys are found here. Other alphas: the row max only. A block's
//      candidates are placed by the whole warp through a queue of score pairs.
//   2. refining passes (kMaxPasses, and one more that marks the rows the last finished by binning):
//      each pass counts the rows the next one has work for, so a launch past convergence reads one
//      word and returns, and a CTA whose rows need nothing returns at once. Per row, by its state:
//      - collect (the bracket holds at most kCollect scores): those scores (as u - lo) and the moments
//        of the scores above the bracket; tau solved exactly at the end of the pass;
//      - bin (a bracket holding more, or other alphas): the bracket cut into kSections intervals, as
//        in the first pass but on a fixed grid; a row still bracketed after the last pass takes the
//        midpoint;
//      - mark (threshold known, bits not yet set): the pairs with z > z_tau counted, and the bit of
//        (tile, 128-key block) set where some row has z > z_tau - margin, margin = 2^-10 max(1, |z_max|):
//        the output pass recomputes the scores with the same wgmma but may sum them in another order,
//        so no block holding a score that it weighs is ever skipped.
//      A collecting row also sets its bits in that pass, with the bracket's low end standing in for
//      z_tau while the pass runs (z > z_lo - margin): at most a bracket's width (1/32 of the window)
//      below the threshold, so a block is set that holds only such a score. A row that finishes by
//      binning is marked in the next pass. On random rows every row is live after the collecting pass,
//      which also sets every bit: two passes in all.
// A row finishes with z_tau = z_max + (tau - 1) / (alpha - 1) in float32: its weights are
// ((alpha - 1)(z - z_tau))^r for z > z_tau, normalised by their sum in the output pass. The threshold is
// thus exact to the float32 resolution of z_tau (a few 1e-7 of |z|).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "core/check.hpp"
#include "cuda/attention/entmax_params.hpp"
#include "cuda/attention/mainloop.cuh"
#include "cuda/attention/softmax.cuh"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/smem_limit.hpp"
#include "cuda/common/sync.cuh"
#include "cuda/common/tma.hpp"
#include "cuda/common/wgmma.cuh"
#include "cuda/common/workspace_cache.hpp"
#include "cuda/convert/backend.hpp"
#include "cuda/entmax/backend.hpp"
#include "cuda/entmax/bracket.hpp"

namespace sparse_attn::cuda_kernels::entmax {

// K ring depth: with no V ring the slots take its room (D = 128: Q 32 KB + 4 x 32 KB + the rows' bins
// and search state 55 KB of the 227 KB), three blocks of lead over the consumers' score arithmetic.
constexpr int kStages = 4;
constexpr int kThreads = 128 + kConsumerThreads;  // producer warpgroup + two consumer warpgroups
constexpr std::uint32_t kProducerRegs = 24, kConsumerRegs = 240;  // as the Q-centric kernel
constexpr float kBitMargin = 1.0f / 1024.0f;

enum class Pass { kFirst, kRefine };
// What a refining pass does for a row (the file's comment).
enum class Role { kNone, kMark, kBin, kCollect };

struct ScanParams {
  int Lq = 0, Lk = 0, Hq = 0, group = 1, Tq = 0, words = 0;
  bool causal = false;
  float scale = 1.0f;
  double am1 = 0.5, r = 2.0;
  int power = 2;                    // 1: r = 1, 2: r = 2, 0: other
  int pass = 0;                     // refining pass: 0, 1, .. kMaxPasses
  bool last_pass = false;           // the last bracketing pass: every row finishes
  // Rows that refining pass k has work for, counted by the pass before it (zeroed first): a launch
  // past convergence reads one word and returns.
  int* pending = nullptr;           // [kMaxPasses + 1]
  EntmaxRow* rows = nullptr;        // [B, Hq, Lq]
  std::uint32_t* bits = nullptr;    // [B, Hq, Tq, words], zeroed before the first pass
  unsigned long long* support = nullptr;
};

// A row's bins: the first pass's ring (or a bracketing pass's kSections + 1 bins), or a collecting
// pass's scores inside the bracket and the moments of those above it.
struct RingBins {
  int cnt[kRing];
  float s1[kRing];  // power 1, 2: sum d; other alphas: f at interior edge j (j >= 1)
  float s2[kRing];
};
struct Collected {
  int n;  // scores >= hi: count, sum and sum of squares of u - hi
  float s1, s2;
  float d[kCollect];  // the scores inside the bracket as u - lo
};
union RowBins {
  RingBins ring;
  Collected coll;
};
constexpr int kRowWords = sizeof(RowBins) / 4;
// What a refining pass reads of a row on its few candidate scores (in shared memory: held in registers
// it would push the two accumulators' neighbours into local memory).
struct RowSearch {
  double lo, hi;
  float z_max, z_lo, z_tau;
  float z_bit;  // scores above this set their block's bit (+inf: none)
  Role role;
};

// The first pass's candidates of a block are placed by the whole warp: each lane writes the score pairs
// holding its candidates to the warp's queue (lanes in order, then fragment pairs in order: a fixed
// order) and the lanes take the queue's entries in turn, so the visits are shared evenly and no register
// is picked dynamically (placed by the lane that holds them, a warp would run its candidate loop as often
// as its busiest lane needs; docs/notes/entmax.md, version 3). Other alphas have no ring and no
// candidates.

// What the first pass's placement reads of a row: the ring's anchor, the candidates' raw cut and the lowest
// bin index still binned (kNoBin: the row bins nothing).
struct FirstRow {
  float anchor;
  float cut;  // the row's raw cut: scores at or above it are candidates
  int bottom;
};
constexpr int kNoBin = std::numeric_limits<int>::max();
// Score pairs a warp's queue holds; a block with more (the first blocks of a row) drains in rounds.
constexpr int kQueue = 120;

template <class Elem, int D>
struct alignas(1024) ScanStorage {
  static constexpr int kHalves = D / 64;
  Elem q[kHalves][kTileRows][64];
  Elem k[kStages][kHalves][kBlockKeys][64];
  RowBins bins[kTileRows];
  RowSearch search[kTileRows];
  int ncoll[kTileRows];  // scores a collecting row found inside its bracket (may pass kCollect)
  // First pass, candidates placed by the warp: per row what the placement reads, per
  // consumer warp the queue of a block's candidate pairs (two raw scores of one row's neighbouring keys,
  // the row in the tile).
  FirstRow first[kTileRows];
  float2 queue_s[kConsumerThreads / 32][kQueue];
  std::uint8_t queue_row[kConsumerThreads / 32][kQueue];
  MBarrier q_full, k_full[kStages], k_empty[kStages];
};
static_assert(sizeof(ScanStorage<std::uint16_t, 128>) + 1024 <= 227 * 1024, "shared memory over budget");

__host__ __device__ inline int key_end(const ScanParams& p, int row) {
  return p.causal ? min(max(row + p.Lk - p.Lq + 1, 0), p.Lk) : p.Lk;
}

__device__ __forceinline__ Role role_of(const EntmaxRow& st, int power) {
  if (st.status == EntmaxRow::kSearching) return collects(st, power) ? Role::kCollect : Role::kBin;
  return st.status == EntmaxRow::kLive && !st.marked ? Role::kMark : Role::kNone;
}

// Element e of a score fragment, e not known at compile time, without moving the fragment to local
// memory (the candidates of a block are few).
__device__ __forceinline__ float pick(const float (&s)[64], int e) {
  float v = 0.0f;
  switch (e) {
#define SA_PICK4(i) \
  case i: v = s[i]; break; case i + 1: v = s[i + 1]; break; case i + 2: v = s[i + 2]; break; case i + 3: v = s[i + 3]; break;
#define SA_PICK16(i) SA_PICK4(i) SA_PICK4(i + 4) SA_PICK4(i + 8) SA_PICK4(i + 12)
    SA_PICK16(0) SA_PICK16(16) SA_PICK16(32) SA_PICK16(48)
#undef SA_PICK16
#undef SA_PICK4
    default: break;
  }
  return v;
}

// A cut on raw scores s for a cut z on z = s * scale (scale > 0), a few float steps low: every s with
// s * scale > z (or >=) lies above it. The hot loops compare raw scores (one instruction per score);
// the few above the cut are tested exactly.
__device__ __forceinline__ float raw_cut(float z, float scale) {
  const float t = z / scale;
  return t < INFINITY ? t - fabsf(t) * 1e-6f - 1e-30f : t;
}

// The K block a pass visits at step i of its nblk visible blocks: refining passes in order, the first pass
// in bracket.hpp's first_pass_block order.
template <Pass kPass>
__device__ __forceinline__ int visit_block(int i, int nblk) {
  return kPass == Pass::kFirst ? first_pass_block(i, nblk) : i;
}

// Fragment element e of thread `lane` (wgmma.cuh's layout): row (e / 2) % 2 of the thread's two, key
// 8 (e / 4) + 2 (lane % 4) + e % 2 of the block.
__device__ __forceinline__ int row_of(int e) { return (e / 2) % 2; }

// One consumer warpgroup's pass over the tile's blocks: 64 rows, two per thread (g and g + 8 of its
// warp's 16), each row's bins touched only by the four lanes of its quad.
template <class Tag, int D, Pass kPass>
__device__ __forceinline__ void consume(const ScanParams& p, ScanStorage<typename Tag::Elem, D>& sm, int consumer,
                                        int thread, int b, int h, int tile, int nblk) {
  const int w = thread / 32, lane = thread % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = tile * kTileRows, first_row = row0 + consumer * kRowsPerConsumer;
  const long long row_base = (static_cast<long long>(b) * p.Hq + h) * p.Lq;
  const int warp_row = consumer * kRowsPerConsumer + 16 * w;  // the warp's first row in the tile
  const auto rl = [&](int i) { return warp_row + g + 8 * i; };  // the thread's rows in the tile

  {  // the warp's 16 rows' bins start empty
    int* words = reinterpret_cast<int*>(&sm.bins[warp_row]);
    for (int e = lane; e < 16 * kRowWords; e += 32) words[e] = 0;
    if (lane < 16) sm.ncoll[warp_row + lane] = 0;
    __syncwarp();
  }

  // First pass: running max M, the ring's anchor and top bin, the window's floor as a raw cut (+inf: not
  // binned).
  const bool ring = kPass == Pass::kFirst && p.power != 0;
  const double c = kSections * p.am1;
  float M[2] = {-INFINITY, -INFINITY}, anchor[2] = {0.0f, 0.0f}, wfloor[2] = {INFINITY, INFINITY};
  int top[2] = {0, 0}, settled[2] = {0, 0};  // the top bin, and the settled bottom (ring_settled)
  bool bad[2] = {false, false}, lost[2] = {false, false};
  // Refining passes: per row the raw cut below which its role has nothing to do (+inf: no role); the
  // rest in sm.search.
  float scut[2] = {INFINITY, INFINITY};
  bool live_row[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    live_row[i] = row0 + rl(i) < p.Lq;
    if (kPass == Pass::kFirst || !live_row[i]) continue;
    const EntmaxRow st = p.rows[row_base + row0 + rl(i)];
    const Role role = role_of(st, p.power);
    const float margin = kBitMargin * fmaxf(1.0f, fabsf(st.z_max));
    // Mark: the bits below z_tau by the margin; collect: below the bracket's low end by the margin.
    const float z_bit = role == Role::kMark ? st.z_tau - margin : (role == Role::kCollect ? st.z_lo - margin : INFINITY);
    if (t4 == 0) sm.search[rl(i)] = RowSearch{st.lo, st.hi, st.z_max, st.z_lo, st.z_tau, z_bit, role};
    if (role != Role::kNone) scut[i] = raw_cut(role == Role::kBin ? st.z_lo : z_bit, p.scale);
  }
  __syncwarp();
  unsigned long long support = 0;
  std::uint32_t word = 0;  // the bits of the block word `word_idx` this warp has seen hits in
  int word_idx = 0;
  std::uint32_t* bits_row = p.bits + ((static_cast<long long>(b) * p.Hq + h) * p.Tq + tile) * p.words;
  const auto flush_word = [&]() {
    if (lane == 0 && word != 0u) atomicOr(bits_row + word_idx, word);
    word = 0u;
  };

  // The first pass's placement of a block's candidates (the comment above FirstRow): the rows' anchors,
  // cuts and bottom bins, the candidate pairs through the warp's queue, their ring bins.
  const auto place_candidates = [&](const float (&s)[64]) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (t4 == i)
        sm.first[rl(i)] =
            FirstRow{anchor[i], wfloor[i], wfloor[i] < INFINITY ? ring_bottom(top[i], settled[i]) : kNoBin};
    // Fragment elements 2k and 2k + 1 are neighbouring keys of one row: a pair goes to the queue where
    // either is a candidate.
    std::uint32_t pairs = 0u;
#pragma unroll
    for (int k = 0; k < 32; ++k)
      if (fmaxf(s[2 * k], s[2 * k + 1]) >= wfloor[row_of(2 * k)]) pairs |= 1u << k;
    const int mine = __popc(pairs);
    int before = mine;  // inclusive scan over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o) before += x;
    }
    const int total = __shfl_sync(0xffffffffu, before, 31);
    before -= mine;
    const int qw = w + 4 * consumer;  // the warp's queue
    for (int base = 0; base < total; base += kQueue) {
      int pos = before - base;
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const bool c = (pairs >> k) & 1u;
        if (c && static_cast<unsigned>(pos) < static_cast<unsigned>(kQueue)) {
          sm.queue_s[qw][pos] = make_float2(s[2 * k], s[2 * k + 1]);
          sm.queue_row[qw][pos] = static_cast<std::uint8_t>(rl(row_of(2 * k)));
        }
        pos += c ? 1 : 0;
      }
      __syncwarp();  // the queue and the rows' FirstRow
      const int n = min(total - base, kQueue);
      for (int k = lane; k < n; k += 32) {
        const int r = sm.queue_row[qw][k];
        const FirstRow fr = sm.first[r];
        const float2 v = sm.queue_s[qw][k];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float raw = x == 0 ? v.x : v.y;
          int sl;
          float d;
          if (!(raw >= fr.cut) || fr.bottom == kNoBin || !ring_place(raw * p.scale, fr.anchor, fr.bottom, c, sl, d))
            continue;
          RingBins& rb = sm.bins[r].ring;
          atomicAdd(&rb.cnt[sl], 1);
          atomicAdd(&rb.s1[sl], d);
          if (p.power == 2) atomicAdd(&rb.s2[sl], d * d);  // alpha = 2 (r = 1) reads no squares
        }
      }
      __syncwarp();  // the queue's reads before it is written again
    }
  };

  // The running max of a block's rows, the ring slid up with it (bins falling out cleared, by the
  // quad's four lanes in turn), on some blocks the bottom settled, then the scores above it binned.
  const auto first_block = [&](float (&s)[64], int i_step) {
    float mx[2] = {-INFINITY, -INFINITY};
    row_max<true>(s, mx);
#pragma unroll
    for (int i = 0; i < 2; ++i) mx[i] = quad_max<true>(mx[i]);
    __syncwarp();  // every lane's atomics of the previous block are in before slots are cleared
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float zm = mx[i] * p.scale;
      if (!(zm < INFINITY)) {  // NaN or +inf: the row is poisoned
        bad[i] = true;
        wfloor[i] = INFINITY;
        continue;
      }
      if (!(zm > M[i])) continue;
      if (!ring || !live_row[i] || bad[i] || lost[i]) {
        M[i] = zm;
        continue;
      }
      int nt = kRingBase;
      if (M[i] == -INFINITY) {
        anchor[i] = zm;
        top[i] = nt;  // the ring is empty
      } else {
        const double pos = ring_pos(zm, anchor[i], c);
        if (pos > kRingLimit) {
          lost[i] = true;
          wfloor[i] = INFINITY;
          M[i] = zm;
          continue;
        }
        nt = ring_index(pos);
      }
      M[i] = zm;
      if (nt > top[i]) {
        RingBins& rb = sm.bins[rl(i)].ring;
        for (int idx = max(top[i] + 1, nt - kSections) + t4; idx <= nt; idx += 4) {
          const int sl = ring_slot(idx);
          rb.cnt[sl] = 0;
          rb.s1[sl] = 0.0f;
          rb.s2[sl] = 0.0f;
        }
        top[i] = nt;
      }
      wfloor[i] = raw_cut(ring_edge(anchor[i], ring_bottom(top[i], settled[i]), c), p.scale);
    }
    __syncwarp();
    // Now and then (settles_after: steps 1, 2, 4, 8, 16, then every 16th) the bottom rises to where the
    // scores seen so far settle it: one lane per row scans its ring from the top, the quad takes its
    // verdict.
    if (ring && settles_after(i_step)) {
      int k_new[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (t4 != i || !(wfloor[i] < INFINITY)) continue;
        const RingBins& rb = sm.bins[rl(i)].ring;
        const int base = top[i] - kSections;
        k_new[i] = base + ring_settled(
                              [&](int k, int& n, float& a1, float& a2) {
                                const int sl = ring_slot(base + k);
                                n = rb.cnt[sl];
                                a1 = rb.s1[sl];
                                a2 = rb.s2[sl];
                              },
                              p.power);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = __shfl_sync(0xffffffffu, k_new[i], (lane & ~3) + i);
        if (k > settled[i] && wfloor[i] < INFINITY) {
          settled[i] = k;
          wfloor[i] = raw_cut(ring_edge(anchor[i], ring_bottom(top[i], k), c), p.scale);
        }
      }
      __syncwarp();  // the scans' reads before the block's atomics
    }
    if (ring) place_candidates(s);
  };

  // A refining pass's block: the few scores above a row's cut are marked, counted and searched.
  const auto refine_block = [&](float (&s)[64], int j) {
    std::uint32_t cand[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 64; ++e)
      if (s[e] > scut[row_of(e)]) cand[e / 32] |= 1u << (e % 32);
    bool hit = false;
#pragma unroll
    for (int half = 0; half < 2; ++half)
      for (std::uint32_t m = cand[half]; m != 0u; m &= m - 1u) {
        const int e = 32 * half + __ffs(m) - 1, r = rl(row_of(e));
        const RowSearch rs = sm.search[r];
        const float z = pick(s, e) * p.scale;
        hit |= z > rs.z_bit;
        if (rs.role == Role::kMark) {
          support += z > rs.z_tau ? 1u : 0u;
          continue;
        }
        if (!(z > rs.z_lo)) continue;
        const double rlo = rs.lo, rhi = rs.hi;
        const double u = p.am1 * (static_cast<double>(z) - static_cast<double>(rs.z_max)) + 1.0;
        RowBins& rb = sm.bins[r];
        if (rs.role == Role::kCollect) {
          if (u < rhi) {
            const int slot = atomicAdd(&sm.ncoll[r], 1);
            if (slot < kCollect) rb.coll.d[slot] = static_cast<float>(fmax(u - rlo, 0.0));
          } else {
            const double d = u - rhi;
            atomicAdd(&rb.coll.n, 1);
            atomicAdd(&rb.coll.s1, static_cast<float>(d));
            if (p.power == 2) atomicAdd(&rb.coll.s2, static_cast<float>(d * d));
          }
        } else if (p.power != 0) {
          double d;
          const int k = bin_of(u, rlo, rhi, d);
          atomicAdd(&rb.ring.cnt[k], 1);
          atomicAdd(&rb.ring.s1[k], static_cast<float>(d));
          if (p.power == 2) atomicAdd(&rb.ring.s2[k], static_cast<float>(d * d));
        } else {
          const float rf = static_cast<float>(p.r);
          const double wd = (rhi - rlo) / kSections;
          for (int k = 1; k < kSections; ++k) {
            const double x = u - (rlo + k * wd);
            if (!(x > 0.0)) break;
            atomicAdd(&rb.ring.s1[k], fast_exp2(rf * __log2f(static_cast<float>(x))));
          }
        }
      }
    if (j / 32 != word_idx) {
      flush_word();
      word_idx = j / 32;
    }
    if (__any_sync(0xffffffffu, hit)) word |= 1u << (j % 32);
  };

  const auto process = [&](float (&s)[64], int i) {
    const int j = visit_block<kPass>(i, nblk);
    // The block straddles the diagonal of the warpgroup's rows, or runs past Lk.
    const int block_end = (j + 1) * kBlockKeys;
    if (block_end > p.Lk || (p.causal && block_end - 1 > first_row + (p.Lk - p.Lq)))
      OnlineSoftmax::apply_mask(s, thread, first_row, j * kBlockKeys, p.Lk, p.causal, p.Lk - p.Lq);
    if constexpr (kPass == Pass::kFirst) first_block(s, i);  // the settling cadence counts steps
    else refine_block(s, j);
  };

  if (nblk > 0) {
    const std::uint32_t s_q =
        static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.q[0][0][0])) + consumer * kRowsPerConsumer * 128;
    const auto issue = [&](float (&acc)[64], int j) {
      const int st = j % kStages;
      sm.k_full[st].wait(static_cast<std::uint32_t>(j / kStages) & 1u);
      wgmma_fence();
      issue_qk<Tag, D>(acc, s_q, static_cast<std::uint32_t>(__cvta_generic_to_shared(&sm.k[st][0][0][0])));
    };
    const auto retire = [&](float (&acc)[64], int j) {
      fence_operands(acc);
      sm.k_empty[j % kStages].arrive();
      process(acc, j);
    };
    // Two accumulators: block j + 1's product is in flight while block j's scores are read.
    float a0[64], a1[64];
    sm.q_full.wait(0);
    issue(a0, 0);
    int j = 0;
    for (; j + 2 < nblk; j += 2) {
      issue(a1, j + 1);
      wgmma_wait<1>();
      retire(a0, j);
      issue(a0, j + 2);
      wgmma_wait<1>();
      retire(a1, j + 1);
    }
    if (j + 1 < nblk) {
      issue(a1, j + 1);
      wgmma_wait<1>();
      retire(a0, j);
      wgmma_wait<0>();
      retire(a1, j + 1);
    } else {
      wgmma_wait<0>();
      retire(a0, j);
    }
  }
  if constexpr (kPass == Pass::kRefine) flush_word();

  // Each row closed by one lane of its quad (row g by lane 0, row g + 8 by lane 1).
  __syncwarp();
  bool next = false;  // the row this lane closed has work in the next refining pass
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (t4 != i || !live_row[i]) continue;
    const int r = rl(i);
    EntmaxRow& out = p.rows[row_base + row0 + r];
    if constexpr (kPass == Pass::kFirst) {
      EntmaxRow st;
      st.z_max = M[i];
      st.z_tau = INFINITY;
      if (bad[i]) {
        st.status = EntmaxRow::kPoisoned;
      } else if (M[i] == -INFINITY) {
        st.status = EntmaxRow::kNoKey;
      } else if (!ring || lost[i]) {  // the refining passes bin [0, 1]
        st.z_lo = z_of_lo(st, p.am1);
      } else {
        const RingBins& rb = sm.bins[r].ring;
        int cnt[kRing];
        float s1[kRing], s2[kRing];
        for (int k = 0; k < kRing; ++k) {
          const int sl = ring_slot(top[i] - kSections + k);
          cnt[k] = rb.cnt[sl];
          s1[k] = rb.s1[sl];
          s2[k] = rb.s2[sl];
        }
        ring_close(st, cnt, s1, s2, ring_pos(M[i], anchor[i], c), p.power, p.am1);
      }
      out = st;
      next = role_of(st, p.power) != Role::kNone;
    } else {
      const Role role = sm.search[r].role;
      if (role == Role::kNone) continue;
      EntmaxRow st = out;
      RowBins& rb = sm.bins[r];
      if (role == Role::kMark) {
        st.marked = 1;
      } else if (role == Role::kBin) {
        close_row(st, rb.ring.cnt, rb.ring.s1, rb.ring.s2, p.power, p.am1, p.last_pass);
      } else if (sm.ncoll[r] <= kCollect) {
        const int nc = sm.ncoll[r];
        const double tau = close_collected(st, rb.coll.n, rb.coll.s1, rb.coll.s2, rb.coll.d, nc, p.power, p.am1);
        // Its bits went out in the pass; its support is the scores above hi and the collected above tau.
        support += static_cast<unsigned long long>(rb.coll.n);
        for (int k = 0; k < nc; ++k) support += st.lo + rb.coll.d[k] > tau ? 1u : 0u;
        st.marked = 1;
      } else if (p.last_pass) {  // more than the count said (rounding at the bracket's ends): midpoint
        finish_row(st, 0.5 * (st.lo + st.hi), p.am1);
      } else {
        st.inside = -1;  // bin the bracket on the next pass
      }
      out = st;
      next = role_of(st, p.power) != Role::kNone;
    }
  }
  const int next_rows = __popc(__ballot_sync(0xffffffffu, next));
  const int next_pass = kPass == Pass::kFirst ? 0 : p.pass + 1;
  if (lane == 0 && next_rows != 0 && next_pass <= kMaxPasses) atomicAdd(p.pending + next_pass, next_rows);
  if constexpr (kPass == Pass::kRefine) {
    for (int o = 16; o > 0; o >>= 1) support += __shfl_xor_sync(0xffffffffu, support, o);
    if (lane == 0 && support != 0) atomicAdd(p.support, support);
  }
}

// One CTA per (Q tile, head, b), the tiles in reverse so the longest causal ones start first.
template <class Tag, int D, Pass kPass>
__global__ void __launch_bounds__(kThreads, 1)
    scan_kernel(const __grid_constant__ ScanParams p, const __grid_constant__ CUtensorMap tm_q,
                const __grid_constant__ CUtensorMap tm_k) {
  using Storage = ScanStorage<typename Tag::Elem, D>;
  constexpr int kHalves = D / 64;
  const int tile = static_cast<int>(gridDim.x - 1 - blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int row0 = tile * kTileRows;
  if constexpr (kPass == Pass::kRefine) {
    if (p.pending[p.pass] == 0) return;
    int need = 0;
    const int row = row0 + static_cast<int>(threadIdx.x);
    if (threadIdx.x < kTileRows && row < p.Lq)
      need = role_of(p.rows[(static_cast<long long>(b) * p.Hq + h) * p.Lq + row], p.power) != Role::kNone;
    if (!__syncthreads_or(need)) return;
  }
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  Storage& sm = *reinterpret_cast<Storage*>(smem_raw + ((1024u - (raw & 1023u)) & 1023u));
  const int nblk = (key_end(p, min(row0 + kTileRows, p.Lq) - 1) + kBlockKeys - 1) / kBlockKeys;
  if (threadIdx.x == 0) {
    tma_prefetch_descriptor(&tm_q);
    tma_prefetch_descriptor(&tm_k);
    sm.q_full.init(1);
    for (int s = 0; s < kStages; ++s) {
      sm.k_full[s].init(1);
      sm.k_empty[s].init(kConsumerThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();
  // warp_uniform: the wgmma descriptors derived from the consumer index stay in uniform registers.
  const int warpgroup = warp_uniform(static_cast<int>(threadIdx.x) / 128);
  const int thread = static_cast<int>(threadIdx.x) % 128;
  if (warpgroup == 0) {
    warpgroup_reg_dealloc<kProducerRegs>();
    if (thread != 0 || nblk == 0) return;
    sm.q_full.arrive_expect_tx(kTileBytes<D>);
    for (int half = 0; half < kHalves; ++half)
      tma_load_bhld(&sm.q[half][0][0], &tm_q, 64 * half, h, row0, b, &sm.q_full.word);
    const int kvh = h / p.group;
    for (int j = 0; j < nblk; ++j) {
      const int s = j % kStages;
      sm.k_empty[s].wait((static_cast<std::uint32_t>(j / kStages) & 1u) ^ 1u);
      sm.k_full[s].arrive_expect_tx(kTileBytes<D>);
      for (int half = 0; half < kHalves; ++half)
        tma_load_bhld(&sm.k[s][half][0][0], &tm_k, 64 * half, kvh, visit_block<kPass>(j, nblk) * kBlockKeys, b,
                      &sm.k_full[s].word);
    }
  } else {
    warpgroup_reg_alloc<kConsumerRegs>();
    consume<Tag, D, kPass>(p, sm, warpgroup - 1, thread, b, h, tile, nblk);
  }
}

// Sum of the set bits of `n` words into *count.
__global__ void popcount_kernel(const std::uint32_t* bits, long long n, unsigned long long* count) {
  unsigned long long c = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    c += __popc(bits[i]);
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % 32 == 0 && c != 0) atomicAdd(count, c);
}

// The contiguous [B, Hq, Tq, words] bits into the caller's block_bits (any strides).
struct CopyBitsParams {
  const std::uint32_t* src = nullptr;
  std::uint32_t* dst = nullptr;
  long long stride[4] = {};
  long long shape[4] = {};
};
__global__ void copy_bits_kernel(const __grid_constant__ CopyBitsParams p) {
  const long long n = p.shape[0] * p.shape[1] * p.shape[2] * p.shape[3];
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long rest = i, off = 0;
    for (int d = 3; d >= 0; --d) {
      off += (rest % p.shape[d]) * p.stride[d];
      rest /= p.shape[d];
    }
    p.dst[off] = p.src[i];
  }
}

template <class Tag, int D, Pass kPass>
cudaError_t launch_scan(const ScanParams& p, const CUtensorMap& tm_q, const CUtensorMap& tm_k, dim3 grid,
                        cudaStream_t stream) {
  constexpr std::size_t smem = sizeof(ScanStorage<typename Tag::Elem, D>) + 1024;  // + slack for the alignment
  auto* kernel = &scan_kernel<Tag, D, kPass>;
  return launch_with_smem(kernel, smem, [&] { kernel<<<grid, kThreads, smem, stream>>>(p, tm_q, tm_k); });
}

// The first pass, kMaxPasses refining passes (the last finishes every row), and one more that marks the
// rows the last ones finished by binning. Past convergence a launch finds nothing to do.
template <class Tag, int D>
cudaError_t launch_passes(ScanParams p, const CUtensorMap& tm_q, const CUtensorMap& tm_k, dim3 grid,
                          cudaStream_t stream) {
  cudaError_t e = launch_scan<Tag, D, Pass::kFirst>(p, tm_q, tm_k, grid, stream);
  for (int i = 0; i <= kMaxPasses && e == cudaSuccess; ++i) {
    p.pass = i;
    p.last_pass = i == kMaxPasses - 1;
    e = launch_scan<Tag, D, Pass::kRefine>(p, tm_q, tm_k, grid, stream);
  }
  return e;
}

}  // namespace sparse_attn::cuda_kernels::entmax

namespace sparse_attn::cuda_backend {
namespace {

constexpr const char* kOp = "entmax";

// Per (device, stream): the row states, the bits, the tile lists of the output pass, two counters
// (support, active tiles) and the refining passes' pending rows.
// entmax holds its lock across both phases.
WorkspaceCache g_entmax_workspaces;

std::size_t round256(std::size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

std::mutex& entmax_workspace_mutex() { return g_entmax_workspaces.mutex(); }

EntmaxPlan entmax_thresholds(const detail::AttentionCall& a, const EntmaxOptions& options) {
  using namespace cuda_kernels::entmax;
  using cuda_kernels::check_cuda;
  const ProblemShape& s = a.p;
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  detail::require(s.Lq <= kIntMax && s.Lk <= kIntMax && s.Tq() <= kIntMax && s.Hq <= 65535 && s.B <= 65535,
                  kOp, "q", [&] { return "problem too large for the CUDA entmax's grid: " + s.describe(); });
  cuda_kernels::DeviceGuard guard(a.device, kOp);
  // TMA loads (throws naming the tensor where TMA cannot address it: alignment of the base or strides).
  const CUtensorMap tm_q = cuda_kernels::make_bhld_tensor_map(kOp, "q", a.q);
  const CUtensorMap tm_k = cuda_kernels::make_bhld_tensor_map(kOp, "k", a.k);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  const std::int64_t Tq = s.Tq(), Tk = s.Tk(), words = ceil_div(Tk, 32);
  const std::int64_t nrows = s.B * s.Hq * s.Lq, nbits = s.B * s.Hq * Tq * words;

  const std::size_t rows_bytes = round256(static_cast<std::size_t>(nrows) * sizeof(cuda_kernels::EntmaxRow));
  const std::size_t bits_bytes = round256(static_cast<std::size_t>(nbits) * 4);
  const std::size_t idx_bytes = round256(static_cast<std::size_t>(s.B * s.Hq * Tq * Tk) * 4);
  const std::size_t cnt_bytes = round256(static_cast<std::size_t>(s.B * s.Hq * Tq) * 4);
  const std::size_t need = rows_bytes + bits_bytes + idx_bytes + cnt_bytes + 256;
  char* ws = static_cast<char*>(g_entmax_workspaces.get(kOp, a.device, a.stream, need));
  auto* rows = reinterpret_cast<cuda_kernels::EntmaxRow*>(ws);
  auto* bits = reinterpret_cast<std::uint32_t*>(ws + rows_bytes);
  char* idx = ws + rows_bytes + bits_bytes;
  char* cnt = idx + idx_bytes;
  auto* counters = reinterpret_cast<unsigned long long*>(cnt + cnt_bytes);  // support, active tiles
  int* pending = reinterpret_cast<int*>(counters + 2);
  static_assert(2 * sizeof(unsigned long long) + (kMaxPasses + 1) * sizeof(int) <= 256, "counters over their room");
  check_cuda(cudaMemsetAsync(bits, 0, bits_bytes, stream), kOp, "bits");
  check_cuda(cudaMemsetAsync(counters, 0, 256, stream), kOp, "counters");

  const double alpha = options.alpha;
  ScanParams p;
  p.Lq = static_cast<int>(s.Lq);
  p.Lk = static_cast<int>(s.Lk);
  p.Hq = static_cast<int>(s.Hq);
  p.group = static_cast<int>(s.group_size());
  p.Tq = static_cast<int>(Tq);
  p.words = static_cast<int>(words);
  p.causal = s.causal;
  p.scale = a.scale;
  p.am1 = alpha - 1.0;
  p.r = 1.0 / (alpha - 1.0);
  p.power = alpha == 2.0 ? 1 : (alpha == 1.5 ? 2 : 0);
  p.rows = rows;
  p.bits = bits;
  p.support = counters;
  p.pending = pending;
  const dim3 grid(static_cast<unsigned>(Tq), static_cast<unsigned>(s.Hq), static_cast<unsigned>(s.B));
  const bool bf16 = a.q.dtype == DType::bf16;
  using cuda_kernels::Bf16Tag;
  using cuda_kernels::F16Tag;
  check_cuda(s.D == 128 ? (bf16 ? launch_passes<Bf16Tag, 128>(p, tm_q, tm_k, grid, stream)
                               : launch_passes<F16Tag, 128>(p, tm_q, tm_k, grid, stream))
                        : (bf16 ? launch_passes<Bf16Tag, 64>(p, tm_q, tm_k, grid, stream)
                                : launch_passes<F16Tag, 64>(p, tm_q, tm_k, grid, stream)),
             kOp, "threshold passes");
  const unsigned small_grid = static_cast<unsigned>(std::clamp<std::int64_t>(ceil_div(nbits, 256), 1, 1024));
  popcount_kernel<<<small_grid, 256, 0, stream>>>(
      bits, nbits, counters + 1);
  check_cuda(cudaGetLastError(), kOp, "popcount");
  if (options.block_bits) {
    CopyBitsParams c;
    c.src = bits;
    c.dst = static_cast<std::uint32_t*>(options.block_bits->data);
    for (int i = 0; i < 4; ++i) {
      c.stride[i] = options.block_bits->stride[i];
      c.shape[i] = options.block_bits->shape[i];
    }
    copy_bits_kernel<<<small_grid, 256, 0, stream>>>(c);
    check_cuda(cudaGetLastError(), kOp, "block_bits copy");
  }

  // The output pass over the set bits, as TileLists (one list per query head).
  const TileLists tiles{TensorView::contiguous(idx, DType::i32, {s.B, s.Hq, Tq, Tk}, Device::cuda, a.device),
                        TensorView::contiguous(cnt, DType::i32, {s.B, s.Hq, Tq}, Device::cuda, a.device)};
  ConvertOptions convert;
  convert.trusted = true;  // set by the support pass: in range by construction
  convert.stream = a.stream;
  block_bits_to_tile_lists(BlockBits{TensorView::contiguous(bits, DType::u32, {s.B, s.Hq, Tq, words}, Device::cuda, a.device)},
                           tiles, s, convert, kOp, "block_bits");
  EntmaxPlan plan{detail::TileCall{tiles, s.Hq, Tk}, {}, counters};
  plan.transform.rows = rows;
  plan.transform.am1 = static_cast<float>(alpha - 1.0);
  plan.transform.r = static_cast<float>(1.0 / (alpha - 1.0));
  plan.transform.scale = a.scale;
  plan.transform.power = p.power;
  return plan;
}

EntmaxStats entmax(const detail::AttentionCall& a, const EntmaxOptions& options, const detail::AttentionTuning& tuning) {
  using cuda_kernels::check_cuda;
  const ProblemShape& s = a.p;
  cuda_kernels::DeviceGuard guard(a.device, kOp);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  std::lock_guard<std::mutex> lock(entmax_workspace_mutex());
  const EntmaxPlan plan = entmax_thresholds(a, options);
  entmax_output(a, plan.tiles, plan.transform, tuning);
  unsigned long long host[2] = {0, 0};
  check_cuda(cudaMemcpyAsync(host, plan.counters, sizeof(host), cudaMemcpyDeviceToHost, stream), kOp, "statistics");
  check_cuda(cudaStreamSynchronize(stream), kOp, "statistics");
  EntmaxStats stats;
  stats.support = static_cast<std::int64_t>(host[0]);
  stats.active_tiles = static_cast<std::int64_t>(host[1]);
  for (std::int64_t t = 0; t < s.Tq(); ++t) {
    const std::int64_t last = std::min(s.Lq, (t + 1) * cuda_kernels::kTileRows) - 1;
    stats.visible_tiles += s.B * s.Hq * ceil_div(s.key_end(last), static_cast<std::int64_t>(cuda_kernels::kBlockKeys));
  }
  return stats;
}

}  // namespace sparse_attn::cuda_backend
