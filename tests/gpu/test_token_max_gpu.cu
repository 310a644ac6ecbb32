// GPU tests of the tensor-core token_max selector against its contract (docs/design.md §5.7): every list
// is a top-k of the exact block scores (float64, from the CPU-quantised inputs) within eps = 2 x the bound
// stated in src/cuda/selectors/token_max.cu (token_max_contract.hpp), with the forced blocks present, for
// the three precisions and both outputs, on random and planted inputs (near-ties below and above eps, huge
// and tiny magnitudes), awkward shapes and the sink option; two runs give the same bits; eps is checked
// not to be vacuous on random inputs. The quantisation itself equals the CPU's bit for bit. Device outputs
// are poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "cuda/selectors/backend.hpp"
#include "cuda/common/mma_sync.cuh"
#include "cuda/common/sync.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/common/wgmma_fp8.cuh"
#include "cuda/selectors/tc_index.cuh"
#include "gpu/device_testing.hpp"
#include "gpu/token_max_contract.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::check_token_max_gpu;
using st::cuda_ok;
using st::Dev;
using st::TokenMaxCase;

constexpr sa::IndexPrecision kPrecisions[] = {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3,
                                              sa::IndexPrecision::fp4_e2m1};

st::ContractReport run_random(const TokenMaxCase& c, sa::IndexPrecision prec, bool tiles, std::uint64_t seed,
                              sa::DType dtype = sa::DType::bf16, float stddev = 1.0f) {
  const sa::HostTensor q = st::random_tensor(dtype, {c.B, c.Lq, c.Hkv, c.Di}, seed, stddev);
  const sa::HostTensor k = st::random_tensor(dtype, {c.B, c.Lk, c.Hk, c.Di}, seed + 1, stddev);
  return check_token_max_gpu(c, prec, tiles, q, k);
}

float* row_f32(sa::HostTensor& t, std::int64_t b, std::int64_t l, std::int64_t h) {
  const auto& s = t.shape();
  return t.data<float>() + ((b * s[1] + l) * s[2] + h) * s[3];
}

