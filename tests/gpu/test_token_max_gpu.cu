// GPU tests of the tensor-core token_max selector (screening in float32 on bf16 codes, float64 re-scoring
// of the blocks within the error bound of the k-th): every id, count and -1 pad must equal the CPU
// reference bit for bit, for the three precisions and both outputs, on random and planted inputs,
// awkward shapes, adversarial near-ties (block maxima that differ in their last bits, and exact ties),
// and non-finite index rows. Device outputs are poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "cuda/selectors/tc_index.cuh"
#include "cuda/selectors/backend.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::cuda_ok;
using st::Dev;
using st::expect_equal_i32;
using st::poisoned_i32;

constexpr sa::IndexPrecision kPrecisions[] = {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3,
                                              sa::IndexPrecision::fp4_e2m1};

// Device counters of the selector (candidates ranked, pairs re-scored in float64), added to by the calls
// that take tuning().
struct Stats {
  unsigned long long* d = nullptr;
  Stats() {
    cuda_ok(cudaMalloc(&d, 2 * sizeof(unsigned long long)), "cudaMalloc");
    cuda_ok(cudaMemset(d, 0, 2 * sizeof(unsigned long long)), "cudaMemset");
  }
  Stats(const Stats&) = delete;
  Stats& operator=(const Stats&) = delete;
  ~Stats() { cudaFree(d); }
  sa::detail::SelectorTuning tuning() const {
    sa::detail::SelectorTuning t;
    t.token_max_counters = d;
    return t;
  }
  void read(unsigned long long& candidates, unsigned long long& rescored) const {
    unsigned long long h[2] = {0, 0};
    cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    candidates = h[0], rescored = h[1];
  }
};

struct Case {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 128, Hkv = 1, Hk = 1, Di = 64;
  int top_k = 4, kmax = 4;
  bool causal = true, reserve_local = true;
};

sa::TokenMaxOptions options_of(const Case& c, sa::IndexPrecision prec) {
  sa::TokenMaxOptions o;
  o.top_k = c.top_k, o.precision = prec, o.causal = c.causal, o.reserve_local = c.reserve_local;
  return o;
}

// Runs the CPU on (cq, ck) and the GPU on the device views (gq, gk) and compares every output element. The
// GPU call is the public function, or with `stats` the CUDA backend counting into them.
void compare_views(const Case& c, sa::IndexPrecision prec, bool tiles, const sa::HostTensor& cq, const sa::HostTensor& ck,
                   const sa::TensorView& gq, const sa::TensorView& gk, const Stats* stats = nullptr) {
  SCOPED_TRACE(c.name + " " + sa::precision_name(prec) + (tiles ? " TileLists" : " QueryLists"));
  const sa::TokenMaxOptions o = options_of(c, prec);
  if (tiles) {
    const std::int64_t Tq = sa::ceil_div(c.Lq, sa::kTileQ);
    sa::HostTensor idx(sa::DType::i32, {c.B, c.Hkv, Tq, c.kmax}), cnt(sa::DType::i32, {c.B, c.Hkv, Tq});
    sa::token_max_select(cq.view(), ck.view(), sa::TileLists{idx.view(), cnt.view()}, o);
    Dev didx(poisoned_i32(idx.shape())), dcnt(poisoned_i32(cnt.shape()));
    const sa::TileLists out{didx.view, dcnt.view};
    if (stats != nullptr) sa::cuda_backend::token_max_select(gq, gk, out, o, stats->tuning());
    else sa::token_max_select(gq, gk, out, o);
    cuda_ok(cudaDeviceSynchronize(), "token_max_select");
    expect_equal_i32(dcnt.download(cnt), cnt, "cnt");
    expect_equal_i32(didx.download(idx), idx, "idx");
  } else {
    sa::HostTensor idx(sa::DType::i32, {c.B, c.Hkv, c.Lq, c.kmax});
    sa::token_max_select(cq.view(), ck.view(), sa::QueryLists{idx.view()}, o);
    Dev didx(poisoned_i32(idx.shape()));
    const sa::QueryLists out{didx.view};
    if (stats != nullptr) sa::cuda_backend::token_max_select(gq, gk, out, o, stats->tuning());
    else sa::token_max_select(gq, gk, out, o);
    cuda_ok(cudaDeviceSynchronize(), "token_max_select");
    expect_equal_i32(didx.download(idx), idx, "idx");
  }
}

