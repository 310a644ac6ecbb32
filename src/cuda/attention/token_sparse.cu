// token_sparse on the GPU: attention of each query over its own list of key positions (TokenLists),
// shared by the heads of its GQA group.
//
// A work unit is one query and up to 16 heads of its group: the rows of one m16 tile of mma.sync
// m16n8k16 (groups above 16 heads take several units). A unit belongs to one warp, which
//   1. copies its Q rows into shared memory (rows past the group zero-filled) and keeps them as A
//      fragments in registers;
//   2. walks the list in chunks of 32 slots: lane l reads slot l's position two chunks ahead (the
//      load is consumed a step later, so it is never waited for), and the warp gathers the chunk's K
//      and V rows with cp.async into one of two shared-memory stages (a chunk ahead of its use), whole
//      rows per instruction; empty slots, positions out of range and keys in the query's causal
//      future are zero-filled and masked;
//   3. runs the online softmax (common/online_softmax.cuh) over each chunk: S = Q K^T (4 n-tiles of 8
//      keys), P from the S fragments in registers, O += P V with V by transposing ldmatrix;
//   4. writes out (normalised, 16-bit) and the natural-log LSE; a query that sees no key gets 0 and
//      -inf.
// Every row is computed by the same instructions in the list's slot order, so results are bitwise
// identical run to run. The kernel reads every gathered byte once per unit: with G heads per unit it
// does 4 G D flops per 4 D bytes of K and V (G flops per byte), so small groups are bound by the
// gather (L2 and HBM), not by the tensor cores.
//
// Unless trusted, a validation kernel checks the lists first (one CTA per row at a time, a bit set of
// the Lk positions in shared memory): entries >= -1, positions < Lk, no repeat in a row. It records the
// first faulty row; the host reads that row back and reports it with the CPU's message
// (detail::list_row_message).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/fault_word.hpp"
#include "cuda/common/mma_sync.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/smem_limit.hpp"

namespace sparse_attn::cuda_kernels::tok {

constexpr int kWarps = 4;    // units per CTA, one per warp
constexpr int kChunk = 32;   // list slots per step
constexpr int kStages = 2;   // K/V chunks in shared memory per warp
constexpr int kPad = 8;      // halves of padding per shared row: ldmatrix rows fall on distinct banks

struct Params {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;                // nullptr: not written
  const std::int32_t* idx = nullptr;   // [B, Hkv, Lq, Kt]
  long long q_stride[3] = {};          // b, l, h (elements; d contiguous)
  long long k_stride[3] = {};
  long long v_stride[3] = {};
  long long out_stride[3] = {};
  long long lse_stride[3] = {};        // b, h, i
  long long idx_stride[4] = {};
  long long units = 0;                 // B * Hkv * Lq * head_tiles
  int Lq = 0, Lk = 0, Hkv = 0, group = 0, head_tiles = 0, Kt = 0;
  bool causal = false;
  float scale = 0.0f;                  // softmax scale (natural-log units)
  float scale_log2 = 0.0f;             // scale * log2(e)
};

template <int D>
struct WarpSmem {
  static constexpr int kRow = D + kPad;  // halves per shared row
  std::uint16_t q[16 * kRow];
  std::uint16_t k[kStages][kChunk * kRow];
  std::uint16_t v[kStages][kChunk * kRow];
};

__device__ __forceinline__ const std::uint16_t* row_ptr(const void* base, const long long (&stride)[3], long long b,
                                                        long long l, long long h) {
  return static_cast<const std::uint16_t*>(base) + b * stride[0] + l * stride[1] + h * stride[2];
}

template <class Tag, int D>
__global__ void __launch_bounds__(kWarps * 32) token_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kRow = WarpSmem<D>::kRow;
  constexpr int kPieces = D / 8;                // 16-byte pieces per row
  constexpr int kRowsPerCopy = 32 / kPieces;    // rows one cp.async instruction of the warp covers
  constexpr int kKSteps = D / 16;
  constexpr int kDTiles = D / 8;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  auto& sm = reinterpret_cast<WarpSmem<D>*>(smem_raw)[warp];
  const long long unit = static_cast<long long>(blockIdx.x) * kWarps + warp;
  if (unit >= p.units) return;