// Structured input (float32): queries near a shared direction u per (batch, KV head) with q[d0] = A; KV
// block j holds one key equal to u except k[d0] = step * m_j (m_j in -3..3, repeating, so some blocks tie
// exactly) and small noise in its other keys. The block maxima then differ by multiples of A * step (up to
// the quantisation of the planted values): far below eps for a small step, far above it for step = 1.
void near_tie_inputs(const TokenMaxCase& c, float A, float step, std::uint64_t seed, sa::HostTensor& q,
                     sa::HostTensor& k) {
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
          r[d0] = A;
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

// Per list, the gap between the exact k-th and (k + 1)-th scored (not forced) candidates, or -1 when the
// list has no such pair.
std::vector<double> boundary_gaps(const st::ExactScores& ex, int top_k) {
  std::vector<double> gaps;
  for (std::int64_t r = 0; r < ex.rows; ++r) {
    std::vector<double> s;
    int forced = 0;
    for (std::int64_t c = 0; c < ex.candidates; ++c) {
      const double v = ex.at(r, c);
      if (v == std::numeric_limits<double>::infinity()) ++forced;
      else if (v > -std::numeric_limits<double>::infinity()) s.push_back(v);
    }
    const int kk = top_k - forced;
    std::sort(s.begin(), s.end(), std::greater<>());
    gaps.push_back(kk >= 1 && static_cast<std::size_t>(kk) < s.size() ? s[kk - 1] - s[kk] : -1.0);
  }
  return gaps;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- tests ---------------------------------------------------------------------------------------------

// The device quantisation (tc_index.cuh's quantize_codes: the codes kernel's arithmetic, fp8 through
// fp8_quotient) row by row in 16-element groups: values v and codes c of rows x [rows, n].
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

// ---- the fp8 accumulation the bound relies on ----------------------------------------------------------

// One warpgroup: d = `steps` chained m64n128k32 e4m3 wgmmas (as the screen issues them) of a [64][32 steps]
// and b [128][32 steps] (bytes, row-major), written by the threads into 128B-swizzled shared memory (16-byte
// chunk index XOR row % 8, the layout TMA writes); out [64][128] row-major.
__global__ void fp8_mma_kernel(const unsigned char* a, const unsigned char* b, int steps, float* out) {
  namespace ck = sparse_attn::cuda_kernels;
  extern __shared__ __align__(16) unsigned char raw[];
  unsigned char* sa_ = raw + ((1024 - (ck::smem_addr(raw) & 1023)) & 1023);
  unsigned char* sb_ = sa_ + 64 * 128;
  const int w = static_cast<int>(threadIdx.x);
  for (int e = w; e < 192 * 128; e += 128) {
    const int r = e / 128, c = e % 128, rr = r < 64 ? r : r - 64;
    const unsigned char* src = r < 64 ? a + r * 32 * steps : b + rr * 32 * steps;
    unsigned char* dst = r < 64 ? sa_ : sb_;
    dst[rr * 128 + (((c / 16) ^ (rr % 8)) * 16) + c % 16] = c < 32 * steps ? src[c] : 0;
  }
  ck::fence_async_shared();
  __syncthreads();
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  ck::wgmma_fence();
  for (int s = 0; s < 4; ++s)
    if (s < steps)
      ck::wgmma_ss_e4m3(d, ck::make_desc_sw128(ck::smem_addr(sa_) + s * 32, 16, 1024),
                        ck::make_desc_sw128(ck::smem_addr(sb_) + s * 32, 16, 1024), s > 0);
  ck::wgmma_commit();
  ck::wgmma_wait<0>();
  ck::fence_operands(d);
  const int warp = w / 32, g = (w % 32) / 4, q = w % 4;
  for (int i = 0; i < 64; ++i)
    out[(16 * warp + g + 8 * ((i % 4) / 2)) * 128 + 8 * (i / 4) + 2 * q + i % 2] = d[i];
}

// The fp8 MMA's error on adversarial operands (one large product and many small ones of the same sign, a
// large accumulator followed by small products, random exponents over the whole e4m3 range) against the
// model token_max.cu relies on: an instruction errs by at most 40 x 2^-13 of the largest magnitude in it (40 x
// 2^-13 S for one from zero), n chained instructions (the screen chains a dot's k-steps) by n x 40 x 2^-13 S,
// S the sum of |products|. Prints the worst observed error in units of 2^-13 S, to show how much of the
// bound the hardware uses.
TEST(TokenMaxGpu, Fp8AccumulationWithinModel) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4242);
  std::uniform_int_distribution<int> pick(0, 3), ex(-9, 8), sign(0, 1);
  std::uniform_real_distribution<float> mant(1.0f, 1.875f);
  for (int steps : {1, 4}) {
    const int K = 32 * steps;
    std::vector<unsigned char> a(64 * K), b(128 * K);
    auto fill_row = [&](unsigned char* row, int kind) {
      for (int d = 0; d < K; ++d) {
        float v;
        switch (kind) {
          case 0: v = d == 0 ? 240.0f : std::ldexp(mant(rng), -7); break;        // one large, many small
          case 1: v = d < 32 ? 224.0f : std::ldexp(mant(rng), -(d % 9)); break;  // large accumulator first
          case 2: v = std::ldexp(mant(rng), ex(rng)) * (sign(rng) ? -1.0f : 1.0f); break;
          default: v = std::ldexp(mant(rng), ex(rng) / 3); break;                // same sign, moderate
        }
        row[d] = sa::float_to_e4m3(v);
      }
    };
    for (int r = 0; r < 64; ++r) fill_row(a.data() + r * K, pick(rng));
    for (int r = 0; r < 128; ++r) fill_row(b.data() + r * K, r % 4 == 3 ? 2 : r % 4);
    unsigned char *da = nullptr, *db = nullptr;
    float* dout = nullptr;
    cuda_ok(cudaMalloc(&da, a.size()), "cudaMalloc");
    cuda_ok(cudaMalloc(&db, b.size()), "cudaMalloc");
    cuda_ok(cudaMalloc(&dout, 64 * 128 * 4), "cudaMalloc");
    cuda_ok(cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice), "upload");
    cuda_ok(cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice), "upload");
    fp8_mma_kernel<<<1, 128, 192 * 128 + 1024>>>(da, db, steps, dout);
    cuda_ok(cudaDeviceSynchronize(), "fp8_mma_kernel");
    std::vector<float> out(64 * 128);
    cuda_ok(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost), "download");
    cudaFree(da), cudaFree(db), cudaFree(dout);
    double worst = 0.0, worst_m = 0.0;
    for (int i = 0; i < 64; ++i)
      for (int j = 0; j < 128; ++j) {
        // t: the exact sum; S: sum of |products|; M: sum over instructions of the largest magnitude in it
        // (the exact running sum before and after, its products).
        double t = 0.0, S = 0.0, M = 0.0;
        for (int g = 0; g < steps; ++g) {
          double m = std::fabs(t);
          for (int d = 32 * g; d < 32 * (g + 1); ++d) {
            const double p = static_cast<double>(sa::e4m3_to_float(a[i * K + d])) * sa::e4m3_to_float(b[j * K + d]);
            t += p, S += std::fabs(p), m = std::max(m, std::fabs(p));
          }
          M += std::max(m, std::fabs(t));
        }
        const double err = std::fabs(static_cast<double>(out[i * 128 + j]) - t);
        if (S > 0.0) worst = std::max(worst, err / (0x1p-13 * S)), worst_m = std::max(worst_m, err / (0x1p-13 * M));
        EXPECT_LE(err, steps * 40.0 * 0x1p-13 * S) << "steps " << steps << " (" << i << ", " << j << "): mma "
                                                     << out[i * 128 + j] << ", exact " << t;
      }
    // worst_m near 2 would mean each instruction sums its products exactly and truncates once.
    std::printf("fp8 MMA, %d chained k32 instructions: worst error %.3f x 2^-13 S (model bound %d x 2^-13 S), "
                "%.3f x 2^-13 x (largest magnitude per instruction, summed)\n",
                steps, worst, 40 * steps, worst_m);
  }
}

