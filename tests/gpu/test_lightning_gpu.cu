// GPU tests of the lightning indexer's token form (TokenLists: tensor-core screen with a fused top-k, float64
// for the keys the screen cannot decide, float64 streaming fallback): every id and -1 pad of every group must
// equal the CPU reference bit for bit, in bf16 and fp8, on random inputs, awkward shapes (Lq = 1, 17, 1013,
// Lq != Lk both ways, queries seeing fewer than top_k keys or none), B > 1, G > 1, strided outputs, and
// structured inputs built to defeat the screen (exact ties from duplicated keys, near-ties one code apart, all
// keys equal, an all-zero query tensor). The small-capacity cases make short rows go through the candidate
// buffer's compaction many times. Device outputs are poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "gpu/device_testing.hpp"
#include "cuda/selectors/backend.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sa = sparse_attn;
namespace st = sparse_attn::testing;

namespace {

using st::cuda_ok;
using st::Dev;
using st::expect_equal_i32;
using st::poisoned_i32;

// The tuning of one GPU call (tuning.hpp) with its device counters.
struct Hooks {
  unsigned long long* d = nullptr;
  sa::detail::SelectorTuning tuning;
  explicit Hooks(bool fallback_only = false, int capacity = 0, bool mma_sync = false) {
    cuda_ok(cudaMalloc(&d, 4 * sizeof(unsigned long long)), "cudaMalloc");
    cuda_ok(cudaMemset(d, 0, 4 * sizeof(unsigned long long)), "cudaMemset");
    tuning.lightning_counters = d;
    tuning.lightning_fallback_only = fallback_only;
    tuning.lightning_capacity = capacity;
    tuning.lightning_screen = mma_sync ? sa::detail::LightningScreen::mma_sync : sa::detail::LightningScreen::automatic;
  }
  Hooks(const Hooks&) = delete;
  Hooks& operator=(const Hooks&) = delete;
  ~Hooks() { cudaFree(d); }
  // rows screened, (row, key) pairs re-scored in float64, rows on the float64 fallback, compactions
  std::vector<unsigned long long> read() const {
    std::vector<unsigned long long> h(4, 0);
    cudaMemcpy(h.data(), d, 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
    return h;
  }
};

struct Case {
  std::string name;
  std::int64_t B = 1, Lq = 128, Lk = 128, HI = 4, Di = 32, G = 1;
  int top_k = 16;
  bool causal = true;
  sa::DType dtype = sa::DType::bf16;
  int extra_width = 0;  // Kt - top_k
};

struct Inputs {
  sa::HostTensor q, w, k;
};

Inputs random_inputs(const Case& c, std::uint64_t seed) {
  return {st::random_tensor(c.dtype, {c.B, c.Lq, c.HI, c.Di}, seed), st::random_tensor(sa::DType::f32, {c.B, c.Lq, c.HI}, seed + 1),
          st::random_tensor(c.dtype, {c.B, c.Lk, c.Di}, seed + 2)};
}

sa::LightningOptions options_of(const Case& c, sa::IndexPrecision prec) {
  sa::LightningOptions o;
  o.top_k = c.top_k, o.causal = c.causal, o.precision = prec;
  return o;
}

// CPU and GPU on the same inputs; every element of the [B, G, Lq, Kt] output compared. The GPU call is the
// public function, or with any tuning the CUDA backend with that tuning and counters, which are returned
// (zeros for the public function).
std::vector<unsigned long long> compare(const Case& c, sa::IndexPrecision prec, const Inputs& in,
                                        bool fallback_only = false, int capacity = 0, bool mma_sync = false) {
  SCOPED_TRACE(c.name + " " + sa::precision_name(prec) + (fallback_only ? " fallback" : "") +
               (capacity ? " capacity " + std::to_string(capacity) : "") + (mma_sync ? " mma.sync" : " automatic"));
  const sa::LightningOptions o = options_of(c, prec);
  sa::HostTensor idx(sa::DType::i32, {c.B, c.G, c.Lq, c.top_k + c.extra_width});
  sa::lightning_select(in.q.view(), in.w.view(), in.k.view(), sa::TokenLists{idx.view()}, o);
  Dev dq(in.q), dw(in.w), dk(in.k), didx(poisoned_i32(idx.shape()));
  Hooks hooks(fallback_only, capacity, mma_sync);
  if (fallback_only || capacity != 0 || mma_sync)
    sa::cuda_backend::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{didx.view}, o, hooks.tuning);
  else
    sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{didx.view}, o);
  cudaError_t e = cudaDeviceSynchronize();
  EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  expect_equal_i32(didx.download(idx), idx, "idx");
  return hooks.read();
}