  const int tile = static_cast<int>(unit % p.head_tiles);
  const long long qg = unit / p.head_tiles;  // (b, g, i)
  const int i = static_cast<int>(qg % p.Lq);
  const int g = static_cast<int>(qg / p.Lq % p.Hkv);
  const long long b = qg / (static_cast<long long>(p.Lq) * p.Hkv);
  const int h0 = g * p.group + tile * 16;                       // first query head of the unit
  const int rows = min(16, p.group - tile * 16);                // real rows of the m16 tile
  const long long limit = p.causal ? static_cast<long long>(i) + p.Lk - p.Lq : p.Lk - 1;
  const std::int32_t* list = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + i * p.idx_stride[2];
  const int chunks = (p.Kt + kChunk - 1) / kChunk;

  // Q rows: lane l copies pieces l, l + 32, ... of the 16 x kPieces grid.
  for (int e = lane; e < 16 * kPieces; e += 32) {
    const int r = e / kPieces, c = e % kPieces;
    const std::uint16_t* src = row_ptr(p.q, p.q_stride, b, i, h0 + min(r, rows - 1)) + c * 8;
    cp_async16(smem_addr(&sm.q[r * kRow + c * 8]), src, r < rows ? 16 : 0);
  }
  cp_async_commit();

  // Slot l of chunk c as listed (-1 past Kt). The load is only consumed a step later (`visible` is
  // applied where the position is used), so no step waits for it.
  const auto position = [&](int c) {
    const int s = c * kChunk + lane;
    return s < p.Kt ? list[static_cast<long long>(s) * p.idx_stride[3]] : -1;
  };
  // A key this query sees: listed, in range (also for trusted lists) and not in its causal future.
  const auto visible = [&](int x) { return x >= 0 && x < p.Lk && x <= limit; };
  // The chunk's K and V rows into `stage`, whole rows per instruction; masked slots are zero-filled.
  const auto gather = [&](int pos, int stage) {
#pragma unroll
    for (int it = 0; it < kChunk / kRowsPerCopy; ++it) {
      const int r = it * kRowsPerCopy + lane / kPieces, c = lane % kPieces;
      const int x = __shfl_sync(0xffffffffu, pos, r);
      const bool ok = visible(x);
      const int bytes = ok ? 16 : 0;
      const long long xr = ok ? x : 0;
      cp_async16(smem_addr(&sm.k[stage][r * kRow + c * 8]), row_ptr(p.k, p.k_stride, b, xr, g) + c * 8, bytes);
      cp_async16(smem_addr(&sm.v[stage][r * kRow + c * 8]), row_ptr(p.v, p.v_stride, b, xr, g) + c * 8, bytes);
    }
    cp_async_commit();
  };

  // pos_c: this lane's slot of chunk c (the mask of step c); pos_n: of chunk c + 1 (gathered at step c).
  int pos_c = chunks > 0 ? position(0) : -1;
  int pos_n = chunks > 1 ? position(1) : -1;
  if (chunks > 0) gather(pos_c, 0);

  cp_async_wait<1>();  // Q (the chunk-0 gather may still be in flight)
  __syncwarp();
  std::uint32_t qa[kKSteps][4];
  {
    const int r = lane % 16, c = (lane / 16) * 8;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(qa[ks], smem_addr(&sm.q[r * kRow + ks * 16 + c]));
  }

  float o[kDTiles][4];
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  RowSoftmax softmax;  // rows g8 and g8 + 8
  const int g8 = lane / 4, t4 = lane % 4;