std::vector<TokenMaxCase> shapes() {
  return {
      {"Lq=1 causal Lk=333", 1, 1, 333, 1, 1, 64, 3, 4, true},
      {"Lq=17 non-causal Hk=Hkv=2 Lk=900", 1, 17, 900, 2, 2, 64, 4, 5, false},
      {"Lq=1013 causal B=2 Lk=1013", 2, 1013, 1013, 1, 1, 64, 5, 5, true},
      {"Hkv=16 Hk=1 Lq<Lk causal Di=128", 1, 140, 1500, 16, 1, 128, 4, 6, true},
      {"Hkv=16 Hk=16 non-causal Di=32 sink", 1, 130, 700, 16, 16, 32, 3, 3, false, true, true},
      {"B=3 non-causal no reserve Di=48", 3, 200, 1100, 1, 1, 48, 3, 3, false, false},
      {"Lq>Lk causal (queries see nothing) Di=32", 1, 300, 140, 1, 1, 32, 2, 2, true},
      {"Lq>Lk causal sink top_k=1 (block 0 beats the local block)", 1, 500, 400, 1, 1, 32, 1, 2, true, true, true},
      {"top_k above candidates Di=20", 1, 130, 400, 1, 1, 20, 8, 9, true},
      {"Di=256 non-causal", 1, 129, 700, 1, 1, 256, 3, 3, false},
      {"Di=200 causal sink B=2", 2, 250, 1000, 2, 1, 200, 4, 4, true, true, true},
  };
}

