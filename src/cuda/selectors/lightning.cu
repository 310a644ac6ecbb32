// DSA lightning indexer on the GPU (docs/design.md §5.7): I[t, s] = sum_j w[t, j] * ReLU(qI[t, j] . kI[s]),
// per query the top-k keys (TokenLists) or the top-k KV blocks by the maximum over their visible keys
// (QueryLists), ascending, -1 padded, written to every group. Kernels on the caller's stream:
//  1. (fp8) amax of qI and kI (float bits, atomicMax; prep.cuh, shared with token_max);
//  2. codes (prep.cuh's codes_kernel with TileLayout, one launch for both tensors): qI and kI rounded through
//     the precision exactly as the CPU's load_quantized (fp8: the e4m3 byte of x / scale, tc_index.cuh's
//     fp8_quotient; bf16: the bf16 bits), written to scratch already in the wgmma shared-memory layout (rows
//     of 128-byte chunks, 128B swizzle), so that a tile is one contiguous bulk copy: key tiles of 128 keys,
//     query tiles of 128 (query, head) rows = nq queries x hp head slots (hp = 128 / nq >= HI, zero padded);
//  3. select: one CTA per two query tiles, one pass over their visible keys (described at select_kernel).
// What reaches device memory: the codes (fp8: Lq * hp + Lk rows of Di bytes rounded up to 128, the query tiles
// padded to an even count; bf16: twice that) and the output lists; no score (token or block) is ever stored.
//
// The bound ε (lightning_epsilon below). Notation: a row (query t) has heads j with weights w_j; cq_j, ck the
// codes (fp8: e4m3 values without the per-tensor scales sq, sk; bf16: the values, sq = sk = 1). The GPU score
// of key s is Ic = fl-sum_j w_j ReLU(T^_j) in code units, T^_j the tensor-core dot of cq_j and ck. The exact
// score (the CPU's) is X = sum_j w_j ReLU(D_j), D_j the float64 dot of the dequantised values.
//  a. Tensor cores, fp8 (m64n64k32 pieces, products of two e4m3 values exact). Assumed, conservatively: within
//     one wgmma k32 instruction the 32 products and the incoming accumulator are aligned to the largest
//     exponent among them and each is truncated to 13 significant bits relative to it (error below 2^-12 x
//     the largest magnitude, per addend), the sum is formed without further loss and rounded once to float32.
//     The kernel therefore starts every k32 step from a zero accumulator (no incoming term: 32 addends of at
//     most M = max |product| of the step) and adds the steps in float32 in d order. Per step the error is at
//     most 32 * 2^-12 M = 2^-7 M plus 2^-24 of the result; the n = ceil(Di / 32) step results and their n - 1
//     float32 additions add at most n 2^-23 sum_d |cq_d ck_d|. With M <= |cq_j|inf |ck|inf per step:
//       |T^_j - T_j| <= 2^-7 n |cq_j|inf |ck|inf + n 2^-23 |cq_j|2 |ck|2.
//     bf16 (m64n64k16 pieces, products exact in float32): float32 accumulation keeps at least 24 bits after the
//     alignment, so each k16 step errs by at most 2^-18 (|acc| + sum |products|) (tc_index.cuh, item 1):
//       |T^_j - T_j| <= 2^-18 n |cq_j|2 |ck|2 with n = ceil(Di / 16) (the accumulator chain is not reset).
//  b. ReLU is 1-Lipschitz; the head sum is an fma chain over the thread's heads (at most 32) then two quad
//     shuffles: at most 34 roundings on any term's path, so the float32 sum errs by at most
//     34 * 2^-24 (1 + 2^-18) sum_j |w_j| |T^_j|, with |T^_j| <= |cq_j|2 |ck|2 (1 + 2^-6).
//  c. Dequantisation: vq = fl(cq sq) = cq sq (1 + d), |d| <= 2^-24 (below 2^-126, an absolute 2^-150), the
//     same for vk, and the CPU's float64 sum of Di products: |D_j - sq sk T_j| <= 2^-22 |vq_j|2 |vk|2 (1 + ...)
//     plus 2^-148 Di (|vq_j|inf + |vk|inf + 2^-150) for underflow.
//  So |X - sq sk Ic| <= E with, in value units (|v| = sq |c| up to 2^-23 relative, absorbed by the 2^-10
//  margin below),
//    E = (1 + 2^-10) sum_j |w_j| [A_j + (34 * 2^-24 + 2^-22 + n 2^-23) |vq_j|2 |vk|2max] + underflow terms,
//    A_j = 2^-7 n |vq_j|inf |vk|infmax (fp8) or 2^-18 n |vq_j|2 |vk|2max (bf16),
//  taking the largest key norms over the row's keys. The kernel selects the top-k of Ic with ties to the
//  lower id, so for a selected key a and an unselected candidate u: X_a >= sq sk Ic_a - E >= sq sk Ic_u - E
//  >= X_u - 2E: the contract holds with ε = 2E. A forced key (sink) is +inf on both sides; NaN scores rank
//  as -inf. When a per-tensor scale is 0 (an fp8 tensor whose amax underflows, kept raw by the CPU, all
//  codes 0 here), ε is twice the largest possible |X|: 2 sum_j |w_j| Di |vq_j|inf |vk|infmax.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/common/mma_sync.cuh"
#include "cuda/common/smem_limit.hpp"
#include "cuda/common/sync.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/common/wgmma_fp8.cuh"
#include "cuda/selectors/backend.hpp"
#include "cuda/selectors/common.cuh"
#include "cuda/selectors/prep.cuh"
#include "cuda/selectors/scratch.hpp"
#include "cuda/selectors/select.cuh"
#include "cuda/selectors/tc_index.cuh"