// The same with the GPU inputs uploaded from host tensors (gq, gk): the same tensors as (cq, ck) unless a
// test maps non-finite GPU inputs to their CPU equivalents.
void compare(const Case& c, sa::IndexPrecision prec, bool tiles, const sa::HostTensor& cq, const sa::HostTensor& ck,
             const sa::HostTensor& gq, const sa::HostTensor& gk, const Stats* stats = nullptr) {
  Dev dq(gq), dk(gk);
  compare_views(c, prec, tiles, cq, ck, dq.view, dk.view, stats);
}

void run_random(const Case& c, sa::IndexPrecision prec, bool tiles, std::uint64_t seed,
                sa::DType dtype = sa::DType::bf16, const Stats* stats = nullptr) {
  const sa::HostTensor q = st::random_tensor(dtype, {c.B, c.Lq, c.Hkv, c.Di}, seed);
  const sa::HostTensor k = st::random_tensor(dtype, {c.B, c.Lk, c.Hk, c.Di}, seed + 1);
  compare(c, prec, tiles, q, k, q, k, stats);
}

float* row_f32(sa::HostTensor& t, std::int64_t b, std::int64_t l, std::int64_t h) {
  const auto& s = t.shape();
  return t.data<float>() + ((b * s[1] + l) * s[2] + h) * s[3];
}

// Structured input (float32): queries near a shared direction u per (batch, KV head) with q[d0] = 1;
// KV block j holds one key equal to u except k[d0] = step * m_j (m_j in -3..3, repeating, so some blocks
// tie exactly) and small noise in its other keys. The block maxima then differ by exactly step * m_j:
// with a small step, in the last bits of the float64 scores, far inside the screening bound.
void near_tie_inputs(const Case& c, float step, std::uint64_t seed, sa::HostTensor& q, sa::HostTensor& k) {
  q = sa::HostTensor(sa::DType::f32, {c.B, c.Lq, c.Hkv, c.Di});
  k = sa::HostTensor(sa::DType::f32, {c.B, c.Lk, c.Hk, c.Di});
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::int64_t d0 = c.Di / 3;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hk; ++h) {
      std::vector<float> u(static_cast<std::size_t>(c.Di));
      for (auto& x : u) x = sa::round_bf16(nd(rng));
      const std::int64_t groups = c.Hk == 1 ? c.Hkv : 1;
      for (std::int64_t gg = 0; gg < groups; ++gg) {
        const std::int64_t g = c.Hk == 1 ? gg : h;
        for (std::int64_t i = 0; i < c.Lq; ++i) {
          float* r = row_f32(q, b, i, g);
          for (std::int64_t d = 0; d < c.Di; ++d) r[d] = sa::round_bf16(u[static_cast<std::size_t>(d)] + 0.01f * nd(rng));
          r[d0] = 1.0f;
        }
      }
      for (std::int64_t s = 0; s < c.Lk; ++s) {
        float* r = row_f32(k, b, s, h);
        const std::int64_t j = s / sa::kBlockK, size = std::min<std::int64_t>(sa::kBlockK, c.Lk - j * sa::kBlockK);
        if (s % sa::kBlockK == 17 % size) {
          for (std::int64_t d = 0; d < c.Di; ++d) r[d] = u[static_cast<std::size_t>(d)];
          r[d0] = step * static_cast<float>(static_cast<int>((j * 5) % 7) - 3);
        } else {
          for (std::int64_t d = 0; d < c.Di; ++d) r[d] = sa::round_bf16(0.05f * nd(rng));
        }
      }
    }
}

// ---- tests ---------------------------------------------------------------------------------------------

// The device quantisation of the tensor-core path, row by row in 16-element groups as prepare_pair_kernel
// runs it: values v and codes c of rows x [rows, n].
template <sa::cuda_backend::sel::Prec P>
__global__ void quantize_rows_kernel(const float* x, int rows, int n, float ts, float* v, float* c) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  for (int d0 = 0; d0 < n; d0 += 16) {
    const int cnt = n - d0 < 16 ? n - d0 : 16;
    float xv[16], vv[16], cc[16];
    for (int i = 0; i < cnt; ++i) xv[i] = x[r * n + d0 + i];
    sa::cuda_backend::tc::quantize_codes<P>(xv, cnt, ts, vv, cc);
    for (int i = 0; i < cnt; ++i) v[r * n + d0 + i] = vv[i], c[r * n + d0 + i] = cc[i];
  }
}

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0; }