// The oracle of these tests (token_max_contract.hpp: exact scores, candidates, forced blocks) against the
// CPU selector, which scores the same quantised values in float64: the CPU's lists keep the contract with
// eps shrunk to 2^-20 of the GPU's (room for the order of the float64 sums only). Runs without a GPU.
TEST(TokenMaxGpu, OracleAgreesWithTheCpuSelector) {
  std::uint64_t seed = 6900;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true})
      for (const auto& c : shapes()) {
        const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10);
        const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {c.B, c.Lk, c.Hk, c.Di}, seed + 1);
        const std::string what = c.name + " " + sa::precision_name(prec) + (tiles ? " TileLists" : " QueryLists");
        const st::TokenMaxExact ex = st::token_max_exact(c, prec, tiles, q, k);
        const std::int64_t Tq = sa::ceil_div(c.Lq, sa::kTileQ);
        sa::HostTensor idx(sa::DType::i32, {c.B, c.Hkv, tiles ? Tq : c.Lq, c.kmax}), cnt(sa::DType::i32, {c.B, c.Hkv, Tq});
        const sa::TokenMaxOptions o = st::token_max_options(c, prec);
        if (tiles) sa::token_max_select(q.view(), k.view(), sa::TileLists{idx.view(), cnt.view()}, o);
        else sa::token_max_select(q.view(), k.view(), sa::QueryLists{idx.view()}, o);
        const st::ContractReport rep = st::expect_top_k_within(
            ex.exact, idx.data<std::int32_t>(), c.kmax, c.kmax, tiles ? cnt.data<std::int32_t>() : nullptr, c.top_k,
            [&](std::int64_t r) { return ex.eps[static_cast<std::size_t>(r)] * 0x1p-20; }, what);
        EXPECT_EQ(rep.rows_differing, 0) << what;
      }
}

// Every shape of shapes() in every precision, as TileLists and as QueryLists.
TEST(TokenMaxGpu, RandomWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 7000;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true})
      for (const auto& c : shapes()) run_random(c, prec, tiles, seed += 10);
}

// More candidate blocks (547, 2,344) than rank_kernel has threads (128): select.cuh's radix selection. Random
// inputs keep the contract; all-equal inputs (every score ties) give the CPU's lists exactly: the forced blocks,
// then the lowest ids.
TEST(TokenMaxGpu, LongContextRadixSelection) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase cases[] = {{"Lk=70000 causal (547 candidate blocks)", 1, 300, 70000, 2, 1, 16, 24, 24, true},
                                {"Lk=300000 non-causal (2344 blocks)", 1, 100, 300000, 1, 1, 16, 40, 40, false}};
  std::uint64_t seed = 7700;
  for (const TokenMaxCase& c : cases) {
    const bool big = c.Lk > 100000;  // one precision there (the host's exact scores and CPU lists take longest)
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true})
        if (!big || prec == sa::IndexPrecision::fp8_e4m3) run_random(c, prec, tiles, seed += 10);
    sa::HostTensor q(sa::DType::f32, {c.B, c.Lq, c.Hkv, c.Di}), k(sa::DType::f32, {c.B, c.Lk, c.Hk, c.Di});
    std::fill(q.data<float>(), q.data<float>() + q.numel(), 0.5f);
    std::fill(k.data<float>(), k.data<float>() + k.numel(), 0.25f);
    Dev dq(q), dk(k);
    const std::int64_t Tq = sa::ceil_div(c.Lq, sa::kTileQ);
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true}) {
        if (big && prec != sa::IndexPrecision::fp8_e4m3) continue;
        SCOPED_TRACE(c.name + " " + sa::precision_name(prec) + (tiles ? " TileLists" : " QueryLists"));
        sa::HostTensor idx(sa::DType::i32, {c.B, c.Hkv, tiles ? Tq : c.Lq, c.kmax}), cnt(sa::DType::i32, {c.B, c.Hkv, Tq});
        const sa::TokenMaxOptions o = st::token_max_options(c, prec);
        if (tiles) sa::token_max_select(q.view(), k.view(), sa::TileLists{idx.view(), cnt.view()}, o);
        else sa::token_max_select(q.view(), k.view(), sa::QueryLists{idx.view()}, o);
        const st::TokenMaxGpuLists got = st::token_max_gpu(c, prec, tiles, dq.view, dk.view);
        st::expect_equal_i32(got.idx, idx, "idx");
        if (tiles) st::expect_equal_i32(got.cnt, cnt, "cnt");
      }
  }
}