namespace sparse_attn::cuda_backend {

namespace {

using sel::check_cuda;
using sel::imax;
using sel::imin;
using sel::order_key;
using sel::In;
using sel::Prec;
namespace ck = cuda_kernels;

constexpr int kStageKeys = 128;               // keys per pipeline stage = one KV block (kBlockK)
constexpr int kRows = 128;                    // rows of a tile: keys, or (query, head) columns of wgmma N
constexpr int kChunkBytes = kRows * 128;      // one 128-byte column chunk of a tile (128B swizzle rows)
constexpr int kKStepBytes = 32;               // bytes of a row per wgmma k-step (fp8 k32, bf16 k16)
constexpr int kConsumerWGs = 2;               // each takes one query tile, against every key tile
constexpr int kThreads = 128 * (kConsumerWGs + 1);  // + a producer warpgroup (one thread issues the copies; the
                                                    // kernel fits 168 registers a thread without spills)
using sel::kHist;                             // radix digit of the exact selection
constexpr int kGroupScratch = 32;             // words after a selecting group's histogram (see Group)
constexpr int kSmemLimit = 227 * 1024;        // Hopper's opt-in dynamic shared memory per block
constexpr int kMaxStages = 4;

static_assert(kStageKeys == kBlockK, "a stage is one KV block (the block form pools per stage)");

// ---- plan: tile geometry and shared-memory layout (host) ------------------------------------------------

struct Plan {
  int nq = 0;        // queries per query tile (a consumer warpgroup's; a CTA takes kConsumerWGs tiles)
  int hp = 0;        // head slots per query: 128 / nq >= HI
  int chunks = 0;    // 128-byte chunks per row (Di bytes rounded up)
  int ksteps = 0;    // wgmma k-steps per row
  int stages = 0;    // key tiles in flight
  int cap = 0;       // candidate buffer entries per query
  // byte offsets in the 1024-aligned dynamic shared memory
  int off_q = 0, off_stage = 0, off_buf = 0, off_hist = 0, off_thr = 0, off_cnt = 0, off_red = 0, off_w = 0, off_bar = 0;
  int smem = 0;      // dynamic bytes to request (+1024 alignment slack)
  bool ok() const { return nq > 0; }
};

int elem_bytes(IndexPrecision p) { return p == IndexPrecision::bf16 ? 2 : 1; }

// The most queries per query tile (fewest padded head slots), then buffers of 2 top_k (fewer compactions) over
// buffers of top_k, then the most stages, such that a candidate buffer holds top_k plus one tile's insertions
// (128 keys, or 1 block). A single stage (no copy overlapping the MMAs) only where two do not fit (bf16 rows of
// more than 192 elements: the two query tiles and two key tiles alone take 256 KB at Di = 256).
Plan make_plan(std::int64_t HI, std::int64_t Di, int top_k, IndexPrecision prec, bool blocks) {
  Plan best;
  if (HI < 1 || HI > kRows || Di < 1 || Di > 256 || top_k < 1) return best;
  const int es = elem_bytes(prec);
  const int row_bytes = static_cast<int>(Di) * es;
  const int chunks = (row_bytes + 127) / 128, ksteps = (row_bytes + kKStepBytes - 1) / kKStepBytes;
  int hp_min = 8;
  while (hp_min < HI) hp_min *= 2;
  const int per_stage = blocks ? 1 : kStageKeys;
  const long long need_min = static_cast<long long>(top_k) + per_stage;
  struct Try {
    long long need;
    int min_stages;
  };
  for (int nq = kRows / hp_min; nq >= 1; nq /= 2)
    for (const Try& tr : {Try{2LL * top_k + per_stage, 2}, Try{need_min, 2}, Try{need_min, 1}})
      for (int stages = kMaxStages; stages >= tr.min_stages; --stages) {
        Plan p;
        p.nq = nq, p.hp = kRows / nq, p.chunks = chunks, p.ksteps = ksteps, p.stages = stages;
        int off = 0;
        p.off_q = off, off += kConsumerWGs * chunks * kChunkBytes;
        p.off_stage = off, off += stages * chunks * kChunkBytes;
        p.off_hist = off, off += kConsumerWGs * (kHist + kGroupScratch) * 4;
        p.off_thr = off, off += nq * kConsumerWGs * 8;
        p.off_cnt = off, off += nq * kConsumerWGs * 4;
        p.off_red = off, off += kConsumerWGs * 2 * 4 * nq * 4;
        p.off_w = off, off += kConsumerWGs * kRows * 4;
        off = (off + 7) / 8 * 8;
        p.off_bar = off, off += (2 * stages + 1) * 8;
        p.off_buf = (off + 15) / 16 * 16;
        const long long room = static_cast<long long>(kSmemLimit) - 1024 - p.off_buf;
        if (room <= 0) continue;
        const long long cap = room / (8LL * nq * kConsumerWGs) / 32 * 32;
        if (cap < tr.need) continue;
        p.cap = static_cast<int>(std::min<long long>(cap, 1 << 24));
        p.smem = p.off_buf + 8 * nq * kConsumerWGs * p.cap + 1024;
        return p;
      }
  return best;
}

struct ScratchLayout {
  std::size_t amax = 0, qcodes = 0, kcodes = 0, total = 0;
};

// Query tiles per batch, padded to whole CTAs (kConsumerWGs tiles each; the padding's codes are zero).
std::int64_t query_tiles(std::int64_t Lq, const Plan& p) { return ceil_div(ceil_div(Lq, p.nq), kConsumerWGs) * kConsumerWGs; }

ScratchLayout scratch_layout(std::int64_t B, std::int64_t Lq, std::int64_t Lk, const Plan& p) {
  ScratchLayout s;
  const std::size_t tile = static_cast<std::size_t>(p.chunks) * kChunkBytes;
  s.amax = 0;
  s.qcodes = sel::align_up(2 * sizeof(unsigned));
  s.kcodes = s.qcodes + sel::align_up(static_cast<std::size_t>(B * query_tiles(Lq, p)) * tile);
  s.total = s.kcodes + sel::align_up(static_cast<std::size_t>(B * ceil_div(Lk, kStageKeys)) * tile);
  return s;
}

// ---- 3. selection ---------------------------------------------------------------------------------------

struct OutRows {
  std::int32_t* idx;
  std::int64_t s0, s1, s2, s3, G, width;
  __device__ std::int32_t* row(std::int64_t b, std::int64_t g, std::int64_t t) const {
    return idx + b * s0 + g * s1 + t * s2;
  }
};

struct SelectParams {
  const unsigned char* qcodes;  // [B, Gq] tiles (Gq even)
  const unsigned char* kcodes;  // [B, Tk] tiles
  const float* w;
  std::int64_t ws0, ws1, ws2;
  std::int64_t Lq, Lk, HI, Gq, Tk;
  std::int64_t sink;
  bool causal;
  int top_k;
  Plan plan;
  OutRows out;
  __device__ std::int64_t key_end(std::int64_t t) const {
    const std::int64_t e = t + (Lk - Lq) + 1;
    return causal ? (e < 0 ? 0 : (e > Lk ? Lk : e)) : Lk;
  }
};

using sel::group_kth_key;
using sel::key_id;
using sel::rank_key;
using sel::sanitize;
using sel::u64;
using Group = sel::Group<128>;  // a consumer warpgroup selecting among its candidates
static_assert(kHist + kGroupScratch == Group::kScratchWords, "a group's scratch words");

// Keeps the keys >= v of a[0, n) in place, in order, by the whole group, and returns how many: a chunk of 128
// keys is read, the warps' counts meet in shared memory (double-buffered by chunk parity), then each kept key
// moves down. A chunk's writes land at or below its own positions, whose reads precede the barrier, and below
// the next chunk's.
__device__ int group_keep(const Group& gr, u64* a, int n, u64 v) {
  const int lane = gr.tid % 32, w = gr.tid / 32;
  int at = 0;
  for (int base = 0, chunk = 0; base < n; base += Group::kThreads, ++chunk) {
    const int i = base + gr.tid;
    const u64 x = i < n ? a[i] : 0ull;
    const bool keep = i < n && x >= v;
    const unsigned m = __ballot_sync(0xffffffffu, keep);
    int* wc = gr.warp_counts() + (chunk & 1) * Group::kWarps;
    if (lane == 0) wc[w] = __popc(m);
    gr.sync();
    int before = 0, total = 0;
    for (int u = 0; u < Group::kWarps; ++u) before += u < w ? wc[u] : 0, total += wc[u];
    if (keep) a[at + before + __popc(m & ((1u << lane) - 1u))] = x;
    at += total;
  }
  return at;
}

// The ids of the keys >= v in a[0, n) (distinct ids in [0, nid)), ascending, to out[0, m) of every group's row,
// -1 after up to `width`: window by window of 32 `words` ids, a bitmap of the window's selected ids in shared
// memory, then each thread writes the ids of its run of words at its exclusive prefix sum of their popcounts.
// No sort: the bitmap is the order.
__device__ void group_write_ascending(const Group& gr, const u64* a, int n, u64 v, std::int64_t nid, unsigned* bitmap,
                                      int words, const OutRows& out, std::int64_t batch, std::int64_t t) {
  int written = 0;
  for (std::int64_t w0 = 0; w0 < nid; w0 += 32LL * words) {
    const int nw = static_cast<int>(imin<std::int64_t>(words, (nid - w0 + 31) / 32));
    for (int i = gr.tid; i < nw; i += Group::kThreads) bitmap[i] = 0u;
    gr.sync();
    for (int i = gr.tid; i < n; i += Group::kThreads) {
      if (a[i] < v) continue;
      const std::int64_t id = key_id(a[i]) - w0;
      if (id >= 0 && id < 32LL * nw) atomicOr(&bitmap[id / 32], 1u << (id % 32));
    }
    gr.sync();
    const int per = (nw + Group::kThreads - 1) / Group::kThreads;
    const int lo = imin(gr.tid * per, nw), hi = imin(lo + per, nw);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += __popc(bitmap[i]);
    int total = 0;
    int pos = written + sel::group_exclusive_scan(gr, mine, total);
    for (int i = lo; i < hi; ++i)
      for (unsigned bits = bitmap[i]; bits != 0u; bits &= bits - 1u, ++pos) {
        const auto id = static_cast<std::int32_t>(w0 + 32 * i + __ffs(bits) - 1);
        for (std::int64_t g = 0; g < out.G; ++g) out.row(batch, g, t)[pos * out.s3] = id;
      }
    written += total;
    gr.sync();  // the bitmap and the warp sums are reused by the next window
  }
  for (std::int64_t s = written + gr.tid; s < out.width; s += Group::kThreads)
    for (std::int64_t g = 0; g < out.G; ++g) out.row(batch, g, t)[s * out.s3] = -1;
}

// The fp8 scores of a 64-key half against the two n64 column pieces, kSteps k32 steps (desc_a(kk), desc_lo(kk),
// desc_hi(kk) the operands of step kk). Every step from a zero accumulator, the steps added in float32 in d order
// (the bound's item a). One commit group per (step, piece), issued in that order; after issuing one, waiting
// until one group is pending retires the previous, which is then added while the new one runs.
template <int kSteps, class DA, class DLo, class DHi>
__device__ __forceinline__ void fp8_scores(float (&acc_lo)[32], float (&acc_hi)[32], float (&part_lo)[32],
                                           float (&part_hi)[32], const DA& desc_a, const DLo& desc_lo,
                                           const DHi& desc_hi) {
  ck::wgmma_fence();
  ck::wgmma_ss_e4m3(acc_lo, desc_a(0), desc_lo(0), 0);
  ck::wgmma_commit();
  ck::wgmma_ss_e4m3(acc_hi, desc_a(0), desc_hi(0), 0);
  ck::wgmma_commit();
#pragma unroll
  for (int kk = 1; kk < kSteps; ++kk) {
    ck::wgmma_fence();
    ck::wgmma_ss_e4m3(part_lo, desc_a(kk), desc_lo(kk), 0);
    ck::wgmma_commit();
    ck::wgmma_wait<1>();  // step kk - 1 of the high piece (and every group before) done
    ck::fence_operands(acc_lo);
    ck::fence_operands(acc_hi);
    ck::fence_operands(part_hi);
    if (kk > 1) {
#pragma unroll
      for (int i = 0; i < 32; ++i) acc_hi[i] += part_hi[i];
    }
    ck::wgmma_fence();
    ck::wgmma_ss_e4m3(part_hi, desc_a(kk), desc_hi(kk), 0);
    ck::wgmma_commit();
    ck::wgmma_wait<1>();  // step kk of the low piece done
    ck::fence_operands(part_lo);
#pragma unroll
    for (int i = 0; i < 32; ++i) acc_lo[i] += part_lo[i];
  }
  ck::wgmma_wait<0>();
  ck::fence_operands(acc_lo);
  ck::fence_operands(acc_hi);
  if constexpr (kSteps > 1) {
    ck::fence_operands(part_hi);
#pragma unroll
    for (int i = 0; i < 32; ++i) acc_hi[i] += part_hi[i];
  }
}

// Barrier ids: each consumer warpgroup's stage barrier, and the two warpgroups' final merge.
__device__ __forceinline__ ck::NamedBarrier wg_barrier(int wg) {
  return wg == 0 ? ck::NamedBarrier::kLightningWG0 : ck::NamedBarrier::kLightningWG1;
}

// grid: (Gq / 2, B), kThreads. A CTA holds the query tiles 2 c and 2 c + 1 (c = the last first: the
// longest rows first), consumer warpgroup w the queries of tile 2 c + w; both run over the key tiles
// 0 .. ceil(key_end(last query) / 128) - 1, so that each key tile brought on chip serves 2 nq queries. The
// producer thread (warpgroup 2) bulk-copies both query tiles once and the key tiles through a ring of `stages`
// slots (full / empty mbarriers; a slot is free once the 8 consumer warps have read it). Per 64-key half,
// wgmma with keys on M and the warpgroup's 128 (query, head) columns on N, as two n64 pieces (fp8: one piece's
// next k32 step overlaps the other's add, fp8_scores); thread (warp v, lane 4 g + q) then holds keys 16 v + g
// (+ 8) and columns 8 i + 2 q (+ 1), i < 16, so a query's weighted ReLU sum over its heads is an fma chain over
// the thread's columns (i, then the pair, in order) and two quad shuffles. Token form:
// each visible key's score enters the query's candidate buffer if it ranks before the buffer's threshold (the
// k-th best key at the last compaction); block form: the tile's maximum over visible keys is one candidate.
// After each tile, a buffer that could overflow on the next one is compacted by its warpgroup: an exact radix
// selection of the k-th best, keep the k best, raise the threshold to it. Every candidate dropped is outranked
// by k kept ones, so the buffer's final top-k is the top-k of all scores: at the end each warpgroup selects
// the k-th key of each of its queries, marks the ids ranking at or above it in a bitmap and writes them in
// bitmap order (ascending, no sort). Sink keys (and the blocks holding them) score +inf.
template <bool kFp8, bool kBlocks>
__global__ void __launch_bounds__(kThreads, 1) select_kernel(const __grid_constant__ SelectParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (ck::smem_addr(smem_raw) & 1023)) & 1023);
  const Plan& pl = p.plan;
  const int nq = pl.nq, hp = pl.hp, cap = pl.cap, k = p.top_k;
  // fp8: the warp index warp_uniform, so the wgmma descriptors derived from it stay in uniform registers. Not
  // for bf16: there ptxas then serialises the wgmmas of the run-time k-step loop (C7520).
  const int tid = threadIdx.x, warp = kFp8 ? ck::warp_uniform(tid / 32) : tid / 32, lane = tid % 32, wg = warp / 4;
  const int tile_bytes = pl.chunks * kChunkBytes;
  const std::int64_t b = blockIdx.y, gq0 = (gridDim.x - 1 - blockIdx.x) * static_cast<std::int64_t>(kConsumerWGs);
  const std::int64_t t_last = imin(p.Lq, (gq0 + kConsumerWGs) * nq) - 1;
  const int ntiles = static_cast<int>((p.key_end(t_last) + kStageKeys - 1) / kStageKeys);