// Quotients x / d of tc::div_rn against __fdiv_rn, bit for bit: `mode` 0 sweeps every exponent pair of
// [-70, 70]^2 (past the fast path's [-60, 60] on both sides) with hashed mantissas and signs; mode 1 divides
// every mantissa of one binade of x, both signs, by the divisor ds[blockIdx.y].
__device__ unsigned test_hash(unsigned v) {
  v ^= v >> 16;
  v *= 0x7feb352du;
  v ^= v >> 15;
  v *= 0x846ca68bu;
  return v ^ (v >> 16);
}

__global__ void division_mismatches(int mode, const float* ds, unsigned long long* bad, unsigned* example) {
  const unsigned tid = blockIdx.x * blockDim.x + threadIdx.x;
  float x, d;
  if (mode == 0) {
    const unsigned ex = tid / (141u * 64u), ed = (tid / 64u) % 141u, h = test_hash(tid);
    if (ex >= 141u) return;
    x = __uint_as_float(((h & 1u) << 31) | ((ex + 127u - 70u) << 23) | (test_hash(h) & 0x7fffffu));
    d = __uint_as_float(((h & 2u) << 30) | ((ed + 127u - 70u) << 23) | (test_hash(h + 1u) & 0x7fffffu));
  } else {
    if (tid >= 2u << 23) return;
    x = __uint_as_float(((tid >> 23) << 31) | (127u << 23) | (tid & 0x7fffffu));
    d = ds[blockIdx.y];
  }
  const float a = sparse_attn::cuda_backend::tc::div_rn(x, sparse_attn::cuda_backend::tc::make_divisor(d));
  const float b = __fdiv_rn(x, d);
  if (__float_as_uint(a) != __float_as_uint(b)) {
    if (atomicAdd(bad, 1ull) == 0ull) example[0] = __float_as_uint(x), example[1] = __float_as_uint(d);
  }
}