TEST(TokenMaxGpu, InputDtypesWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"f32 / f16 inputs", 2, 257, 777, 2, 1, 64, 4, 4, true};
  std::uint64_t seed = 7400;
  for (auto dtype : {sa::DType::f32, sa::DType::f16})
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true}) run_random(c, prec, tiles, seed += 10, dtype);
}

// Index tensors as strided views that start one element into their buffer, with a row pitch of Di + 3
// elements: the codes kernel's vector loads apply to one row in four, so both of its load paths run.
TEST(TokenMaxGpu, StridedUnalignedViewsWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"strided views, Di = 42 (a partial group per row)", 2, 300, 900, 2, 1, 42, 4, 4, true};
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
        check_token_max_gpu(c, prec, tiles, q, k, view_of(dq, q), view_of(dk, k));
      }
}

// Planted block maxima A * step apart (and exact ties): with step far below eps any order of the tied
// levels is allowed, with step = 1 the gaps exceed eps, so those lists must be the exact top-k (which the
// contract implies; the test asserts that such lists occur, so the check is not vacuous).
TEST(TokenMaxGpu, NearTiesWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase cases[] = {
      {"near ties Hk=Hkv=2", 2, 150, 2000, 2, 2, 64, 5, 6, false},
      {"near ties causal Hk=1", 1, 300, 1700, 4, 1, 128, 4, 4, true},
      {"near ties Lq=17 Di=40 sink", 1, 17, 1300, 1, 1, 40, 6, 6, false, true, true},
  };
  std::uint64_t seed = 7600;
  for (float step : {0x1p-12f, 0x1p-7f, 0x1p-3f, 1.0f})
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true})
        for (const auto& c : cases) {
          sa::HostTensor q, k;
          near_tie_inputs(c, 8.0f, step, seed += 10, q, k);
          check_token_max_gpu(c, prec, tiles, q, k);
          if (step == 1.0f) {
            const st::TokenMaxExact ex = st::token_max_exact(c, prec, tiles, q, k);
            const std::vector<double> gaps = boundary_gaps(ex.exact, c.top_k);
            std::int64_t above = 0;
            for (std::size_t r = 0; r < gaps.size(); ++r) above += gaps[r] > ex.eps[r];
            EXPECT_GT(above, 0) << c.name << " " << sa::precision_name(prec) << ": no list with a gap above eps";
          }
        }
}

// Magnitudes far from 1 (2^60 and 2^-60, and one tensor large with the other small): the per-tensor scales
// (2^e for bf16) keep the code dots inside float32, and eps scales with the norms.
TEST(TokenMaxGpu, HugeAndTinyMagnitudesWithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"magnitudes", 1, 200, 900, 2, 1, 64, 4, 4, true};
  std::uint64_t seed = 7800;
  for (auto [sq, sk] : {std::pair{0x1p60f, 0x1p60f}, std::pair{0x1p-60f, 0x1p-60f}, std::pair{0x1p60f, 0x1p-60f}})
    for (auto prec : kPrecisions)
      for (bool tiles : {false, true}) {
        SCOPED_TRACE("scales " + std::to_string(sq) + ", " + std::to_string(sk));
        const sa::HostTensor q = st::random_tensor(sa::DType::f32, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10, sq);
        const sa::HostTensor k = st::random_tensor(sa::DType::f32, {c.B, c.Lk, c.Hk, c.Di}, seed += 10, sk);
        check_token_max_gpu(c, prec, tiles, q, k);
      }
}

