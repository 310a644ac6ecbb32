// The index selectors' shared preparation (src/cuda/selectors/prep.cuh): the amax against a host max on
// contiguous, odd-sized, strided and unaligned views of f32, f16 and bf16; the fp8 quotient and the e4m3
// conversion against the CPU's quantisation for every float; the codes kernel's bytes in both layouts
// (token_max's rows, lightning's swizzled tiles; the rows of contiguous 16-bit views with D a multiple of 16 by
// the flat kernel) against the CPU's quantisation.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/selectors/prep.cuh"
#include "gpu/device_testing.hpp"
#include "selectors/select_common.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace {

namespace sa = sparse_attn;
namespace prep = sa::cuda_backend::prep;
namespace tc = sa::cuda_backend::tc;
using sa::testing::cuda_ok;

// A device buffer of `elems` elements of `dtype` holding x (rounded to the dtype), freed on destruction.
struct Buffer {
  void* ptr = nullptr;
  std::vector<float> host;  // the values as stored
  Buffer(sa::DType dtype, const std::vector<float>& x) : host(x.size()) {
    const std::size_t es = sa::dtype_size(dtype);
    std::vector<unsigned char> bytes(x.size() * es);
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (dtype == sa::DType::f32) {
        std::memcpy(&bytes[i * 4], &x[i], 4);
        host[i] = x[i];
      } else {
        const std::uint16_t h = dtype == sa::DType::bf16 ? sa::float_to_bf16(x[i]) : sa::float_to_f16(x[i]);
        std::memcpy(&bytes[i * 2], &h, 2);
        host[i] = dtype == sa::DType::bf16 ? sa::bf16_to_float(h) : sa::f16_to_float(h);
      }
    }
    cuda_ok(cudaMalloc(&ptr, bytes.size() + 16), "cudaMalloc");
    cuda_ok(cudaMemcpy(ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "upload");
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { cudaFree(ptr); }
};

// A device view with the given shape ([B, L, H, D] or [B, L, D]) and strides of `base` from element `first`.
sa::TensorView view_of(void* base, sa::DType dtype, std::int64_t first, std::vector<std::int64_t> shape,
                       std::vector<std::int64_t> stride) {
  sa::TensorView v = sa::TensorView::contiguous(static_cast<unsigned char*>(base) + first * sa::dtype_size(dtype), dtype,
                                                shape, sa::Device::cuda, 0);
  for (std::size_t i = 0; i < stride.size(); ++i) v.stride[i] = stride[i];
  return v;
}

// Element offsets (from the view's first element) of every element of a 3- or 4-dimensional view.
std::vector<std::int64_t> offsets(const sa::TensorView& v) {
  std::vector<std::int64_t> out;
  const bool three = v.ndim == 3;
  const std::int64_t H = three ? 1 : v.shape[2], D = three ? v.shape[2] : v.shape[3], sh = three ? 0 : v.stride[2];
  for (std::int64_t b = 0; b < v.shape[0]; ++b)
    for (std::int64_t l = 0; l < v.shape[1]; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) out.push_back(b * v.stride[0] + l * v.stride[1] + h * sh + d);
  return out;
}

struct ViewCase {
  std::string name;
  std::int64_t first;  // element offset of the view in its buffer
  std::vector<std::int64_t> shape, stride;
  std::int64_t extent;  // buffer elements
};

std::vector<ViewCase> view_cases() {
  return {
      {"contiguous", 0, {2, 700, 3, 40}, {700 * 120, 120, 40, 1}, 2 * 700 * 120},
      {"contiguous, D a multiple of 16 (token_max's flat codes for 16-bit types)", 0, {2, 301, 2, 64}, {301 * 128, 128, 64, 1},
       2 * 301 * 128},
      {"odd size (tail)", 0, {1, 333, 37}, {333 * 37, 37, 1}, 333 * 37},
      {"strided rows", 0, {2, 300, 2, 24}, {300 * 58, 58, 29, 1}, 2 * 300 * 58},
      {"unaligned base", 1, {3, 257, 1, 16}, {257 * 16, 16, 16, 1}, 3 * 257 * 16 + 1},
  };
}

// The host's amax of a view: std::fmax of |x| (NaN skipped), as the CPU's load_quantized.
float host_amax(const Buffer& buf, const sa::TensorView& v, std::int64_t first) {
  float m = 0.0f;
  for (std::int64_t o : offsets(v)) m = std::fmax(m, std::fabs(buf.host[static_cast<std::size_t>(first + o)]));
  return m;
}

// Random values, a planted negative maximum inside the view, NaN and -0 inside it, and larger values in the
// buffer outside the view (padding), which the amax must not see.
std::vector<float> amax_values(const ViewCase& c, const sa::TensorView& v, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> x(static_cast<std::size_t>(c.extent), 1000.0f);
  const std::vector<std::int64_t> in = offsets(v);
  for (std::int64_t o : in) x[static_cast<std::size_t>(c.first + o)] = nd(rng);
  const std::size_t n = in.size();
  x[static_cast<std::size_t>(c.first + in[n / 3])] = -37.5f;
  x[static_cast<std::size_t>(c.first + in[n / 2])] = std::numeric_limits<float>::quiet_NaN();
  x[static_cast<std::size_t>(c.first + in[n - 1])] = std::numeric_limits<float>::quiet_NaN();
  x[static_cast<std::size_t>(c.first + in[1])] = -0.0f;
  return x;
}

TEST(SelectorPrepGpu, AmaxMatchesHostMax) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  unsigned* amax = nullptr;
  cuda_ok(cudaMalloc(&amax, 2 * sizeof(unsigned)), "cudaMalloc");
  std::uint64_t seed = 300;
  const std::vector<ViewCase> cases = view_cases();
  for (sa::DType dt : {sa::DType::f32, sa::DType::f16, sa::DType::bf16})
    for (std::size_t i = 0; i < cases.size(); ++i) {
      // Tensor a is case i, tensor b case i + 1 in another dtype: one launch measures both.
      const ViewCase& ca = cases[i];
      const ViewCase& cb = cases[(i + 1) % cases.size()];
      const sa::DType db = dt == sa::DType::bf16 ? sa::DType::f32 : sa::DType::bf16;
      SCOPED_TRACE(std::string(sa::dtype_name(dt)) + " " + ca.name + " with " + sa::dtype_name(db) + " " + cb.name);
      const sa::TensorView pa = view_of(nullptr, dt, 0, ca.shape, ca.stride);  // the layouts, for the values
      const sa::TensorView pb = view_of(nullptr, db, 0, cb.shape, cb.stride);
      const Buffer ba(dt, amax_values(ca, pa, seed += 10)), bb(db, amax_values(cb, pb, seed += 10));
      const sa::TensorView va = view_of(ba.ptr, dt, ca.first, ca.shape, ca.stride);
      const sa::TensorView vb = view_of(bb.ptr, db, cb.first, cb.shape, cb.stride);
      for (bool both : {true, false}) {
        cuda_ok(cudaMemset(amax, 0, 2 * sizeof(unsigned)), "cudaMemset");
        prep::launch_amax("test", va, both ? &vb : nullptr, amax, nullptr);
        cuda_ok(cudaDeviceSynchronize(), "amax");
        unsigned got[2] = {0u, 0u};
        cuda_ok(cudaMemcpy(got, amax, sizeof(got), cudaMemcpyDeviceToHost), "download");
        const float wa = host_amax(ba, va, ca.first), wb = both ? host_amax(bb, vb, cb.first) : 0.0f;
        float ga = 0.0f, gb = 0.0f;
        std::memcpy(&ga, &got[0], 4);
        std::memcpy(&gb, &got[1], 4);
        EXPECT_EQ(ga, wa) << (both ? "two tensors" : "one tensor");
        EXPECT_EQ(gb, wb) << (both ? "two tensors" : "one tensor");
      }
    }
  cudaFree(amax);
}