TEST(TokenMaxGpu, DivisionMatchesFdivRn) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  // Divisors as the tensor scales of the fp8 and fp4 paths produce them (amax / 448, amax / 2688) and
  // block scales, plus mantissas at the ends of the binade.
  const std::vector<float> divisors = {3.7f / 448.0f, 11.25f / 448.0f, 0.031f / 2688.0f, 1.0f, 1.0000001f, 1.9999999f,
                                       0.75f * 0.0625f, 6.5e-7f, 12345.678f};
  struct Buf {
    void* ptr = nullptr;
    explicit Buf(std::size_t bytes) { cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
    ~Buf() { cudaFree(ptr); }
  } dds(divisors.size() * sizeof(float)), dbad(sizeof(unsigned long long) + 2 * sizeof(unsigned));
  cuda_ok(cudaMemcpy(dds.ptr, divisors.data(), divisors.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
  for (int mode : {0, 1}) {
    cuda_ok(cudaMemset(dbad.ptr, 0, sizeof(unsigned long long) + 2 * sizeof(unsigned)), "cudaMemset");
    auto* bad = static_cast<unsigned long long*>(dbad.ptr);
    auto* example = reinterpret_cast<unsigned*>(bad + 1);
    const unsigned n = mode == 0 ? 141u * 141u * 64u : 2u << 23;
    const dim3 grid((n + 255u) / 256u, mode == 0 ? 1u : static_cast<unsigned>(divisors.size()));
    division_mismatches<<<grid, 256>>>(mode, static_cast<const float*>(dds.ptr), bad, example);
    cuda_ok(cudaDeviceSynchronize(), "division_mismatches");
    unsigned long long h_bad = 0;
    unsigned h_ex[2] = {0, 0};
    cuda_ok(cudaMemcpy(&h_bad, bad, sizeof(h_bad), cudaMemcpyDeviceToHost), "download");
    cuda_ok(cudaMemcpy(h_ex, example, sizeof(h_ex), cudaMemcpyDeviceToHost), "download");
    float x = 0, d = 0;
    std::memcpy(&x, &h_ex[0], 4);
    std::memcpy(&d, &h_ex[1], 4);
    EXPECT_EQ(h_bad, 0u) << "mode " << mode << ": " << h_bad << " quotients differ, e.g. " << x << " / " << d;
  }
}

// The device values equal the CPU's quantize_dequantize bit for bit (ties, subnormals, saturation, the
// format boundaries, NaN), and the codes are exact in bf16 with value = fl(code * scale) for fp8.
TEST(TokenMaxGpu, QuantisationEqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  using sa::cuda_backend::sel::Prec;
  const int n = 40, rows = 4096;
  std::mt19937_64 rng(99);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 9), ex(-30, 12), mant(0, 63);
  for (int pi = 0; pi < 3; ++pi) {
    const sa::IndexPrecision prec = kPrecisions[pi];
    SCOPED_TRACE(sa::precision_name(prec));
    std::vector<float> x(static_cast<std::size_t>(rows * n));
    for (auto& e : x) {
      switch (pick(rng)) {
        case 0: e = std::ldexp(static_cast<float>(mant(rng)) + 0.5f, ex(rng)); break;  // ties of coarse grids
        case 1: e = std::ldexp(1.0f, ex(rng)) * (pick(rng) < 5 ? 1.0f : -1.0f); break;
        case 2: e = std::ldexp(nd(rng), -140); break;                                  // float subnormals
        case 3: e = nd(rng) * 300.0f; break;
        default: e = nd(rng) * std::ldexp(1.0f, ex(rng) / 3); break;
      }
    }
    x[5] = 0.0f, x[6] = -0.0f, x[7] = std::numeric_limits<float>::quiet_NaN(), x[8] = 1e30f, x[9] = -1e-30f;
    float amax = 0.0f;
    for (float e : x)
      if (!std::isnan(e)) amax = std::fmax(amax, std::fabs(e));
    for (float ts : {prec == sa::IndexPrecision::fp8_e4m3 ? amax / 448.0f : amax / (448.0f * 6.0f), 1.0f, 0x1p-7f,
                     3.0f / 7.0f}) {
      std::vector<float> want = x;
      for (int r = 0; r < rows; ++r)
        sa::quantize_dequantize(want.data() + static_cast<std::size_t>(r) * n, n, prec, ts);
      float *dx = nullptr, *dv = nullptr, *dc = nullptr;
      const std::size_t bytes = x.size() * 4;
      cuda_ok(cudaMalloc(&dx, bytes), "cudaMalloc");
      cuda_ok(cudaMalloc(&dv, bytes), "cudaMalloc");
      cuda_ok(cudaMalloc(&dc, bytes), "cudaMalloc");
      cuda_ok(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice), "upload");
      const unsigned blocks = (rows + 127) / 128;
      if (prec == sa::IndexPrecision::bf16) quantize_rows_kernel<Prec::bf16><<<blocks, 128>>>(dx, rows, n, ts, dv, dc);
      else if (prec == sa::IndexPrecision::fp8_e4m3) quantize_rows_kernel<Prec::fp8><<<blocks, 128>>>(dx, rows, n, ts, dv, dc);
      else quantize_rows_kernel<Prec::fp4><<<blocks, 128>>>(dx, rows, n, ts, dv, dc);
      std::vector<float> v(x.size()), c(x.size());
      cuda_ok(cudaMemcpy(v.data(), dv, bytes, cudaMemcpyDeviceToHost), "download");
      cuda_ok(cudaMemcpy(c.data(), dc, bytes, cudaMemcpyDeviceToHost), "download");
      cudaFree(dx), cudaFree(dv), cudaFree(dc);
      int bad = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const bool ok_v = same_float(v[i], want[i]);
        const bool ok_c = std::isnan(c[i]) || sa::round_bf16(c[i]) == c[i];
        const bool ok_fp8 = prec != sa::IndexPrecision::fp8_e4m3 || same_float(v[i], c[i] * ts);
        if ((!ok_v || !ok_c || !ok_fp8) && bad++ < 5)
          ADD_FAILURE() << "x = " << x[i] << " (ts " << ts << "): device value " << v[i] << " code " << c[i]
                        << ", cpu value " << want[i];
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

std::vector<Case> shapes() {
  return {
      {"Lq=1 causal Lk=333", 1, 1, 333, 1, 1, 64, 3, 4, true},
      {"Lq=17 non-causal Hk=Hkv=2 Lk=900", 1, 17, 900, 2, 2, 64, 4, 5, false},
      {"Lq=1013 causal B=2 Lk=1013", 2, 1013, 1013, 1, 1, 64, 5, 5, true},
      {"Hkv=16 Hk=1 Lq<Lk causal Di=128", 1, 140, 1500, 16, 1, 128, 4, 6, true},
      {"B=3 non-causal no reserve Di=48", 3, 200, 1100, 1, 1, 48, 3, 3, false, false},
      {"Lq>Lk causal (queries see nothing) Di=32", 1, 300, 140, 1, 1, 32, 2, 2, true},
      {"top_k above candidates Di=20", 1, 130, 400, 1, 1, 20, 8, 9, true},
      {"Di=256 non-causal", 1, 129, 700, 1, 1, 256, 3, 3, false},
  };
}

// Every shape of shapes() in every precision, as TileLists and as QueryLists.
TEST(TokenMaxGpu, RandomEqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 7000;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true})
      for (const auto& c : shapes()) run_random(c, prec, tiles, seed += 10);
}

TEST(TokenMaxGpu, InputDtypesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"f32 / f16 inputs", 2, 257, 777, 2, 1, 64, 4, 4, true};
  std::uint64_t seed = 7400;
  for (auto dtype : {sa::DType::f32, sa::DType::f16})
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true}) run_random(c, prec, tiles, seed += 10, dtype);
}