// eps is not vacuous: on random inputs at a realistic shape few lists differ from the exact top-k, and for
// the precisions scored on the bf16 MMA (bf16, fp4) eps is below the typical gap between the k-th and the
// (k + 1)-th exact score. The fp8 MMA's bound is wider (token_max.cu: n x 40 x 2^-13 S, n = 4 k32
// instructions per 128 code bytes); its ratio is printed.
TEST(TokenMaxGpu, EpsIsSmallOnRandomInputs) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"random, Di = 128, top_k = 16", 2, 512, 4096, 1, 1, 128, 16, 16, false, false};
  std::uint64_t seed = 7900;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true}) {
      const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10);
      const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {c.B, c.Lk, c.Hk, c.Di}, seed += 10);
      const st::TokenMaxExact ex = st::token_max_exact(c, prec, tiles, q, k);
      Dev dq(q), dk(k);
      const st::TokenMaxGpuLists got = st::token_max_gpu(c, prec, tiles, dq.view, dk.view);
      const st::ContractReport rep = st::expect_top_k_within(
          ex.exact, got.idx.data<std::int32_t>(), c.kmax, c.kmax, tiles ? got.cnt.data<std::int32_t>() : nullptr,
          c.top_k, [&](std::int64_t r) { return ex.eps[static_cast<std::size_t>(r)]; }, c.name);
      const std::vector<double> gaps = boundary_gaps(ex.exact, c.top_k);
      const double ratio = median(ex.eps) / median(gaps);
      std::printf("token_max %s %s: %lld of %lld lists differ from the exact top-k; median eps %.3g, median k-th gap "
                  "%.3g (ratio %.3g), worst margin %.3g\n",
                  sa::precision_name(prec), tiles ? "TileLists" : "QueryLists", static_cast<long long>(rep.rows_differing),
                  static_cast<long long>(rep.rows_checked), median(ex.eps), median(gaps), ratio, rep.worst_margin);
      const bool fp8 = prec == sa::IndexPrecision::fp8_e4m3;
      EXPECT_LE(rep.rows_differing * (fp8 ? 4 : 20), rep.rows_checked) << sa::precision_name(prec);
      if (!fp8) EXPECT_LT(ratio, 1.0) << sa::precision_name(prec);
    }
}

// The sink: block 0 is in every list that sees a key, ranks above the scored blocks, counts towards
// top_k, and beats the local block when only one fits (the checker requires the lower forced ids).
TEST(TokenMaxGpu, ForceBlock0WithinEps) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase cases[] = {
      {"sink causal Lq<Lk", 2, 300, 1500, 2, 1, 64, 4, 4, true, true, true},
      {"sink causal Lq>Lk (first queries see nothing)", 1, 500, 300, 1, 1, 64, 2, 3, true, true, true},
      {"sink and local, top_k = 1", 1, 200, 900, 1, 1, 64, 1, 1, true, true, true},
      {"sink non-causal no reserve", 1, 130, 1000, 1, 1, 48, 3, 3, false, false, true},
  };
  std::uint64_t seed = 8000;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true})
      for (const auto& c : cases) run_random(c, prec, tiles, seed += 10);
}