// For every float x: the e4m3 byte of fp8_quotient (what the codes kernel stores) against the CPU's
// float_to_e4m3(fl(x / ts)) (the device port of common.cuh; ts = 0: x itself, kept raw on the CPU), and the
// hardware conversion alone against float_to_e4m3(x). NaN: any NaN code (0x7f, 0xff).
__device__ bool same_e4m3(unsigned got, unsigned want) {
  return (want & 0x7fu) == 0x7fu ? (got & 0x7fu) == 0x7fu : got == want;
}

__global__ void fp8_mismatches(const float* divisors, unsigned long long* bad, unsigned* example) {
  const float ts = divisors[blockIdx.y];
  const tc::Fp8Scale s = tc::make_fp8_scale(ts);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {
    const float x = __uint_as_float(static_cast<unsigned>(i));
    const unsigned got = __nv_cvt_float2_to_fp8x2(make_float2(tc::fp8_quotient(x, s), x), __NV_SATFINITE, __NV_E4M3);
    const unsigned want = sa::cuda_backend::sel::float_to_e4m3(ts == 0.0f ? x : __fdiv_rn(x, ts));
    const unsigned raw = sa::cuda_backend::sel::float_to_e4m3(x);
    const bool ok = same_e4m3(got & 0xffu, want) && (blockIdx.y != 0 || same_e4m3(got >> 8, raw));
    if (!ok && atomicAdd(bad + blockIdx.y, 1ull) == 0ull) example[blockIdx.y] = static_cast<unsigned>(i);
  }
}