// Index tensors as strided views that start one element into their buffer, with a row pitch of Di + 3
// elements: the preparation's aligned vector loads apply to one row in four, so both of its load paths run;
// the ids must still equal the CPU's on the contiguous copies.
TEST(TokenMaxGpu, StridedUnalignedViewsEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"strided views, Di = 42 (a partial group per row)", 2, 300, 900, 2, 1, 42, 4, 4, true};
  std::uint64_t seed = 7700;
  for (auto dtype : {sa::DType::bf16, sa::DType::f32})
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true}) {
        SCOPED_TRACE(sa::dtype_name(dtype));
        const sa::HostTensor q = st::random_tensor(dtype, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10);
        const sa::HostTensor k = st::random_tensor(dtype, {c.B, c.Lk, c.Hk, c.Di}, seed += 10);
        const std::int64_t pitch = c.Di + 3, es = static_cast<std::int64_t>(sa::dtype_size(dtype));
        // The padded copies on the host ([B, L, H, pitch] plus one leading element), then on the device.
        auto padded = [&](const sa::HostTensor& x) {
          const auto& sh = x.shape();
          sa::HostTensor h(dtype, {1 + sh[0] * sh[1] * sh[2] * pitch});
          std::memset(h.view().data, 0x7f, static_cast<std::size_t>(h.numel() * es));  // padding: large finite values
          const auto* src = static_cast<const unsigned char*>(x.view().data);
          auto* dst = static_cast<unsigned char*>(h.view().data) + es;
          for (std::int64_t r = 0; r < sh[0] * sh[1] * sh[2]; ++r)
            std::memcpy(dst + r * pitch * es, src + r * sh[3] * es, static_cast<std::size_t>(sh[3] * es));
          return h;
        };
        auto view_of = [&](const Dev& d, const sa::HostTensor& x) {
          const auto& sh = x.shape();
          sa::TensorView v = sa::TensorView::contiguous(static_cast<unsigned char*>(d.ptr) + es, dtype, sh, sa::Device::cuda, 0);
          v.stride = {sh[1] * sh[2] * pitch, sh[2] * pitch, pitch, 1};
          return v;
        };
        const sa::HostTensor hq = padded(q), hk = padded(k);
        Dev dq(hq), dk(hk);
        compare_views(c, prec, tiles, q, k, view_of(dq, q), view_of(dk, k));
      }
}

// Block maxima that differ in their last bits (and exact ties): the screening cannot separate them, so
// the float64 path decides; the counters show it ran.
TEST(TokenMaxGpu, NearTiesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"near ties QueryLists-sized", 2, 150, 2000, 2, 2, 64, 5, 6, false},
      {"near ties causal Hk=1", 1, 300, 1700, 4, 1, 128, 4, 4, true},
      {"near ties Lq=17 Di=40", 1, 17, 1300, 1, 1, 40, 6, 6, false},
  };
  std::uint64_t seed = 7600;
  for (float step : {0x1p-7f, 0x1p-3f, 0x1p-12f})
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true})
        for (const auto& c : cases) {
          sa::HostTensor q, k;
          near_tie_inputs(c, step, seed += 10, q, k);
          Stats stats;
          compare(c, prec, tiles, q, k, q, k, &stats);
          unsigned long long cand = 0, rescored = 0;
          stats.read(cand, rescored);
          EXPECT_GT(cand, 0u);
          if (prec == sa::IndexPrecision::bf16 && step == 0x1p-12f)
            EXPECT_GT(rescored, 0u) << c.name << ": near-ties 2^-12 apart must reach the float64 path";
        }
}