const Case kCases[] = {
    {"Lq=1 causal", 1, 1, 300, 4, 32, 1, 16, true},
    {"Lq=17 non-causal G=2 B=2, Kt > k", 2, 17, 700, 3, 24, 2, 32, false, sa::DType::bf16, 5},
    {"Lq=1013 causal, 8 heads of 64", 1, 1013, 1013, 8, 64, 1, 64, true},
    {"Lq<Lk causal f32 B=2", 2, 150, 900, 2, 16, 1, 40, true, sa::DType::f32},
    {"Lq>Lk causal f16 (queries see nothing)", 1, 300, 140, 2, 16, 1, 8, true, sa::DType::f16},
    {"Di=20 HI=5 G=3 non-causal", 1, 40, 333, 5, 20, 3, 7, false},
    {"64 heads of 128, top-256", 1, 96, 2100, 64, 128, 1, 256, true},
    {"k=1", 2, 33, 257, 4, 48, 1, 1, true},
};

TEST(LightningTokensGpu, EqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4000;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const auto& c : kCases) compare(c, prec, random_inputs(c, seed += 10));
}

// The mma.sync screening kernel (up to eight queries per CTA, a warp-private buffer; the automatic choice
// where the wgmma kernel's buffers would be too small for top_k) on the same cases.
TEST(LightningTokensGpu, MmaSyncScreenEqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4200;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const auto& c : kCases) compare(c, prec, random_inputs(c, seed += 10), false, 0, true);
}

// A buffer barely larger than top_k: compaction runs every few chunks, including rows whose kept set is
// exactly k after it.
TEST(LightningTokensGpu, SmallBufferCompactsEqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      {"compaction, causal", 1, 200, 1500, 6, 32, 1, 40, true},
      {"compaction, non-causal B=2 G=2", 2, 20, 2000, 64, 128, 2, 100, false},
  };
  std::uint64_t seed = 4500;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3})
    for (const auto& c : cases) {
      const Inputs in = random_inputs(c, seed += 10);
      for (bool mma_sync : {false, true}) {
        const auto stats = compare(c, prec, in, false, c.top_k + 32, mma_sync);
        EXPECT_GT(stats[0], 0u) << "no row was screened";
      }
    }
}

// Every row on the float64 streaming path (SelectorTuning::lightning_fallback_only), and shapes the screening
// kernels do not take (HI > 64, Di > 128), which fall back automatically.
TEST(LightningTokensGpu, FallbackEqualsCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4700;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3}) {
    const Case forced{"forced fallback", 2, 60, 700, 4, 32, 2, 150, true};
    const auto st1 = compare(forced, prec, random_inputs(forced, seed += 10), true);
    EXPECT_EQ(st1[2], static_cast<unsigned long long>(forced.B * forced.Lq));
    const Case wide{"HI=80", 1, 30, 400, 80, 16, 1, 50, true};
    compare(wide, prec, random_inputs(wide, seed += 10));
    const Case deep{"Di=160", 1, 30, 400, 3, 160, 1, 50, false};
    compare(deep, prec, random_inputs(deep, seed += 10));
  }
}