  u64* buf = reinterpret_cast<u64*>(smem + pl.off_buf);        // [wg][nq][cap]
  u64* thr = reinterpret_cast<u64*>(smem + pl.off_thr);        // [wg][nq]
  int* cnt = reinterpret_cast<int*>(smem + pl.off_cnt);        // [wg][nq]
  float* red = reinterpret_cast<float*>(smem + pl.off_red);    // [wg][2 halves][4 warps][nq]
  float* wsm = reinterpret_cast<float*>(smem + pl.off_w);      // [wg][128] weight per column
  unsigned* hist = reinterpret_cast<unsigned*>(smem + pl.off_hist);  // [wg][kHist + kGroupScratch]
  ck::MBarrier* full = reinterpret_cast<ck::MBarrier*>(smem + pl.off_bar);
  ck::MBarrier* empty = full + pl.stages;
  ck::MBarrier* qbar = empty + pl.stages;

  if (tid == 0) {
    for (int s = 0; s < pl.stages; ++s) full[s].init(1), empty[s].init(4 * kConsumerWGs);
    qbar->init(1);
    ck::fence_barrier_init();
  }
  for (int i = tid; i < nq * kConsumerWGs; i += kThreads) thr[i] = 0ull, cnt[i] = 0;
  // The weight of column c of warpgroup w: query (gq0 + w) nq + c / hp, head c % hp (0 past HI or Lq).
  for (int i = tid; i < kRows * kConsumerWGs; i += kThreads) {
    const int c = i % kRows;
    const std::int64_t t = (gq0 + i / kRows) * nq + c / hp, h = c % hp;
    wsm[i] = t < p.Lq && h < p.HI ? p.w[b * p.ws0 + t * p.ws1 + h * p.ws2] : 0.0f;
  }
  __syncthreads();