  for (int c = 0; c < chunks; ++c) {
    const int stage = c % kStages;
    // The next chunk's gather (its positions were loaded a step ago), then the positions of the one
    // after it, which the next step gathers.
    int pos_nn = -1;
    if (c + 1 < chunks) {
      gather(pos_n, (c + 1) % kStages);
      pos_nn = c + 2 < chunks ? position(c + 2) : -1;
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const unsigned valid = __ballot_sync(0xffffffffu, visible(pos_c));
    if (valid != 0u) {
      // S = Q K^T for 4 n-tiles of 8 keys.
      float s[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < kKSteps / 2; ++kp) {
          std::uint32_t kb[4];
          ldmatrix_x4(kb, smem_addr(&sm.k[stage][(nt * 8 + lane % 8) * kRow + kp * 32 + (lane / 8) * 8]));
          mma_m16n8k16<Tag>(s[nt], qa[2 * kp], kb[0], kb[1]);
          mma_m16n8k16<Tag>(s[nt], qa[2 * kp + 1], kb[2], kb[3]);
        }
      }
      // Online softmax over the chunk: masked keys are -inf.
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (((valid >> (nt * 8 + 2 * t4 + (e & 1))) & 1u) == 0u) s[nt][e] = -INFINITY;
      float alpha[2];
      softmax.update(s, p.scale_log2, alpha);
      RowSoftmax::rescale(o, alpha);
      std::uint32_t pa[2][4];  // P as the A fragments of two 16-key steps
      pack_a<Tag>(s, pa);
      // O += P V: per 16-key step, V fragments for two 8-dim n-tiles per transposing ldmatrix.
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int np = 0; np < kDTiles / 2; ++np) {
          std::uint32_t vb[4];
          ldmatrix_x4_trans(vb, smem_addr(&sm.v[stage][(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kRow +
                                                       np * 16 + (lane / 16) * 8]));
          mma_m16n8k16<Tag>(o[2 * np], pa[kk], vb[0], vb[1]);
          mma_m16n8k16<Tag>(o[2 * np + 1], pa[kk], vb[2], vb[3]);
        }
    }
    __syncwarp();  // every lane is done with `stage` before the next step's gather refills it
    pos_c = pos_n;
    pos_n = pos_nn;
  }

  // Epilogue: the quad's sums, then out = O / l (16-bit) and the natural-log lse for the real rows.
  softmax.finish();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g8 + 8 * r;
    if (row >= rows) continue;
    const float inv = softmax.normaliser(r);
    std::uint16_t* orow = static_cast<std::uint16_t*>(p.out) + b * p.out_stride[0] +
                          static_cast<long long>(i) * p.out_stride[1] + static_cast<long long>(h0 + row) * p.out_stride[2];
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      const std::uint32_t packed = Tag::pack(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      *reinterpret_cast<std::uint32_t*>(orow + n * 8 + 2 * t4) = packed;
    }
    if (p.lse != nullptr && t4 == 0)
      p.lse[b * p.lse_stride[0] + static_cast<long long>(h0 + row) * p.lse_stride[1] + static_cast<long long>(i) * p.lse_stride[2]] =
          softmax.lse(r, p.scale);
  }
}

// ---- validation ------------------------------------------------------------------------------------

constexpr int kCheckThreads = 256;

struct CheckParams {
  const std::int32_t* idx = nullptr;
  long long idx_stride[4] = {};
  long long rows = 0;  // B * Hkv * Lq
  int Lq = 0, Hkv = 0, Kt = 0, Lk = 0;
  unsigned long long* fault = nullptr;  // the first faulty row
};

// One row per CTA at a time: every slot is checked against [-1, Lk), and each position sets its bit in
// the CTA's bit set over the Lk positions; a bit already set is a repeat. The bits are cleared again
// (by the same slots) before the next row. Rows past the first fault found so far are skipped.
__global__ void __launch_bounds__(kCheckThreads) check_kernel(const __grid_constant__ CheckParams p) {
  extern __shared__ unsigned seen[];
  __shared__ int bad, skip;
  const int words = (p.Lk + 31) / 32;
  for (int w = threadIdx.x; w < words; w += kCheckThreads) seen[w] = 0u;
  for (long long r = blockIdx.x; r < p.rows; r += gridDim.x) {
    if (threadIdx.x == 0) {
      bad = 0;
      skip = static_cast<unsigned long long>(r) > *reinterpret_cast<volatile unsigned long long*>(p.fault);
    }
    __syncthreads();
    if (skip) break;
    const long long i = r % p.Lq, g = r / p.Lq % p.Hkv, b = r / (static_cast<long long>(p.Lq) * p.Hkv);
    const std::int32_t* row = p.idx + b * p.idx_stride[0] + g * p.idx_stride[1] + i * p.idx_stride[2];
    for (int s = threadIdx.x; s < p.Kt; s += kCheckThreads) {
      const int x = row[static_cast<long long>(s) * p.idx_stride[3]];
      if (x == -1) continue;
      bool fault = x < -1 || x >= p.Lk;
      if (!fault) {
        const unsigned bit = 1u << (x & 31);
        fault = (atomicOr(&seen[x >> 5], bit) & bit) != 0u;
      }
      if (fault) atomicOr(&bad, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0 && bad) atomicMin(p.fault, static_cast<unsigned long long>(r));
    for (int s = threadIdx.x; s < p.Kt; s += kCheckThreads) {
      const int x = row[static_cast<long long>(s) * p.idx_stride[3]];
      if (x >= 0 && x < p.Lk) atomicAnd(&seen[x >> 5], ~(1u << (x & 31)));
    }
    __syncthreads();
  }
}

}  // namespace sparse_attn::cuda_kernels::tok