// Structured inputs: ties and near-ties at the k-th place, where only the exact float64 scores and the tie
// rule (lower key first) decide.
TEST(LightningTokensGpu, TiesAndNearTiesEqualCpu) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 4900;
  for (auto prec : {sa::IndexPrecision::bf16, sa::IndexPrecision::fp8_e4m3}) {
    {  // key 2i + 1 duplicates key 2i: every score is tied with its pair
      const Case c{"duplicated keys", 1, 130, 1100, 8, 64, 1, 64, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      float* k = in.k.data<float>();
      for (std::int64_t s = 1; s < c.Lk; s += 2) std::copy(k + (s - 1) * c.Di, k + s * c.Di, k + s * c.Di);
      compare(c, prec, in);
      compare(c, prec, in, false, c.top_k + 32, true);
    }
    {  // key 3i + 1 and 3i + 2 are key 3i with one element nudged by about one code: near-ties everywhere
      const Case c{"near-ties", 2, 70, 900, 16, 32, 1, 48, false, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      float* k = in.k.data<float>();
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t s = 0; s + 2 < c.Lk; s += 3) {
          float* r = k + (b * c.Lk + s) * c.Di;
          std::copy(r, r + c.Di, r + c.Di);
          std::copy(r, r + c.Di, r + 2 * c.Di);
          r[c.Di + static_cast<std::int64_t>(s % c.Di)] *= 1.0f + 0x1p-4f;
          r[2 * c.Di + static_cast<std::int64_t>((s + 5) % c.Di)] *= 1.0f - 0x1p-7f;
        }
      compare(c, prec, in);
    }
    {  // all keys equal: every visible key ties, the lowest k ids win (the rows overflow to the fallback)
      const Case c{"all keys equal", 1, 50, 600, 4, 32, 2, 20, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      float* k = in.k.data<float>();
      for (std::int64_t s = 1; s < c.Lk; ++s) std::copy(k, k + c.Di, k + s * c.Di);
      compare(c, prec, in);
    }
    {  // an all-zero query tensor: every score is 0 (fp8: zero per-tensor scale)
      const Case c{"zero queries", 1, 40, 300, 3, 16, 1, 10, false, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      std::fill(in.q.data<float>(), in.q.data<float>() + in.q.numel(), 0.0f);
      compare(c, prec, in);
    }
    {  // weights of one sign and keys with a wide spread of norms (a few much longer keys)
      const Case c{"positive weights, long keys", 1, 120, 1000, 12, 64, 1, 30, true, sa::DType::f32};
      Inputs in = random_inputs(c, seed += 10);
      for (std::int64_t i = 0; i < in.w.numel(); ++i) in.w.data<float>()[i] = std::fabs(in.w.data<float>()[i]);
      float* k = in.k.data<float>();
      for (std::int64_t s = 0; s < c.Lk; s += 37)
        for (std::int64_t d = 0; d < c.Di; ++d) k[s * c.Di + d] *= 16.0f;
      compare(c, prec, in);
    }
  }
}

// An output view that is a strided slice of a larger buffer ([B, Lq, G, Kt + 3] storage): only the view's
// elements are written, each with the CPU's value; the rest keeps its poison.
TEST(LightningTokensGpu, StridedOutput) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"strided", 2, 90, 500, 4, 32, 2, 24, true};
  const Inputs in = random_inputs(c, 5100);
  const sa::LightningOptions o = options_of(c, sa::IndexPrecision::fp8_e4m3);
  sa::HostTensor ref(sa::DType::i32, {c.B, c.G, c.Lq, c.top_k});
  sa::lightning_select(in.q.view(), in.w.view(), in.k.view(), sa::TokenLists{ref.view()}, o);
  const std::int64_t W = c.top_k + 3;
  Dev dq(in.q), dw(in.w), dk(in.k), dst(poisoned_i32({c.B, c.Lq, c.G, W}));
  sa::TensorView v = dst.view;
  v.shape = {c.B, c.G, c.Lq, c.top_k};
  v.stride = {c.Lq * c.G * W, W, c.G * W, 1};
  sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{v}, o);
  cuda_ok(cudaDeviceSynchronize(), "lightning_select");
  const sa::HostTensor got = dst.download(poisoned_i32({c.B, c.Lq, c.G, W}));
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < c.Lq; ++t)
      for (std::int64_t g = 0; g < c.G; ++g)
        for (std::int64_t s = 0; s < W; ++s) {
          const std::int32_t x = got.data<std::int32_t>()[((b * c.Lq + t) * c.G + g) * W + s];
          const std::int32_t want = s < c.top_k ? ref.data<std::int32_t>()[((b * c.G + g) * c.Lq + t) * c.top_k + s] : 0x5a5a5a5a;
          bad += x != want;
        }
  EXPECT_EQ(bad, 0);
}

