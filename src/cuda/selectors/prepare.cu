// Index tensors of the selectors, rounded through their precision on the device: the per-tensor amax
// (fp8, fp4) and a dense float32 copy holding exactly the values of the CPU's load_quantized
// (common.cuh ports its round trips operation by operation). Shared by token_max and lightning.
#include <algorithm>

#include "cuda/selectors/common.cuh"

namespace sparse_attn::cuda_backend::sel {

namespace {

struct Src {
  const void* x;
  std::int64_t sb, sl, sh;  // element strides; d contiguous
  std::int64_t B, L, H, D;
};

// [B, L, H, D] or [B, L, D] (one head).
Src src_of(const TensorView& t) {
  if (t.ndim == 3) return {t.data, t.stride[0], t.stride[1], 0, t.shape[0], t.shape[1], 1, t.shape[2]};
  return {t.data, t.stride[0], t.stride[1], t.stride[2], t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
}

__device__ __forceinline__ std::int64_t row_offset(const Src& s, std::int64_t row) {
  const std::int64_t h = row % s.H, l = (row / s.H) % s.L, b = row / (s.H * s.L);
  return b * s.sb + l * s.sl + h * s.sh;
}

// Largest |x| over the tensor, as float bits (non-negative floats order like their bit patterns).
template <In T>
__global__ void amax_kernel(const Src s, unsigned int* amax_bits) {
  const std::int64_t rows = s.B * s.L * s.H;
  float m = 0.0f;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::int64_t off = row_offset(s, row);
    for (std::int64_t d = threadIdx.x; d < s.D; d += blockDim.x) m = fmaxf(m, fabsf(load_elem<T>(s.x, off + d)));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) atomicMax(amax_bits, __float_as_uint(m));
}

// One thread per element (bf16, fp8) or per 16-element fp4 block of a row; dst is dense [rows, D].
template <In T, Prec P>
__global__ void dequantize_kernel(const Src s, const unsigned int* amax_bits, float* dst) {
  constexpr int G = P == Prec::fp4 ? kFp4Block : 1;
  const std::int64_t per_row = (s.D + G - 1) / G;
  const std::int64_t n = s.B * s.L * s.H * per_row;
  const float scale = P == Prec::bf16 ? 1.0f : tensor_scale_of<P>(__uint_as_float(*amax_bits));
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / per_row, d0 = (e % per_row) * G;
    const int cnt = static_cast<int>(imin<std::int64_t>(G, s.D - d0));
    const std::int64_t off = row_offset(s, row) + d0;
    float v[G];
    for (int i = 0; i < cnt; ++i) v[i] = load_elem<T>(s.x, off + i);
    quantize_row<P>(v, cnt, scale);
    for (int i = 0; i < cnt; ++i) dst[row * s.D + d0 + i] = v[i];
  }
}

template <In T, Prec P>
void launch_dequantize(const Src& s, const unsigned int* amax, float* dst, cudaStream_t stream) {
  constexpr int G = P == Prec::fp4 ? kFp4Block : 1;
  const std::int64_t n = s.B * s.L * s.H * ((s.D + G - 1) / G);
  const int threads = 256;
  const std::int64_t blocks = std::min<std::int64_t>((n + threads - 1) / threads, 65536);
  dequantize_kernel<T, P><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(s, amax, dst);
}

template <In T>
void prepare_tensor(const Src& s, IndexPrecision prec, unsigned int* amax, float* dst, cudaStream_t stream) {
  if (prec != IndexPrecision::bf16) {
    const std::int64_t rows = s.B * s.L * s.H;
    amax_kernel<T><<<static_cast<unsigned>(std::min<std::int64_t>(rows, 1024)), 128, 0, stream>>>(s, amax);
  }
  switch (prec) {
    case IndexPrecision::bf16: return launch_dequantize<T, Prec::bf16>(s, amax, dst, stream);
    case IndexPrecision::fp8_e4m3: return launch_dequantize<T, Prec::fp8>(s, amax, dst, stream);
    case IndexPrecision::fp4_e2m1: return launch_dequantize<T, Prec::fp4>(s, amax, dst, stream);
  }
}

}  // namespace

void prepare_index_tensor(const TensorView& t, IndexPrecision prec, unsigned int* amax, float* dst,
                          cudaStream_t stream) {
  const Src s = src_of(t);
  switch (in_type(t.dtype)) {
    case In::f32: return prepare_tensor<In::f32>(s, prec, amax, dst, stream);
    case In::f16: return prepare_tensor<In::f16>(s, prec, amax, dst, stream);
    case In::bf16: return prepare_tensor<In::bf16>(s, prec, amax, dst, stream);
  }
}

}  // namespace sparse_attn::cuda_backend::sel