namespace sparse_attn::cuda_backend {
namespace {

namespace tk = cuda_kernels::tok;
using detail::require;

const std::string kOp = "token_sparse";

// Bytes of the validation's bit set over the Lk positions: the largest a CTA can hold decides how long
// Lk may be for checked lists (the check is skipped for trusted ones).
std::size_t seen_bytes(std::int64_t Lk) { return static_cast<std::size_t>((Lk + 31) / 32) * sizeof(unsigned); }

void check_lists(const ProblemShape& p, const TokenLists& tokens, int device, cudaStream_t stream) {
  const std::size_t smem = seen_bytes(p.Lk);
  int optin = 0;
  cuda_kernels::check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), kOp,
                           "device query");
  require(smem + 64 <= static_cast<std::size_t>(optin), kOp, "tokens.idx", [&] {
    return "checking lists on the device takes a bit set of the Lk = " + std::to_string(p.Lk) + " positions (" +
           std::to_string(smem) + " bytes of shared memory, this device has " + std::to_string(optin) +
           "); pass options.trusted for lists known to be valid";
  });
  tk::CheckParams c;
  c.idx = static_cast<const std::int32_t*>(tokens.idx.data);
  for (int d = 0; d < 4; ++d) c.idx_stride[d] = tokens.idx.stride[d];
  c.rows = p.B * p.Hkv * p.Lq;
  c.Lq = static_cast<int>(p.Lq);
  c.Hkv = static_cast<int>(p.Hkv);
  c.Kt = static_cast<int>(tokens.idx.shape[3]);
  c.Lk = static_cast<int>(p.Lk);
  int sms = 0;
  cuda_kernels::check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kOp, "device query");

  const long long ctas = std::min<long long>(c.rows, 8LL * sms);
  const unsigned long long f = cuda_kernels::checked_launch(device, stream, kOp, [&](unsigned long long* w) {
    c.fault = w;
    cuda_kernels::check_cuda(
        cuda_kernels::launch_with_smem(
            tk::check_kernel, smem,
            [&] { tk::check_kernel<<<static_cast<unsigned>(ctas), tk::kCheckThreads, smem, stream>>>(c); }),
        kOp, "list validation launch");
  });
  if (f == cuda_kernels::kNoFault) return;
  // The faulty row, read back and reported as the CPU reports it.
  const long long r = static_cast<long long>(f);
  const long long i = r % p.Lq, g = r / p.Lq % p.Hkv, b = r / (p.Lq * p.Hkv);
  const std::vector<std::int32_t> row = cuda_kernels::read_back_row(
      c.idx + b * c.idx_stride[0] + g * c.idx_stride[1] + i * c.idx_stride[2], c.idx_stride[3],
      static_cast<std::size_t>(c.Kt), stream, kOp);
  std::vector<std::int64_t> scratch;
  if (auto m = detail::list_row_message(row.data(), c.Kt, p.Lk, true, b, g, i, r, scratch))
    throw Error(kOp, "tokens.idx", *m);
  throw Error(kOp, "tokens.idx", "the device check found a fault in the row at " + detail::coord_string({b, g, i}) +
                                     " that the row read back does not show");
}