  if (wg == kConsumerWGs) {  // producer warpgroup
    if (warp == 4 * kConsumerWGs && lane == 0 && ntiles > 0) {
      // Both query tiles, adjacent in the scratch (its query tiles are padded to an even count).
      const auto q_bytes = static_cast<std::uint32_t>(kConsumerWGs * tile_bytes);
      qbar->arrive_expect_tx(q_bytes);
      ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem + pl.off_q,
                                 p.qcodes + (b * p.Gq + gq0) * tile_bytes, q_bytes, &qbar->word);
      for (int j = 0; j < ntiles; ++j) {
        const int slot = j % pl.stages;
        empty[slot].wait(((j / pl.stages) & 1) ^ 1);
        full[slot].arrive_expect_tx(static_cast<std::uint32_t>(tile_bytes));
        ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                                   smem + pl.off_stage + slot * tile_bytes, p.kcodes + (b * p.Tk + j) * tile_bytes,
                                   static_cast<std::uint32_t>(tile_bytes), &full[slot].word);
      }
    }
    return;
  }

  const int wl = warp % 4, g = lane / 4, q4 = lane % 4, wtid = tid % 128;
  const std::int64_t t0 = (gq0 + wg) * nq;  // this warpgroup's first query
  const Group mine{wtid, wg_barrier(wg), hist + wg * (kHist + kGroupScratch)};
  u64* wbuf = buf + static_cast<std::int64_t>(wg) * nq * cap;
  u64* wthr = thr + wg * nq;
  int* wcnt = cnt + wg * nq;
  float* wred = red + wg * 8 * nq;
  const float* ww = wsm + wg * kRows;
  const std::uint32_t q_base = ck::smem_addr(smem + pl.off_q) + wg * tile_bytes;
  const std::uint32_t s_base = ck::smem_addr(smem + pl.off_stage);
  const int per_stage = kBlocks ? 1 : kStageKeys;

  // The scores of a 64-key half against the 128 columns, as two n64 pieces (columns [0, 64) and [64, 128)), so
  // that in fp8 one piece's next k32 step runs on the tensor cores while the other's is added; part: the step
  // buffers of the pieces.
  float acc_lo[32], acc_hi[32], part_lo[32], part_hi[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc_lo[i] = 0.0f, acc_hi[i] = 0.0f, part_lo[i] = 0.0f, part_hi[i] = 0.0f;

  // The scores of a half's 64 keys for each query of the warpgroup's tile, kHp head slots a query: acc_lo holds
  // columns [0, 64), acc_hi [64, 128); thread (warp wl, lane 4 g + q4) holds keys 16 wl + g (+ 8) and columns
  // 8 i + 2 q4 (+ 1), i < 16, so a query's weighted ReLU sum over its heads is an fma chain over the thread's
  // columns (i, then the pair, in order) and two quad shuffles. kHp a constant: the query boundaries, the
  // weights' offsets and the query indices are fixed at compile time. Token form: each visible key's score
  // enters the query's candidate buffer if it ranks before the buffer's threshold (the k-th best key at the
  // last compaction); block form: the half's maximum over the query's visible keys, per warp, to `wred`.
  auto score_half = [&](auto hp_c, int j, int half) {
    constexpr int kHp = decltype(hp_c)::value;
    float2 wv[16];  // the weights of the thread's columns, loaded together
#pragma unroll
    for (int i = 0; i < 16; ++i) wv[i] = *reinterpret_cast<const float2*>(ww + 8 * i + 2 * q4);
    const int kt0 = 64 * half + 16 * wl + g;  // the thread's first key in the tile
    // The tile's keys as the queries see them, relative to its first key, in 32 bits: query qi sees keys
    // [0, end_rel(qi)) of the tile (none past Lq), keys [0, sink_rel) are forced. e0 is clamped so that
    // e0 + qi cannot overflow; every value outside [0, 128] acts as its bound. Computed per half rather than
    // kept per tile: four more live registers made ptxas spill the block form.
    const std::int64_t k_tile = static_cast<std::int64_t>(j) * kStageKeys;
    const int lk_rel = static_cast<int>(imin<std::int64_t>(p.Lk - k_tile, kStageKeys));
    const int e0 = static_cast<int>(imax<std::int64_t>(-256, imin<std::int64_t>(256, t0 + (p.Lk - p.Lq) + 1 - k_tile)));
    const int sink_rel = static_cast<int>(imax<std::int64_t>(0, imin<std::int64_t>(kStageKeys, p.sink - k_tile)));
    const int nvalid = static_cast<int>(imax<std::int64_t>(0, imin<std::int64_t>(128 / kHp, p.Lq - t0)));
    auto end_rel = [&](int qi) {
      const int e = p.causal ? imin(imax(e0 + qi, 0), lk_rel) : lk_rel;
      return qi < nvalid ? e : 0;
    };
    float slo = 0.0f, shi = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float* sc = i < 8 ? acc_lo + 4 * i : acc_hi + 4 * (i - 8);  // i is a constant after unrolling
      slo = fmaf(wv[i].x, fmaxf(sc[0], 0.0f), slo);
      slo = fmaf(wv[i].y, fmaxf(sc[1], 0.0f), slo);
      shi = fmaf(wv[i].x, fmaxf(sc[2], 0.0f), shi);
      shi = fmaf(wv[i].y, fmaxf(sc[3], 0.0f), shi);
      if (((8 * (i + 1)) % kHp) != 0) continue;  // the query's columns continue (a constant)
      const int qi = 8 * i / kHp;
      slo += __shfl_xor_sync(0xffffffffu, slo, 1);
      shi += __shfl_xor_sync(0xffffffffu, shi, 1);
      slo += __shfl_xor_sync(0xffffffffu, slo, 2);
      shi += __shfl_xor_sync(0xffffffffu, shi, 2);
      const int er = end_rel(qi);
      if constexpr (kBlocks) {
        float m = fmaxf(kt0 < er ? sanitize(slo) : -INFINITY, kt0 + 8 < er ? sanitize(shi) : -INFINITY);
        for (int o = 4; o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) wred[(half * 4 + wl) * (128 / kHp) + qi] = m;
      } else {
        // Lane q4 = 0 offers key kt0, q4 = 1 key kt0 + 8 (the quad holds both sums).
        const int kt = kt0 + 8 * q4;
        const float s = kt < sink_rel ? INFINITY : sanitize(q4 == 0 ? slo : shi);
        const u64 rk = rank_key(s, k_tile + kt);
        const bool offer = q4 < 2 && kt < er && rk > wthr[qi];
        const unsigned m = __ballot_sync(0xffffffffu, offer);
        if (m != 0u) {
          const int leader = __ffs(m) - 1;
          int base = 0;
          if (lane == leader) base = atomicAdd(&wcnt[qi], __popc(m));
          base = __shfl_sync(0xffffffffu, base, leader);
          if (offer) wbuf[static_cast<std::int64_t>(qi) * cap + base + __popc(m & ((1u << lane) - 1u))] = rk;
        }
      }
      slo = 0.0f, shi = 0.0f;
    }
  };

  if (ntiles > 0) qbar->wait(0);
  for (int j = 0; j < ntiles; ++j) {
    const int slot = j % pl.stages;
    full[slot].wait((j / pl.stages) & 1);
    for (int half = 0; half < 2; ++half) {
      // Scores of keys 128 j + 64 half + [0, 64) against the 128 columns.
      const std::uint32_t a0 = s_base + slot * tile_bytes + half * (kChunkBytes / 2);
      auto desc = [&](std::uint32_t base, int kk) {
        return ck::make_desc_sw128(base + (kk / 4) * kChunkBytes + (kk % 4) * kKStepBytes, 16, 1024);
      };
      const std::uint32_t b_hi = q_base + kChunkBytes / 2;  // columns [64, 128)
      if constexpr (kFp8) {
        const auto da = [&](int kk) { return desc(a0, kk); };
        const auto dlo = [&](int kk) { return desc(q_base, kk); };
        const auto dhi = [&](int kk) { return desc(b_hi, kk); };
        switch (pl.ksteps) {  // a constant step count per case keeps ptxas's wgmma pipeline analysis exact
          case 1: fp8_scores<1>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          case 2: fp8_scores<2>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          case 3: fp8_scores<3>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          case 4: fp8_scores<4>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          case 5: fp8_scores<5>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          case 6: fp8_scores<6>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          case 7: fp8_scores<7>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
          default: fp8_scores<8>(acc_lo, acc_hi, part_lo, part_hi, da, dlo, dhi); break;
        }
      } else {
        ck::wgmma_fence();
        ck::wgmma_ss_first<ck::Bf16Tag>(acc_lo, desc(a0, 0), desc(q_base, 0));
        for (int kk = 1; kk < pl.ksteps; ++kk) ck::wgmma_ss<ck::Bf16Tag>(acc_lo, desc(a0, kk), desc(q_base, kk), 1);
        ck::wgmma_ss_first<ck::Bf16Tag>(acc_hi, desc(a0, 0), desc(b_hi, 0));
        for (int kk = 1; kk < pl.ksteps; ++kk) ck::wgmma_ss<ck::Bf16Tag>(acc_hi, desc(a0, kk), desc(b_hi, kk), 1);
        ck::wgmma_commit();
        ck::wgmma_wait<0>();
        ck::fence_operands(acc_lo);
        ck::fence_operands(acc_hi);
      }
      if (half == 1 && lane == 0) empty[slot].arrive();  // this warp's reads of the tile are done

      // The head sums and the candidates (score_half), with hp (head slots per query) as a constant.
      switch (hp) {
        case 8: score_half(std::integral_constant<int, 8>{}, j, half); break;
        case 16: score_half(std::integral_constant<int, 16>{}, j, half); break;
        case 32: score_half(std::integral_constant<int, 32>{}, j, half); break;
        case 64: score_half(std::integral_constant<int, 64>{}, j, half); break;
        default: score_half(std::integral_constant<int, 128>{}, j, half); break;
      }
    }
    ck::named_barrier_sync(wg_barrier(wg), 128);
    if constexpr (kBlocks) {
      for (int qi = wtid; qi < nq; qi += 128) {
        const std::int64_t t = t0 + qi;
        const std::int64_t end = t < p.Lq ? p.key_end(t) : 0;
        if (static_cast<std::int64_t>(j) * kStageKeys >= end) continue;  // the block holds no visible key
        float m = -INFINITY;
        for (int r = 0; r < 8; ++r) m = fmaxf(m, wred[r * nq + qi]);
        if (static_cast<std::int64_t>(j) * kStageKeys < imin(p.sink, end)) m = INFINITY;
        const u64 rk = rank_key(m, j);
        if (rk > wthr[qi]) wbuf[static_cast<std::int64_t>(qi) * cap + wcnt[qi]++] = rk;
      }
      ck::named_barrier_sync(wg_barrier(wg), 128);
    }
    // Compaction of the buffers that the next tile could overflow, each by the whole warpgroup.
    for (int qi = 0; qi < nq; ++qi) {
      const int c = wcnt[qi];
      if (c <= cap - per_stage) continue;  // uniform: read after the barrier, written only below
      u64* a = wbuf + static_cast<std::int64_t>(qi) * cap;
      const u64 v = group_kth_key(mine, a, c, k);
      group_keep(mine, a, c, v);
      mine.sync();
      if (wtid == 0) wcnt[qi] = k, wthr[qi] = v;
    }
    ck::named_barrier_sync(wg_barrier(wg), 128);
  }

  // Each query's best min(k, n) ids, ascending, to every group, by its warpgroup. Once both warpgroups are
  // done with the key tiles the stage ring is free (every copy landed and was read): each takes half of it for
  // the bitmap of the selected ids.
  ck::named_barrier_sync(ck::NamedBarrier::kLightningMerge, 128 * kConsumerWGs);
  const int words = pl.stages * tile_bytes / 4 / kConsumerWGs;
  unsigned* bitmap = reinterpret_cast<unsigned*>(smem + pl.off_stage) + wg * words;
  for (int qi = 0; qi < nq; ++qi) {
    const std::int64_t t = t0 + qi;
    if (t >= p.Lq) break;
    const u64* a = wbuf + static_cast<std::int64_t>(qi) * cap;
    const int n = wcnt[qi];
    const u64 v = n > k ? group_kth_key(mine, a, n, k) : 0ull;
    const std::int64_t end = p.key_end(t);
    group_write_ascending(mine, a, n, v, kBlocks ? (end + kStageKeys - 1) / kStageKeys : end, bitmap,
                          words, p.out, b, t);
  }
}