// Two runs on the same inputs give the same bits (fixed order, no atomics on scores).
TEST(TokenMaxGpu, RunsAreBitwiseRepeatable) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"repeat", 2, 1013, 3000, 2, 1, 128, 8, 8, true, true, true};
  std::uint64_t seed = 8200;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true}) {
      SCOPED_TRACE(std::string(sa::precision_name(prec)) + (tiles ? " TileLists" : " QueryLists"));
      const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10);
      const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {c.B, c.Lk, c.Hk, c.Di}, seed += 10);
      Dev dq(q), dk(k);
      const st::TokenMaxGpuLists a = st::token_max_gpu(c, prec, tiles, dq.view, dk.view);
      const st::TokenMaxGpuLists b = st::token_max_gpu(c, prec, tiles, dq.view, dk.view);
      EXPECT_EQ(std::memcmp(a.idx.view().data, b.idx.view().data, static_cast<std::size_t>(a.idx.numel()) * 4), 0);
      if (tiles) EXPECT_EQ(std::memcmp(a.cnt.view().data, b.cnt.view().data, static_cast<std::size_t>(a.cnt.numel()) * 4), 0);
    }
}

// Non-finite rows are outside the contract (the CPU rejects them; the device does not synchronise to
// look): the lists are still complete and well formed, with the forced blocks, and the other lists keep
// the contract on the finite inputs... checked here as well-formed lists of min(top_k, candidates) ids.
TEST(TokenMaxGpu, NonFiniteRowsGiveWellFormedLists) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"NaN rows", 1, 300, 900, 2, 1, 64, 4, 4, true};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::uint64_t seed = 8100;
  for (auto prec : kPrecisions)
    for (bool tiles : {false, true}) {
      SCOPED_TRACE(std::string(sa::precision_name(prec)) + (tiles ? " TileLists" : " QueryLists"));
      const sa::HostTensor q = st::random_tensor(sa::DType::f32, {c.B, c.Lq, c.Hkv, c.Di}, seed += 10);
      const sa::HostTensor k = st::random_tensor(sa::DType::f32, {c.B, c.Lk, c.Hk, c.Di}, seed += 10);
      sa::HostTensor gq = q, gk = k;
      std::fill_n(row_f32(gq, 0, 137, 1), c.Di, nan);
      std::fill_n(row_f32(gk, 0, 3 * sa::kBlockK + 40, 0), c.Di, nan);
      // Structure only: every candidate scores 0 and eps is 0, so any min(top_k, candidates) candidates with
      // the forced ones present pass.
      st::TokenMaxExact ex = st::token_max_exact(c, prec, tiles, q, k);
      for (double& v : ex.exact.score)
        if (std::isfinite(v)) v = 0.0;
      Dev dq(gq), dk(gk);
      const st::TokenMaxGpuLists got = st::token_max_gpu(c, prec, tiles, dq.view, dk.view);
      st::expect_top_k_within(ex.exact, got.idx.data<std::int32_t>(), c.kmax, c.kmax,
                              tiles ? got.cnt.data<std::int32_t>() : nullptr, c.top_k, [](std::int64_t) { return 0.0; },
                              "NaN rows");
    }
}

// Every score negative (keys along -u, queries along u): the block maxima are the least negative scores, which
// the screen's integer maximum of the values' bits does not give (it is valid only for maxima >= +0), so this
// takes the float trees. Within a block the keys spread over 2 |u|^2, far beyond eps: a block score taken
// from the wrong end of the block would break the contract.
TEST(TokenMaxGpu, NegativeScoresKeepTheBlockMaxima) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  TokenMaxCase c{"negative scores", 1, 256, 12 * sa::kBlockK, 1, 1, 64, 4, 4, false};
  c.reserve_local = false;
  std::mt19937_64 rng(9100);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> u(static_cast<std::size_t>(c.Di));
  for (float& e : u) e = 1.0f + 0.25f * nd(rng);
  sa::HostTensor q(sa::DType::f32, {c.B, c.Lq, c.Hkv, c.Di}), k(sa::DType::f32, {c.B, c.Lk, c.Hk, c.Di});
  for (std::int64_t i = 0; i < c.Lq; ++i) {
    float* r = row_f32(q, 0, i, 0);
    for (std::int64_t d = 0; d < c.Di; ++d) r[d] = sa::round_bf16(u[static_cast<std::size_t>(d)] + 0.05f * nd(rng));
  }
  for (std::int64_t t = 0; t < c.Lk; ++t) {
    const std::int64_t j = t / sa::kBlockK;
    const float a = 0.25f + 0.5f * static_cast<float>((j * 5) % 12) + 2.0f * static_cast<float>(t % sa::kBlockK) / sa::kBlockK;
    float* r = row_f32(k, 0, t, 0);
    for (std::int64_t d = 0; d < c.Di; ++d) r[d] = sa::round_bf16(-a * u[static_cast<std::size_t>(d)]);
  }
  for (auto prec : kPrecisions)
    for (bool tiles : {true, false}) {
      // The block maxima are 0.5 |u|^2 apart: every list is the exact top-k.
      const st::ContractReport rep = check_token_max_gpu(c, prec, tiles, q, k);
      EXPECT_GT(rep.rows_checked, 0);
      EXPECT_EQ(rep.rows_differing, 0) << sa::precision_name(prec) << (tiles ? " TileLists" : " QueryLists");
    }
}