TEST(SelectorPrepGpu, Fp8CodesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // Tensor scales amax / 448 of ordinary tensors, the ends of the clamped range [2^-48, 2^48] and just
  // outside it (div_rn there), the fast division's limits, odd mantissas, 0 (an amax that underflows).
  // The first (1) also checks the hardware conversion of every float.
  const std::vector<float> divisors = {1.0f,         3.7f / 448.0f, 11.25f / 448.0f, 0x1p-48f, 0x1p48f,
                                       0x1.fffffep-49f, 0x1.000002p48f, 0x1p-60f,    0x1p60f,  3.0f / 7.0f,
                                       65504.0f / 448.0f, 1e-30f,   0.0f};
  float* dd = nullptr;
  unsigned long long* bad = nullptr;
  unsigned* example = nullptr;
  const std::size_t n = divisors.size();
  cuda_ok(cudaMalloc(&dd, n * sizeof(float)), "cudaMalloc");
  cuda_ok(cudaMalloc(&bad, n * sizeof(unsigned long long)), "cudaMalloc");
  cuda_ok(cudaMalloc(&example, n * sizeof(unsigned)), "cudaMalloc");
  cuda_ok(cudaMemcpy(dd, divisors.data(), n * sizeof(float), cudaMemcpyHostToDevice), "upload");
  cuda_ok(cudaMemset(bad, 0, n * sizeof(unsigned long long)), "cudaMemset");
  fp8_mismatches<<<dim3(4096, static_cast<unsigned>(n)), 256>>>(dd, bad, example);
  cuda_ok(cudaDeviceSynchronize(), "fp8_mismatches");
  std::vector<unsigned long long> h_bad(n);
  std::vector<unsigned> h_ex(n);
  cuda_ok(cudaMemcpy(h_bad.data(), bad, n * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "download");
  cuda_ok(cudaMemcpy(h_ex.data(), example, n * sizeof(unsigned), cudaMemcpyDeviceToHost), "download");
  for (std::size_t i = 0; i < n; ++i) {
    float x = 0.0f;
    std::memcpy(&x, &h_ex[i], 4);
    EXPECT_EQ(h_bad[i], 0u) << "ts = " << divisors[i] << ": " << h_bad[i] << " floats differ, e.g. x = " << x << " (bits 0x"
                            << std::hex << h_ex[i] << std::dec << ")";
  }
  cudaFree(dd), cudaFree(bad), cudaFree(example);
}

// The codes kernel end to end (amax, then codes) on views of every input type: token_max's rows (fp8 e4m3
// bytes, Dc = Di rounded up to 16) and lightning's tiles (fp8, 128B swizzle, query tiles of nq positions x hp
// head slots), each byte against float_to_e4m3(x / ts), ts the CPU's precision_tensor_scale of the host amax.
TEST(SelectorPrepGpu, CodesLayoutsEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  unsigned* amax = nullptr;
  cuda_ok(cudaMalloc(&amax, 2 * sizeof(unsigned)), "cudaMalloc");
  std::uint64_t seed = 700;
  for (sa::DType dt : {sa::DType::f32, sa::DType::f16, sa::DType::bf16})
    for (const ViewCase& c : view_cases()) {
      if (c.shape.size() != 4) continue;  // lightning's queries are [B, L, H, D]
      SCOPED_TRACE(std::string(sa::dtype_name(dt)) + " " + c.name);
      std::mt19937_64 rng(seed += 10);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::vector<float> x(static_cast<std::size_t>(c.extent));
      for (float& e : x) e = nd(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
      const Buffer buf(dt, x);
      const sa::TensorView v = view_of(buf.ptr, dt, c.first, c.shape, c.stride);
      const std::int64_t B = c.shape[0], L = c.shape[1], H = c.shape[2], D = c.shape[3];
      cuda_ok(cudaMemset(amax, 0, 2 * sizeof(unsigned)), "cudaMemset");
      prep::launch_amax("test", v, &v, amax, nullptr);
      const float ts = sa::detail::precision_tensor_scale(sa::IndexPrecision::fp8_e4m3, host_amax(buf, v, c.first));
      auto want = [&](std::int64_t b, std::int64_t l, std::int64_t h, std::int64_t d) -> unsigned {
        if (l >= L || h >= H || d >= D) return 0u;
        const float e = buf.host[static_cast<std::size_t>(c.first + b * c.stride[0] + l * c.stride[1] + h * c.stride[2] + d)];
        return sa::float_to_e4m3(e / ts);
      };
      for (bool tiles : {false, true}) {
        SCOPED_TRACE(tiles ? "tiles" : "rows");
        // rows: Dc bytes a row; tiles: 128-byte chunks, nq = 128 / hp positions a tile, hp >= H a power of two.
        const int chunks = static_cast<int>((D + 127) / 128), hp = H <= 2 ? 2 : 4, nq = prep::kTileRows / hp;
        const std::int64_t Dc = tc::padded_dim(D), tiles_per_b = (L + nq - 1) / nq;
        const std::int64_t bytes = tiles ? B * tiles_per_b * chunks * prep::kChunkBytes : B * L * H * Dc;
        unsigned char* codes = nullptr;
        cuda_ok(cudaMalloc(&codes, static_cast<std::size_t>(2 * bytes)), "cudaMalloc");
        auto run = [&](auto layout, std::int64_t rows, int lanes) {
          prep::CodesParams<decltype(layout)> p{};
          p.src[0] = p.src[1] = tc::index_src(v);
          p.type[0] = p.type[1] = sa::cuda_backend::sel::in_type(dt);
          p.dst[0] = codes, p.dst[1] = codes + bytes;  // both tensors the same view: two equal copies
          p.lay[0] = p.lay[1] = layout;
          p.lanes = lanes;
          p.rows0 = rows;
          p.rows = 2 * rows;
          p.amax = amax;
          prep::launch_codes<sa::cuda_backend::sel::Prec::fp8>("test", p, false, nullptr);
        };
        int hp_log2 = 0;
        while ((1 << hp_log2) < hp) ++hp_log2;
        if (tiles) run(prep::TileLayout{tiles_per_b, nq, hp_log2, chunks}, B * tiles_per_b * prep::kTileRows, chunks * 16);
        else run(prep::RowLayout{Dc, prep::contiguous_rows(tc::index_src(v))}, B * L * H, static_cast<int>(Dc / 8));
        cuda_ok(cudaDeviceSynchronize(), "codes");
        std::vector<unsigned char> got(static_cast<std::size_t>(2 * bytes));
        cuda_ok(cudaMemcpy(got.data(), codes, got.size(), cudaMemcpyDeviceToHost), "download");
        cudaFree(codes);
        int bad = 0;
        for (std::int64_t copy = 0; copy < 2; ++copy)
          for (std::int64_t i = 0; i < bytes; ++i) {
            std::int64_t b, l, h, d;
            if (tiles) {  // byte i of chunk-major tile rows: undo the swizzle
              const std::int64_t bt = i / (chunks * prep::kChunkBytes), in = i % (chunks * prep::kChunkBytes);
              const std::int64_t ch = in / prep::kChunkBytes, r = in % prep::kChunkBytes / 128, sw = in % 128;
              const std::int64_t u = (sw / 16) ^ (r % 8);
              b = bt / tiles_per_b, l = bt % tiles_per_b * nq + r / hp, h = r % hp, d = ch * 128 + u * 16 + sw % 16;
            } else {
              b = i / (L * H * Dc), l = i / (H * Dc) % L, h = i / Dc % H, d = i % Dc;
            }
            const unsigned w = want(b, l, h, d), g = got[static_cast<std::size_t>(copy * bytes + i)];
            if (g != w && bad++ < 5)
              ADD_FAILURE() << "copy " << copy << " (b, l, h, d) = (" << b << ", " << l << ", " << h << ", " << d
                            << "): code 0x" << std::hex << g << ", cpu 0x" << w << std::dec;
          }
        EXPECT_EQ(bad, 0);
      }
    }
  cudaFree(amax);
}


// The fused amax and codes (one cooperative launch, prep::launch_fused) on two contiguous tensors of different
// sizes, magnitudes and 16-bit types (NaN and -0 planted): the amax words equal the host's, the fp8 codes equal
// float_to_e4m3(x / ts) and the bf16 codes x 2^-e (2^e the power of two above the amax) bit for bit. A problem
// whose items do not fit one resident wave is refused (false, nothing launched). Nothing needs zeroing first.
TEST(SelectorPrepGpu, FusedAmaxCodesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using sa::cuda_backend::sel::Prec;
  unsigned* words = nullptr;
  float* slots = nullptr;
  cuda_ok(cudaMalloc(&words, 2 * sizeof(unsigned)), "cudaMalloc");
  cuda_ok(cudaMalloc(&slots, prep::fused_slot_bytes()), "cudaMalloc");
  const std::vector<std::int64_t> shape[2] = {{2, 301, 2, 64}, {1, 4000, 1, 64}};  // one row length, as token_max's
  std::uint64_t seed = 900;
  for (sa::DType dt : {sa::DType::bf16, sa::DType::f16})
    for (bool fp8 : {true, false}) {
      SCOPED_TRACE(std::string(sa::dtype_name(dt)) + (fp8 ? " fp8 codes" : " bf16 codes"));
      std::vector<std::unique_ptr<Buffer>> buf;
      sa::TensorView v[2];
      for (int w = 0; w < 2; ++w) {
        const std::vector<std::int64_t>& sh = shape[w];
        const std::int64_t n = sh[0] * sh[1] * sh[2] * sh[3];
        const ViewCase c{"", 0, sh, {sh[1] * sh[2] * sh[3], sh[2] * sh[3], sh[3], 1}, n};
        std::vector<float> x = amax_values(c, view_of(nullptr, dt, 0, c.shape, c.stride), seed += 10);
        for (float& e : x) e *= w == 0 ? 0.25f : 3.0f;  // different scales
        buf.push_back(std::make_unique<Buffer>(dt, x));
        v[w] = view_of(buf.back()->ptr, dt, 0, c.shape, c.stride);
      }
      const int cb = fp8 ? 1 : 2;
      std::int64_t bytes[2], rows[2];
      for (int w = 0; w < 2; ++w) rows[w] = v[w].shape[0] * v[w].shape[1] * v[w].shape[2], bytes[w] = rows[w] * v[w].shape[3] * cb;
      unsigned char* codes = nullptr;
      cuda_ok(cudaMalloc(&codes, static_cast<std::size_t>(bytes[0] + bytes[1])), "cudaMalloc");
      prep::CodesParams<prep::RowLayout> p{};
      for (int w = 0; w < 2; ++w) {
        p.src[w] = tc::index_src(v[w]);
        p.type[w] = sa::cuda_backend::sel::in_type(dt);
        p.lay[w] = {v[w].shape[3] * cb, true};
      }
      p.dst[0] = codes, p.dst[1] = codes + bytes[0];
      p.lanes = static_cast<int>(v[0].shape[3] / 8);
      p.rows0 = rows[0];
      p.rows = rows[0] + rows[1];
      p.bf16_down = true;
      // Neither the amax words nor the slots need zeroing: both start as 0xff bytes (a NaN's bits).
      cuda_ok(cudaMemset(words, 0xff, 2 * sizeof(unsigned)), "cudaMemset");
      cuda_ok(cudaMemset(slots, 0xff, prep::fused_slot_bytes()), "cudaMemset");
      const bool launched = fp8 ? prep::launch_fused<Prec::fp8>("test", p, words, slots, nullptr)
                                : prep::launch_fused<Prec::bf16>("test", p, words, slots, nullptr);
      ASSERT_TRUE(launched);
      cuda_ok(cudaDeviceSynchronize(), "fused");
      unsigned got_amax[2] = {};
      cuda_ok(cudaMemcpy(got_amax, words, sizeof(got_amax), cudaMemcpyDeviceToHost), "download");
      std::vector<unsigned char> got(static_cast<std::size_t>(bytes[0] + bytes[1]));
      cuda_ok(cudaMemcpy(got.data(), codes, got.size(), cudaMemcpyDeviceToHost), "download");
      cudaFree(codes);
      int bad = 0;
      for (int w = 0; w < 2; ++w) {
        const float amax = host_amax(*buf[w], v[w], 0);
        float g = 0.0f;
        std::memcpy(&g, &got_amax[w], 4);
        EXPECT_EQ(g, amax) << "tensor " << w;
        const float ts = sa::detail::precision_tensor_scale(sa::IndexPrecision::fp8_e4m3, amax);
        int e = 0;
        std::frexp(amax, &e);
        e = std::max(-100, std::min(128, e));
        const std::size_t n = static_cast<std::size_t>(bytes[w] / cb), at = static_cast<std::size_t>(w == 0 ? 0 : bytes[0]);
        for (std::size_t i = 0; i < n; ++i) {
          const float x = buf[w]->host[i];
          unsigned gw = 0, ww = 0;
          if (fp8) {
            gw = got[at + i], ww = sa::float_to_e4m3(x / ts);
            if ((ww & 0x7fu) == 0x7fu) gw |= 0x80u, ww |= 0x80u;  // any NaN code
          } else {
            gw = got[at + 2 * i] | static_cast<unsigned>(got[at + 2 * i + 1]) << 8;
            ww = sa::float_to_bf16(std::ldexp(x, -e));
            if (std::isnan(x) && (gw & 0x7f80u) == 0x7f80u && (gw & 0x7fu) != 0u) gw = ww;  // any NaN
          }
          if (gw != ww && bad++ < 5)
            ADD_FAILURE() << "tensor " << w << " element " << i << " (" << x << "): code 0x" << std::hex << gw << ", cpu 0x" << ww
                          << std::dec;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  // Larger than one resident wave (a view is only described, not read): refused.
  prep::CodesParams<prep::RowLayout> big{};
  for (int w = 0; w < 2; ++w) {
    big.src[w] = tc::index_src(view_of(nullptr, sa::DType::bf16, 0, {8, 1 << 20, 1, 128}, {(1 << 20) * 128, 128, 128, 1}));
    big.type[w] = sa::cuda_backend::sel::In::bf16;
    big.lay[w] = {128, true};
  }
  big.lanes = 16;
  big.rows0 = 8 << 20;
  big.rows = 16 << 20;
  EXPECT_FALSE(prep::launch_fused<Prec::fp8>("test", big, words, slots, nullptr));
  cuda_ok(cudaGetLastError(), "nothing launched");
  cudaFree(words), cudaFree(slots);
}

}  // namespace