// Random inputs: the screening decides nearly everything; the re-scored share stays small.
TEST(TokenMaxGpu, RescoredShareIsSmallOnRandomInputs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"random share", 2, 1024, 4096, 1, 1, 128, 16, 16, false};
  for (auto prec : kPrecisions) {
    Stats stats;
    run_random(c, prec, true, 7900 + static_cast<int>(prec), sa::DType::bf16, &stats);
    unsigned long long cand = 0, rescored = 0;
    stats.read(cand, rescored);
    EXPECT_EQ(cand, 2u * 8u * 32u);
    EXPECT_LE(rescored * 20, cand) << sa::precision_name(prec) << ": " << rescored << " of " << cand << " re-scored";
  }
}

// Non-finite rows: the CPU rejects them with an Error; the device path (which does not synchronise to
// look) ranks NaN scores as -inf, the CPU's rule for NaN dots. The GPU lists then equal the CPU's on a
// finite input with the same scores: an all-NaN query row scores -inf everywhere, which ranks like an
// all-zero row (all ties, lower ids first) in a QueryList and like a duplicate of a neighbour in a tile;
// an all-NaN key row drops out of its block, like a duplicate of the block's first key. fp4 maps NaN to
// 0 (an all-NaN 16-block has scale 0), so its CPU equivalent is zero rows.
TEST(TokenMaxGpu, NonFiniteRowsMatchCpuRule) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"NaN rows", 1, 300, 900, 2, 1, 64, 4, 4, true};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::uint64_t seed = 8100;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true}) {
      sa::HostTensor q = st::random_tensor(sa::DType::f32, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10);
      sa::HostTensor k = st::random_tensor(sa::DType::f32, {c.B, c.Lk, c.Hk, c.Di}, seed += 10);
      sa::HostTensor gq = q, gk = k;
      const std::int64_t qi = 137, ks = 3 * sa::kBlockK + 40;
      std::fill_n(row_f32(gq, 0, qi, 1), c.Di, nan);
      std::fill_n(row_f32(gk, 0, ks, 0), c.Di, nan);
      {  // the CPU rejects the non-finite input
        sa::HostTensor idx(sa::DType::i32, {c.B, c.Hkv, c.Lq, c.kmax});
        EXPECT_THROW(sa::token_max_select(gq.view(), gk.view(), sa::QueryLists{idx.view()}, options_of(c, prec)),
                     sa::Error);
      }
      if (prec == sa::IndexPrecision::fp4_e2m1) {
        std::fill_n(row_f32(q, 0, qi, 1), c.Di, 0.0f);
        std::fill_n(row_f32(k, 0, ks, 0), c.Di, 0.0f);
      } else {
        if (tiles) std::copy_n(row_f32(q, 0, qi - 1, 1), c.Di, row_f32(q, 0, qi, 1));
        else std::fill_n(row_f32(q, 0, qi, 1), c.Di, 0.0f);
        std::copy_n(row_f32(k, 0, 3 * sa::kBlockK, 0), c.Di, row_f32(k, 0, ks, 0));
      }
      compare(c, prec, tiles, q, k, gq, gk);
    }
}

// Every kernel once (prepare, screen, decide, re-score, finish) on a small input with near-ties, for
// compute-sanitizer.
TEST(TokenMaxGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"sanitizer", 2, 150, 290, 2, 1, 40, 2, 3, true};
  std::uint64_t seed = 8500;
  for (auto prec : kPrecisions) {
    sa::HostTensor q, k;
    near_tie_inputs(c, 0x1p-12f, seed += 10, q, k);
    compare(c, prec, false, q, k, q, k);
    compare(c, prec, true, q, k, q, k);
  }
  run_random({"sanitizer random", 1, 17, 333, 1, 1, 24, 2, 2, false}, sa::IndexPrecision::fp8_e4m3, true, seed + 1);
}

// Di past the tensor-core path's limit is an Error naming qidx, not a fault.
TEST(TokenMaxGpu, IndexDimLimitIsAnError) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {1, 16, 1, 272}, 1);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {1, 200, 1, 272}, 2);
  Dev dq(q), dk(k), didx(poisoned_i32({1, 1, 16, 2}));
  sa::TokenMaxOptions o;
  o.top_k = 2;
  try {
    sa::token_max_select(dq.view, dk.view, sa::QueryLists{didx.view}, o);
    ADD_FAILURE() << "no Error for Di = 272";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "qidx") << e.what();
  }
}

}  // namespace