// Every kernel once (amax, codes, screen, rank) per precision and output on a small input, for
// compute-sanitizer.
TEST(TokenMaxGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const TokenMaxCase c{"sanitizer", 2, 150, 290, 2, 1, 40, 2, 3, true, true, true};
  std::uint64_t seed = 8500;
  for (auto prec : kPrecisions) {
    sa::HostTensor q, k;
    near_tie_inputs(c, 8.0f, 0x1p-12f, seed += 10, q, k);
    check_token_max_gpu(c, prec, false, q, k);
    check_token_max_gpu(c, prec, true, q, k);
  }
  run_random({"sanitizer random", 1, 17, 333, 1, 1, 24, 2, 2, false}, sa::IndexPrecision::fp8_e4m3, true, seed + 1);
}

// Di past the tensor-core path's limit is an Error naming qidx, not a fault.
TEST(TokenMaxGpu, IndexDimLimitIsAnError) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const sa::HostTensor q = st::random_tensor(sa::DType::bf16, {1, 16, 1, 272}, 1);
  const sa::HostTensor k = st::random_tensor(sa::DType::bf16, {1, 200, 1, 272}, 2);
  Dev dq(q), dk(k), didx(st::poisoned_i32({1, 1, 16, 2}));
  sa::TokenMaxOptions o;
  o.top_k = 2;
  try {
    sa::token_max_select(dq.view, dk.view, sa::QueryLists{didx.view}, o);
    ADD_FAILURE() << "no Error for Di = 272";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "qidx") << e.what();
  }
}

// The scratch of a call is one allocation: the amax words, both code tensors and the maxima, each
// 256-byte aligned (tile16 at Lk = 16K, fp8 codes, TileLists: 8 partial maxima per (tile, block)).
TEST(TokenMaxGpu, ScratchBytes) {
  const std::size_t tiles = sa::cuda_backend::token_max_scratch_bytes(2, 4096, 16384, 1, 1, 128, sa::IndexPrecision::fp8_e4m3, true);
  // The amax words (256 aligned), the fused prep's per-CTA maxima (8 KB), the codes, the maxima.
  EXPECT_EQ(tiles, 256u + 8192u + 2u * 4096 * 128 + 2u * 16384 * 128 + 8u * 2 * 32 * 128 * 4);
  const std::size_t queries = sa::cuda_backend::token_max_scratch_bytes(2, 4096, 16384, 1, 1, 128, sa::IndexPrecision::bf16, false);
  EXPECT_EQ(queries, 256u + 8192u + 2u * (2u * 4096 * 128 + 2u * 16384 * 128) + 2u * 4096 * 128 * 4);
  // Di = 20: rows padded to 32 codes.
  EXPECT_EQ(sa::cuda_backend::token_max_scratch_bytes(1, 100, 300, 1, 1, 20, sa::IndexPrecision::fp8_e4m3, false),
            256u + 8192u + 3328u + 9728u + 1280u);
}

}  // namespace