template <bool kBlocks>
void run(const TensorView& qI, const TensorView& w, const TensorView& kI, const TensorView& idx,
         const LightningOptions& o) {
  const std::string op = "lightning_select";
  const std::int64_t B = qI.shape[0], Lq = qI.shape[1], HI = qI.shape[2], Di = qI.shape[3], Lk = kI.shape[1];
  const auto stream = static_cast<cudaStream_t>(o.stream);
  const int max_smem = sel::usable_device_smem(op, "qI", qI);
  sel::check_device_memory(op, "qI", qI);
  sel::check_device_memory(op, "w", w);
  sel::check_device_memory(op, "kI", kI);
  sel::check_device_memory(op, "out.idx", idx);
  if (HI > kRows)
    throw Error(op, "qI", std::to_string(HI) + " index heads exceed the CUDA lightning selector's limit of 128");
  if (Di > 256)
    throw Error(op, "qI", "index dimension " + std::to_string(Di) + " exceeds the CUDA lightning selector's limit of 256");
  if (B > 65535) throw Error(op, "qI", "batch " + std::to_string(B) + " exceeds the CUDA lightning selector's limit of 65535");
  if (Lk >= 0x7fffffffLL)
    throw Error(op, "kI", "Lk = " + std::to_string(Lk) + " exceeds the CUDA lightning selector's limit of 2^31 - 2");
  const Plan pl = make_plan(HI, Di, o.top_k, o.precision, kBlocks);
  if (!pl.ok())
    throw Error(op, "options.top_k", "top_k = " + std::to_string(o.top_k) + " with " + std::to_string(HI) +
                                         " index heads exceeds the CUDA lightning selector's shared memory");
  if (pl.smem > max_smem)
    throw Error(op, "qI", "the CUDA lightning selector needs " + std::to_string(pl.smem) +
                              " bytes of shared memory per block; the device allows " + std::to_string(max_smem));
  const std::int64_t Gq = query_tiles(Lq, pl), Tk = ceil_div(Lk, kStageKeys);
  if (Gq / kConsumerWGs > 0x7fffffffLL) throw Error(op, "qI", "Lq = " + std::to_string(Lq) + " exceeds the CUDA lightning selector's grid");

  const ScratchLayout sl = scratch_layout(B, Lq, Lk, pl);
  sel::Scratch scratch(op, o.workspace, sl.total, qI.device_index, stream);
  auto* amax = scratch.as<unsigned>(sl.amax);
  const bool fp8 = o.precision == IndexPrecision::fp8_e4m3;
  // 1.-2. (prep.cuh): the amax words (fp8), then the codes of both tensors in the tile layout, a programmatic
  // dependent of the amax.
  if (fp8) {
    check_cuda(cudaMemsetAsync(amax, 0, 2 * sizeof(unsigned), stream), op, "cudaMemsetAsync");
    prep::launch_amax(op, qI, &kI, amax, stream);
  }
  prep::CodesParams<prep::TileLayout> cp{};
  cp.src[0] = tc::index_src(qI), cp.src[1] = tc::index_src(kI);
  cp.type[0] = sel::in_type(qI.dtype), cp.type[1] = sel::in_type(kI.dtype);
  cp.dst[0] = scratch.as<unsigned char>(sl.qcodes), cp.dst[1] = scratch.as<unsigned char>(sl.kcodes);
  int hp_log2 = 0;
  while ((1 << hp_log2) < pl.hp) ++hp_log2;
  cp.lay[0] = {Gq, pl.nq, hp_log2, pl.chunks};
  cp.lay[1] = {Tk, kRows, 0, pl.chunks};
  cp.lanes = pl.chunks * 128 / (8 * elem_bytes(o.precision));
  cp.rows0 = B * Gq * kRows;
  cp.rows = cp.rows0 + B * Tk * kRows;
  cp.amax = fp8 ? amax : nullptr;
  if (fp8) prep::launch_codes<Prec::fp8>(op, cp, true, stream);
  else prep::launch_codes<Prec::bf16>(op, cp, false, stream);

  SelectParams sp{};
  sp.qcodes = scratch.as<unsigned char>(sl.qcodes), sp.kcodes = scratch.as<unsigned char>(sl.kcodes);
  sp.w = w.ptr<float>(), sp.ws0 = w.stride[0], sp.ws1 = w.stride[1], sp.ws2 = w.stride[2];
  sp.Lq = Lq, sp.Lk = Lk, sp.HI = HI, sp.Gq = Gq, sp.Tk = Tk;
  sp.sink = o.sink_keys, sp.causal = o.causal, sp.top_k = o.top_k, sp.plan = pl;
  sp.out = OutRows{idx.ptr<std::int32_t>(), idx.stride[0], idx.stride[1], idx.stride[2], idx.stride[3], idx.shape[1],
                   idx.shape[3]};
  const dim3 grid(static_cast<unsigned>(Gq / kConsumerWGs), static_cast<unsigned>(B));
  auto go = [&](auto kernel) {
    check_cuda(ck::launch_with_smem(kernel, static_cast<std::size_t>(pl.smem),
                                    [&] { kernel<<<grid, kThreads, pl.smem, stream>>>(sp); }),
               op, "select kernel launch");
  };
  if (fp8) go(select_kernel<true, kBlocks>);
  else go(select_kernel<false, kBlocks>);
}

}  // namespace