// Non-finite inputs are not rejected on the device (no synchronisation): the rows go to the float64 path and
// the lists stay well formed (distinct ascending visible ids, then -1).
TEST(LightningTokensGpu, NonFiniteInputsGiveWellFormedLists) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"nan", 1, 50, 400, 4, 32, 1, 20, true, sa::DType::f32};
  Inputs in = random_inputs(c, 5300);
  in.q.data<float>()[7 * c.HI * c.Di + 3] = std::nanf("");
  in.k.data<float>()[100 * c.Di + 1] = INFINITY;
  Dev dq(in.q), dw(in.w), dk(in.k), didx(poisoned_i32({c.B, c.G, c.Lq, c.top_k}));
  sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{didx.view},
                       options_of(c, sa::IndexPrecision::fp8_e4m3));
  cuda_ok(cudaDeviceSynchronize(), "lightning_select");
  const sa::HostTensor got = didx.download(poisoned_i32({c.B, c.G, c.Lq, c.top_k}));
  for (std::int64_t t = 0; t < c.Lq; ++t) {
    const std::int64_t visible = std::min<std::int64_t>(c.Lk, t + (c.Lk - c.Lq) + 1);
    const std::int64_t n = std::min<std::int64_t>(visible, c.top_k);
    const std::int32_t* r = got.data<std::int32_t>() + t * c.top_k;
    for (std::int64_t s = 0; s < c.top_k; ++s) {
      if (s < n) {
        EXPECT_TRUE(r[s] >= 0 && r[s] < visible && (s == 0 || r[s] > r[s - 1])) << "row " << t << " slot " << s;
      } else {
        EXPECT_EQ(r[s], -1) << "row " << t << " slot " << s;
      }
    }
  }
}

TEST(LightningTokensGpu, TopKBeyondSharedMemoryIsAnError) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"huge k", 1, 4, 64, 2, 16, 1, 1 << 20, true};
  const Inputs in = random_inputs(c, 5400);
  Dev dq(in.q), dw(in.w), dk(in.k), didx(poisoned_i32({1, 1, 4, c.top_k}));
  try {
    sa::lightning_select(dq.view, dw.view, dk.view, sa::TokenLists{didx.view}, options_of(c, sa::IndexPrecision::bf16));
    ADD_FAILURE() << "no Error for top_k = 2^20";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.argument(), "options.top_k") << e.what();
  }
}

// Small enough for compute-sanitizer: the screen (with compaction), the resolve and the fallback kernels.
TEST(LightningTokensGpu, SanitizerSmall) {
  SPARSE_ATTN_SKIP_WITHOUT_GPU();
  const Case c{"sanitizer", 2, 40, 333, 5, 40, 2, 24, true};
  const Inputs in = random_inputs(c, 5500);
  compare(c, sa::IndexPrecision::fp8_e4m3, in);
  compare(c, sa::IndexPrecision::bf16, in, false, c.top_k + 32, true);
  compare(c, sa::IndexPrecision::fp8_e4m3, in, true);
}

}  // namespace