template <class Tag, int D>
void launch(const tk::Params& prm, cudaStream_t stream) {
  const std::size_t smem = tk::kWarps * sizeof(tk::WarpSmem<D>);
  const long long ctas = (prm.units + tk::kWarps - 1) / tk::kWarps;
  cuda_kernels::check_cuda(
      cuda_kernels::launch_with_smem(
          tk::token_kernel<Tag, D>, smem,
          [&] { tk::token_kernel<Tag, D><<<static_cast<unsigned>(ctas), tk::kWarps * 32, smem, stream>>>(prm); }),
      kOp, "kernel launch");
}

}  // namespace

void token_sparse(const ProblemShape& p, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TokenLists& tokens, const TensorView& out, const std::optional<TensorView>& lse,
                  const AttentionOptions& options) {
  require(p.D == 64 || p.D == 128, kOp, "q",
          [&] { return "the CUDA backend implements head dim 64 and 128, got " + std::to_string(p.D); });
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
  const std::int64_t Kt = tokens.idx.shape[3];
  const std::int64_t head_tiles = ceil_div(p.group_size(), 16);
  require(p.Lq <= kIntMax && p.Lk < kIntMax && Kt < kIntMax - tk::kChunk && p.B * p.Hkv * p.Lq * head_tiles < (1LL << 40),
          kOp, "q", [&] { return "problem too large for the CUDA kernel's indices: " + p.describe(); });
  // cp.async copies 16-byte pieces of the q, k and v rows; out is stored in pairs of elements.
  const auto aligned = [](const TensorView& t, int elems) {
    return reinterpret_cast<std::uintptr_t>(t.data) % (2 * elems) == 0 && t.stride[0] % elems == 0 &&
           t.stride[1] % elems == 0 && t.stride[2] % elems == 0;
  };
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}})
    require(aligned(*t, 8), kOp, name, [&] {
      return std::string("needs a 16-byte aligned base and strides that are multiples of 8 elements, got ") +
             t->describe();
    });
  require(aligned(out, 2), kOp, "out",
          [&] { return "needs a 4-byte aligned base and even strides, got " + out.describe(); });

  cuda_kernels::DeviceGuard guard(q.device_index, kOp);
  const auto stream = static_cast<cudaStream_t>(options.stream);
  if (!options.trusted && Kt > 0) check_lists(p, tokens, q.device_index, stream);

  tk::Params prm;
  prm.q = q.data;
  prm.k = k.data;
  prm.v = v.data;
  prm.out = out.data;
  for (int d = 0; d < 3; ++d) {
    prm.q_stride[d] = q.stride[d];
    prm.k_stride[d] = k.stride[d];
    prm.v_stride[d] = v.stride[d];
    prm.out_stride[d] = out.stride[d];
  }
  if (lse) {
    prm.lse = static_cast<float*>(lse->data);
    for (int d = 0; d < 3; ++d) prm.lse_stride[d] = lse->stride[d];
  }
  prm.idx = static_cast<const std::int32_t*>(tokens.idx.data);
  for (int d = 0; d < 4; ++d) prm.idx_stride[d] = tokens.idx.stride[d];
  prm.Lq = static_cast<int>(p.Lq);
  prm.Lk = static_cast<int>(p.Lk);
  prm.Hkv = static_cast<int>(p.Hkv);
  prm.group = static_cast<int>(p.group_size());
  prm.head_tiles = static_cast<int>(head_tiles);
  prm.Kt = static_cast<int>(Kt);
  prm.causal = p.causal;
  prm.units = p.B * p.Hkv * p.Lq * head_tiles;
  prm.scale = resolve_scale(kOp, options.softmax_scale, p.D);
  prm.scale_log2 = prm.scale * 1.4426950408889634f;
  if (prm.units == 0) return;
  const bool bf16 = q.dtype == DType::bf16;
  if (p.D == 128)
    bf16 ? launch<cuda_kernels::Bf16Tag, 128>(prm, stream) : launch<cuda_kernels::F16Tag, 128>(prm, stream);
  else
    bf16 ? launch<cuda_kernels::Bf16Tag, 64>(prm, stream) : launch<cuda_kernels::F16Tag, 64>(prm, stream);
}

}  // namespace sparse_attn::cuda_backend