std::size_t lightning_scratch_bytes(std::int64_t B, std::int64_t Lq, std::int64_t Lk, std::int64_t HI, std::int64_t Di,
                                    int top_k, IndexPrecision precision, bool blocks) {
  const Plan pl = make_plan(HI, Di, top_k, precision, blocks);
  return pl.ok() ? scratch_layout(B, Lq, Lk, pl).total : 0;
}

double lightning_epsilon(IndexPrecision precision, std::int64_t HI, std::int64_t Di, const float* w,
                         const float* q_values, double key_inf, double key_norm, bool zero_scale) {
  double e = 0.0;
  const double n = precision == IndexPrecision::bf16 ? std::ceil(Di / 16.0) : std::ceil(Di / 32.0);
  for (std::int64_t j = 0; j < HI; ++j) {
    double qinf = 0.0, q2 = 0.0;
    for (std::int64_t d = 0; d < Di; ++d) {
      const double x = std::fabs(static_cast<double>(q_values[j * Di + d]));
      qinf = std::max(qinf, x), q2 += x * x;
    }
    q2 = std::sqrt(q2) * (1.0 + 0x1p-40);
    const double aw = std::fabs(static_cast<double>(w[j]));
    if (zero_scale) {
      e += aw * static_cast<double>(Di) * qinf * key_inf;
      continue;
    }
    const double tc = precision == IndexPrecision::bf16 ? std::ldexp(n, -18) * q2 * key_norm
                                                        : std::ldexp(n, -7) * qinf * key_inf;
    const double rest = (34.0 * 0x1p-24 + 0x1p-22 + n * 0x1p-23) * q2 * key_norm;
    const double under = 0x1p-148 * static_cast<double>(Di) * (qinf + key_inf + 0x1p-150);
    e += aw * ((tc + rest) * (1.0 + 0x1p-10) + under);
  }
  return 2.0 * e;
}

void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const TokenLists& out,
                      const LightningOptions& options) {
  run<false>(qI, w, kI, out.idx, options);
}

void lightning_select(const TensorView& qI, const TensorView& w, const TensorView& kI, const QueryLists& out,
                      const LightningOptions& options) {
  run<true>(qI, w, kI, out.idx, options);
}

}  // namespace sparse_attn::cuda_backend
