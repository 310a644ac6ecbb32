// The per-tensor amax of the index selectors' preparation (prep.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "cuda/selectors/prep.cuh"

namespace sparse_attn::cuda_backend::prep {

namespace {

// A tensor that is one flat array is read as 16-byte units, kAmaxLoads of them issued per thread and round
// (ptxas starts the first maxima before the last loads of a round issue: 5 or more in flight, 80 KB or more
// per SM at 4 CTAs of 256 threads, several times what covers the HBM latency), by a grid stride; its |x| max
// is taken on the packed data: per 32-bit word of 16-bit elements a sign clear and a max.bf16x2 / max.f16x2
// (which return the other operand for a NaN, as std::fmax; ptxas pairs them into 3-input maxima, 6
// instructions per 16 bytes), per f32 element one max with |x|. Other views (strided rows, an unaligned
// base): a warp per row, one element per lane, only for them.
constexpr int kAmaxLoads = 8;
constexpr int kAmaxCtasPerSm = 4;

struct AmaxTensor {
  IndexSrc src;
  In type;
  bool flat;
};

struct AmaxParams {
  AmaxTensor t[2];
  unsigned blocks0;  // CTAs [0, blocks0) take tensor 0, the others tensor 1
  unsigned int* amax;
};

template <In T>
__device__ float flat_max(const IndexSrc& s, unsigned block, unsigned blocks) {
  constexpr int es = T == In::f32 ? 4 : 2;
  const std::int64_t n = s.B * s.L * s.H * s.D, units = n * es / 16;
  const std::int64_t stride = static_cast<std::int64_t>(blocks) * kThreads;
  const std::int64_t first = static_cast<std::int64_t>(block) * kThreads + threadIdx.x;
  const auto* v = static_cast<const uint4*>(s.x);
  Packed<T> acc;
  for (std::int64_t i = first; i < units; i += kAmaxLoads * stride) {
    uint4 w[kAmaxLoads];
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) {
      const std::int64_t j = i + u * stride;
      w[u] = j < units ? __ldg(v + j) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) fold_unit(acc, w[u]);
  }
  float m = acc.value();
  for (std::int64_t e = units * (16 / es) + first; e < n; e += stride) m = fmaxf(m, fabsf(sel::load_elem<T>(s.x, e)));
  return m;
}

template <In T>
__device__ float row_max(const IndexSrc& s, unsigned block, unsigned blocks) {
  const std::int64_t rows = s.B * s.L * s.H, warps = static_cast<std::int64_t>(blocks) * (kThreads / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  float m = 0.0f;
  for (std::int64_t r = static_cast<std::int64_t>(block) * (kThreads / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const std::int64_t off = s.offset(r);
    for (std::int64_t d = lane; d < s.D; d += 32) m = fmaxf(m, fabsf(sel::load_elem<T>(s.x, off + d)));
  }
  return m;
}

template <In T>
__device__ float tensor_max(const AmaxTensor& t, unsigned block, unsigned blocks) {
  return t.flat ? flat_max<T>(t.src, block, blocks) : row_max<T>(t.src, block, blocks);
}

// A block reduction and one atomicMax per CTA on the float bits (non-negative floats order like their bits):
// atomics on one address serialise in L2, so one per warp from thousands of warps would cost more than the read.
__global__ void __launch_bounds__(kThreads) amax_kernel(const __grid_constant__ AmaxParams p) {
  sel::pdl_launch_dependents();  // the codes kernel may be scheduled beside this one and issue its loads
  const int which = blockIdx.x < p.blocks0 ? 0 : 1;
  const AmaxTensor& t = which ? p.t[1] : p.t[0];
  const unsigned block = which ? blockIdx.x - p.blocks0 : blockIdx.x;
  const unsigned blocks = which ? gridDim.x - p.blocks0 : p.blocks0;
  float m = t.type == In::f32   ? tensor_max<In::f32>(t, block, blocks)
            : t.type == In::f16 ? tensor_max<In::f16>(t, block, blocks)
                                : tensor_max<In::bf16>(t, block, blocks);
  __shared__ float red[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
    atomicMax(p.amax + which, __float_as_uint(m));
  }
}

}  // namespace

void launch_amax(const std::string& op, const TensorView& a, const TensorView* b, unsigned int* amax, cudaStream_t stream) {
  const int sms = sel::current_sm_count(op);
  AmaxParams p{};
  const TensorView* views[2] = {&a, b};
  std::int64_t want[2] = {0, 0};  // CTAs that have work: a round of loads per thread, or a warp per row
  double bytes[2] = {0.0, 0.0};
  for (int i = 0; i < 2; ++i) {
    if (views[i] == nullptr) continue;
    AmaxTensor& t = p.t[i];
    t.src = tc::index_src(*views[i]);
    t.type = sel::in_type(views[i]->dtype);
    t.flat = contiguous_rows(t.src);
    const std::int64_t n = views[i]->numel();
    bytes[i] = static_cast<double>(n) * static_cast<double>(dtype_size(views[i]->dtype));
    want[i] = t.flat ? ceil_div(n * static_cast<std::int64_t>(dtype_size(views[i]->dtype)), std::int64_t{16} * kAmaxLoads * kThreads)
                     : ceil_div(t.src.B * t.src.L * t.src.H, std::int64_t{kThreads / 32});
  }
  // One wave of kAmaxCtasPerSm CTAs per SM, shared in proportion to the tensors' bytes.
  const double total = std::max(1.0, bytes[0] + bytes[1]);
  unsigned blocks[2] = {0u, 0u};
  for (int i = 0; i < 2; ++i) {
    const auto share = static_cast<std::int64_t>(std::llround(sms * kAmaxCtasPerSm * bytes[i] / total));
    blocks[i] = static_cast<unsigned>(std::min(want[i], std::max<std::int64_t>(1, share)));
  }
  p.blocks0 = blocks[0];
  p.amax = amax;
  const unsigned grid = blocks[0] + blocks[1];
  if (grid == 0) return;
  sel::launch_kernel(op, "amax launch", amax_kernel, dim3(grid), dim3(kThreads), 0, stream, false, p);
}

}  // namespace sparse_attn::cuda_backend::prep
